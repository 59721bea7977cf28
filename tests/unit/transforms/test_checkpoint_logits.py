"""Validation's block-by-block logits are the logits the model's own forward pass computes, for a float checkpoint and
for a quantized one (levels rebuilt, inputs and an FP8 KV cache quantized as deployed)."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
import torch

from compress.core.memory import peak_mb, reset_peak
from compress.eval.fidelity import compare_window_pairs
from compress.models.compute import computed_in_float32
from compress.models.loading import load_causal_lm, load_tokenizer, save_model_folder
from compress.transforms import checkpoint_logits
from compress.transforms.checkpoint_logits import window_logits
from compress.transforms.quantize.config import QUANTIZE_CONFIG
from compress.transforms.quantize.decoder import quantize_folder
from compress.transforms.quantize.saved import attach_quantization, held_quantized_causal_lm, load_quantization


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 400, (3, 40), generator=torch.Generator().manual_seed(5))


def _forward(model, windows) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(row[None]).logits[0] for row in windows]


def test_a_float_checkpoint_gives_its_forward_pass_logits(tiny_llama_deep, windows):
    logits = window_logits(tiny_llama_deep, windows)
    for index, expected in enumerate(_forward(load_causal_lm(tiny_llama_deep), windows)):
        assert torch.equal(torch.from_numpy(logits.logits(index)), expected)


def test_the_head_is_taken_a_slice_of_rows_at_a_time_with_the_same_logits(tiny_llama_deep, windows, monkeypatch):
    from compress.models import compute

    whole = window_logits(tiny_llama_deep, windows)
    vocab = whole.head_weight.shape[0]
    monkeypatch.setattr(compute, "HEAD_ROWS", 7)  # a vocabulary of several slices, the last one short
    assert vocab % 7 and vocab > 7
    converted = []
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda self: converted.append(self.shape[0]) or real_float(self))
    sliced = whole.logits(1)
    monkeypatch.undo()
    expected = torch.nn.functional.linear(whole.hidden[1][0], whole.head_weight.float())
    assert converted and max(converted) == 7  # never the whole head in float32 at once
    assert torch.allclose(torch.from_numpy(sliced), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "options",
    [
        {"method": "int8", "alpha": 0.5},
        {"method": "int8", "alpha": 0.5, "kv_cache": "fp8"},
        {"method": "int4", "group_size": 32},
    ],
)
def test_a_quantized_checkpoint_gives_the_deployed_numbers(tiny_llama, windows, tmp_path, options):
    bf16 = tmp_path / "bf16"  # held in bf16, as real checkpoints are
    save_model_folder(load_causal_lm(tiny_llama).to(torch.bfloat16), load_tokenizer(tiny_llama), tiny_llama, bf16)
    config = QUANTIZE_CONFIG.validate_python({**options, "calib_windows": 3, "calib_window": 40, "min_calib_tokens": 1,
                                              "sample_tokens": 64})
    folder = tmp_path / "quantized"
    quantize_folder(bf16, folder, windows, config)
    model, rebuilt = held_quantized_causal_lm(folder)
    attach_quantization(model, *load_quantization(folder))
    with computed_in_float32(model, rebuilt):
        expected = _forward(model, windows)
    logits = window_logits(folder, windows)
    for index, reference in enumerate(expected):
        torch.testing.assert_close(torch.from_numpy(logits.logits(index)), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stop", [None, 39])
def test_a_windows_logits_read_a_few_positions_at_a_time_are_its_logits(tiny_llama_deep, windows, monkeypatch, stop):
    logits = window_logits(tiny_llama_deep, windows)
    vocab = logits.head_weight.shape[0]
    monkeypatch.setattr(checkpoint_logits, "LOGIT_BLOCK_BYTES", 32 * 4 * vocab)  # a 40-token window is two blocks
    whole = logits.logits(2)
    rows = logits.rows(2, stop=stop)
    assert len(rows) == (stop or 40) and rows.block == 32
    for positions in (slice(0, 8), slice(8, 16), slice(16, 32), slice(32, None), slice(10, 36), slice(None)):
        expected = whole[: len(rows)][positions]
        assert rows[positions].shape == expected.shape
        np.testing.assert_allclose(rows[positions], expected, rtol=0, atol=1e-5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak reads Linux's VmHWM")
def test_comparing_two_models_never_holds_a_whole_windows_logits(tmp_path):
    """Two 512-token windows' float32 logits at a 250k vocabulary are 1 GB; read a few positions at a time, the
    comparison holds a block of positions of each (and the float64 temporaries of 32 positions)."""
    import transformers

    vocab, positions = 250_000, 512
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=vocab, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp_path)
    windows = torch.randint(0, vocab, (2, positions), generator=torch.Generator().manual_seed(1))
    model = window_logits(tmp_path, windows)
    teacher = window_logits(tmp_path, windows)
    domains = [("a", windows[:1]), ("b", windows[1:])]
    compare_window_pairs(lambda i: (model.rows(i), teacher.rows(i)), domains, progress=False)  # allocator settled
    gc.collect()
    reset_peak()
    before = peak_mb()
    figures = compare_window_pairs(lambda i: (model.rows(i), teacher.rows(i)), domains, progress=False)
    two_windows_mb = 2 * positions * vocab * 4 / 2**20
    assert peak_mb() - before < 0.75 * two_windows_mb
    assert figures["mixed"]["tokens"] == 2 * (positions - 1) and figures["mixed"]["top1_agreement"] == 1.0
    assert abs(figures["mixed"]["mean_kl"]) < 1e-9
