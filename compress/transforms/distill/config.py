"""The distill stage's options."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from compress.core.config import StrictModel


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
            raise ValueError(
                "give target_parameters, target_fraction, or explicit shapes (num_layers, intermediate_size, ...)"
            )
        if self.batch_size % self.processes:
            raise ValueError(f"batch_size {self.batch_size} must be a multiple of processes {self.processes}")
        if self.teacher_generations and self.generation_prompt_tokens >= self.seq_len:
            raise ValueError(
                f"generation_prompt_tokens {self.generation_prompt_tokens} must be below seq_len {self.seq_len}"
            )
        return self
