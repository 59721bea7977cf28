"""Pruning a decoder's linear layers block by block (2:4 or unstructured).

Embeddings and the LM head stay dense. Calibration walks the blocks in order like quantization:
each block's inputs come from the already-pruned blocks before it.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

import torch
from pydantic import Field, PositiveInt
from tqdm import tqdm

from compress.algorithms.calibration import (
    BlockInputs,
    capture_first_block_inputs,
    collect_input_stats,
    decoder_blocks,
    release_freed_memory,
    run_block,
)
from compress.algorithms.sparse import fraction_in_24_pattern, magnitude_mask, sparsegpt_prune, wanda_mask
from compress.config import StrictModel
from compress.errors import UsageError
from compress.families import Family, family_of

log = logging.getLogger(__name__)

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


def sparsify_model(model, windows: torch.Tensor, config: SparsifyConfig, progress: bool = True) -> dict:
    """Prune every decoder block in place; returns per-layer sparsity, pattern coverage and timing."""
    started = time.perf_counter()
    inputs = capture_first_block_inputs(model, windows) if config.method != "magnitude" else None
    layers = []
    family = family_of(model.config)
    blocks = decoder_blocks(model)
    for index in tqdm(range(len(blocks)), desc=f"sparsify {config.method}", unit="layer", disable=not progress, leave=False):
        block = blocks[index]
        if inputs is None:
            sparsity = sparsify_block(block, BlockInputs([], {}), config, family)
        else:
            sparsity = sparsify_block(block, inputs, config, family)
            inputs = BlockInputs(run_block(block, inputs), inputs.kwargs)
            release_freed_memory()
        layers.append({"layer": index, **{k.split(".")[-1]: round(v, 4) for k, v in sparsity.items()}})
    return {"layers": layers, "pattern_fraction": pattern_fraction(model) if config.pattern == "2:4" else None,
            "seconds": time.perf_counter() - started}


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
