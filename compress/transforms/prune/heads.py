"""Structured attention-head pruning for decoders of every described family (GQA-aware).

Importance: the first-order Taylor estimate of the loss change when a head is removed,
``|sum over tokens and head dims of o_h * dL/do_h|`` where ``o_h`` is the head's slice of the
``o_proj`` input, summed over calibration windows. It measures what removing the head costs
the loss (not only how large its output is), for one backward pass per window.

Rule for grouped-query attention: every layer keeps the same number of query heads in each KV
group, so KV heads and the grouping stay intact and the pruned model is described by the plain
config (``num_attention_heads`` = KV heads x kept per group; ``head_dim`` pinned). Which heads are
kept is chosen per layer, per group, by importance (``mode: per_layer``), or once for every layer
by the importance summed over the layers (``mode: uniform``). A layer never loses its last head.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, PositiveInt, model_validator

from compress.core.config import StrictModel
from compress.core.errors import UsageError
from compress.models.families import attention_geometry, decoder_blocks, family_of


class PruneHeadsConfig(StrictModel):
    """Options of the prune_heads stage: a fraction of query heads, or a target parameter count."""

    fraction: float | None = Field(0.25, gt=0.0, lt=1.0)
    target_parameters: PositiveInt | None = None
    importance: Literal["taylor", "output_norm"] = "taylor"
    # "per_layer": each layer keeps its own most important heads; "uniform": every layer keeps the same heads, those of
    # the largest importance summed over the layers (what a runtime with one set of attention weights per layer index
    # reads alike).
    mode: Literal["per_layer", "uniform"] = "per_layer"
    calib_windows: PositiveInt = 8
    calib_window: PositiveInt = 512
    min_calib_tokens: PositiveInt = 1024

    @model_validator(mode="after")
    def _one_goal(self) -> PruneHeadsConfig:
        if self.target_parameters is not None:
            self.__dict__["fraction"] = None
        elif self.fraction is None:
            raise ValueError("give fraction or target_parameters")
        return self


def head_importance(model, windows: torch.Tensor, method: str = "taylor") -> torch.Tensor:
    """``(layers, heads)`` importance scores on calibration windows."""
    heads, _, head_dim = attention_geometry(model.config)
    blocks = decoder_blocks(model)
    scores = torch.zeros(len(blocks), heads, dtype=torch.float64)
    captured: dict[int, torch.Tensor] = {}

    def make_hook(index: int):
        def hook(_module, args):
            x = args[0]
            if method == "taylor":
                x.retain_grad()
            captured[index] = x
        return hook

    output = family_of(model.config).attn_output
    handles = [block.get_submodule(output).register_forward_pre_hook(make_hook(i)) for i, block in enumerate(blocks)]
    try:
        for row in windows:
            ids = row[None]
            if method == "taylor":
                model.zero_grad(set_to_none=True)
                loss = model(ids, labels=ids, use_cache=False).loss
                loss.backward()
                for index, x in captured.items():
                    contribution = (x * x.grad).reshape(*x.shape[:-1], heads, head_dim).sum(dim=(0, 1, 3))
                    scores[index] += contribution.detach().abs().double()
            else:
                with torch.no_grad():
                    model(ids, use_cache=False)
                for index, x in captured.items():
                    scores[index] += x.reshape(*x.shape[:-1], heads, head_dim).norm(dim=-1).mean(dim=(0, 1)).double()
            captured.clear()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    return scores


def heads_per_group_to_keep(config, prune: PruneHeadsConfig, parameter_count) -> int:
    """How many query heads each KV group keeps."""
    heads, kv, _ = attention_geometry(config)
    per_group = heads // kv
    if prune.fraction is not None:
        return max(1, math.floor(per_group * (1 - prune.fraction) + 1e-9))
    for keep in range(per_group, 0, -1):
        if parameter_count(keep) <= prune.target_parameters:
            return keep
    raise UsageError(f"target_parameters={prune.target_parameters:,} cannot be reached by pruning heads "
                     f"(one head per KV group gives {parameter_count(1):,})")


def plan_heads(scores: torch.Tensor, kv_heads: int, keep_per_group: int) -> list[list[int]]:
    """Per layer, the query heads kept: the most important ``keep_per_group`` in each KV group, in group order."""
    layers, heads = scores.shape
    per_group = heads // kv_heads
    plan = []
    for layer in range(layers):
        kept = []
        for group in range(kv_heads):
            members = list(range(group * per_group, (group + 1) * per_group))
            ranked = sorted(members, key=lambda h: -float(scores[layer, h]))
            kept.extend(sorted(ranked[:keep_per_group]))
        plan.append(kept)
    return plan


def plan_heads_uniform(scores: torch.Tensor, kv_heads: int, keep_per_group: int) -> list[list[int]]:
    """The same query heads kept in every layer: in each KV group, the ``keep_per_group`` of largest summed
    importance."""
    kept = plan_heads(scores.sum(dim=0, keepdim=True), kv_heads, keep_per_group)[0]
    return [list(kept) for _ in range(scores.shape[0])]


def attention_parameters_after(config, keep_per_group: int, total_parameters: int) -> int:
    """Parameter count after keeping ``keep_per_group`` query heads per KV group in every layer."""
    heads, kv, head_dim = attention_geometry(config)
    removed_heads = heads - kv * keep_per_group
    return total_parameters - config.num_hidden_layers * removed_heads * 2 * head_dim * config.hidden_size
