"""Student construction (Minitron-style depth and width pruning) and knowledge-distillation training.

Student: drop whole decoder layers that change their input least (block influence,
``1 - cos(h_in, h_out)`` on calibration text), narrow the MLP to the intermediate channels with the
largest mean activation ``|act(gate) * up|``, and optionally prune query heads with
:mod:`compress.pruning`. The result loads with plain transformers.

Training: KL divergence between teacher and student next-token distributions at temperature T
(times T^2), optionally plus hidden-state MSE on the kept layers; or, for comparison, plain
next-token cross-entropy without the teacher. The loop runs alone or under ``torchrun`` (DDP; FSDP
for models that do not fit one device): gradients are averaged across ranks, each rank takes its
share of every global batch, and checkpoints are written atomically by rank 0.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, PositiveInt, model_validator
from tqdm import tqdm

from compress.algorithms.calibration import capture_first_block_inputs, decoder_blocks, run_block
from compress.config import StrictModel
from compress.errors import UsageError
from compress.families import attention_geometry, family_of, rows_keeping
from compress.fsutil import atomic_write_json

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


class DistillConfig(StrictModel):
    """Options of the distill stage."""

    target_parameters: float | None = None
    target_fraction: float | None = Field(None, gt=0.0, lt=1.0)
    num_layers: PositiveInt | None = None
    intermediate_size: PositiveInt | None = None
    heads_per_group: PositiveInt | None = None
    min_width_fraction: float = Field(0.5, gt=0.0, le=1.0)
    loss: Literal["kd", "ce"] = "kd"
    temperature: float = Field(2.0, gt=0.0)
    hidden_weight: float = Field(0.0, ge=0.0)
    steps: PositiveInt = 200
    batch_size: PositiveInt = 8
    seq_len: PositiveInt = 256
    train_windows: PositiveInt = 512
    lr: float = Field(5e-4, gt=0.0)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_accumulation: PositiveInt = 1
    precision: Literal["fp32", "bf16"] = "fp32"
    activation_checkpointing: bool = False
    teacher_cache_topk: PositiveInt | None = None
    checkpoint_every: PositiveInt = 50
    eval_every: PositiveInt = 50
    eval_windows: PositiveInt = 4
    # Sampled continuations of the teacher (temperature 1) added to the training windows: text drawn from
    # the teacher's own distribution, so KD does not specialise the student on the calibration domains.
    teacher_generations: int = Field(0, ge=0)
    generation_prompt_tokens: PositiveInt = 32
    # Stop when the unseen evaluation domains' perplexity rises this many percent above its best so far,
    # and keep the best weights; None trains to ``steps`` whatever happens out of domain.
    stop_when_unseen_worse_pct: float | None = Field(1.0, gt=0.0)
    processes: PositiveInt = 1
    distributed: Literal["ddp", "fsdp"] = "ddp"
    seed: int = 0

    @model_validator(mode="after")
    def _shape_goal(self) -> DistillConfig:
        explicit = any(v is not None for v in (self.num_layers, self.intermediate_size, self.heads_per_group))
        goals = sum(v is not None for v in (self.target_parameters, self.target_fraction))
        if goals > 1 or (goals and explicit):
            raise ValueError("give one of target_parameters, target_fraction, or explicit shapes")
        if not goals and not explicit:
            raise ValueError("give target_parameters, target_fraction, or explicit shapes (num_layers, intermediate_size, ...)")
        if self.batch_size % self.processes:
            raise ValueError(f"batch_size {self.batch_size} must be a multiple of processes {self.processes}")
        if self.teacher_generations and self.generation_prompt_tokens >= self.seq_len:
            raise ValueError(f"generation_prompt_tokens {self.generation_prompt_tokens} must be below seq_len {self.seq_len}")
        return self


# ---------------------------------------------------------------- shapes and parameter counts


def decoder_parameters(cfg: dict[str, Any], layers: int | None = None, intermediate: int | None = None,
                       heads: int | None = None) -> int:
    """Parameters of a decoder config with optional new depth, MLP width and query heads."""
    hidden = cfg["hidden_size"]
    n_heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or hidden // n_heads
    heads = heads or n_heads
    layers = layers or cfg["num_hidden_layers"]
    intermediate = intermediate or cfg["intermediate_size"]
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    mlp = 3 * hidden * intermediate
    embed = cfg["vocab_size"] * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return layers * (attention + mlp + 2 * hidden) + embed + hidden


def student_shape(cfg: dict[str, Any], config: DistillConfig) -> dict[str, int]:
    """The student's depth, MLP width and query heads for the configured goal."""
    n_heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or n_heads
    if config.target_parameters is None and config.target_fraction is None:
        heads = kv * config.heads_per_group if config.heads_per_group else n_heads
        shape = {"num_layers": config.num_layers or cfg["num_hidden_layers"],
                 "intermediate_size": config.intermediate_size or cfg["intermediate_size"], "num_attention_heads": heads}
        _check_not_larger(shape, cfg)
        return shape
    target = config.target_parameters or config.target_fraction * decoder_parameters(cfg)
    floor = _round64(cfg["intermediate_size"] * config.min_width_fraction)
    # Width first (Minitron found width pruning cheaper to recover), down to min_width_fraction; then depth.
    for layers in range(cfg["num_hidden_layers"], 0, -1):
        per_channel = layers * 3 * cfg["hidden_size"]
        rest = decoder_parameters(cfg, layers, 1) - per_channel
        width = _round64_down((target - rest) / per_channel) if target > rest else 0
        if width >= floor:
            return {"num_layers": layers, "intermediate_size": min(width, cfg["intermediate_size"]), "num_attention_heads": n_heads}
    raise UsageError(f"target of {target:,.0f} parameters is below what one layer at {config.min_width_fraction:.0%} MLP width gives")


