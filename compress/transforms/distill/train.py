"""Knowledge-distillation training of a student against its teacher.

KL divergence between teacher and student next-token distributions at temperature T (times T^2),
optionally plus hidden-state MSE on the kept layers; or, for comparison, plain next-token
cross-entropy without the teacher. The loop runs alone or under ``torchrun`` (DDP; FSDP for models
that do not fit one device): gradients are averaged across ranks, each rank takes its share of
every global batch, and checkpoints are written atomically by rank 0.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from compress.core.files import atomic_write_json
from compress.core.text import TextSource, calibration_windows
from compress.transforms.distill.config import DistillConfig

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) at ``temperature``, scaled by T^2."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    per_token = (t.exp() * (t - s)).sum(dim=-1)
    return per_token.mean() * temperature**2


def _lr_factor(step: int, config: DistillConfig) -> float:
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def batch_indices(step: int, config: DistillConfig, n_windows: int) -> torch.Tensor:
    """The global batch of window indices for ``step`` (same on every rank, independent of resume)."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    return torch.randint(0, n_windows, (config.batch_size,), generator=generator)


@dataclass(frozen=True)
class Ranks:
    """Where one training process stands in a distributed job: its rank, how many there are, and how it wraps the
    student (DistributedDataParallel; None: trained as it is)."""

    rank: int = 0
    world: int = 1
    wrap: Callable | None = None


ALONE = Ranks()


