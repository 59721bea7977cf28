"""Quantizing a decoder block by block: SmoothQuant W8A8, AWQ / GPTQ INT4, RTN.

Per block, statistics of the four linear inputs are gathered in one pass (attention input,
attention output, MLP input, MLP hidden). Migration scales (SmoothQuant or AWQ) are folded into
the producer of each input, as :mod:`compress.models.families` describes it, so the float function is
unchanged. On Llama:

* attention input -> ``input_layernorm`` weight; q/k/v columns
* attention output -> ``v_proj`` rows (equal per grouped KV channel, so GQA stays exact); o_proj columns
* MLP input -> ``post_attention_layernorm`` weight; gate/up columns
* MLP hidden -> ``up_proj`` rows; down_proj columns

(Gemma 3's MLP input comes from ``pre_feedforward_layernorm``, whose ``1 + w`` form the fold keeps;
Phi-3's producers are the v and up parts of its fused ``qkv_proj`` and ``gate_up_proj``.)

For W8A8 with ``hadamard_block``, the MLP hidden state may instead be rotated by a block-diagonal
Hadamard matrix in front of ``down_proj`` (kept where it gives the lower output error on the
calibration samples). The rotation cannot be folded through the gated product, so it stays in
the deployed graph as a small ``MatMul``; the levels are saved in the rotated basis and the float
weight the model computes with is the rotated-back dequantized one (``x W^T == (x R)(W R)^T``).

Weights are then quantized (RTN, AWQ clipping, GPTQ), their grid values kept for the saved checkpoint and
the block computing on with them dequantized, and the block's
outputs (with simulated activation quantization for W8A8) become the next block's inputs: the
blocks are driven by the shared walker (:mod:`compress.transforms.walk`), this module being one
of its visitors.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compress.algorithms import kv_cache
from compress.algorithms.formats import (
    ROWS_AT_A_TIME,
    ActivationFormat,
    Nvfp4Grid,
    WeightGrid,
    expand_scales,
    quantize_dequantize,
)
from compress.algorithms.quant import (
    activation_scale,
    awq_search_clip,
    awq_search_scales,
    gptq_quantize,
    smoothquant_scales,
    sqnr_db,
    sqnr_of_energies,
)
from compress.algorithms.rotation import rotate
from compress.algorithms.rounding import TunableWeight, TuneOutcome, TuneSettings, tune_block
from compress.algorithms.stats import InputStats
from compress.core.devices import ON_CPU, Compute
from compress.core.errors import UsageError
from compress.models.families import (
    ActivationPoint,
    Family,
    attention_geometry,
    decoder_blocks,
    family_of,
    final_norm,
    linear_shapes,
    part_rows,
)
from compress.models.weights import CheckpointReader, empty_causal_lm, materialize, module_prefix
from compress.transforms.quantize.config import QuantizeConfig
from compress.transforms.quantize.plan import FLOAT, MixedPlan
from compress.transforms.quantize.saved import (
    LEVEL_DTYPES,
    LinearQuant,
    QuantizedCheckpointWriter,
    QuantResult,
    attach_activation_quant,
    grid_levels,
    input_quantizer,
    stored_grid,
)
from compress.transforms.rotate import ResidualRotation, rotate_ends
from compress.transforms.walk import (
    BlockInputs,
    BlockVisitor,
    StreamedBlocks,
    collect_input_stats,
    run_block,
    walk_blocks,
)

log = logging.getLogger(__name__)

CLIP_SEARCH_TOKENS = 256


def _linears(block, family: Family) -> dict[str, torch.nn.Linear]:
    return {name: block.get_submodule(name) for name in family.linears()}


def check_group_size(config: QuantizeConfig, shapes: dict[str, tuple[int, int]]) -> None:
    """Refuse a group size that does not divide a quantized linear's input width (``shapes``: out, in by short name)."""
    group = config.scheme()[2]
    for name, (_, in_features) in shapes.items():
        if group and not config.is_float(name) and in_features % group:
            raise UsageError(
                f"quantize.group_size={group} does not divide {name}'s input width {in_features}; choose a group "
                f"that does, or keep {name} float with quantize.float_linears"
            )


def rotation_block(width: int, limit: int) -> int:
    """The largest power-of-two Hadamard block up to ``limit`` that divides ``width`` (0 when none above 1)."""
    block = limit
    while block > 1 and width % block:
        block //= 2
    return block if block > 1 else 0


