"""Learned rounding on every weight grid: the tuned block is never worse than its AWQ / GPTQ start on the calibration
windows, its weights stay on their grid, and what the quantizer stores is what the model computes with."""

from __future__ import annotations

import pytest
import torch

from compress.algorithms.formats import E2M1_LEVELS, expand_scales
from compress.models.families import decoder_blocks
from compress.models.loading import load_causal_lm
from compress.transforms.quantize.config import quantize_config
from compress.transforms.quantize.decoder import quantize_model
from compress.transforms.quantize.saved import dequantized_weight
from compress.transforms.walk import capture_first_block_inputs, run_block

SMALL = {"calib_windows": 6, "calib_window": 48, "min_calib_tokens": 96}
GRIDS = {
    "int4-g32": {"method": "int4", "group_size": 32},
    "int8": {"method": "int8", "weight_algorithm": "rtn"},
    "fp8": {"method": "fp8"},
    "nvfp4": {"method": "nvfp4"},
}


def _windows() -> torch.Tensor:
    shape = (SMALL["calib_windows"], SMALL["calib_window"])
    return torch.randint(0, 500, shape, generator=torch.Generator().manual_seed(1))


def _first_block_error(model, reference, windows) -> float:
    """Mean squared output error of the quantized model's first block against the float one, on the windows."""
    inputs = capture_first_block_inputs(reference, windows)
    ours = run_block(decoder_blocks(model)[0], inputs)
    theirs = run_block(decoder_blocks(reference)[0], inputs)
    return sum(float((a - b).pow(2).mean()) for a, b in zip(ours, theirs, strict=True)) / len(ours)


@pytest.mark.parametrize("grid", sorted(GRIDS))
def test_tuned_rounding_is_never_worse_than_its_start_and_stays_on_the_grid(tiny_llama, grid):
    windows = _windows()
    reference = load_causal_lm(tiny_llama)
    start, tuned = load_causal_lm(tiny_llama), load_causal_lm(tiny_llama)
    quantize_model(start, windows, quantize_config(**GRIDS[grid], **SMALL), progress=False)
    result = quantize_model(tuned, windows, quantize_config(**GRIDS[grid], **SMALL, tune_iters=10), progress=False)

    assert len(result.tuned) == len(decoder_blocks(tuned))
    assert all(o.error_after < o.error_before for o in result.tuned if o.kept)
    # measured apart from the tuner: the first block (same inputs in both models) is no worse than its start
    assert _first_block_error(tuned, reference, windows) <= _first_block_error(start, reference, windows) * (1 + 1e-6)
    summary = result.tuning_summary()
    assert summary["blocks"] == len(result.tuned) and summary["iterations"] == 10

    for name, quant in result.linears.items():
        weight = tuned.get_submodule(name).weight.detach()
        torch.testing.assert_close(weight, dequantized_weight(quant), rtol=0, atol=1e-6)  # stored == computed with
        values = quant.levels.float()
        if quant.format.weight_format == "nvfp4":
            assert set(values.abs().unique().tolist()) <= set(E2M1_LEVELS)
            assert quant.weight_scales.float().equal(quant.weight_scales.to(torch.float8_e4m3fn).float())
        elif quant.format.weight_format == "fp8":
            assert values.equal(values.to(torch.float8_e4m3fn).float())
            assert quant.weight_scales.float().equal(quant.weight_scales.half().float())
        else:
            bits = quant.format.weight_bits
            assert values.equal(values.round()) and values.abs().max() <= 2 ** (bits - 1)
            if quant.group_size:
                groups = values.reshape(values.shape[0], -1, quant.group_size)
                assert max(len(g.unique()) for row in groups for g in row) <= 2 ** bits
        expanded = expand_scales(quant.weight_scales.float(), values.shape[1])
        assert torch.isfinite(expanded).all() and (expanded >= 0).all()


def test_tuning_is_off_by_default_and_named_in_the_config():
    assert quantize_config(method="int4").tuning() is None
    settings = quantize_config(method="int4", tune_iters=50, tune_windows=2).tuning()
    assert (settings.iters, settings.windows, settings.learning_rate()) == (50, 2, 1 / 50)
    with pytest.raises(ValueError, match="tune_iters"):
        quantize_config(method="int4", tune_iters=-1)


def test_the_plan_estimate_counts_the_tuning_steps():
    from compress.pipeline.resources import estimate_stages

    config = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
              "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}

    def minutes(**options) -> float:
        (estimate,) = estimate_stages([("quantize", quantize_config(method="int4", **options))], config, 5.4e8)
        return estimate.seconds / 60

    plain, tuned = minutes(), minutes(tune_iters=100)
    assert plain < tuned < plain + 60  # about 27 minutes of tuning on this class of machine
    assert minutes(tune_iters=50) < tuned