class Distiller:
    """One training job: student, teacher, data, optimizer, checkpoints."""

    def __init__(self, student, teacher, windows: torch.Tensor, config: DistillConfig, checkpoint_dir: Path,
                 kept_layers: list[int] | None = None, ranks: Ranks = ALONE) -> None:
        self.config = config
        self.student = student
        self.teacher = teacher.eval() if teacher is not None else None
        self.windows = windows
        self.checkpoint_dir = Path(checkpoint_dir)
        self.kept_layers = kept_layers
        self.rank, self.world = ranks.rank, ranks.world
        wrap = ranks.wrap
        if config.activation_checkpointing:
            student.gradient_checkpointing_enable()
        student.train()
        self.model = wrap(student) if wrap else student
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.stopped_early_at: int | None = None
        self._best_unseen: tuple[float, dict[str, torch.Tensor]] | None = None
        self.teacher_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _teacher_logits(self, index: int, ids: torch.Tensor) -> torch.Tensor:
        k = self.config.teacher_cache_topk
        if k is None or index not in self.teacher_cache:
            with torch.no_grad():
                out = self.teacher(ids, output_hidden_states=self.config.hidden_weight > 0, use_cache=False)
            if k is None:
                self._teacher_hidden = out.hidden_states if self.config.hidden_weight > 0 else None
                return out.logits
            values, positions = out.logits.topk(k, dim=-1)
            self.teacher_cache[index] = (values, positions)
        values, positions = self.teacher_cache[index]
        self._teacher_hidden = None
        # Outside the cached top-k the teacher distribution is taken as (near) zero.
        logits = torch.full((*values.shape[:-1], self.student_vocab), -1e4)
        return logits.scatter(-1, positions, values)

    @property
    def student_vocab(self) -> int:
        return self.student.config.vocab_size

    def _micro_loss(self, index: int) -> torch.Tensor:
        ids = self.windows[index][None, : self.config.seq_len]
        autocast = torch.autocast(
            "cuda" if ids.is_cuda else "cpu", dtype=torch.bfloat16, enabled=self.config.precision == "bf16"
        )
        with autocast:
            out = self.model(ids, output_hidden_states=self.config.hidden_weight > 0, use_cache=False,
                             labels=ids if self.config.loss == "ce" else None)
        if self.config.loss == "ce":
            return out.loss
        loss = kd_loss(out.logits[:, :-1], self._teacher_logits(index, ids)[:, :-1], self.config.temperature)
        if self.config.hidden_weight > 0 and self._teacher_hidden is not None and self.kept_layers is not None:
            pairs = [
                (out.hidden_states[i + 1], self._teacher_hidden[layer + 1]) for i, layer in enumerate(self.kept_layers)
            ]
            loss = (
                loss
                + self.config.hidden_weight * torch.stack([F.mse_loss(s.float(), t.float()) for s, t in pairs]).mean()
            )
        return loss

    def train_step(self) -> float:
        """One optimizer step over this rank's share of the global batch."""
        config = self.config
        indices = batch_indices(self.step, config, len(self.windows))[self.rank::self.world].tolist()
        micro = [indices[i::config.grad_accumulation] for i in range(config.grad_accumulation)]
        total = 0.0
        for group in micro:
            for index in group:
                loss = self._micro_loss(index) / len(indices)
                loss.backward()
                total += float(loss.detach())
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = config.lr * _lr_factor(self.step, config)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total

    # --- checkpoints -------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        if self.rank != 0:
            return
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        state = {"step": self.step, "student": self.student.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "history": self.history}
        partial = self.checkpoint_dir / f".{CHECKPOINT}.partial"
        torch.save(state, partial)
        os.replace(partial, self.checkpoint_dir / CHECKPOINT)

    def load_checkpoint(self) -> bool:
        path = self.checkpoint_dir / CHECKPOINT
        if not path.is_file():
            return False
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.student.load_state_dict(state["student"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.history = list(state["history"])
        return True

    def run(self, evaluate: Callable[[], dict[str, float]] | None = None, progress: bool = True,
            initial: dict[str, float] | None = None) -> list[dict[str, float]]:
        """Train to ``steps``, resuming from the last checkpoint when one exists.

        ``initial`` holds the untrained student's evaluation; it is the first candidate for the best
        unseen-domain weights, so training that only ever hurts unseen domains returns the start.
        """
        if self.load_checkpoint():
            log.info("resuming distillation from step %d", self.step)
        elif initial is not None:
            self._unseen_got_worse(initial)
        config = self.config
        bar = tqdm(total=config.steps, initial=self.step, desc=f"distill ({config.loss})", unit="step",
                   disable=not progress or self.rank != 0)
        tokens_per_step = config.batch_size * config.seq_len
        started, first_step = time.perf_counter(), self.step
        while self.step < config.steps:
            loss = self.train_step()
            rate = tokens_per_step * (self.step - first_step) / (time.perf_counter() - started)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:.0f}")
            point: dict[str, float] = {"step": self.step, "loss": loss, "tokens_per_s": rate}
            if (
                evaluate is not None
                and self.rank == 0
                and (self.step % config.eval_every == 0 or self.step == config.steps)
            ):
                self.student.eval()
                point.update(evaluate())
                self.student.train()
            self.history.append(point)
            if self.step % config.checkpoint_every == 0 or self.step == config.steps:
                self.save_checkpoint()
            if self._unseen_got_worse(point):
                break
        bar.close()
        self.student.eval()
        return self.history

    def _unseen_got_worse(self, point: dict[str, float]) -> bool:
        """Track the best unseen-domain perplexity; on a rise past the limit restore those weights and say stop."""
        limit = self.config.stop_when_unseen_worse_pct
        unseen = point.get("perplexity_unseen")
        if limit is None or unseen is None or self.world > 1:
            return False
        if self._best_unseen is None or unseen < self._best_unseen[0]:
            self._best_unseen = (unseen, {k: v.detach().clone() for k, v in self.student.state_dict().items()})
            return False
        if unseen <= self._best_unseen[0] * (1 + limit / 100):
            return False
        best, weights = self._best_unseen
        log.warning(
            "step %d: unseen-domain perplexity %.2f is %.1f%% above its best %.2f; stopping and keeping the best "
            "weights",
            self.step,
            unseen,
            100 * (unseen / best - 1),
            best,
        )
        self.student.load_state_dict(weights)
        self.stopped_early_at = self.step
        return True


def write_job(path: Path, job: dict[str, Any]) -> None:
    atomic_write_json(path, job)


def read_job(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def teacher_generations(
    teacher, tokenizer, calibration: list[TextSource], config: DistillConfig
) -> torch.Tensor | None:
    """``teacher_generations`` windows of ``seq_len`` tokens: calibration openings continued by the teacher, sampled at
    T=1."""
    if not config.teacher_generations:
        return None
    prompts = calibration_windows(tokenizer, calibration, config.generation_prompt_tokens, config.teacher_generations)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(config.seed)
    rows = []
    started = time.perf_counter()
    for batch in prompts.split(16):
        with torch.no_grad():
            out = teacher.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=config.seq_len - batch.shape[1],
                min_new_tokens=config.seq_len - batch.shape[1],
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        rows.append(out[:, : config.seq_len])
    torch.random.set_rng_state(generator_state)
    generated = torch.cat(rows)
    log.info(
        "teacher generated %d windows of %d tokens in %.1fs",
        generated.shape[0],
        config.seq_len,
        time.perf_counter() - started,
    )
    return generated