def _kv_groups(block, config) -> torch.Tensor:
    """For each attention-output channel, the value channel (row of the value part) it is computed from."""
    family = family_of(config)
    heads, kv, head_dim = attention_geometry(config)
    output = block.get_submodule(family.attn_output)
    n_heads = output.in_features // head_dim
    head = torch.arange(n_heads, device=output.weight.device).repeat_interleave(head_dim)
    dim = torch.arange(head_dim, device=output.weight.device).repeat(n_heads)
    return (head // (n_heads // kv)) * head_dim + dim


def fold_scales(block, point: ActivationPoint, scales: torch.Tensor, kv_groups: torch.Tensor, config) -> None:
    """Divide the producer's output by ``scales`` and multiply the consumers' input columns by it (exact in float)."""
    family = family_of(config)
    with torch.no_grad():
        producer = block.get_submodule(point.producer)
        if point.producer_kind == "norm":
            # The norm multiplies by (offset + w); (offset + w) / s is the new factor.
            producer.weight.copy_((family.norm_offset + producer.weight) / scales - family.norm_offset)
        else:
            rows = part_rows(family, config, point.producer, point.producer_part) if point.producer_part \
                else slice(0, producer.out_features)
            if point.name == "attn_out":
                # One scale per attention-output channel; every query head of a KV group reads the same value row.
                width = rows.stop - rows.start
                scales_out = scales.new_zeros(width).index_copy_(0, kv_groups, scales)
            else:
                scales_out = scales
            _scale_rows(producer, rows, 1.0 / scales_out)
        for name in point.consumers:
            block.get_submodule(name).weight.mul_(scales[None, :])


def _scale_rows(linear: torch.nn.Linear, rows: slice, factors: torch.Tensor) -> None:
    linear.weight[rows].mul_(factors[:, None])
    if linear.bias is not None:
        linear.bias[rows].mul_(factors)


ALPHA_GRID = (0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
# GPTQ lowers the weight error, so with GPTQ weights the best alpha sits at or above the one the
# RTN proxy picks; the proxy's choice and the next larger values (up to 1.0, all difficulty in the
# weights, which only GPTQ can afford) are re-ranked with the weights actually shipped.
GPTQ_ALPHA_GRID = (*ALPHA_GRID, 1.0)
ALPHA_REFINE_STEPS = 2


def _smoothing(
    stats: InputStats, weights: list[torch.Tensor], alpha: float, reduce: torch.Tensor | None
) -> torch.Tensor:
    """SmoothQuant scales; with ``reduce``, equal inside each group (GQA value channels)."""
    if reduce is None:
        return smoothquant_scales(stats.absmax, weights, alpha)
    size = int(reduce.max()) + 1
    act = stats.absmax.new_zeros(size).index_reduce_(0, reduce, stats.absmax, "amax", include_self=False)[reduce]
    wmax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
    wmax = wmax.new_zeros(size).index_reduce_(0, reduce, wmax, "amax", include_self=False)[reduce]
    return (act.clamp(min=1e-5).pow(alpha) / wmax.clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-5)


@dataclass
class _Candidate:
    """One way to prepare a group's input, scored by the output error of its W8A8 linears."""

    error: float
    gptq_weights: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # (dequantized, scales) per consumer


def _w8a8_candidate(samples: torch.Tensor, weights: list[torch.Tensor], scales: torch.Tensor, absmax: torch.Tensor,
                    config: QuantizeConfig, hessian: torch.Tensor | None = None) -> _Candidate:
    """Output MSE of the W8A8 linears (INT8 or FP8, as ``config`` says) after smoothing by ``scales``; RTN weights, or
    GPTQ given the input's Hessian.

    GPTQ weights are kept so that the chosen candidate's weights ship without a second GPTQ pass.
    """
    x = samples / scales
    activation = config.activation_format()
    x_q = activation.fake_quantize(x, activation.scale_for(float((absmax / scales).max())))
    scaled_hessian = hessian / (scales[:, None] * scales[None, :]) if hessian is not None else None
    grid = config.weight_grid()
    error, kept = 0.0, []
    for w in weights:
        if scaled_hessian is not None:
            w_q, w_scales = gptq_quantize(
                w * scales, scaled_hessian, grid, damp=config.gptq_damp, act_order=config.gptq_act_order
            )
            kept.append((w_q, w_scales))
        else:
            w_q, _ = quantize_dequantize(w * scales, grid)
        error += (samples @ w.T - x_q @ w_q.T).pow(2).mean().item()
    return _Candidate(error, kept if scaled_hessian is not None else None)


def _gptq_hessian(config: QuantizeConfig, stats: InputStats) -> torch.Tensor | None:
    """The Hessian the W8A8 searches re-rank with, when the weights are GPTQ's."""
    return stats.mean_hessian() if config.is_w8a8() and config.uses_gptq() else None


def _search_alpha(config: QuantizeConfig, stats: InputStats, weights: list[torch.Tensor], reduce: torch.Tensor | None
                  ) -> tuple[float, _Candidate]:
    """The SmoothQuant strength with the least output error (an RTN proxy over the grid, then GPTQ
    re-ranking), and its candidate with the weights actually shipped."""
    samples = stats.sample_matrix(config.sample_tokens)

    def candidate(alpha: float, hessian: torch.Tensor | None = None) -> _Candidate:
        return _w8a8_candidate(
            samples, weights, _smoothing(stats, weights, alpha, reduce), stats.absmax, config, hessian
        )

    scored = {alpha: candidate(alpha) for alpha in ALPHA_GRID}
    best = min(scored, key=lambda alpha: scored[alpha].error)
    hessian = _gptq_hessian(config, stats)
    if hessian is None:
        return best, scored[best]
    start = GPTQ_ALPHA_GRID.index(best)
    refined = {alpha: candidate(alpha, hessian) for alpha in GPTQ_ALPHA_GRID[start:start + ALPHA_REFINE_STEPS + 1]}
    best = min(refined, key=lambda alpha: refined[alpha].error)
    return best, refined[best]


def _rotation_candidate(config: QuantizeConfig, stats: InputStats, weights: list[torch.Tensor]) -> _Candidate:
    """The W8A8 linears on Hadamard-rotated inputs, without smoothing."""
    rotated = stats.rotated_view()
    samples = rotated.sample_matrix(config.sample_tokens)
    rotated_weights = [rotate(w, stats.rotation) for w in weights]
    ones = samples.new_ones(samples.shape[1])
    return _w8a8_candidate(samples, rotated_weights, ones, rotated.absmax, config, _gptq_hessian(config, rotated))


@dataclass
class Migration:
    """How the input of one group of linears is prepared for quantization."""

    scales: torch.Tensor | None = None  # folded into the producer (SmoothQuant or AWQ)
    ratio: float | None = None  # the SmoothQuant strength or AWQ exponent chosen
    rotation: int = 0  # Hadamard block size, instead of folded scales
    gptq_weights: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # from the search, per consumer


def _smoothquant(config: QuantizeConfig, stats: InputStats, weights: list[torch.Tensor],
                 reduce: torch.Tensor | None) -> Migration:
    """The SmoothQuant strength (searched or fixed), or the Hadamard rotation when its output error is lower."""
    if config.alpha == "auto":
        alpha, smoothed = _search_alpha(config, stats, weights, reduce)
    elif stats.rotation:
        alpha = config.alpha
        smoothed = _w8a8_candidate(
            stats.sample_matrix(config.sample_tokens),
            weights,
            _smoothing(stats, weights, alpha, reduce),
            stats.absmax,
            config,
            _gptq_hessian(config, stats),
        )
    else:
        return Migration(_smoothing(stats, weights, config.alpha, reduce), config.alpha)
    if stats.rotation:
        rotated = _rotation_candidate(config, stats, weights)
        if rotated.error < smoothed.error:
            return Migration(rotation=stats.rotation, gptq_weights=rotated.gptq_weights)
    return Migration(_smoothing(stats, weights, alpha, reduce), alpha, gptq_weights=smoothed.gptq_weights)


def _dynamic_fake_quantize(activation: ActivationFormat | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Fake quantization of a sample matrix under the scale its own maximum gives (for searches on scaled inputs)."""
    if activation is None:
        return None
    return lambda x: activation.fake_quantize(x, activation.scale_for(float(x.abs().max())))


def _migration(config: QuantizeConfig, point: str, stats: InputStats, weights: list[torch.Tensor],
               kv_groups: torch.Tensor) -> Migration:
    """Scales to fold into the producer of ``point`` (SmoothQuant or AWQ), or a Hadamard rotation."""
    reduce = kv_groups if point == "attn_out" else None
    if config.smooths_activations():
        return _smoothquant(config, stats, weights, reduce)
    if config.uses_awq():
        return Migration(
            *awq_search_scales(
                stats.sample_matrix(config.sample_tokens),
                weights,
                config.weight_grid(),
                reduce=reduce,
                activation=_dynamic_fake_quantize(config.activation_format()),
            )
        )
    if stats.rotation:
        samples = stats.sample_matrix(config.sample_tokens)
        plain = _w8a8_candidate(samples, weights, torch.ones_like(stats.absmax), stats.absmax, config).error
        if _rotation_candidate(config, stats, weights).error < plain:
            return Migration(rotation=stats.rotation)
    return Migration()


# Multipliers of the NVFP4 global scale tried by the per-tensor scale search: below 1, the blocks
# with the largest values saturate their FP8 scale (they are clipped), and every block's scale
# rounds to a different FP8 number.
NVFP4_GLOBAL_SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5)


def _search_global_scale(weights: list[torch.Tensor], hessian: torch.Tensor) -> Nvfp4Grid:
    """The NVFP4 global scale, shared by ``weights``, with the least round-to-nearest output error.

    The error is ``tr(dW H dW^T)``, the output error over every calibration token: the attention
    sink's massive activations included, which read the largest weights a smaller global scale
    would clip (on SmolLM2's layer 11 ``down_proj``, a 0.9 shrink multiplies the sink row's output
    error by four while barely changing the other tokens').
    """
    best: tuple[float, Nvfp4Grid | None] = (float("inf"), None)
    for shrink in NVFP4_GLOBAL_SHRINKS:
        grid = Nvfp4Grid(global_shrink=shrink).bind(weights)
        error = 0.0
        for w in weights:
            for rows in w.split(ROWS_AT_A_TIME):  # a slice at a time in float32: the LM head's 150k rows included
                rows = rows.to(hessian.dtype)
                delta = rows - quantize_dequantize(rows, grid)[0]
                error += float(((delta @ hessian) * delta).sum())
        if error < best[0]:
            best = (error, grid)
    return best[1]


def _consumer_grids(config: QuantizeConfig, weights: list[torch.Tensor], stats: InputStats) -> list[WeightGrid]:
    """The bound grid of each consumer of one input.

    NVFP4 W4A4: one global scale for all of them (with equal global and input scales, Edge-LLM runs
    q, k and v as one GEMM behind one activation quantizer). NVFP4 weight-only: one per linear (Edge-LLM
    0.11's fused q/k/v GEMM quantizes its input whatever the export's ``--no-quantize-activations``
    says, so q, k and v must not fuse).
    """
    grid = config.weight_grid()
    if not config.binds_global_scale():
        return [grid] * len(weights)
    hessian = stats.mean_hessian() if config.searches_global_scale() else None

    def bound(group: list[torch.Tensor]) -> Nvfp4Grid:
        return _search_global_scale(group, hessian) if hessian is not None else Nvfp4Grid().bind(group)

    if config.scheme()[1]:
        return [bound(weights)] * len(weights)
    return [bound([w]) for w in weights]


def _quantize_weight(config: QuantizeConfig, weight: torch.Tensor, stats: InputStats, grid: WeightGrid,
                     search_clip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    clip: torch.Tensor | float = 1.0
    if config.uses_awq() and search_clip:
        hessian = stats.mean_hessian() if config.clip_on_all_tokens() else None
        clip = awq_search_clip(stats.sample_matrix(CLIP_SEARCH_TOKENS), weight, grid, hessian=hessian)
    if config.uses_gptq():
        act_order = config.gptq_act_order and grid.group_size is None
        return gptq_quantize(
            weight, stats.mean_hessian(), grid, damp=config.gptq_damp, clip_ratio=clip, act_order=act_order
        )
    return quantize_dequantize(weight, grid, clip)


def _wants_hessian(config: QuantizeConfig) -> bool:
    """Whether the format's weight search reads its input's Hessian (GPTQ, NVFP4's scale search, AWQ's clip on all
    tokens)."""
    return config.uses_gptq() or config.searches_global_scale() or config.clip_on_all_tokens()


def quantize_block(block, inputs: BlockInputs, config: QuantizeConfig, model_config, prefix: str,
                   points: Collection[str] | None = None) -> dict[str, LinearQuant]:
    """Quantize one decoder block in place (``points``: only the linears reading these inputs, by activation point
    name); returns per-linear scales and errors."""
    activation = config.activation_format()
    family = family_of(model_config)
    active = [p for p in family.points if not all(config.is_float(name) for name in p.consumers)
              and (points is None or p.name in points)]
    linears = _linears(block, family)
    points = {point.name: linears[point.consumers[0]] for point in active}
    per_window = max(1, config.sample_tokens // max(1, len(inputs.hidden)))
    rotated = family.point(family.rotated_point)
    block_size = rotation_block(linears[rotated.consumers[0]].in_features, config.rotation_limit())
    rotations = {rotated.name: block_size} if block_size and rotated in active else None
    stats = collect_input_stats(block, inputs, points, _wants_hessian(config), per_window, rotations=rotations)
    migrations = _prepare_inputs(block, active, linears, stats, config, model_config)
    result: dict[str, LinearQuant] = {}
    for point in active:
        samples = stats[point.name].sample_matrix(config.sample_tokens)
        absmax = float(stats[point.name].absmax.max())
        point_scale = activation_scale(samples, absmax, config.act_scale, activation) if activation else None
        consumers = [name for name in point.consumers if not config.is_float(name)]
        weights = [_input_basis(linears[name].weight.detach(), migrations[point.name]) for name in consumers]
        grids = dict(zip(consumers, _consumer_grids(config, weights, stats[point.name]), strict=True))
        for index, name in enumerate(point.consumers):
            if config.is_float(name):
                continue
            input_scale = None if config.keeps_float_input(name) else point_scale
            # As in AWQ, weights computing queries and keys are not clipped: attention scores are too sensitive.
            search_clip = not {"q", "k"} & set(family.parts(name))
            shared = _SharedInput(stats[point.name], samples, migrations[point.name])
            result[f"{prefix}.{name}"] = _quantize_linear(
                config, linears[name], shared, input_scale, index, grids[name], search_clip
            )
    return result


def _prepare_inputs(
    block,
    points: list[ActivationPoint],
    linears: dict[str, torch.nn.Linear],
    stats: dict[str, InputStats],
    config: QuantizeConfig,
    model_config,
) -> dict[str, Migration]:
    """Choose each input's migration and apply it: fold scales into the block, or switch ``stats`` to the rotated
    view."""
    kv_groups = _kv_groups(block, model_config)
    migrations: dict[str, Migration] = {}
    for point in points:
        weights = [linears[name].weight.detach() for name in point.consumers]
        migration = migrations[point.name] = _migration(config, point.name, stats[point.name], weights, kv_groups)
        if migration.scales is not None:
            fold_scales(block, point, migration.scales, kv_groups, model_config)
            stats[point.name].rescale(migration.scales)
        elif migration.rotation:
            stats[point.name] = stats[point.name].rotated_view()
    return migrations


def _input_basis(weight: torch.Tensor, migration: Migration) -> torch.Tensor:
    """The weight in the basis its input is quantized in (rotated when the input is)."""
    return rotate(weight, migration.rotation) if migration.rotation else weight


def _stored(config: QuantizeConfig, dequantized: torch.Tensor, grid: WeightGrid, scales: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """An on-grid weight's stored levels, and the weight rebuilt from them: what is computed with from here on, as every
    reader rebuilds it."""
    levels = grid_levels(dequantized, grid, scales, config.weight_format())
    return levels, grid.dequantize(levels.float(), expand_scales(scales.float(), dequantized.shape[1]))


@dataclass(frozen=True)
class _SharedInput:
    """What the linears reading one input share: its statistics, a sample of it, and the migration folded into it."""

    stats: InputStats
    samples: torch.Tensor
    migration: Migration


def _quantize_linear(config: QuantizeConfig, linear: torch.nn.Linear, shared: _SharedInput, input_scale: float | None,
                     index: int, grid: WeightGrid, search_clip: bool) -> LinearQuant:
    """Quantize one linear in place (the ``index``-th consumer of its input) on its bound ``grid`` and measure its SQNR
    on the input's samples."""
    stats, samples, migration = shared.stats, shared.samples, shared.migration
    weight = _input_basis(linear.weight.detach().clone(), migration)
    if migration.gptq_weights:
        dequantized, weight_scales = migration.gptq_weights[index]
    else:
        dequantized, weight_scales = _quantize_weight(config, weight, stats, grid, search_clip)
    levels, dequantized = _stored(config, dequantized, grid, weight_scales)
    activation = config.activation_format()
    x_q = activation.fake_quantize(samples, input_scale) if input_scale else samples
    reference, output = samples @ weight.T, x_q @ dequantized.T
    error = sqnr_db(reference, output)
    if input_scale and config.float_activations_below_db is not None and error < config.float_activations_below_db:
        # Mixed-precision fallback: this linear keeps quantized weights but float inputs.
        input_scale = None
        output = samples @ dequantized.T
        error = sqnr_db(reference, output)
    with torch.no_grad():
        # A rotated weight is stored rotated back: x W^T == (x R)(W R)^T, so the float model is exact.
        linear.weight.copy_(rotate(dequantized, migration.rotation) if migration.rotation else dequantized)
    return LinearQuant(
        weight_scales.cpu(),
        input_scale,
        error,
        migration.ratio,
        migration.rotation,
        global_scale=getattr(grid, "global_scale", None),
        input_format=activation.name if activation else "int8",
        levels=levels.cpu(),
        precision=config.precision().name,
        group_size=config.scheme()[2],
        output_mse=(output - reference).pow(2).mean(0).cpu(),
    )


@dataclass
class LmHead:
    """What quantizing the LM head needs: the final norm its input comes out of, its weight as stored (a tied head's is
    the embedding table, which is read, never changed) and its name."""

    norm: torch.nn.Module
    weight: torch.Tensor
    name: str


def lm_head_of(model, reader: CheckpointReader | None = None) -> LmHead:
    """``model``'s LM head and final norm; ``reader``: a model built empty, whose norm and head are read from its
    checkpoint (a tied head from its embedding table, already read)."""
    norm, head = final_norm(model), model.get_output_embeddings()
    name = module_prefix(model, head)
    weight = head.weight.detach()
    if reader is not None:
        materialize(norm, module_prefix(model, norm), reader)
        key = f"{name}.weight"
        weight = reader.read([key])[key] if key in reader else model.get_input_embeddings().weight.detach()
    return LmHead(norm, weight, name)


def quantize_head(head: LmHead, outputs: list[torch.Tensor], config: QuantizeConfig) -> LinearQuant:
    """Quantize the LM head on its inputs (the final norm of the last block's ``outputs``) without touching the model.

    No migration: the only producer to fold scales into is the final norm, and a quantized head is shipped as a linear
    of its own (untied), so its weight is simply taken to its grid with the format's weight search and its input scale
    calibrated as any linear's. A slice of rows at a time (``ROWS_AT_A_TIME``): once the input's statistics and the
    grid's per-tensor scale are fixed, every weight search treats rows independently, so a 150k-word head never has a
    float32 copy whole."""
    device = outputs[0].device
    norm = copy.deepcopy(head.norm).to(device=device, dtype=torch.float32)
    stats = InputStats()
    generator = torch.Generator().manual_seed(0)
    per_window = max(1, config.sample_tokens // max(1, len(outputs)))
    with torch.no_grad():
        for hidden in outputs:
            stats.add(norm(hidden), _wants_hessian(config), per_window, generator)
    samples = stats.sample_matrix(config.sample_tokens)
    activation = config.activation_format()
    input_scale = (
        activation_scale(samples, float(stats.absmax.max()), config.act_scale, activation) if activation else None
    )
    grid = _consumer_grids(config, [head.weight], stats)[0].bind([head.weight])
    x_q = activation.fake_quantize(samples, input_scale) if input_scale else samples
    fallback = input_scale is not None and config.float_activations_below_db is not None
    levels = torch.empty(head.weight.shape, dtype=LEVEL_DTYPES[config.weight_format()])
    scales: list[torch.Tensor] = []
    error, float_error = _OutputError(), _OutputError()
    for start in range(0, head.weight.shape[0], ROWS_AT_A_TIME):
        weight = head.weight[start:start + ROWS_AT_A_TIME].to(device=device, dtype=torch.float32)
        dequantized, weight_scales = _quantize_weight(config, weight, stats, grid, search_clip=True)
        rows, dequantized = _stored(config, dequantized, grid, weight_scales)
        levels[start:start + rows.shape[0]] = rows.cpu()
        scales.append(weight_scales.cpu())
        reference = samples @ weight.T
        error.add(reference, x_q @ dequantized.T)
        if fallback:
            float_error.add(reference, samples @ dequantized.T)
    if fallback and error.sqnr_db() < config.float_activations_below_db:
        input_scale, error = None, float_error  # as any linear: quantized weights, float inputs
    weight_scales = scales[0] if scales[0].dim() == 0 else torch.cat(scales)  # one per-tensor scale, or one per row
    return LinearQuant(
        weight_scales,
        input_scale,
        error.sqnr_db(),
        global_scale=getattr(grid, "global_scale", None),
        input_format=activation.name if activation else "int8",
        levels=levels,
        precision=config.precision().name,
        group_size=config.scheme()[2],
        output_mse=torch.cat(error.mse),
    )


@dataclass
class _OutputError:
    """A linear's output error summed over slices of its rows: the SQNR and each output's mean squared error."""

    signal: float = 0.0
    noise: float = 0.0
    mse: list[torch.Tensor] = field(default_factory=list)

    def add(self, reference: torch.Tensor, output: torch.Tensor) -> None:
        difference = output - reference
        self.signal += reference.double().pow(2).sum().item()
        self.noise += difference.double().pow(2).sum().item()
        self.mse.append(difference.pow(2).mean(0).cpu())

    def sqnr_db(self) -> float:
        return sqnr_of_energies(self.signal, self.noise)


def tune_rounding(block, inputs: BlockInputs, targets: list[torch.Tensor], quantized: dict[str, LinearQuant],
                  settings: TuneSettings) -> TuneOutcome:
    """Tune the rounding and clipping of a quantized block's linears (``quantized``: by path inside the block) towards
    ``targets`` and write the tuned levels, scales and weights back where tuning lowered the block's output error."""
    device = next(block.parameters()).device
    weights = {}
    for name, quant in quantized.items():
        grid = stored_grid(quant)
        scales = quant.weight_scales.to(device).float()
        start = grid.dequantize(quant.levels.to(device).float(), expand_scales(scales, quant.levels.shape[1]))
        weights[name] = TunableWeight(grid, start, scales, quant.rotation)
    quantizers = {name: q for name, quant in quantized.items() if (q := input_quantizer(quant)) is not None}
    outcome = tune_block(block, weights, inputs.hidden, targets, inputs.kwargs, settings, quantizers)
    if outcome.kept:
        for name, weight in weights.items():
            quant = quantized[name]
            dequantized, scales = weight.solution()
            levels = grid_levels(dequantized, weight.grid, scales, quant.format.weight_format)
            with torch.no_grad():
                block.get_submodule(name).weight.copy_(weight.module_weight(dequantized))
            quant.levels, quant.weight_scales = levels.cpu(), scales.cpu()
    return outcome


class _Quantizer(BlockVisitor):
    """The walker's visitor that quantizes each block in place and records its scales."""

    def __init__(
        self,
        model,
        config: QuantizeConfig,
        result: QuantResult,
        writer: QuantizedCheckpointWriter | None = None,
        plan: MixedPlan | None = None,
        head: LmHead | None = None,
        rotation: ResidualRotation | None = None,
    ) -> None:
        self.model_config = model.config
        self.rotation = rotation
        self.float_hidden: list[torch.Tensor] | None = None  # the float model's inputs to the block being visited
        self.last = len(decoder_blocks(model)) - 1
        self.head = head
        self.config = config
        self.plan = plan
        self.result = result
        self.writer = writer
        self.prefix = module_prefix(model, decoder_blocks(model))
        self.fp8_cache = config.kv_cache == "fp8"
        self.block_linears: dict[str, LinearQuant] = {}
        self.quantized: dict[str, LinearQuant] = {}

    def visit(self, index: int, block, inputs: BlockInputs) -> None:
        if self.rotation is not None:
            self.rotation.rotate_block(block)
        tuning = self.config.tuning()
        targets = None
        if tuning:
            # What tuning aims at: the float model's hidden states after this block (the float block on the float
            # model's own inputs to it, carried beside the quantized model's), so each block also corrects the drift
            # the quantized blocks before it left; they are the next block's float inputs.
            float_inputs = BlockInputs(self.float_hidden or inputs.hidden, inputs.kwargs)
            targets = self.float_hidden = run_block(block, float_inputs)
        amax = kv_cache.record_amax(block) if self.fp8_cache else None
        prefix = f"{self.prefix}.{index}"
        if self.plan is None:
            quantized = quantize_block(block, inputs, self.config, self.model_config, prefix)
        else:  # each run of one format's points with its own method, in the family's order (see MixedPlan.block_runs)
            quantized = {}
            order = [point.name for point in family_of(self.model_config).points]
            for name, points in self.plan.block_runs(index, order):
                quantized.update(
                    quantize_block(block, inputs, self.plan.configs[name], self.model_config, prefix, points=points)
                )
        if amax is not None:
            kv_cache.stop_recording(block)
            self.result.kv_scales[index] = (kv_cache.kv_scale(amax[0]), kv_cache.kv_scale(amax[1]))
            kv_cache.set_block_scales(block, self.result.kv_scales[index])
        if tuning and quantized:
            local = {name.removeprefix(prefix + "."): quant for name, quant in quantized.items()}
            outcome = tune_rounding(block, inputs, targets, local, tuning)
            self.result.tuned.append(outcome)
            log.debug("layer %d: output error %.3g -> %.3g (%s)", index, outcome.error_before, outcome.error_after,
                      "kept" if outcome.kept else "start kept")
        self.result.linears.update(quantized)
        self.quantized = quantized
        self.block_linears = {name.split(f"{self.prefix}.{index}.", 1)[1]: q for name, q in quantized.items()}
        if quantized:  # a plan may leave a whole block float
            log.debug("layer %d quantized; min SQNR %.1f dB", index, min(q.sqnr_db for q in quantized.values()))

    def propagation_hooks(self, index: int, block) -> list:
        # The next block sees this one's outputs as the deployed graph computes them: inputs quantized.
        return attach_activation_quant(block, self.block_linears)

    def after(self, index: int, block, inputs: BlockInputs, outputs: list[torch.Tensor]) -> None:
        if self.writer is not None:
            self.writer.add_block(index, f"{self.prefix}.{index}", block, self.quantized)
        if index == self.last and self.plan is not None and self.plan.head != FLOAT:
            quant = quantize_head(self.head, outputs, self.plan.configs[self.plan.head])
            self.result.linears[self.head.name] = quant
            log.info("LM head quantized to %s; SQNR %.1f dB", self.plan.head, quant.sqnr_db)
            if self.writer is not None:
                self.writer.add_head(self.head.name, quant)


def _rotation(model, config: QuantizeConfig, held: bool, result: QuantResult) -> ResidualRotation | None:
    """The residual rotation ``config`` asks for, with the embedding already rotated (calibration then enters the first
    block in the rotated basis) and, for a model ``held`` in memory, its final norm folded into its LM head; the blocks
    are rotated as the walker reaches them. A streamed model's norm and head are rotated where they are written
    (:func:`quantize_folder`)."""
    if config.rotate == "none":
        return None
    rotation = ResidualRotation.for_config(model.config)
    if held:
        result.untied_head = rotate_ends(model, rotation)
    else:
        rotation.rotate_embedding(model.get_input_embeddings().weight)
    return rotation


@dataclass(frozen=True)
class Streamed:
    """A model quantized as it is streamed: where its blocks come from, where each goes once quantized (its levels
    then let go), and where its LM head comes from when a plan quantizes it (None: the model's own)."""

    blocks: StreamedBlocks
    writer: QuantizedCheckpointWriter
    head: LmHead | None = None


def quantize_model(model, windows: torch.Tensor, config: QuantizeConfig, progress: bool = True,
                   device: torch.device | str | None = None, plan: MixedPlan | None = None,
                   streamed: Streamed | None = None) -> QuantResult:
    """Quantize every decoder block of ``model`` in place, block by block through the shared walker (``streamed``:
    blocks read from and written to checkpoints; else the model holds them; ``plan``: each point's own format,
    ``config`` then giving only the calibration and KV-cache options, and the LM head's, quantized on the last block's
    outputs; the model's head itself is left as it is).

    With an FP8 KV cache, each block's key and value maxima are recorded while its input statistics
    are gathered, and its outputs (the next block's inputs) are computed with the cache rounded.
    """
    if plan is None:
        check_group_size(config, linear_shapes(model.config.to_dict()))
    started = time.perf_counter()
    result = QuantResult(config, calibration_tokens=int(windows.numel()), plan=plan)
    rotation = _rotation(model, config, held=streamed is None, result=result)
    fp8_cache = config.kv_cache == "fp8"
    if fp8_cache:
        kv_cache.route_attention(model)
    head = streamed.head if streamed is not None else None
    if plan is not None and plan.head != FLOAT and head is None:
        head = lm_head_of(model)
    writer = streamed.writer if streamed is not None else None
    quantizer = _Quantizer(model, config, result, writer, plan, head, rotation)
    try:
        walk_blocks(model, windows, [quantizer], device=device, progress=progress, desc=f"quantize {config.method}",
                    blocks=streamed.blocks if streamed is not None else None)
    finally:
        if fp8_cache:
            kv_cache.restore_attention(model)
    result.seconds = time.perf_counter() - started
    return result


def quantize_folder(source: Path, out: Path, windows: torch.Tensor, config: QuantizeConfig,
                    compute: Compute = ON_CPU, trust_remote_code: bool = False,
                    plan: MixedPlan | None = None) -> QuantResult:
    """Quantize the Hugging Face checkpoint ``source`` into the quantized checkpoint ``out`` (its tensors and config;
    the caller adds the tokenizer), one decoder block in memory at a time.

    The model is built empty; its embeddings are read to capture the calibration windows' hidden states,
    then each block is read from ``source``, quantized on ``device`` in float32, written to ``out`` in the
    checkpoint's own dtype and released. The tensors outside the blocks are copied as stored (rotated, where
    ``config`` folds a rotation into the weights).
    """
    model = empty_causal_lm(source, trust_remote_code)
    if plan is None:
        check_group_size(config, linear_shapes(model.config.to_dict()))
    reader = CheckpointReader(source)
    embeddings = model.get_input_embeddings()
    materialize(embeddings, module_prefix(model, embeddings), reader)
    writer = QuantizedCheckpointWriter(out, len(decoder_blocks(model)), embeddings.weight.dtype)
    ends = _RotatedEnds.read(model, reader) if config.rotate != "none" else None
    head = None
    if plan is not None and plan.head != FLOAT:
        head = lm_head_of(model, reader) if ends is None else ends.lm_head(model, reader)
    result = quantize_model(model, windows, config, compute.progress, compute.device, plan,
                            Streamed(StreamedBlocks(model, reader), writer, head))
    in_blocks = module_prefix(model, decoder_blocks(model)) + "."
    head_weight = f"{head.name}.weight" if head is not None else None
    rest = reader.read(name for name in reader.names() if not name.startswith(in_blocks) and name != head_weight)
    if ends is not None:
        result.untied_head = ends.replace(rest, embeddings.weight, quantized_head=head is not None)
    writer.finish(rest, result)
    if head is not None or result.untied_head:
        # the head is a linear of its own (quantized, or rotated with the final norm folded in); the embedding is
        # stored as its own table
        model.config.tie_word_embeddings = False
    model.config.save_pretrained(out)
    return result


@dataclass
class _RotatedEnds:
    """The final norm and LM head of a streamed model whose residual stream is rotated: the head with the norm folded
    in, read before the embedding (a tied head's table) is rotated in place."""

    rotation: ResidualRotation
    norm_key: str
    head_key: str
    embed_key: str
    head: torch.Tensor
    tied: bool

    @classmethod
    def read(cls, model, reader: CheckpointReader) -> _RotatedEnds:
        rotation = ResidualRotation.for_config(model.config)
        embeddings = model.get_input_embeddings()
        norm_key = f"{module_prefix(model, final_norm(model))}.weight"
        head_key = f"{module_prefix(model, model.get_output_embeddings())}.weight"
        tied = head_key not in reader
        head = embeddings.weight.detach() if tied else reader.read([head_key])[head_key]
        rotated = rotation.rotated_head(head, reader.read([norm_key])[norm_key])
        return cls(rotation, norm_key, head_key, f"{module_prefix(model, embeddings)}.weight", rotated, tied)

    def lm_head(self, model, reader: CheckpointReader) -> LmHead:
        """The rotated head for quantizing, behind a final norm that multiplies by one."""
        norm = final_norm(model)
        materialize(norm, module_prefix(model, norm), reader)
        with torch.no_grad():
            norm.weight.copy_(self.rotation.weightless_norm(norm.weight))
        return LmHead(norm, self.head, self.head_key.removesuffix(".weight"))

    def replace(self, rest: dict[str, torch.Tensor], embedding: torch.Tensor, quantized_head: bool) -> bool:
        """Put the rotated tensors into ``rest`` (what is written outside the blocks); returns whether a tied head was
        untied."""
        rest[self.embed_key] = embedding.detach()
        rest[self.norm_key] = self.rotation.weightless_norm(rest[self.norm_key])
        if not quantized_head:
            rest[self.head_key] = self.head
        return self.tied
