"""The decoder export traces a weightless skeleton and writes the checkpoint's own bytes one tensor at a time; ONNX
Runtime computes what torch computes with the model held in its own dtype."""

from __future__ import annotations

import sys
import weakref

import numpy as np
import onnx
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from compress.backends.onnx.decoder_graph import skeleton_causal_lm, write_weights
from compress.backends.onnx.export import ParityCheck, decoder_layout, export_decoder, export_decoder_folder
from compress.backends.onnx.graph import external_files
from compress.backends.onnx.runtime import ONNX_FILE, DecoderLayout, OnnxDecoder
from compress.backends.onnx.slices import SlicedDecoder, graph_weight_bytes, plan_slices
from compress.backends.tensorrt.engine_graph import engine_graph_parity, write_engine_graph
from compress.core.memory import phase_peak
from compress.models.loading import chat_prompt_ids, load_causal_lm, load_tokenizer, save_side_files
from compress.transforms.checkpoint_logits import window_logits
from compress.transforms.quantize.config import QUANTIZE_CONFIG
from compress.transforms.quantize.decoder import quantize_folder
from compress.transforms.quantize.saved import load_quantization, load_quantized_causal_lm
from tests.conftest import build_tiny_llama

LAYERS = 6


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """A tiny Llama saved in bfloat16, as real checkpoints are."""
    root = tmp_path_factory.mktemp("bf16")
    source = build_tiny_llama(root / "fp32", layers=LAYERS, hidden=64, heads=4, kv_heads=2, intermediate=192)
    model = load_causal_lm(source).to(torch.bfloat16)
    model.save_pretrained(root / "model")
    load_tokenizer(source).save_pretrained(root / "model")
    return root / "model"


@pytest.fixture(scope="module")
def quantized_bf16(bf16_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "int8"
    windows = torch.randint(0, 400, (3, 40), generator=torch.Generator().manual_seed(3))
    config = QUANTIZE_CONFIG.validate_python(
        {"method": "int8", "calib_windows": 3, "calib_window": 40, "min_calib_tokens": 1}
    )
    quantize_folder(bf16_model, out, windows, config)
    save_side_files(load_tokenizer(bf16_model), bf16_model, out)
    return out, windows


def _parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _stored_bytes(init: onnx.TensorProto) -> int:
    external = {entry.key: entry.value for entry in init.external_data}
    return int(external["length"]) if "length" in external else len(init.raw_data)


def test_the_skeleton_the_exporter_traces_holds_no_weights(bf16_model):
    skeleton = skeleton_causal_lm(bf16_model)
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight  # the tie survives
    assert all(p.dtype == torch.float32 and p.untyped_storage().nbytes() <= 4 for p in skeleton.parameters())
    assert _parameter_bytes(skeleton) == 4 * _parameter_bytes(load_causal_lm(bf16_model, own_dtype=True)) // 2


def test_a_bf16_model_is_exported_in_its_own_bytes_and_computes_as_torch_does(bf16_model, tmp_path):
    exported = export_decoder_folder(bf16_model, tmp_path / "onnx", parity=ParityCheck(new_tokens=8))
    assert exported.parity["max_abs_logit_diff"] < 1e-3 and exported.parity["greedy_match"]
    graph = onnx.load(str(tmp_path / "onnx" / ONNX_FILE), load_external_data=False).graph
    matrices = [init for init in graph.initializer if len(init.dims) == 2]
    assert matrices and all(init.data_type == onnx.TensorProto.BFLOAT16 for init in matrices)
    assert not any(i.name.startswith("model.") for i in graph.input)  # parameters are initializers, not inputs
    stored = sum(_stored_bytes(init) for init in graph.initializer if init.data_type == onnx.TensorProto.BFLOAT16)
    # the checkpoint's bytes, each tensor once
    assert stored == _parameter_bytes(
        load_causal_lm(bf16_model, own_dtype=True)
    )
    assert external_files(tmp_path / "onnx" / ONNX_FILE)  # beside the graph
    # TensorRT's FP16 input graph casts the bf16 tensors to FP16 and computes what the exported graph does
    write_engine_graph(tmp_path / "onnx" / ONNX_FILE, tmp_path / "engine_input.onnx")
    ids = np.array([[5, 17, 33, 9]])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None]}
    feeds |= {
        f"past_key_values.{i}.{p}": np.zeros((1, 2, 0, 16), dtype=np.float32)
        for i in range(LAYERS)
        for p in ("key", "value")
    }
    assert (
        engine_graph_parity(tmp_path / "onnx" / ONNX_FILE, tmp_path / "engine_input.onnx", feeds)["cosine_min"] > 0.999
    )


