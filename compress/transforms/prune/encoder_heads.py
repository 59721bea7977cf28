"""Choosing which attention heads a BERT-family encoder keeps.

Heads are scored by the mean norm of their context output (the input of ``attention.output.dense``)
over calibration sentences; each layer keeps its most important ones (layers may keep different
numbers of heads; never fewer than one). Removing them is :mod:`compress.models.pruned_bert`'s.
"""

from __future__ import annotations

import torch
from pydantic import Field, PositiveInt

from compress.core.config import StrictModel
from compress.models.families import encoder_layers
from compress.transforms.walk import run_encoder_batches


class PruneEncoderHeadsConfig(StrictModel):
    """Options of pruning an encoder's heads: the share of each layer's heads removed, and the calibration sentences."""

    fraction: float = Field(0.25, gt=0.0, lt=1.0)
    calib_sentences: PositiveInt = 256
    batch_size: PositiveInt = 32
    max_length: PositiveInt = 128


def encoder_head_importance(model, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """``(layers, heads)`` mean output norm per head over the (masked) tokens of every batch."""
    heads = model.config.num_attention_heads
    head_size = model.config.hidden_size // heads
    scores = torch.zeros(len(encoder_layers(model)), heads, dtype=torch.float64)
    current_mask: list[torch.Tensor] = []
    handles = []
    for index, layer in enumerate(encoder_layers(model)):
        def hook(_module, args, index=index):
            x = args[0].reshape(*args[0].shape[:-1], -1, head_size).norm(dim=-1)
            mask = current_mask[0][..., None].to(x.dtype)
            scores[index, : x.shape[-1]] += ((x * mask).sum(dim=(0, 1)) / mask.sum()).double()
        handles.append(layer.attention.output.dense.register_forward_pre_hook(hook))
    run_encoder_batches(model, batches, current_mask, handles)
    return scores


def plan_encoder_heads(scores: torch.Tensor, fraction: float) -> list[list[int]]:
    """Keep the most important ``1 - fraction`` of heads in each layer (at least one)."""
    heads = scores.shape[1]
    keep = max(1, round(heads * (1 - fraction)))
    return [sorted(torch.argsort(row, descending=True)[:keep].tolist()) for row in scores]


