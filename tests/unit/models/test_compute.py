"""A model held in bf16 or as quantized levels computes what its float32 copy computes."""

from __future__ import annotations

import sys

import pytest
import torch

from compress.models.compute import computed_in_float32
from compress.models.loading import load_causal_lm, load_tokenizer, save_model_folder
from compress.transforms.quantize.config import QUANTIZE_CONFIG
from compress.transforms.quantize.decoder import quantize_folder
from compress.transforms.quantize.saved import held_quantized_causal_lm, load_quantized_causal_lm


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 400, (2, 40), generator=torch.Generator().manual_seed(1))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_a_bf16_model_computes_exactly_what_its_float32_copy_does(tiny_llama, ids):
    held = load_causal_lm(tiny_llama).to(torch.bfloat16)
    copy = load_causal_lm(tiny_llama).to(torch.bfloat16).float()
    with computed_in_float32(held):
        logits = _logits(held, ids)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, _logits(copy, ids), atol=1e-5, rtol=1e-5)
    assert {p.dtype for p in held.parameters()} == {torch.bfloat16}  # every part got its own tensors back
    assert float((_logits(held, ids).float() - logits).abs().max()) > 1e-6  # outside, it computes in bf16 again


def test_a_quantized_folder_held_as_levels_computes_what_its_rebuilt_float_model_does(tiny_llama, ids, tmp_path):
    bf16 = tmp_path / "bf16"
    save_model_folder(load_causal_lm(tiny_llama).to(torch.bfloat16), load_tokenizer(tiny_llama), tiny_llama, bf16)
    config = QUANTIZE_CONFIG.validate_python(
        {
            "method": "int4",
            "calib_windows": 2,
            "calib_window": 40,
            "min_calib_tokens": 1,
            "sample_tokens": 64,
            "group_size": 32,
        }
    )
    folder = tmp_path / "quantized"
    result = quantize_folder(bf16, folder, ids, config)
    held, rebuilt = held_quantized_causal_lm(folder)
    assert set(rebuilt) == {f"{name}.weight" for name in result.linears}
    assert all(held.get_submodule(name).weight.numel() == 0 for name in result.linears)  # nothing but the levels
    with computed_in_float32(held, rebuilt):
        logits = _logits(held, ids)
    torch.testing.assert_close(logits, _logits(load_quantized_causal_lm(folder), ids), atol=1e-5, rtol=1e-5)
    assert all(held.get_submodule(name).weight.numel() == 0 for name in result.linears)


def test_the_embedding_and_lm_head_are_never_upcast_whole(tiny_llama, ids, monkeypatch):
    from compress.models import compute

    held = load_causal_lm(tiny_llama).to(torch.bfloat16)
    copy = load_causal_lm(tiny_llama).to(torch.bfloat16).float()
    vocab = held.lm_head.out_features
    monkeypatch.setattr(compute, "HEAD_ROWS", 60)  # several slices, the last one short
    assert vocab > 60 and vocab % 60
    upcast_rows = []
    real_float = torch.Tensor.float

    def watched(tensor):
        if tensor.dim() == 2 and tensor.shape[-1] == held.config.hidden_size:
            upcast_rows.append(tensor.shape[0])
        return real_float(tensor)

    with computed_in_float32(held):
        monkeypatch.setattr(torch.Tensor, "float", watched)
        logits = _logits(held, ids)
        monkeypatch.setattr(torch.Tensor, "float", real_float)
    assert upcast_rows and vocab not in upcast_rows and max(upcast_rows) <= max(60, held.config.intermediate_size)
    torch.testing.assert_close(logits, _logits(copy, ids), atol=1e-5, rtol=1e-5)
    # their own forward again
    assert "forward" not in vars(held.lm_head) and "forward" not in vars(
        held.model.embed_tokens
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are handed back on Linux only")
def test_a_model_mapped_from_its_checkpoint_holds_none_of_its_weights_after_a_pass(tiny_llama, ids, tmp_path):
    from compress.transforms.quantize.saved import held_deployed_causal_lm
    from tests.unit.core.test_mapped_pages import resident_pages

    bf16 = tmp_path / "bf16"
    save_model_folder(load_causal_lm(tiny_llama).to(torch.bfloat16), load_tokenizer(tiny_llama), tiny_llama, bf16)
    held, _ = held_deployed_causal_lm(bf16)  # its weights are views of the mapped safetensors file
    weights = [p for name, p in held.named_parameters() if name.endswith("proj.weight")]
    expected = _logits(load_causal_lm(bf16).to(torch.bfloat16).float(), ids)
    _logits(held, ids)  # in bf16, outside: every page read and kept
    assert sum(resident_pages(w) for w in weights) > 0
    with computed_in_float32(held):
        logits = _logits(held, ids)
        assert sum(resident_pages(w) for w in weights) == 0  # each block's pages went back once it had computed
        again = _logits(held, ids)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits, again)  # read again from the file: the same numbers
    with torch.no_grad():
        weights[0].add_(1)  # its own pages again, writable
