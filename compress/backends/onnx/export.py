"""A decoder with an explicit KV cache as ONNX: export, Q/DQ rewrite, and the parity check against torch.

The graph has dynamic batch, sequence and past axes (see :mod:`compress.backends.onnx.runtime` for
its inputs and outputs). By default the graph is traced from a weightless skeleton and its weights
are written one tensor at a time from the folder, a quantized one's linears as real Q/DQ nodes over
their saved levels and scales (:mod:`compress.backends.onnx.decoder_graph`); the dynamo exporter
traces the float32 model and its graph is rewritten by value. A tied embedding is stored once.
After export the model runs in ONNX Runtime, then torch computes the same prompt and ONNX Runtime's
greedy continuation block by block: the largest logit difference on the prompt and whether torch's
greedy choice agrees at every step are measured.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import torch

from compress.algorithms.formats import PRECISIONS
from compress.backends.onnx.decoder_graph import skeleton_causal_lm, trace_decoder, write_weights
from compress.backends.onnx.graph import onnx_files_size, save_graph, share_tied_embedding
from compress.backends.onnx.qdq import LinearForExport, apply_kv_cache_qdq, apply_qdq
from compress.backends.onnx.runtime import LAYOUT_FILE, ONNX_FILE, DecoderLayout, OnnxDecoder, past_names, present_names
from compress.backends.onnx.slices import SlicedDecoder, slices_over
from compress.core.files import atomic_write_json
from compress.core.memory import phase_peak
from compress.models.compute import computed_in_float32
from compress.models.families import attention_geometry, attention_window, sliding_layer_indices
from compress.models.loading import chat_prompt_ids, load_tokenizer
from compress.transforms.checkpoint_logits import window_logits
from compress.transforms.quantize.saved import (
    held_deployed_causal_lm,
    load_quantization,
    load_quantized_causal_lm,
    quantization_meta,
)
from compress.transforms.walk import release_freed_memory

log = logging.getLogger(__name__)

_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")


class _DecoderWithCache(torch.nn.Module):
    """Flat tensors in and out, so the exporter sees a plain function of the KV cache.

    A full-attention layer's cache holds every past position; a sliding layer's holds its last ``sliding_window - 1``
    (all its next token can see), so its memory stops growing at the window. With sliding layers the wrapper gives
    transformers its own masks (:func:`attention_masks`), because transformers would take every layer's cache for as
    long as the attention mask; without, transformers builds its causal mask from the 2-D one.
    """

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        config = model.config.to_dict()
        self.sliding = sliding_layer_indices(config)
        self.window = attention_window(config) or 0
        self.every_layer_slides = len(self.sliding) == config["num_hidden_layers"]

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer in range(len(past) // 2):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        mask = self._masks(attention_mask, input_ids.shape[1], past) if self.sliding else attention_mask
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                         use_cache=True)
        flat = [out.logits]
        for index, layer in enumerate(out.past_key_values.layers):
            if index in self.sliding:
                flat.extend((layer.keys[:, :, 1 - self.window:], layer.values[:, :, 1 - self.window:]))
            else:
                flat.extend((layer.keys, layer.values))
        return tuple(flat)

    def _masks(self, attention_mask, new_tokens: int, past: tuple):
        window_past = past[2 * self.sliding[0]]
        full, sliding = attention_masks(
            attention_mask, new_tokens, window_past.shape[2], self.window, window_past.dtype
        )
        return sliding if self.every_layer_slides else {"full_attention": full, "sliding_attention": sliding}


def attention_masks(attention_mask: torch.Tensor, new_tokens: int, window_past, window: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive 4-D masks ``(batch, 1, new_tokens, keys)`` for a full layer (keys: every position of ``attention_mask``)
    and a sliding layer (keys: the last ``window_past`` past positions, then the new tokens).

    A key is seen when ``attention_mask`` keeps it, it is not after the query and, in a sliding layer, fewer than
    ``window`` positions before it; positions are the mask's columns, as transformers counts them."""
    device = attention_mask.device
    first_new = attention_mask.shape[1] - new_tokens
    columns = torch.arange(attention_mask.shape[1], device=device)
    queries = torch.arange(new_tokens, device=device) + first_new
    keys = torch.cat([torch.arange(window_past, device=device) + (first_new - window_past), queries])
    queries = queries[:, None]
    keep = attention_mask.bool()
    full = keep[:, None, None, :] & (columns[None, :] <= queries)
    sliding = (
        keep.index_select(1, keys)[:, None, None, :] & (keys[None, :] <= queries) & (keys[None, :] > queries - window)
    )
    seen, hidden = torch.tensor(0.0, dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    return torch.where(full, seen, hidden), torch.where(sliding, seen, hidden)


def decoder_layout(
    model, eos_token_ids: list[int], int8_activations: bool = False, fp4_weights: bool = False
) -> DecoderLayout:
    """KV-cache layout of a decoder: KV heads per layer and head size (head pruning keeps every KV head), and the layers
    whose cache keeps only their window."""
    cfg = model.config
    _, kv, head_dim = attention_geometry(cfg)
    config = cfg.to_dict()
    return DecoderLayout(cfg.num_hidden_layers, [kv] * cfg.num_hidden_layers, head_dim, eos_token_ids, int8_activations,
                         fp4_weights, attention_window(config) or 0, tuple(sliding_layer_indices(config)))


def write_qdq(graph_model, model, linears: dict) -> dict:
    """Turn the float export ``graph_model`` (an ONNX ModelProto) into a Q/DQ graph using the quantize stage's scales,
    each linear in its own format."""
    export = [
        LinearForExport(
            name,
            model.get_submodule(name).weight.detach().numpy(),
            q.weight_scales.numpy(),
            q.format.weight_bits,
            q.input_scale,
            q.rotation,
            weight_format=q.format.weight_format,
            global_scale=q.global_scale,
            input_format=q.input_format,
        )
        for name, q in linears.items()
    ]
    return apply_qdq(graph_model, export)


def _example_inputs(layout: DecoderLayout, batch: int = 2, seq: int = 5, past: int = 3):
    ids = torch.randint(0, 100, (batch, seq))
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    positions = torch.arange(past, past + seq).expand(batch, seq)
    cache = [torch.zeros(batch, layout.num_kv_heads[i // 2], layout.cache_length(i // 2, past), layout.head_dim)
             for i in range(2 * layout.num_layers)]
    return (ids, mask, positions, *cache)


def export_decoder(model, layout: DecoderLayout, path: Path, exporter: str = "torchscript", opset: int = 18) -> None:
    """Write ``model`` as an ONNX decoder with KV cache to ``path``: with the TorchScript exporter, its parameters as
    graph inputs (see :mod:`compress.backends.onnx.decoder_graph`); with the dynamo exporter, its weights in the
    graph."""
    wrapper = _DecoderWithCache(model).eval()
    example = _example_inputs(layout)
    if exporter != "dynamo":
        trace_decoder(wrapper, layout, example, path, opset)
        return
    inputs = ["input_ids", "attention_mask", "position_ids", *past_names(layout.num_layers)]
    outputs = ["logits", *present_names(layout.num_layers)]
    batch, seq, past = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past")
    total, window_past = torch.export.Dim("total"), torch.export.Dim("window_past")
    shapes = (
        {0: batch, 1: seq},
        {0: batch, 1: total},
        {0: batch, 1: seq},
        tuple(
            {0: batch, 2: window_past if i // 2 in layout.sliding_layers else past}
            for i in range(2 * layout.num_layers)
        ),
    )
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapper, example, str(path), input_names=inputs, output_names=outputs,
                          dynamic_shapes=shapes, dynamo=True, opset_version=max(opset, 18), external_data=False)


def eos_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids from the generation config, else the tokenizer."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


@dataclass(frozen=True)
class OnnxSide:
    """ONNX Runtime's side of the parity check: its logits over the prompt and its greedy continuation."""

    logits: np.ndarray  # (prompt tokens, vocab)
    tokens: list[int]


def onnx_side(folder: Path, prompt: list[int], new_tokens: int) -> OnnxSide:
    """Run the exported graph in ONNX Runtime on ``prompt``: its logits, and its greedy continuation (stopping at
    EOS)."""
    decoder = OnnxDecoder(folder)
    return OnnxSide(np.asarray(decoder.logits(np.asarray([prompt])))[0], decoder.greedy(prompt, new_tokens))


def sliced_side(
    decoder: SlicedDecoder, prompt: list[int], continuation: list[int], eos_token_ids: list[int]
) -> OnnxSide:
    """ONNX Runtime's side from the graph's slices over ``prompt`` and torch's greedy ``continuation``: its logits over
    the prompt, and its argmax after each prefix up to the first that differs from torch's token (or an end-of-sequence
    one): its own greedy decoding up to there, since the prefixes agree."""
    ids = np.asarray(prompt + continuation, dtype=np.int64)
    logits = np.concatenate([chunk[0] for _, _, chunk in decoder.sequences_in_chunks([ids], len(ids))])
    tokens: list[int] = []
    for step, expected in enumerate(continuation):
        tokens.append(int(logits[len(prompt) - 1 + step].argmax()))
        if tokens[-1] != expected or tokens[-1] in eos_token_ids:
            break
    return OnnxSide(logits[: len(prompt)], tokens)


def torch_greedy(source: Path, prompt: list[int], new_tokens: int, eos_token_ids: list[int],
                 trust_remote_code: bool = False) -> list[int]:
    """The deployed numbers' greedy continuation of ``prompt`` in torch (the quantized checkpoint held as its levels),
    stopping after an end-of-sequence token."""
    model, rebuilt = held_deployed_causal_lm(source, trust_remote_code)
    tokens: list[int] = []
    with computed_in_float32(model, rebuilt), torch.no_grad():
        ids, past = torch.tensor([prompt]), None
        for _ in range(new_tokens):
            out = model(ids, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
            tokens.append(token)
            if token in eos_token_ids:
                break
            ids = torch.tensor([[token]])
    del model, past
    release_freed_memory()
    return tokens


def compare_with_torch(side: OnnxSide, torch_logits: np.ndarray, prompt: list[int], eos_token_ids: list[int]) -> dict:
    """The parity figures, from torch's logits over the prompt followed by ONNX Runtime's tokens (``torch_logits``).

    Given the same prefix at every step, torch's greedy choice is its argmax there, so one pass over ONNX Runtime's
    continuation says whether torch's own greedy decoding would have produced it; torch's tokens are recorded up to
    and including the first that differs."""
    start = len(prompt) - 1
    torch_tokens: list[int] = []
    for step, theirs in enumerate(side.tokens):
        ours = int(torch_logits[start + step].argmax())
        torch_tokens.append(ours)
        if ours != theirs or ours in eos_token_ids:
            break
    return {
        "max_abs_logit_diff": float(np.abs(side.logits - torch_logits[: len(prompt)]).max()),
        "greedy_match": torch_tokens == side.tokens,
        "greedy_tokens_torch": torch_tokens,
        "greedy_tokens_onnx": side.tokens,
    }


def rewrite_graph(path: Path, model, quantized: tuple[dict, dict] | None) -> dict:
    """Q/DQ nodes for a quantized model and one copy of a tied embedding, in one load and save of the graph (the dynamo
    export, whose graph holds its float weights)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if not quantized and not tied:
        return {}
    graph_model = onnx.load(str(path))
    qdq_stats = {}
    if quantized:
        meta, linears = quantized
        log.info(
            "writing Q/DQ nodes (%s: %s)", meta.method, ", ".join(sorted({q.precision for q in linears.values()}))
        )
        qdq_stats = write_qdq(graph_model, model, linears)
        scales = meta.kv_cache_scales()
        if scales:
            qdq_stats["kv_cache_qdq_pairs"] = apply_kv_cache_qdq(graph_model, scales)
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
    phase_peak_rss_mb: dict[str, float]  # writing the graph, ONNX Runtime's side of the parity check, torch's reference


@dataclass(frozen=True)
class ParityCheck:
    """The prompt ONNX Runtime and torch continue greedily side by side after an export, and for how many tokens."""

    prompt: str = "What is the capital of France?"
    new_tokens: int = 16


def export_decoder_folder(source: Path, out: Path, exporter: str = "torchscript", opset: int = 18,
                          parity: ParityCheck = ParityCheck(), trust_remote_code: bool = False,
                          session_limit_bytes: int | None = None) -> ExportedDecoder:
    """Export the Hugging Face folder ``source`` (float, or quantized by the quantize stage) into ``out``: the graph,
    its KV-cache layout, the tokenizer and config beside it; then compare it with torch in ONNX Runtime.

    The TorchScript exporter (the default) traces a weightless skeleton and writes the weights one tensor at a time from
    the checkpoint; torch's reference is computed block by block from the checkpoint after ONNX Runtime's session is
    gone (:func:`compress.transforms.checkpoint_logits.window_logits`), over the prompt and ONNX Runtime's greedy
    continuation. So neither the model nor a float32 copy of it is ever held. A graph with more than
    ``session_limit_bytes`` of weights is run in slices of whole blocks (:mod:`.slices`), one session at a time, over
    the prompt and torch's greedy continuation (decoded first, the quantized checkpoint held as its levels): ONNX
    Runtime's tokens are its argmax after each of those prefixes. The dynamo exporter traces the model loaded in
    float32."""
    tokenizer = load_tokenizer(source)
    meta = quantization_meta(source)
    formats = (
        [PRECISIONS[meta.linear_precision(name)] for name in meta.linears] if meta else []
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / ONNX_FILE
    export = _export_dynamo if exporter == "dynamo" else _export_streamed
    peaks: dict[str, float] = {}
    with phase_peak(peaks, "graph"):
        layout, qdq_stats = export(source, path, _folder_eos_ids(source, tokenizer), formats, opset, trust_remote_code)
    atomic_write_json(out / LAYOUT_FILE, layout.to_json())
    for name in _SIDE_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, out / name)
    prompt = chat_prompt_ids(tokenizer, parity.prompt)
    slices = slices_over(out, layout, session_limit_bytes)
    if slices is None:
        log.info("checking ONNX Runtime against torch")
        with phase_peak(peaks, "onnx_runtime"):
            side = onnx_side(out, prompt, parity.new_tokens)
            release_freed_memory()
        continuation = side.tokens
    else:  # torch decodes first; ONNX Runtime, slice by slice, then reads its continuation
        log.info("checking ONNX Runtime against torch, the graph in %d slices of whole blocks", len(slices))
        with phase_peak(peaks, "torch_greedy"):
            continuation = torch_greedy(source, prompt, parity.new_tokens, layout.eos_token_ids, trust_remote_code)
        with phase_peak(peaks, "onnx_runtime"):
            side = sliced_side(SlicedDecoder(out, slices), prompt, continuation, layout.eos_token_ids)
    with phase_peak(peaks, "torch_reference"):  # the deployed numbers, one block in memory at a time
        ids = torch.tensor([prompt + continuation])
        torch_logits = window_logits(source, ids, trust_remote_code=trust_remote_code).logits(0)
    parity = {**compare_with_torch(side, torch_logits, prompt, layout.eos_token_ids),
              "greedy_text_onnx": tokenizer.decode(side.tokens, skip_special_tokens=True), "prompt": parity.prompt}
    log.info("parity: max |logit diff| %.2e, greedy tokens %s", parity["max_abs_logit_diff"],
             "identical" if parity["greedy_match"] else "DIFFER")
    return ExportedDecoder(layout, meta is not None, parity, qdq_stats, onnx_files_size(path), peaks)


def _layout(model, eos: list[int], formats: list) -> DecoderLayout:
    return decoder_layout(
        model, eos, any(f.activations == "int8" for f in formats), any(f.weight_format == "nvfp4" for f in formats)
    )


def _export_streamed(source: Path, path: Path, eos: list[int], formats: list, opset: int,
                     trust_remote_code: bool) -> tuple[DecoderLayout, dict]:
    """Trace a weightless skeleton, then write the weights one tensor at a time (:mod:`.decoder_graph`)."""
    skeleton = skeleton_causal_lm(source, trust_remote_code)
    layout = _layout(skeleton, eos, formats)
    log.info("exporting %d layers to ONNX (opset %d), the weights one tensor at a time", layout.num_layers, opset)
    export_decoder(skeleton, layout, path, "torchscript", opset)
    graph_model = onnx.load(str(path))
    qdq_stats = write_weights(graph_model, skeleton, source, path, trust_remote_code)
    onnx.save(graph_model, str(path))
    return layout, qdq_stats


def _export_dynamo(source: Path, path: Path, eos: list[int], formats: list, opset: int,
                   trust_remote_code: bool) -> tuple[DecoderLayout, dict]:
    """Trace the model loaded in float32 with the dynamo exporter, then rewrite its graph with Q/DQ nodes."""
    model = load_quantized_causal_lm(source, trust_remote_code=trust_remote_code)
    layout = _layout(model, eos, formats)
    log.info("exporting %d layers to ONNX with the dynamo exporter (opset %d)", layout.num_layers, opset)
    export_decoder(model, layout, path, "dynamo", opset)
    return layout, rewrite_graph(path, model, load_quantization(source))


def _folder_eos_ids(folder: Path, tokenizer) -> list[int]:
    """End-of-sequence ids from the folder's generation config, else the tokenizer's."""
    from transformers import GenerationConfig

    generation = (
        GenerationConfig.from_pretrained(folder) if (Path(folder) / "generation_config.json").is_file() else None
    )
    return eos_ids(SimpleNamespace(generation_config=generation or GenerationConfig()), tokenizer)