def test_a_quantized_bf16_model_exports_its_levels_and_onnx_runtime_computes_the_measured_logits(
    quantized_bf16, tmp_path
):
    folder, windows = quantized_bf16
    exported = export_decoder_folder(folder, tmp_path / "onnx", parity=ParityCheck(new_tokens=4))
    _, linears = load_quantization(folder)
    assert exported.quantized and exported.qdq["quantized_linears"] == len(linears) == 7 * LAYERS
    graph = onnx.load(str(tmp_path / "onnx" / ONNX_FILE)).graph
    initializers = {init.name: init for init in graph.initializer}
    dq_inputs = [n.input[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in initializers]
    stored = sorted(q.levels.to(torch.int8).T.contiguous().numpy().tobytes() for q in linears.values())
    exported_levels = sorted(onnx.numpy_helper.to_array(initializers[name]).tobytes() for name in dq_inputs
                             if initializers[name].data_type == onnx.TensorProto.INT8)
    assert exported_levels == stored  # the quantize stage's levels, untouched
    cast_of = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Cast" and n.input[0] in initializers}
    weights = set(initializers) | set(cast_of)
    transposed = [
        cast_of.get(n.input[0], n.input[0]) for n in graph.node if n.op_type == "Transpose" and n.input[0] in weights
    ]
    gathered = [n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[0] in weights]
    # only the tied embedding is read transposed (by the LM head); linears are stored (in, out)
    assert transposed == gathered == ["model.model.embed_tokens.weight_bfloat16"]
    # the Gather picks the table's bf16 rows itself, so ONNX Runtime folds no float32 copy of the table for it; the
    # head's Transpose moves the bf16 values too (cast after it), so a runtime never holds the cast table and its
    # transpose
    assert initializers[gathered[0]].data_type == onnx.TensorProto.BFLOAT16
    head_transpose, = (n for n in graph.node if n.op_type == "Transpose" and n.input[0] in weights)
    assert head_transpose.input[0] == gathered[0] and [
        n.op_type for n in graph.node if head_transpose.output[0] in n.input
    ] == ["Cast"]
    measured = window_logits(folder, windows)
    decoder = OnnxDecoder(tmp_path / "onnx")
    for index, row in enumerate(windows):
        logits = np.asarray(decoder.logits(row.numpy()[None, :]))[0]
        assert float(np.abs(logits - measured.logits(index)).max()) < 0.05 * float(np.abs(measured.logits(index)).max())
        # computed a few tokens at a time through the KV cache (as the parity check runs it): the same logits
        chunks = list(decoder.logits_in_chunks(row.numpy()[None, :], 5))
        assert [start for start, _ in chunks] == list(range(0, row.shape[0], 5))
        chunked = np.concatenate([piece[0] for _, piece in chunks])
        assert chunked.shape == logits.shape and float(np.abs(chunked - logits).max()) < 1e-3 * float(
            np.abs(logits).max()
        )


def test_the_parity_check_reads_the_same_numbers_chunk_by_chunk(quantized_bf16, tmp_path, monkeypatch):
    from compress.eval import decoder as validation

    folder, windows = quantized_bf16
    export_decoder_folder(folder, tmp_path / "onnx", parity=ParityCheck(new_tokens=2))
    sample = list(range(len(windows)))
    measured = validation.torch_side(window_logits(folder, windows), windows, sample)
    session = OnnxDecoder(tmp_path / "onnx")
    whole = validation.onnx_parity(session, measured, windows)  # each window in one chunk
    monkeypatch.setattr(validation, "PARITY_CHUNK", 7)
    chunked = validation.onnx_parity(session, measured, windows)
    assert whole["tokens"] == chunked["tokens"] == len(windows) * (windows.shape[1] - 1)
    assert abs(chunked["perplexity_onnx"] / whole["perplexity_onnx"] - 1) < 1e-4
    assert chunked["perplexity_torch"] == whole["perplexity_torch"] and chunked["difference_pct"] < 1.0
    assert (
        abs(chunked["top1_agreement"] - whole["top1_agreement"]) <= 2 / chunked["tokens"]
        and whole["top1_agreement"] > 0.9
    )


def test_a_graph_cut_between_its_blocks_computes_the_whole_graphs_logits(quantized_bf16, tmp_path):
    """Consecutive slices of whole blocks, each opened alone: every block in exactly one, each holding only its own
    blocks' weights (and the gathered embedding), and together the whole graph's logits, chunk by chunk."""
    folder, windows = quantized_bf16
    export_decoder_folder(folder, tmp_path / "onnx", parity=ParityCheck(new_tokens=2))
    layout = DecoderLayout.load(tmp_path / "onnx")
    total = graph_weight_bytes(tmp_path / "onnx")
    slices = plan_slices(tmp_path / "onnx", layout, total // 4)
    assert len(slices) >= 3 and [block for piece in slices for block in piece.blocks] == list(range(LAYERS))
    assert slices[0].entering == "input_ids" and slices[-1].leaving == "logits"
    assert all(piece.entering == before.leaving for before, piece in zip(slices, slices[1:], strict=False))
    assert max(piece.weight_bytes for piece in slices) < total / 2
    for piece in slices:
        names = [init.name for init in onnx.load_from_string(piece.graph).graph.initializer]
        layers = {int(name.split(".layers.")[1].split(".")[0]) for name in names if ".layers." in name}
        assert layers == set(piece.blocks)  # its blocks' norms, no other block's
    sequences = [row.numpy() for row in windows]
    whole = list(OnnxDecoder(tmp_path / "onnx").sequences_in_chunks(sequences, 7))
    sliced = list(SlicedDecoder(tmp_path / "onnx", slices).sequences_in_chunks(sequences, 7))
    assert [(index, start) for index, start, _ in sliced] == [(index, start) for index, start, _ in whole]
    for (_, _, ours), (_, _, reference) in zip(sliced, whole, strict=True):
        assert float(np.abs(ours - reference).max()) <= 1e-5 * float(np.abs(reference).max())


@pytest.mark.parametrize("which", ["float", "quantized"])
def test_the_exports_parity_check_runs_a_graph_over_its_session_limit_in_slices(
    which, bf16_model, quantized_bf16, tmp_path
):
    """Over the limit, torch decodes first and the graph's slices read its continuation: the same figures as the whole
    graph's parity check (ONNX Runtime's greedy tokens are its argmax after torch's prefixes, which agree)."""
    folder = bf16_model if which == "float" else quantized_bf16[0]
    whole = export_decoder_folder(folder, tmp_path / "whole", parity=ParityCheck(new_tokens=6))
    limit = graph_weight_bytes(tmp_path / "whole") // 3
    sliced = export_decoder_folder(
        folder, tmp_path / "sliced", parity=ParityCheck(new_tokens=6), session_limit_bytes=limit
    )
    assert "torch_greedy" in sliced.phase_peak_rss_mb and "torch_greedy" not in whole.phase_peak_rss_mb
    assert sliced.parity["greedy_tokens_onnx"] == whole.parity["greedy_tokens_onnx"]
    assert sliced.parity["greedy_match"] == whole.parity["greedy_match"]
    assert abs(sliced.parity["max_abs_logit_diff"] - whole.parity["max_abs_logit_diff"]) < 1e-4
    if which == "float":
        assert sliced.parity["greedy_match"] and len(sliced.parity["greedy_tokens_torch"]) > 1


def test_validation_runs_a_graph_over_its_session_limit_in_slices(quantized_bf16, tmp_path):
    from compress.eval import decoder as validation

    folder, windows = quantized_bf16
    export_decoder_folder(folder, tmp_path / "onnx", parity=ParityCheck(new_tokens=2))
    total = graph_weight_bytes(tmp_path / "onnx")
    assert validation._sliced_decoder(tmp_path / "onnx", total) is None  # it fits one session: run whole
    sliced = validation._sliced_decoder(tmp_path / "onnx", total // 3)
    assert sliced is not None and len(sliced.slices) > 1
    measured = validation.torch_side(window_logits(folder, windows), windows, list(range(len(windows))))
    whole = validation.onnx_parity(OnnxDecoder(tmp_path / "onnx"), measured, windows)
    pieces = validation.onnx_parity(sliced, measured, windows)
    assert pieces["tokens"] == whole["tokens"] == len(windows) * (windows.shape[1] - 1)
    assert abs(pieces["perplexity_onnx"] / whole["perplexity_onnx"] - 1) < 1e-6
    assert pieces["top1_agreement"] == whole["top1_agreement"] > 0.9 and pieces["difference_pct"] < 1.0


class _LiveFloat32(TorchDispatchMode):
    """The most float32 bytes torch held at once while it was active (tensors made by torch operations)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and not tensor.is_meta:
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.seen or storage.nbytes() == 0:
            return
        self.seen.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, key, storage.nbytes())

    def _release(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


def test_neither_the_weights_nor_torchs_reference_hold_the_model_in_float32(bf16_model, quantized_bf16, tmp_path):
    """What the export computes in torch besides tracing the skeleton: writing the weights, and the parity reference
    (the deployed numbers over the prompt and a continuation, computed block by block)."""
    folder, _ = quantized_bf16
    float32_model = 2 * _parameter_bytes(load_causal_lm(bf16_model, own_dtype=True))
    with _LiveFloat32() as loading:  # the measure sees a float32 model when there is one
        model = load_quantized_causal_lm(folder)
    assert loading.peak >= 0.9 * float32_model
    del model
    skeleton = skeleton_causal_lm(folder)
    layout = decoder_layout(skeleton, [0])
    export_decoder(skeleton, layout, tmp_path / ONNX_FILE)
    graph = onnx.load(str(tmp_path / ONNX_FILE))
    tokenizer = load_tokenizer(folder)
    with _LiveFloat32() as writing:
        write_weights(graph, skeleton, folder, tmp_path / ONNX_FILE)
    prompt = chat_prompt_ids(tokenizer, "What is the capital of France?")
    with _LiveFloat32() as reference:
        window_logits(folder, torch.tensor([prompt + [5, 6, 7, 8]])).logits(0)
    assert writing.peak < 0.3 * float32_model and reference.peak < 0.3 * float32_model


def test_torch_greedy_is_read_from_one_pass_over_onnx_runtimes_continuation():
    """Torch's argmax after the same prefix is its greedy choice: agreement step by step, its tokens up to where they
    part, EOS ending both."""
    from compress.backends.onnx.export import OnnxSide, compare_with_torch

    prompt, vocab = [1, 2, 3], 10
    continuation = [4, 7, 2]

    def torch_logits(choices: list[int]) -> np.ndarray:
        logits = np.zeros((len(prompt) + len(continuation), vocab), dtype=np.float32)
        for step, token in enumerate(choices):
            logits[len(prompt) - 1 + step, token] = 5.0
        return logits

    side = OnnxSide(torch_logits(continuation)[: len(prompt)], continuation)
    same = compare_with_torch(side, torch_logits(continuation), prompt, eos_token_ids=[0])
    assert same["greedy_match"] and same["greedy_tokens_torch"] == continuation and same["max_abs_logit_diff"] == 0.0
    parted = compare_with_torch(side, torch_logits([4, 8, 2]), prompt, eos_token_ids=[0])
    assert not parted["greedy_match"] and parted["greedy_tokens_torch"] == [4, 8]
    stopped = compare_with_torch(side, torch_logits([4, 0, 2]), prompt, eos_token_ids=[0])  # torch would end at EOS
    assert not stopped["greedy_match"] and stopped["greedy_tokens_torch"] == [4, 0]
    ended = OnnxSide(side.logits, [4, 0])  # ONNX Runtime ended at EOS, and torch chooses it there too
    assert compare_with_torch(ended, torch_logits([4, 0, 9]), prompt, eos_token_ids=[0])["greedy_match"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the phase's peak reads Linux's VmHWM")
def test_tracing_computes_no_float32_copy_of_the_parameters(tmp_path):
    """The exporter's shape inference computes on what it takes as parameters: traced as inputs, none of them is copied.
    A wide config is enough (the skeleton needs no weights): its float32 parameters are 0.47 GB; taken as parameters,
    the trace held more than that again."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
    config.save_pretrained(tmp_path / "wide")
    skeleton = skeleton_causal_lm(tmp_path / "wide")
    float32_bytes = sum(4 * p.numel() for p in skeleton.parameters())
    layout = decoder_layout(skeleton, [0])
    before = _resident_mb()
    peaks: dict[str, float] = {}
    with phase_peak(peaks, "trace"):
        export_decoder(skeleton, layout, tmp_path / ONNX_FILE)
    assert (peaks["trace"] - before) * 2**20 < 0.6 * float32_bytes, (peaks, before, float32_bytes)
    inputs = {i.name for i in onnx.load(str(tmp_path / ONNX_FILE)).graph.input}
    assert {f"model.{name}" for name, _ in skeleton.named_parameters()} <= inputs


def _resident_mb() -> float:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 1024


@pytest.mark.parametrize("head", ["fp8", "int4"])
def test_a_quantized_lm_head_is_a_qdq_linear_of_its_own_in_the_portable_onnx(tmp_path, head):
    """A plan's quantized LM head (tied in the source) is exported untied: the head's grid values behind their
    DequantizeLinear (and, for FP8, its input's Q/DQ pair), the embedding table as stored; ONNX Runtime computes the
    logits validation measures."""
    from compress.transforms.quantize.config import candidate_configs
    from compress.transforms.quantize.mixed import MixedPlan

    source = build_tiny_llama(tmp_path / "model", layers=2, hidden=128, heads=2, kv_heads=1, intermediate=256)
    shared = {"calib_windows": 3, "calib_window": 40, "min_calib_tokens": 1, "sample_tokens": 64}
    points = {"attn_in": "int8", "attn_out": "int8", "mlp_in": "int8", "mlp_hidden": "int8"}
    plan = MixedPlan({0: points, 1: points}, candidate_configs(["int8", head], shared), head=head)
    windows = torch.randint(0, 400, (3, 40), generator=torch.Generator().manual_seed(8))
    folder = tmp_path / "q"
    quantize_folder(
        source,
        folder,
        windows,
        QUANTIZE_CONFIG.validate_python({"method": "auto", **shared}),
        plan=plan,
    )
    save_side_files(load_tokenizer(source), source, folder)
    exported = export_decoder_folder(folder, tmp_path / "onnx", parity=ParityCheck(new_tokens=4))
    _, linears = load_quantization(folder)
    assert exported.qdq["quantized_linears"] == len(linears) == 7 * 2 + 1
    graph = onnx.load(str(tmp_path / "onnx" / ONNX_FILE)).graph
    initializers = {init.name: onnx.numpy_helper.to_array(init) for init in graph.initializer}
    head_levels = linears["lm_head"].levels.float().numpy()
    dequantized = [
        initializers[n.input[0]] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in initializers
    ]
    assert any(array.shape == head_levels.T.shape and np.array_equal(array.astype(np.float32), head_levels.T)
               for array in dequantized)  # the head's own grid values, transposed as the graph reads them
    measured = window_logits(folder, windows)
    decoder = OnnxDecoder(tmp_path / "onnx")
    for index, row in enumerate(windows):
        logits = np.asarray(decoder.logits(row.numpy()[None, :]))[0]
        assert float(np.abs(logits - measured.logits(index)).max()) < 0.02 * float(np.abs(measured.logits(index)).max())


def test_a_sliding_layers_fp8_kv_cache_is_rounded_before_its_window_is_kept(tmp_path):
    """FP8 KV-cache Q/DQ finds the new keys and values of a sliding layer under the slice that keeps its window, and
    ONNX Runtime then computes, through the cache, the logits the quantize stage measured."""
    window = 8
    source = build_tiny_llama(tmp_path / "gemma3", layers=2, family="gemma3", sliding_window=window)
    windows = torch.randint(0, 400, (2, 3 * window), generator=torch.Generator().manual_seed(5))
    config = QUANTIZE_CONFIG.validate_python({"method": "fp8", "kv_cache": "fp8", "calib_windows": 2,
                                              "calib_window": 3 * window, "min_calib_tokens": 1})
    quantize_folder(source, tmp_path / "fp8", windows, config)
    save_side_files(load_tokenizer(source), source, tmp_path / "fp8")
    exported = export_decoder_folder(tmp_path / "fp8", tmp_path / "onnx", parity=ParityCheck(new_tokens=2))
    assert exported.layout.sliding_layers == (0,) and exported.qdq["kv_cache_qdq_pairs"] == 4
    measured = window_logits(tmp_path / "fp8", windows)
    decoder = OnnxDecoder(tmp_path / "onnx")
    for index, row in enumerate(windows):
        chunked = np.concatenate([piece[0] for _, piece in decoder.logits_in_chunks(row.numpy()[None, :], 5)])
        reference = measured.logits(index)
        assert float(np.abs(chunked - reference).max()) < 0.02 * float(np.abs(reference).max())
