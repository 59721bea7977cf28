"""A decoder with an explicit KV cache as ONNX: export, Q/DQ rewrite, and the parity check against torch.

The graph has dynamic batch, sequence and past axes (see :mod:`compress.backends.onnx.runtime` for
its inputs and outputs). A quantized folder (the quantize stage's) is exported from its on-grid
float weights and rewritten with real Q/DQ nodes from its saved scales; a tied embedding is stored
once. After export the model runs in ONNX Runtime beside torch: the largest logit difference on a
fixed prompt and the greedy tokens of both are measured.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compress.backends.onnx.graph import onnx_files_size, save_graph, share_tied_embedding
from compress.backends.onnx.qdq import LinearForExport, apply_kv_cache_qdq, apply_qdq
from compress.backends.onnx.runtime import LAYOUT_FILE, ONNX_FILE, DecoderLayout, OnnxDecoder, past_names, present_names
from compress.core.files import atomic_write_json
from compress.models.families import attention_geometry
from compress.models.loading import chat_prompt_ids, load_tokenizer
from compress.transforms.quantize.saved import attach_quantization, kv_cache_scales, load_quantization, load_quantized_causal_lm
from compress.transforms.walk import release_freed_memory

log = logging.getLogger(__name__)

_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")


class _DecoderWithCache(torch.nn.Module):
    """Flat tensors in and out, so the exporter sees a plain function of the KV cache.

    Every layer's cache holds every past position, sliding-window layers included (no config is given to the cache,
    so none is cropped to its window): transformers then masks a sliding layer with its banded mask over the whole
    cache, which the graph computes for any length, and every layer's cache has the length the attention mask has.
    """

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer in range(len(past) // 2):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        flat = [out.logits]
        for layer in out.past_key_values.layers:
            flat.extend((layer.keys, layer.values))
        return tuple(flat)


def decoder_layout(model, eos_token_ids: list[int], int8_activations: bool = False, fp4_weights: bool = False) -> DecoderLayout:
    """KV-cache layout of a decoder: KV heads per layer and head size (head pruning keeps every KV head)."""
    cfg = model.config
    _, kv, head_dim = attention_geometry(cfg)
    return DecoderLayout(cfg.num_hidden_layers, [kv] * cfg.num_hidden_layers, head_dim, eos_token_ids, int8_activations, fp4_weights)


def write_qdq(graph_model, model, linears: dict) -> dict:
    """Turn the float export ``graph_model`` (an ONNX ModelProto) into a Q/DQ graph using the quantize stage's scales, each
    linear in its own format."""
    export = [
        LinearForExport(name, model.get_submodule(name).weight.detach().numpy(), q.weight_scales.numpy(), q.format.weight_bits,
                        q.input_scale, q.rotation, weight_format=q.format.weight_format, global_scale=q.global_scale,
                        input_format=q.input_format)
        for name, q in linears.items()
    ]
    return apply_qdq(graph_model, export)


def _example_inputs(layout: DecoderLayout, batch: int = 2, seq: int = 5, past: int = 3):
    ids = torch.randint(0, 100, (batch, seq))
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    positions = torch.arange(past, past + seq).expand(batch, seq)
    cache = [torch.zeros(batch, layout.num_kv_heads[i // 2], past, layout.head_dim) for i in range(2 * layout.num_layers)]
    return (ids, mask, positions, *cache)


def export_decoder(model, layout: DecoderLayout, path: Path, exporter: str = "torchscript", opset: int = 18) -> None:
    """Write ``model`` as an ONNX decoder with KV cache to ``path``."""
    wrapper = _DecoderWithCache(model).eval()
    inputs = ["input_ids", "attention_mask", "position_ids", *past_names(layout.num_layers)]
    outputs = ["logits", *present_names(layout.num_layers)]
    example = _example_inputs(layout)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            batch, seq, past = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
            total = torch.export.Dim("total")
            shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq},
                      tuple({0: batch, 2: past} for _ in range(2 * layout.num_layers)))
            torch.onnx.export(wrapper, example, str(path), input_names=inputs, output_names=outputs,
                              dynamic_shapes=shapes, dynamo=True, opset_version=max(opset, 18), external_data=False)
        else:
            axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total"},
                    "position_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}}
            axes.update({name: {0: "batch", 2: "past"} for name in inputs[3:]})
            axes.update({name: {0: "batch", 2: "total"} for name in outputs[1:]})
            torch.onnx.export(wrapper, example, str(path), input_names=inputs, output_names=outputs,
                              dynamic_axes=axes, dynamo=False, opset_version=opset)


def torch_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int]) -> list[int]:
    """Greedy continuation in torch with the KV cache, stopping at EOS like :meth:`OnnxDecoder.greedy`."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_token_ids or None, pad_token_id=(eos_token_ids or [0])[0])
    return out[0, len(prompt_ids):].tolist()