def _check_not_larger(shape: dict[str, int], cfg: dict[str, Any]) -> None:
    teacher = {"num_layers": cfg["num_hidden_layers"], "intermediate_size": cfg["intermediate_size"],
               "num_attention_heads": cfg["num_attention_heads"]}
    larger = [f"{key} {shape[key]} > {teacher[key]}" for key in teacher if shape[key] > teacher[key]]
    if larger:
        raise UsageError(f"the student cannot be larger than the teacher: {', '.join(larger)}")


def _round64(value: float) -> int:
    return max(64, int(round(value / 64)) * 64)


def _round64_down(value: float) -> int:
    return max(0, int(value // 64) * 64)


# ---------------------------------------------------------------- building the student


def layer_influence(model, windows: torch.Tensor) -> list[float]:
    """Block influence per layer: ``1 - mean cos(input, output)`` of its hidden states (higher = more important)."""
    inputs = capture_first_block_inputs(model, windows)
    scores = []
    for block in decoder_blocks(model):
        outputs = run_block(block, inputs)
        cos = [F.cosine_similarity(a.flatten(0, 1), b.flatten(0, 1), dim=-1).mean() for a, b in zip(inputs.hidden, outputs, strict=True)]
        scores.append(float(1 - torch.stack(cos).mean()))
        inputs.hidden = outputs
    return scores


def mlp_channel_importance(model, windows: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, mean ``|act(gate(x)) * up(x)|`` of every intermediate channel (the MLP output projection's input)."""
    output = family_of(model.config).mlp_output
    sums = [torch.zeros(block.get_submodule(output).in_features, dtype=torch.float64) for block in decoder_blocks(model)]
    handles = []
    for index, block in enumerate(decoder_blocks(model)):
        def hook(_module, args, index=index):
            sums[index] += args[0].detach().abs().reshape(-1, args[0].shape[-1]).sum(dim=0).double()
        handles.append(block.get_submodule(output).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for row in windows:
                model(row[None], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return sums


def drop_layers(model, kept: list[int]) -> None:
    """Keep only the decoder layers at ``kept`` (in order); each keeps its attention kind (sliding or full)."""
    blocks = decoder_blocks(model)
    model.model.layers = torch.nn.ModuleList([blocks[i] for i in kept])
    attention = family_of(model.config).attention
    for new_index, block in enumerate(decoder_blocks(model)):
        if hasattr(block.get_submodule(attention), "layer_idx"):
            block.get_submodule(attention).layer_idx = new_index
    model.config.num_hidden_layers = len(kept)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in kept]


def narrow_mlp(model, importance: list[torch.Tensor], width: int) -> None:
    """Keep the ``width`` most important intermediate channels of every layer: rows of the gate and up parts
    (separate or fused) and the matching input columns of the output projection."""
    from compress.pruning import replace_module, select_linear

    family = family_of(model.config)
    widened = [name for name in family.linears() if {"gate", "up"} & set(family.parts(name))]
    for block, scores in zip(decoder_blocks(model), importance, strict=True):
        keep = torch.sort(scores.topk(width).indices).values
        for name in widened:
            rows = rows_keeping(family, model.config, name, {"gate": keep, "up": keep})
            replace_module(block, name, select_linear(block.get_submodule(name), rows, dim=0))
        replace_module(block, family.mlp_output, select_linear(block.get_submodule(family.mlp_output), keep, dim=1))
        mlp = block.get_submodule(family.mlp_output.rsplit(".", 1)[0])
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = width
    model.config.intermediate_size = width


def build_student(model, windows: torch.Tensor, shape: dict[str, int]) -> dict[str, Any]:
    """Prune ``model`` in place to ``shape``; returns what was kept and the importance scores."""
    from compress.pruning import head_importance, plan_heads, prune_heads

    influence = layer_influence(model, windows)
    order = sorted(range(len(influence)), key=lambda i: -influence[i])
    kept_layers = sorted(order[: shape["num_layers"]])
    drop_layers(model, kept_layers)
    width = shape["intermediate_size"]
    if width < model.config.intermediate_size:
        narrow_mlp(model, mlp_channel_importance(model, windows), width)
    heads, kv, _ = attention_geometry(model.config)
    head_plan = None
    if shape["num_attention_heads"] < heads:
        scores = head_importance(model, windows[: max(1, len(windows) // 2)], "taylor")
        head_plan = plan_heads(scores, kv, shape["num_attention_heads"] // kv)
        prune_heads(model, head_plan)
    return {"kept_layers": kept_layers, "layer_influence": [round(v, 5) for v in influence], "heads_kept": head_plan}


# ---------------------------------------------------------------- training


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


class Distiller:
    """One training job: student, teacher, data, optimizer, checkpoints."""

    def __init__(self, student, teacher, windows: torch.Tensor, config: DistillConfig, checkpoint_dir: Path,
                 kept_layers: list[int] | None = None, rank: int = 0, world: int = 1, wrap: Callable | None = None) -> None:
        self.config = config
        self.student = student
        self.teacher = teacher.eval() if teacher is not None else None
        self.windows = windows
        self.checkpoint_dir = Path(checkpoint_dir)
        self.kept_layers = kept_layers
        self.rank, self.world = rank, world
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
        autocast = torch.autocast("cuda" if ids.is_cuda else "cpu", dtype=torch.bfloat16, enabled=self.config.precision == "bf16")
        with autocast:
            out = self.model(ids, output_hidden_states=self.config.hidden_weight > 0, use_cache=False,
                             labels=ids if self.config.loss == "ce" else None)
        if self.config.loss == "ce":
            return out.loss
        loss = kd_loss(out.logits[:, :-1], self._teacher_logits(index, ids)[:, :-1], self.config.temperature)
        if self.config.hidden_weight > 0 and self._teacher_hidden is not None and self.kept_layers is not None:
            pairs = [(out.hidden_states[i + 1], self._teacher_hidden[layer + 1]) for i, layer in enumerate(self.kept_layers)]
            loss = loss + self.config.hidden_weight * torch.stack([F.mse_loss(s.float(), t.float()) for s, t in pairs]).mean()
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
            if evaluate is not None and self.rank == 0 and (self.step % config.eval_every == 0 or self.step == config.steps):
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
        log.warning("step %d: unseen-domain perplexity %.2f is %.1f%% above its best %.2f; stopping and keeping the best weights",
                    self.step, unseen, 100 * (unseen / best - 1), best)
        self.student.load_state_dict(weights)
        self.stopped_early_at = self.step
        return True


# ---------------------------------------------------------------- planning without weights


def plan_from_config(cfg: dict[str, Any], config: DistillConfig, gpus: int | None = None, gpu_memory_gb: float | None = None
                     ) -> dict[str, Any]:
    """Student shape, parameter counts, memory per GPU under FSDP, and the launch command, from a config alone."""
    shape = student_shape(cfg, config)
    with torch.device("meta"):
        from transformers import AutoConfig, AutoModelForCausalLM

        student_cfg = AutoConfig.for_model(**{**cfg, "num_hidden_layers": shape["num_layers"],
                                              "intermediate_size": shape["intermediate_size"],
                                              "num_attention_heads": shape["num_attention_heads"],
                                              "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]})
        student = AutoModelForCausalLM.from_config(student_cfg)
    student_params = sum(p.numel() for p in student.parameters())
    teacher_params = decoder_parameters(cfg)
    gpus = gpus or config.processes
    bytes_param = 2 if config.precision == "bf16" else 4
    # Per student parameter: weights + gradients at training precision, fp32 master copy (bf16 only) and
    # two fp32 Adam moments; the frozen teacher holds weights only. FSDP shards all of it across GPUs.
    student_bytes = student_params * (2 * bytes_param + (4 if config.precision == "bf16" else 0) + 8)
    teacher_bytes = teacher_params * bytes_param
    activations = config.seq_len * cfg["hidden_size"] * shape["num_layers"] * bytes_param * (2 if config.activation_checkpointing else 34)
    logits = 3 * config.seq_len * cfg["vocab_size"] * 4  # student, teacher and softmax buffers, fp32
    micro_batch = max(1, config.batch_size // gpus // config.grad_accumulation)
    per_gpu = (student_bytes + teacher_bytes) / gpus + micro_batch * (activations + logits)
    return {
        "teacher_parameters": teacher_params,
        "student_shape": shape,
        "student_parameters": student_params,
        "gpus": gpus,
        "distributed": config.distributed,
        "memory_per_gpu_gb": round(per_gpu / 1e9, 2),
        "fits": None if gpu_memory_gb is None else per_gpu / 1e9 <= gpu_memory_gb,
        "launch": f"torchrun --standalone --nproc_per_node={gpus} -m compress.distill_worker --job JOB.json",
    }


def write_job(path: Path, job: dict[str, Any]) -> None:
    atomic_write_json(path, job)


def read_job(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))
