"""Healing a pruned sentence encoder by embedding distillation from the unpruned one.

The student (the pruned encoder) learns to give the teacher's outputs on calibration sentences: each
step lowers ``1 - cosine`` between their pooled sentence embeddings (what a retrieval app compares)
plus ``token_weight`` times the mean ``1 - cosine`` between their token states (what keeps every
layer's work close to the teacher's). Dropout is off (the student is in eval mode with gradients on):
the target is the teacher's deterministic output. A tenth of the sentences is held out; the weights
kept are those of the best held-out cosine seen, never worse than the pruned start.
"""

from __future__ import annotations

import logging
import time
from typing import TypedDict

import torch
from pydantic import Field, PositiveInt
from tqdm import tqdm

from compress.core.config import StrictModel

log = logging.getLogger(__name__)

HELD_OUT_SHARE = 0.1


class DistillEncoderConfig(StrictModel):
    """Options of healing a pruned encoder: optimiser steps, learning rate, calibration sentences and their shape."""

    steps: PositiveInt = 200
    lr: float = Field(5e-5, gt=0.0)
    calib_sentences: PositiveInt = 2048
    batch_size: PositiveInt = 16
    max_length: PositiveInt = 64
    token_weight: float = Field(1.0, ge=0.0)
    eval_every: PositiveInt = 50


class HealResult(TypedDict):
    """What healing did: the held-out pooled cosine to the teacher before and after, and how long it ran."""

    held_out_cosine_before: float
    held_out_cosine_after: float
    steps: int
    held_out_sentences: int
    seconds: float
    history: list[dict[str, float]]


def _pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask[..., None].to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1e-9)


def _token_distance(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean ``1 - cosine`` of the token states over the real (unmasked) tokens."""
    distance = 1 - torch.nn.functional.cosine_similarity(student, teacher, dim=-1)
    weights = mask.to(distance.dtype)
    return (distance * weights).sum() / weights.sum().clamp_min(1.0)


def _loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, mask: torch.Tensor, token_weight: float
          ) -> torch.Tensor:
    pooled = 1 - torch.nn.functional.cosine_similarity(
        _pooled(student_hidden, mask), _pooled(teacher_hidden, mask), dim=-1).mean()
    return pooled + token_weight * _token_distance(student_hidden, teacher_hidden, mask)


@torch.no_grad()
def _teacher_states(teacher, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    teacher.eval()
    return [teacher(**batch).last_hidden_state.float() for batch in batches]


@torch.no_grad()
def pooled_cosine(model, batches: list[dict[str, torch.Tensor]], targets: list[torch.Tensor]) -> float:
    """Mean cosine between ``model``'s pooled embeddings and the targets' over every sentence of ``batches``."""
    total, count = 0.0, 0
    for batch, target in zip(batches, targets, strict=True):
        mask = batch["attention_mask"]
        hidden = model(**batch).last_hidden_state.float()
        cosine = torch.nn.functional.cosine_similarity(_pooled(hidden, mask), _pooled(target, mask), dim=-1)
        total, count = total + float(cosine.sum()), count + len(cosine)
    return total / max(count, 1)


def heal_encoder(student, teacher, batches: list[dict[str, torch.Tensor]], config: DistillEncoderConfig,
                 progress: bool = True) -> HealResult:
    """Train ``student`` in place towards ``teacher``'s outputs on ``batches``; keep its best held-out weights.

    Returns the held-out pooled cosine before and after, the steps run, the seconds taken and the history.
    """
    held = max(1, round(len(batches) * HELD_OUT_SHARE))
    train, held_out = batches[:-held] or batches, batches[-held:]
    train_targets, held_targets = _teacher_states(teacher, train), _teacher_states(teacher, held_out)
    student.eval()  # dropout off: the target is deterministic
    before = best = pooled_cosine(student, held_out, held_targets)
    best_state = {k: v.detach().clone() for k, v in student.state_dict().items()}
    optimizer = torch.optim.AdamW(student.parameters(), lr=config.lr, weight_decay=0.0)
    history: list[dict[str, float]] = []
    started = time.perf_counter()
    for step in tqdm(range(1, config.steps + 1), desc="heal encoder", disable=not progress):
        index = (step - 1) % len(train)
        batch = train[index]
        with torch.enable_grad():
            hidden = student(**batch).last_hidden_state.float()
            loss = _loss(hidden, train_targets[index], batch["attention_mask"], config.token_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if step % config.eval_every == 0 or step == config.steps:
            cosine = pooled_cosine(student, held_out, held_targets)
            history.append({"step": step, "loss": float(loss.detach()), "held_out_cosine": round(cosine, 6)})
            if cosine > best:
                best, best_state = cosine, {k: v.detach().clone() for k, v in student.state_dict().items()}
    student.load_state_dict(best_state)
    seconds = time.perf_counter() - started
    log.info("healed encoder: held-out pooled cosine %.4f -> %.4f in %d steps (%.0f s)", before, best, config.steps,
             seconds)
    return {"held_out_cosine_before": round(before, 6), "held_out_cosine_after": round(best, 6),
            "steps": config.steps, "held_out_sentences": sum(len(b["attention_mask"]) for b in held_out),
            "seconds": round(seconds, 1), "history": history}
