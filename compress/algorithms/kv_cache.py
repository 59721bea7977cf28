"""An FP8 KV cache in torch: keys and values stored as FP8 E4M3 under one calibrated scale per layer and tensor.

TensorRT Edge-LLM's attention plugin takes an FP8 KV cache with per-layer dequantization scales
``[q_scale, k_scale, v_scale]`` (ModelOpt's ``k_proj.k_scale`` / ``v_proj.v_scale`` checkpoint
buffers, ``amax / 448``; the query keeps ModelOpt's legacy scale 1): the cache holds
``fp8(K / k_scale)`` and attention reads it back times ``k_scale``, likewise for V.

Here the same rounding is applied where transformers' attention receives the keys and values
(rotary embedding applied, past and new tokens together, so a cached value is rounded once: the
rounding is idempotent), through an attention function registered with transformers'
``AttentionInterface`` that wraps the model's own (SDPA). Calibration records each layer's
absolute maxima through the same function.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from compress.algorithms.formats import FP8_MAX, round_fp8
from compress.core.errors import UsageError
from compress.models.families import decoder_blocks

KV_ATTENTION = "compress_fp8_kv_cache"


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    amax = getattr(module, "compress_kv_amax", None)
    if amax is not None:
        amax[0] = max(amax[0], float(key.detach().abs().max()))
        amax[1] = max(amax[1], float(value.detach().abs().max()))
    scales = getattr(module, "compress_kv_scales", None)
    if scales is not None:
        key = (round_fp8(key / scales[0]) * scales[0]).to(key.dtype)
        value = (round_fp8(value / scales[1]) * scales[1]).to(value.dtype)
    return ALL_ATTENTION_FUNCTIONS[module.compress_kv_inner](module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(KV_ATTENTION, _fp8_kv_attention)
# transformers builds a model's masks with the mask function registered under its attention's name, and builds none
# for a name it has none for (then every layer attends causally over everything: a sliding layer's band is lost).
# The wrapped implementation is SDPA (route_attention refuses any other), so its masks are SDPA's.
AttentionMaskInterface.register(KV_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def kv_scale(amax: float) -> float:
    """The dequantization scale of a cached tensor of absolute maximum ``amax`` (a float32 number)."""
    return float(torch.tensor(max(amax, 1e-8) / FP8_MAX, dtype=torch.float32))


def route_attention(model) -> None:
    """Send the model's attention through :func:`_fp8_kv_attention`, wrapping the implementation it had."""
    inner = model.config._attn_implementation
    if inner == KV_ATTENTION:
        return
    if inner != "sdpa":
        raise UsageError(
            f"an FP8 KV cache is simulated around transformers' SDPA attention, and the model uses {inner!r}"
        )
    for block in decoder_blocks(model):
        block.self_attn.compress_kv_inner = inner
    model.config._attn_implementation = KV_ATTENTION


def restore_attention(model) -> None:
    """Undo :func:`route_attention` and drop any scales or recorders."""
    blocks = decoder_blocks(model)
    if model.config._attn_implementation == KV_ATTENTION:
        model.config._attn_implementation = blocks[0].self_attn.compress_kv_inner
    for block in blocks:
        for name in ("compress_kv_inner", "compress_kv_scales", "compress_kv_amax"):
            if hasattr(block.self_attn, name):
                delattr(block.self_attn, name)


def record_amax(block) -> list[float]:
    """Start recording the block's key and value absolute maxima; returns the ``[key, value]`` list being filled."""
    block.self_attn.compress_kv_amax = [0.0, 0.0]
    return block.self_attn.compress_kv_amax


def stop_recording(block) -> None:
    del block.self_attn.compress_kv_amax


def set_block_scales(block, scales: tuple[float, float]) -> None:
    """Round the block's cached keys and values to FP8 under ``(k_scale, v_scale)`` from now on."""
    block.self_attn.compress_kv_scales = scales


def attach_kv_cache_quant(model, scales: dict[int, tuple[float, float]]) -> None:
    """Simulate the FP8 KV cache with per-layer ``(k_scale, v_scale)`` (the torch reference of the Q/DQ graph)."""
    route_attention(model)
    for index, block in enumerate(decoder_blocks(model)):
        set_block_scales(block, scales[index])
