"""Quantizer numerics on small tensors: SQNR bounds, AWQ/GPTQ vs RTN, SmoothQuant vs naive W8A8."""

from __future__ import annotations

import pytest
import torch

from compress.algorithms.formats import Int8Activation, IntGrid, Nvfp4Grid
from compress.algorithms.quant import (
    activation_scale,
    awq_search_clip,
    awq_search_scales,
    gptq_quantize,
    qmax,
    quantize_dequantize_activation,
    quantize_dequantize_weight,
    smoothquant_scales,
    sqnr_db,
)
from compress.transforms.quantize.config import QUANTIZE_CONFIG, quantize_config


def _layer(seed=0, out_features=96, in_features=128, tokens=512, outliers=4, outlier_gain=40.0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    x = torch.randn(tokens, in_features, generator=gen)
    x[:, :outliers] *= outlier_gain
    return weight, x


def test_sqnr_bounds_per_scheme():
    weight, x = _layer(outliers=0)
    reference = x @ weight.T
    int8, _ = quantize_dequantize_weight(weight, 8, None)
    int4, _ = quantize_dequantize_weight(weight, 4, 64)
    assert sqnr_db(reference, x @ int8.T) > 38
    assert 14 < sqnr_db(reference, x @ int4.T) < 30
    assert sqnr_db(reference, reference) == float("inf")


def test_levels_are_on_the_grid_and_zeros_stay_zero():
    weight, _ = _layer()
    weight[:, ::4] = 0
    for bits, group in ((8, None), (4, 32)):
        dq, scales = quantize_dequantize_weight(weight, bits, group)
        expanded = (
            scales[:, None] if scales.dim() == 1 else scales.repeat_interleave(weight.shape[1] // scales.shape[1], 1)
        )
        levels = dq / expanded
        assert torch.allclose(levels, levels.round(), atol=1e-4)
        assert levels.abs().max() <= qmax(bits) + 1
        assert (dq[:, ::4] == 0).all()


def test_gptq_beats_rtn_and_keeps_sparsity_zeros():
    weight, _ = _layer()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(512, 24, generator=gen) @ torch.randn(24, 128, generator=gen) + 0.1 * torch.randn(
        512, 128, generator=gen
    )
    weight[:, 1::4] = 0
    hessian = 2 * x.T @ x / x.shape[0]
    reference = x @ weight.T
    rtn, _ = quantize_dequantize_weight(weight, 4, 32)
    gptq, scales = gptq_quantize(weight, hessian, IntGrid(4, 32))
    assert sqnr_db(reference, x @ gptq.T) > sqnr_db(reference, x @ rtn.T) + 1.0
    assert (gptq[:, 1::4] == 0).all()
    assert scales.shape == (96, 4)


def _smoothed_outlier_layer(seed=0):
    """A W8A8 layer after strong smoothing: correlated inputs, a few weight columns carry the activation outliers."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(128, 256, generator=gen) * 0.05
    x = torch.randn(2048, 32, generator=gen) @ torch.randn(32, 256, generator=gen) + 0.2 * torch.randn(
        2048, 256, generator=gen
    )
    x[:, :8] *= 30
    scales = smoothquant_scales(x.abs().amax(dim=0), [weight], alpha=0.9)
    return weight * scales, x / scales


def test_gptq_act_order_lowers_error_on_outlier_columns_and_keeps_zeros():
    weight, x = _smoothed_outlier_layer()
    weight[:, 2::4] = 0
    hessian = 2 * x.T @ x / x.shape[0]
    reference = x @ weight.T
    in_order, scales = gptq_quantize(weight, hessian, IntGrid(8))
    by_energy, scales_ao = gptq_quantize(weight, hessian, IntGrid(8), act_order=True)
    assert sqnr_db(reference, x @ by_energy.T) > sqnr_db(reference, x @ in_order.T) + 0.5
    assert (by_energy[:, 2::4] == 0).all()
    torch.testing.assert_close(scales_ao, scales)
    levels = by_energy / scales[:, None]
    assert torch.allclose(levels, levels.round(), atol=1e-4)
    with pytest.raises(ValueError, match="act_order"):
        gptq_quantize(weight, hessian, IntGrid(4, 32), act_order=True)


def test_alpha_search_reranks_with_the_shipped_gptq_weights():
    from compress.algorithms.stats import InputStats
    from compress.transforms.quantize.decoder import ALPHA_GRID, _search_alpha, _smoothing, _w8a8_candidate

    weight, x = _layer(seed=4, out_features=128, in_features=256, tokens=1024, outliers=6, outlier_gain=80.0)
    stats = InputStats()
    stats.add(x, want_hessian=True, sample_rows=1024, generator=torch.Generator().manual_seed(0))
    rtn_config = quantize_config(method="int8", weight_algorithm="rtn")
    gptq_config = quantize_config(method="int8", weight_algorithm="gptq")
    rtn_choice, _ = _search_alpha(rtn_config, stats, [weight], None)
    gptq_choice, shipped = _search_alpha(gptq_config, stats, [weight], None)
    assert rtn_choice == min(
        ALPHA_GRID,
        key=lambda a: (
            _w8a8_candidate(x, [weight], _smoothing(stats, [weight], a, None), stats.absmax, rtn_config).error
        ),
    )
    assert gptq_choice >= rtn_choice

    def shipped_error(alpha):
        return _w8a8_candidate(x, [weight], _smoothing(stats, [weight], alpha, None), stats.absmax, gptq_config,
                               stats.mean_hessian()).error

    assert shipped_error(gptq_choice) <= shipped_error(rtn_choice)
    # The search hands over the GPTQ weights it scored: on the per-channel grid, with exactly that error.
    scales = _smoothing(stats, [weight], gptq_choice, None)
    (dequantized, weight_scales), = shipped.gptq_weights
    levels = dequantized / weight_scales[:, None]
    assert torch.allclose(levels, levels.round(), atol=1e-3) and levels.abs().max() <= 128
    x_q = quantize_dequantize_activation(x / scales, float((stats.absmax / scales).max()) / 127)
    assert shipped.error == pytest.approx((x @ weight.T - x_q @ dequantized.T).pow(2).mean().item(), rel=1e-5)


def test_sampled_rows_leave_out_the_attention_sink_but_statistics_keep_it():
    from compress.algorithms.stats import InputStats

    x = torch.randn(3, 64, 16, generator=torch.Generator().manual_seed(0))
    x[:, 0, 3] = 1000.0
    stats = InputStats()
    stats.add(x, want_hessian=True, sample_rows=10_000, generator=torch.Generator().manual_seed(0))
    samples = stats.sample_matrix(10_000)
    assert samples.shape == (3 * 63, 16)
    assert samples[:, 3].abs().max() < 10
    assert stats.absmax[3] == 1000.0 and stats.tokens == 3 * 64
    assert stats.hessian[3, 3] >= 3 * 1000.0**2


def test_awq_beats_rtn_on_outlier_channels():
    weight, x = _layer()
    reference = x @ weight.T
    rtn, _ = quantize_dequantize_weight(weight, 4, 32)
    scales, ratio = awq_search_scales(x, [weight], IntGrid(4, 32))
    scaled = weight * scales
    clip = awq_search_clip(x / scales, scaled, IntGrid(4, 32))
    awq, _ = quantize_dequantize_weight(scaled, 4, 32, clip)
    assert ratio > 0
    assert sqnr_db(reference, (x / scales) @ awq.T) > sqnr_db(reference, x @ rtn.T) + 1.0


def test_smoothquant_beats_naive_w8a8_on_activation_outliers():
    weight, x = _layer(outlier_gain=80.0)
    reference = x @ weight.T

    def w8a8(x_in, w_in):
        w_q, _ = quantize_dequantize_weight(w_in, 8, None)
        return quantize_dequantize_activation(x_in, x_in.abs().max().item() / 127) @ w_q.T

    naive = sqnr_db(reference, w8a8(x, weight))
    scales = smoothquant_scales(x.abs().amax(dim=0), [weight], alpha=0.5)
    smoothed = sqnr_db(reference, w8a8(x / scales, weight * scales))
    assert smoothed > naive + 6.0


def test_mse_activation_scale_clips_and_lowers_error():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 64, generator=gen)
    x[0, 0] = 300.0
    absmax = x.abs().max().item()
    mse_scale = activation_scale(x, absmax, "mse", Int8Activation())
    assert mse_scale < absmax / 127
    err = lambda s: (quantize_dequantize_activation(x, s) - x).pow(2).mean().item()  # noqa: E731
    assert err(mse_scale) < err(absmax / 127)


def test_config_round_trip_and_unknown_keys():
    config = quantize_config(method="int4", group_size=32, algorithm="gptq")
    assert QUANTIZE_CONFIG.validate_python(config.model_dump()) == config
    assert config.scheme() == (4, False, 32) and config.precision() == "int4"
    assert quantize_config(method="int8").scheme() == (8, True, None)
    with pytest.raises(ValueError):
        QUANTIZE_CONFIG.validate_python({"method": "int8", "colour": 1})
    with pytest.raises(ValueError):
        QUANTIZE_CONFIG.validate_python({"method": "int4", "group_size": 48})


def test_hadamard_rotation_is_orthogonal_and_preserves_the_linear():
    from compress.algorithms.rotation import hadamard, rotate, rotate_gram
    from compress.transforms.quantize.decoder import rotation_block

    h = hadamard(64)
    assert torch.allclose(h @ h, torch.eye(64, dtype=h.dtype), atol=1e-12) and torch.equal(h, h.T)
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(32, 192, generator=gen), torch.randn(48, 192, generator=gen)
    assert torch.allclose(rotate(x, 64) @ rotate(weight, 64).T, x @ weight.T, atol=1e-4)
    assert torch.allclose(rotate(rotate(x, 64), 64), x, atol=1e-5)
    gram = x.double().T @ x.double()
    rotated = rotate(x.double(), 64)
    assert torch.allclose(rotate_gram(gram, 64), rotated.T @ rotated, atol=1e-9)
    assert [rotation_block(w, 128) for w in (1536, 1472, 96, 7)] == [128, 64, 32, 0]


def _mlp_hidden_stats(x: torch.Tensor, block: int):
    from compress.algorithms.stats import InputStats

    stats = InputStats(rotation=block)
    stats.add(x, want_hessian=True, sample_rows=10_000, generator=torch.Generator().manual_seed(0))
    return stats


def test_rotation_is_chosen_for_scattered_outliers_and_refused_for_a_sink():
    from compress.transforms.quantize.decoder import _migration

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 256, generator=gen) * 0.05
    config = quantize_config(method="int8", hadamard_block=64)
    kv_groups = torch.arange(256)

    scattered = torch.randn(4, 128, 256, generator=gen)  # every token has one large value, in a random channel
    channels = torch.randint(0, 256, (4, 128), generator=gen)
    scattered.scatter_(2, channels[..., None], 60.0)
    migration = _migration(config, "mlp_hidden", _mlp_hidden_stats(scattered, 64), [weight], kv_groups)
    assert migration.rotation == 64 and migration.scales is None

    sink = torch.randn(4, 128, 256, generator=gen)
    sink[:, 0, :4] = 500.0  # a massive activation on the first position only, in fixed channels
    migration = _migration(config, "mlp_hidden", _mlp_hidden_stats(sink, 64), [weight], kv_groups)
    assert migration.rotation == 0 and migration.scales is not None

    without = _migration(
        quantize_config(method="int8"), "mlp_hidden", _mlp_hidden_stats(scattered, 0), [weight], kv_groups
    )
    assert without.rotation == 0


def test_rotated_w8a8_beats_smoothquant_on_scattered_outliers():
    from compress.algorithms.rotation import rotate

    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(64, 256, generator=gen) * 0.05
    x = torch.randn(512, 256, generator=gen)
    x.scatter_(1, torch.randint(0, 256, (512, 1), generator=gen), 60.0)
    reference = x @ weight.T

    def w8a8(x_in, w_in):
        w_q, _ = quantize_dequantize_weight(w_in, 8, None)
        return quantize_dequantize_activation(x_in, x_in.abs().max().item() / 127) @ w_q.T

    scales = smoothquant_scales(x.abs().amax(dim=0), [weight], alpha=0.5)
    smoothed = sqnr_db(reference, w8a8(x / scales, weight * scales))
    rotated = sqnr_db(reference, w8a8(rotate(x, 64), rotate(weight, 64)))
    assert rotated > smoothed + 3.0


def test_hadamard_block_needs_quantized_activations():
    with pytest.raises(ValueError, match="hadamard_block"):
        quantize_config(method="int4", hadamard_block=128)
    assert quantize_config(method="rtn", bits=8, hadamard_block=64).hadamard_block == 64


def test_clipping_scored_on_every_token_spares_the_weights_an_attention_sink_reads():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(32, 64, generator=gen) * 0.05
    weight[:, 3] *= 6  # the channel the sink's massive activation sits on carries each row's largest weight
    x = torch.randn(512, 64, generator=gen)
    sink = torch.zeros(1, 64)
    sink[0, 3] = 2000.0
    everything = torch.cat([x, sink])
    hessian = everything.T @ everything / everything.shape[0]
    grid = IntGrid(4, 32)
    sampled = awq_search_clip(x, weight, grid)  # the sampled rows leave the sink out
    all_tokens = awq_search_clip(x, weight, grid, hessian=hessian)
    assert (sampled[:, 0] < 1).float().mean() > 0.5  # blind to the sink, most rows clip the block holding channel 3
    assert (
        all_tokens[:, 0] < 1
    ).float().mean() < 0.25  # scored on every token, few do (those whose channel-3 weight is small)

    def sink_error(clip):
        return (sink @ weight.T - sink @ quantize_dequantize_weight(weight, 4, 32, clip)[0].T).pow(2).mean().item()

    assert sink_error(all_tokens) < 0.1 * sink_error(sampled)


@pytest.mark.parametrize("scored_on", ["samples", "hessian"])
@pytest.mark.parametrize("grid", [IntGrid(4, 32), Nvfp4Grid()], ids=["int4", "nvfp4"])
def test_the_clip_search_a_few_rows_at_a_time_chooses_what_the_whole_search_does(grid, scored_on, monkeypatch):
    """Rows are searched independently, so bounding the search's temporaries changes no ratio; scored on samples, no
    temporary holds more than the rows at a time's (tokens x groups x rows) outputs."""
    from compress.algorithms import quant

    weight, x = _layer(seed=3, out_features=200, in_features=128, tokens=64)
    grid = grid.bind([weight]) if isinstance(grid, Nvfp4Grid) else grid
    hessian = x.T @ x / x.shape[0] if scored_on == "hessian" else None
    whole = awq_search_clip(x, weight, grid, hessian=hessian)
    # 16 or 32 rows of 200 at a time when scored on the samples
    monkeypatch.setattr(
        quant, "CLIP_SEARCH_ELEMENTS", 8192
    )
    largest = []
    real_einsum = torch.einsum

    def recording_einsum(equation, *operands):
        result = real_einsum(equation, *operands)
        largest.append(result.numel())
        return result

    monkeypatch.setattr(torch, "einsum", recording_einsum)
    sliced = awq_search_clip(x, weight, grid, hessian=hessian)
    assert torch.equal(sliced, whole)
    if hessian is None:  # the sampled outputs, tokens x groups x rows, were the search's largest temporaries
        assert max(largest) <= 8192
