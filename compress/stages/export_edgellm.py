"""``export_edgellm``: the quantized model as a TensorRT Edge-LLM deploy bundle, proven to hold the measured numbers.

Runs after ``export_onnx`` and reads the quantized Hugging Face folder the ONNX was exported from,
so the portable Q/DQ ONNX (measured by ``validate`` in ONNX Runtime) and the bundle carry the
same integers and scales: writes the unified checkpoint, runs NVIDIA's ``tensorrt-edgellm-export``
on it, and checks the chain of custody (see :mod:`compress.deploy.bundle`). What Edge-LLM cannot
express is refused when the plan is checked, before any work.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from compress.artifact import EDGELLM_BUNDLE, HF_MODEL, ONNX, Artifact
from compress.config import StrictModel, Target
from compress.deploy.bundle import export_bundle
from compress.deploy.edgellm import EDGELLM_VERSION
from compress.errors import UsageError
from compress.families import linear_shapes
from compress.stages import StageDef, register

log = logging.getLogger(__name__)

# Decoder families the pinned Edge-LLM exports and compress's quantize -> export path is tested on (Gemma 3 and
# Mistral are not in Edge-LLM 0.11's model list).
SUPPORTED_MODEL_TYPES = ("llama", "phi3", "qwen2", "qwen3")
# Edge-LLM 0.11's INT4 GEMM plugin (V2, the default) tiles weights in blocks of 64 in both dimensions.
INT4_ALIGNMENT = 64
# The Edge-LLM precision a deployment precision ships as (NVFP4 weight-only and W4A4 are both NVFP4 bundles).
EDGELLM_PRECISION = {"int8": "int8", "int4": "int4", "fp8": "fp8", "nvfp4": "nvfp4", "nvfp4_a16": "nvfp4"}
# Head sizes the pinned Edge-LLM's attention plugin has prefill kernels for (fmha_v2_d64/d128/d256/d512
# in the 0.11.0 wheel's libNvInfer_edgellm_plugin.so); any other size fails the engine build or runs decode only.
HEAD_DIMS = (64, 128, 256, 512)


class ExportEdgeLLMConfig(StrictModel):
    """Options of the Edge-LLM export (none yet: the pinned exporter's defaults)."""


def check_plan(config: ExportEdgeLLMConfig, earlier: dict[str, StrictModel], target: Target, model_config: dict | None) -> None:
    """Refuse, before any work, what the pinned Edge-LLM cannot express; each message names the limit and the way out."""
    if "sparsify" in earlier:
        raise UsageError("export_edgellm: Edge-LLM builds engines without sparse weights, and 2:4 sparsity does not speed up "
                         "bandwidth-bound decode; drop the sparsify stage (or end the recipe at export_onnx for a generic TensorRT build)")
    if "prune_heads" in earlier:
        raise UsageError("export_edgellm: head pruning leaves each layer its own number of heads, and Edge-LLM's config has one "
                         "num_attention_heads for every layer; drop prune_heads (or end the recipe at export_onnx)")
    quantize = earlier.get("quantize")
    if quantize is not None and getattr(quantize, "hadamard_block", 0):
        raise UsageError("export_edgellm: quantize.hadamard_block rotates down_proj inputs online, which Edge-LLM's checkpoint "
                         "format cannot express; set quantize.hadamard_block=0 (SmoothQuant only)")
    if model_config is None:
        return
    model_type = model_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UsageError(f"export_edgellm: model_type {model_type!r} is not supported for Edge-LLM deployment "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); a recipe that ends at export_onnx "
                         "(recipe=int8 or recipe=int4) gives the portable Q/DQ ONNX")
    check_attention_shape(model_config)
    precision = EDGELLM_PRECISION[quantize.precision()] if quantize is not None else "fp16"
    if precision not in target.edgellm.precisions:
        raise UsageError(f"export_edgellm: Edge-LLM {target.edgellm.version} on {target.name} runs "
                         f"{', '.join(target.edgellm.precisions)}, not {precision}; choose another quantize.method")
    if quantize is not None and quantize.method == "fp8" and quantize.fp8_weight_scale == "channel":
        raise UsageError("export_edgellm: Edge-LLM's FP8 linears take one weight scale per tensor; set quantize.fp8_weight_scale=tensor "
                         "(per-channel FP8 stays in the portable ONNX: end the recipe at export_onnx)")
    if quantize is not None and quantize.kv_cache == "fp8" and quantize.precision() == "int4":
        raise UsageError("export_edgellm: Edge-LLM 0.11 reads no FP8 KV cache from a W4A16_AWQ checkpoint; drop quantize.kv_cache=fp8 "
                         "or quantize with method fp8 or nvfp4")
    if quantize is not None and quantize.precision() == "int4":
        group = quantize.scheme()[2]
        for name, (out_features, in_features) in linear_shapes(model_config).items():
            if out_features % INT4_ALIGNMENT or in_features % INT4_ALIGNMENT or in_features % group:
                raise UsageError(f"export_edgellm: {name} is {out_features} x {in_features}; Edge-LLM {EDGELLM_VERSION}'s INT4 "
                                 f"GEMM needs both multiples of {INT4_ALIGNMENT} and the input width a multiple of the group "
                                 f"size {group}")


def check_attention_shape(model_config: dict[str, Any]) -> None:
    """Refuse attention shapes the pinned Edge-LLM's attention plugin has no kernels for, and mixed layer types."""
    heads = model_config["num_attention_heads"]
    kv_heads = model_config.get("num_key_value_heads") or heads
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    if heads % kv_heads:
        raise UsageError(f"export_edgellm: {heads} query heads cannot share {kv_heads} KV heads evenly; Edge-LLM's attention "
                         "plugin takes MHA or GQA with a whole number of query heads per KV head")
    if head_dim not in HEAD_DIMS:
        raise UsageError(f"export_edgellm: head_dim {head_dim} has no prefill attention kernel in Edge-LLM {EDGELLM_VERSION} "
                         f"(it has {', '.join(map(str, HEAD_DIMS))}); deploy through export_onnx instead")
    layer_types = model_config.get("layer_types")
    if layer_types and len(set(layer_types)) > 1:
        raise UsageError("export_edgellm: the model mixes layer types (" + ", ".join(sorted(set(layer_types))) + "); "
                         "compress deploys uniform decoder stacks only")


def run_export_edgellm(source: Artifact, config: ExportEdgeLLMConfig, ctx) -> Artifact:
    quantized = ctx.last_artifact(HF_MODEL)
    metrics = export_bundle(Path(quantized.path), ctx.stage_dir)
    bundle = ctx.stage_dir / "bundle"
    meta = {"precision": source.meta.get("precision", "fp16"), "quant_algo": metrics["checkpoint"]["quant_algo"],
            "metrics": metrics}
    return Artifact(EDGELLM_BUNDLE, bundle, meta)


STAGE = register(StageDef(
    name="export_edgellm",
    summary=f"unified quantized checkpoint -> TensorRT Edge-LLM {EDGELLM_VERSION} bundle, with a chain-of-custody check",
    input_kind=ONNX,
    output_kind=EDGELLM_BUNDLE,
    config_cls=ExportEdgeLLMConfig,
    run=run_export_edgellm,
    check_plan=check_plan,
))
