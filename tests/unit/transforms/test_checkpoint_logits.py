"""Validation's block-by-block logits are the logits the model's own forward pass computes, for a float checkpoint and for
a quantized one (levels rebuilt, inputs and an FP8 KV cache quantized as deployed)."""

from __future__ import annotations

import pytest
import torch

from compress.models.compute import computed_in_float32
from compress.models.loading import load_causal_lm, load_tokenizer, save_model_folder
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


@pytest.mark.parametrize("options", [{"method": "int8", "alpha": 0.5}, {"method": "int8", "alpha": 0.5, "kv_cache": "fp8"},
                                     {"method": "int4", "group_size": 32}])
def test_a_quantized_checkpoint_gives_the_deployed_numbers(tiny_llama, windows, tmp_path, options):
    bf16 = tmp_path / "bf16"  # held in bf16, as real checkpoints are
    save_model_folder(load_causal_lm(tiny_llama).to(torch.bfloat16), load_tokenizer(tiny_llama), tiny_llama, bf16)
    config = QUANTIZE_CONFIG.validate_python({**options, "calib_windows": 3, "calib_window": 40, "min_calib_tokens": 1,
                                              "sample_tokens": 64})
    folder = tmp_path / "quantized"
    quantize_folder(bf16, folder, windows, config, progress=False)
    model, rebuilt = held_quantized_causal_lm(folder)
    attach_quantization(model, *load_quantization(folder))
    with computed_in_float32(model, rebuilt):
        expected = _forward(model, windows)
    logits = window_logits(folder, windows)
    for index, reference in enumerate(expected):
        torch.testing.assert_close(torch.from_numpy(logits.logits(index)), reference, atol=1e-5, rtol=1e-5)
