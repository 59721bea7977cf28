"""Pruning a decoder's linear layers block by block (2:4 or unstructured).

Embeddings and the LM head stay dense. The shared walker (:mod:`compress.transforms.walk`) drives
the blocks in order as for quantization: each block's inputs come from the already-pruned blocks
before it (magnitude pruning reads weights only, so nothing is propagated).
"""

from __future__ import annotations

import logging
import time
from typing import Literal, TypedDict

import torch
from pydantic import Field, PositiveInt

from compress.algorithms.sparse import fraction_in_24_pattern, magnitude_mask, sparsegpt_prune, wanda_mask
from compress.core.config import StrictModel
from compress.core.errors import UsageError
from compress.models.families import Family, decoder_blocks, family_of
from compress.transforms.walk import BlockInputs, BlockVisitor, collect_input_stats, walk_blocks

log = logging.getLogger(__name__)

# Share of 4-groups in the 2:4 pattern above which a model counts as 2:4 sparse (float rounding aside, all of them).
PATTERN_COMPLETE = 0.999999


class SparsifyConfig(StrictModel):
    """Options of the sparsify stage."""

    pattern: Literal["2:4", "unstructured"] = "2:4"
    ratio: float = Field(0.5, gt=0.0, lt=1.0)
    method: Literal["magnitude", "wanda", "sparsegpt"] = "sparsegpt"
    calib_windows: PositiveInt = 32
    calib_window: PositiveInt = 512
    min_calib_tokens: PositiveInt = 2048
    damp: float = Field(0.01, gt=0.0, lt=1.0)


def sparsify_block(block, inputs: BlockInputs, config: SparsifyConfig, family: Family) -> dict[str, float]:
    """Prune one block in place; returns each linear's share of zeros."""
    linears = {name: block.get_submodule(name) for name in family.linears()}
    firsts = {p.name: linears[p.consumers[0]] for p in family.points}
    needs_stats = config.method != "magnitude"
    stats = collect_input_stats(block, inputs, firsts, config.method == "sparsegpt", 0) if needs_stats else {}
    sparsity = {}
    for point_def in family.points:
        point = point_def.name
        for name in point_def.consumers:
            linear = linears[name]
            weight = linear.weight.detach()
            if config.pattern == "2:4" and weight.shape[1] % 4:
                raise UsageError(f"{name}: in_features {weight.shape[1]} is not a multiple of 4 for 2:4 sparsity")
            if config.method == "sparsegpt":
                pruned = sparsegpt_prune(weight, stats[point].mean_hessian(), config.pattern, config.ratio, config.damp)
            elif config.method == "wanda":
                pruned = weight * wanda_mask(weight, stats[point].column_norms(), config.pattern, config.ratio)
            else:
                pruned = weight * magnitude_mask(weight, config.pattern, config.ratio)
            with torch.no_grad():
                linear.weight.copy_(pruned)
            sparsity[name] = float((pruned == 0).float().mean())
    return sparsity


class _Sparsifier(BlockVisitor):
    """The walker's visitor that prunes each block in place."""

    def __init__(self, config: SparsifyConfig, family: Family) -> None:
        self.config = config
        self.family = family
        self.needs_inputs = config.method != "magnitude"
        self.layers: list[dict[str, float]] = []

    def visit(self, index: int, block, inputs: BlockInputs) -> None:
        sparsity = sparsify_block(block, inputs, self.config, self.family)
        self.layers.append({"layer": index, **{k.split(".")[-1]: round(v, 4) for k, v in sparsity.items()}})


class SparsifyResult(TypedDict):
    """Per-layer sparsity, the share of weights in the 2:4 pattern (2:4 only) and the seconds it took."""

    layers: list[dict[str, float]]
    pattern_fraction: float | None
    seconds: float


def sparsify_model(model, windows: torch.Tensor, config: SparsifyConfig, progress: bool = True,
                   device: torch.device | str | None = None) -> SparsifyResult:
    """Prune every decoder block in place; returns per-layer sparsity, pattern coverage and timing."""
    started = time.perf_counter()
    sparsifier = _Sparsifier(config, family_of(model.config))
    walk_blocks(model, windows, [sparsifier], device=device, progress=progress, desc=f"sparsify {config.method}")
    return {
        "layers": sparsifier.layers,
        "pattern_fraction": pattern_fraction(model) if config.pattern == "2:4" else None,
        "seconds": time.perf_counter() - started,
    }


def sparse_linears(model) -> dict[str, torch.Tensor]:
    """The decoder linear weights sparsity applies to."""
    family = family_of(model.config)
    return {f"model.layers.{i}.{name}": block.get_submodule(name).weight.detach()
            for i, block in enumerate(decoder_blocks(model)) for name in family.linears()}


def pattern_fraction(model) -> float:
    """Share of the decoder linears' 4-groups that hold the 2:4 pattern, weighted by size."""
    total = covered = 0.0
    for weight in sparse_linears(model).values():
        groups = weight.numel() / 4
        covered += fraction_in_24_pattern(weight) * groups
        total += groups
    return covered / total if total else 0.0