def eos_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids from the generation config, else the tokenizer."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


@dataclass(frozen=True)
class TorchReference:
    """What torch computes on the parity prompt: its logits and greedy continuation (taken before ONNX Runtime loads the
    graph, so the torch model can be freed first)."""

    prompt_text: str
    prompt: list[int]
    logits: np.ndarray
    tokens: list[int]
    new_tokens: int


def torch_reference(model, tokenizer, prompt_text: str, new_tokens: int, eos_token_ids: list[int]) -> TorchReference:
    """Torch's side of the parity check, on ``prompt_text`` in the chat template."""
    prompt = chat_prompt_ids(tokenizer, prompt_text)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits.numpy()
    return TorchReference(prompt_text, prompt, logits, torch_greedy(model, prompt, new_tokens, eos_token_ids), new_tokens)


def check_parity(reference: TorchReference, tokenizer, folder: Path) -> dict:
    """Compare ONNX Runtime with torch's reference on the same prompt: logits and greedy tokens."""
    decoder = OnnxDecoder(folder)
    onnx_logits = decoder.logits(np.asarray([reference.prompt]))
    onnx_tokens = decoder.greedy(reference.prompt, reference.new_tokens)
    return {
        "max_abs_logit_diff": float(np.abs(onnx_logits - reference.logits).max()),
        "greedy_match": reference.tokens == onnx_tokens,
        "greedy_tokens_torch": reference.tokens,
        "greedy_tokens_onnx": onnx_tokens,
        "greedy_text_onnx": tokenizer.decode(onnx_tokens, skip_special_tokens=True),
        "prompt": reference.prompt_text,
    }


def rewrite_graph(path: Path, model, quantized: tuple[dict, dict] | None) -> dict:
    """Q/DQ nodes for a quantized model and one copy of a tied embedding, in one load and save of the graph."""
    import onnx

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if not quantized and not tied:
        return {}
    graph_model = onnx.load(str(path))
    qdq_stats = {}
    if quantized:
        meta, linears = quantized
        log.info("writing Q/DQ nodes (%s: %s)", meta["method"], ", ".join(sorted({q.precision for q in linears.values()})))
        qdq_stats = write_qdq(graph_model, model, linears)
        scales = kv_cache_scales(meta)
        if scales:
            qdq_stats["kv_cache_qdq_pairs"] = apply_kv_cache_qdq(graph_model, scales)
        attach_quantization(model, meta, linears)
    if tied and share_tied_embedding(graph_model):
        log.info("tied embedding stored once (the LM head reads the transposed table)")
    save_graph(graph_model, path)
    return qdq_stats


@dataclass(frozen=True)
class ExportedDecoder:
    """What :func:`export_decoder_folder` wrote and measured."""

    layout: DecoderLayout
    quantized: bool
    parity: dict[str, Any]
    qdq: dict[str, int]
    onnx_size_bytes: int


def export_decoder_folder(source: Path, out: Path, exporter: str = "torchscript", opset: int = 18,
                          parity_prompt: str = "What is the capital of France?", parity_new_tokens: int = 16,
                          trust_remote_code: bool = False) -> ExportedDecoder:
    """Export the Hugging Face folder ``source`` (float, or quantized by the quantize stage) into ``out``: the graph, its
    KV-cache layout, the tokenizer and config beside it; then compare it with torch in ONNX Runtime."""
    model = load_quantized_causal_lm(source, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(source)
    quantized = load_quantization(source)
    formats = [q.format for q in quantized[1].values()] if quantized else []
    int8_activations = any(f.activations == "int8" for f in formats)
    fp4_weights = any(f.weight_format == "nvfp4" for f in formats)
    out.mkdir(parents=True, exist_ok=True)
    layout = decoder_layout(model, eos_ids(model, tokenizer), int8_activations, fp4_weights)
    log.info("exporting %d layers to ONNX with the %s exporter (opset %d)", layout.num_layers, exporter, opset)
    export_decoder(model, layout, out / ONNX_FILE, exporter, opset)
    qdq_stats = rewrite_graph(out / ONNX_FILE, model, quantized)
    atomic_write_json(out / LAYOUT_FILE, layout.to_json())
    for name in _SIDE_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, out / name)
    log.info("checking ONNX Runtime against torch")
    reference = torch_reference(model, tokenizer, parity_prompt, parity_new_tokens, layout.eos_token_ids)
    del model  # ONNX Runtime's copy of the graph is the next large allocation; the torch model has done its part
    release_freed_memory()
    parity = check_parity(reference, tokenizer, out)
    log.info("parity: max |logit diff| %.2e, greedy tokens %s", parity["max_abs_logit_diff"],
             "identical" if parity["greedy_match"] else "DIFFER")
    return ExportedDecoder(layout, quantized is not None, parity, qdq_stats, onnx_files_size(out / ONNX_FILE))
