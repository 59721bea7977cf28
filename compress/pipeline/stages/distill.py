"""``distill``: build a smaller student from the teacher and train it with knowledge distillation.

Checkpoints live outside the stage's staging folder (``RUN_DIR/checkpoints/``), so a killed run
resumes training from the last checkpoint and continues to the same step count.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compress.core.artifact import HF_MODEL, Artifact
from compress.core.errors import UsageError
from compress.core.rundir import CHECKPOINTS_DIR
from compress.core.text import calibration_batches, calibration_windows, domain_windows, packed_windows
from compress.eval.perplexity import seen_and_unseen_perplexity
from compress.models.config_file import ModelConfig
from compress.models.loading import (
    count_parameters,
    load_causal_lm,
    load_encoder,
    load_tokenizer,
    save_model_folder,
)
from compress.pipeline.stage import DECODER, ENCODER, RunContext, StageDef, StageResult, StageVariant, register
from compress.report.figures import TRAINING_CURVE
from compress.transforms.distill.config import DistillConfig
from compress.transforms.distill.encoder import DistillEncoderConfig, heal_encoder
from compress.transforms.distill.student import build_student, plan_from_config, student_shape
from compress.transforms.distill.train import Distiller, teacher_generations
from compress.transforms.distill.worker import JobFolders, train_distributed

log = logging.getLogger(__name__)


def run_distill(source: Artifact, config: DistillConfig, ctx: RunContext) -> StageResult:
    tokenizer = load_tokenizer(source.path)
    teacher = load_causal_lm(source.path)
    shape = student_shape(ModelConfig(teacher.config.to_dict()), config)
    calib = calibration_windows(tokenizer, ctx.calibration, 512, 8)
    train, generated = _training_windows(tokenizer, teacher, config, ctx)
    evaluation, unseen = _evaluation_windows(tokenizer, config, ctx)
    student = copy.deepcopy(teacher)
    log.info("building the student: %s", shape)
    built = build_student(student, calib, shape, ctx.device)
    student_params, teacher_params = count_parameters(student), count_parameters(teacher)
    ppl = _Perplexities(seen_and_unseen_perplexity(teacher, evaluation, unseen)(),
                        seen_and_unseen_perplexity(student, evaluation, unseen)())
    log.info("student: %s parameters (teacher %s); perplexity before training %s (teacher %s)", f"{student_params:,}",
             f"{teacher_params:,}", ppl.line(ppl.before), ppl.line(ppl.teacher))
    checkpoints = ctx.run_dir / CHECKPOINTS_DIR / f"{ctx.stage_name}-{ctx.fingerprint[:16]}"
    out = ctx.stage_dir / "model"
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    training = _Training(tokenizer, train, built["kept_layers"], (evaluation, unseen, ppl.before), checkpoints, out)
    student, history, stopped_early_at = _train(student, teacher, training, config, ctx, source)
    seconds = time.perf_counter() - started
    ppl.after = seen_and_unseen_perplexity(student, evaluation, unseen)()
    log.info("student after training: perplexity %s", ppl.line(ppl.after))
    _remove_checkpoints(checkpoints)
    tokens = config.steps * config.batch_size * config.seq_len
    metrics = {
        "parameters": student_params, "teacher_parameters": teacher_params, "student_shape": shape,
        "kept_layers": built["kept_layers"], "layer_influence": built["layer_influence"], "loss": config.loss,
        "steps": config.steps, "tokens_trained": tokens, "train_seconds": round(seconds, 1),
        "tokens_per_s": round(tokens / max(seconds, 1e-9), 1), **ppl.figures(), "eval_tokens": int(evaluation.numel()),
        "curve": history, "unseen_domains": ctx.unseen_domains, "stopped_early_at": stopped_early_at,
        "teacher_generations": 0 if generated is None else int(generated.shape[0]),
        "train_data": [str(spec) for spec in ctx.train_data] or "the calibration text",
        "train_windows": int(train.shape[0]),
    }
    line = (
        f"{student_params:,} parameters; student {shape}, ppl {ppl.before['perplexity']:.1f} → "
        f"{ppl.after['perplexity']:.1f} after {config.steps} {config.loss} steps "
        f"(teacher {ppl.teacher['perplexity']:.1f})"
    )
    curve = {"loss": config.loss, **ppl.curve_ends(), "stopped_early_at": stopped_early_at, "points": history}
    return StageResult(Artifact(HF_MODEL, out, source.meta.carried(metrics=metrics)), line, {TRAINING_CURVE: curve})


@dataclass
class _Perplexities:
    """The teacher's and the student's perplexity on the seen and unseen evaluation domains, before and after."""

    teacher: dict[str, Any]
    before: dict[str, Any]
    after: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def line(figures: dict[str, Any]) -> str:
        return f"{figures['perplexity']:.2f} seen / {_fmt(figures.get('perplexity_unseen'))} unseen domains"

    def figures(self) -> dict[str, Any]:
        return {
            "perplexity_teacher": self.teacher["perplexity"], "perplexity_before": self.before["perplexity"],
            "perplexity_after": self.after["perplexity"],
            "perplexity_teacher_unseen": self.teacher.get("perplexity_unseen"),
            "perplexity_before_unseen": self.before.get("perplexity_unseen"),
            "perplexity_after_unseen": self.after.get("perplexity_unseen"),
        }

    def curve_ends(self) -> dict[str, Any]:
        return {"before": self.before["perplexity"], "teacher": self.teacher["perplexity"],
                "before_unseen": self.before.get("perplexity_unseen"),
                "teacher_unseen": self.teacher.get("perplexity_unseen")}


def _remove_checkpoints(checkpoints: Path) -> None:
    shutil.rmtree(checkpoints, ignore_errors=True)
    with contextlib.suppress(OSError):
        checkpoints.parent.rmdir()  # only when no other stage keeps checkpoints there


def _training_windows(
    tokenizer, teacher, config: DistillConfig, ctx: RunContext
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The training windows (packed from ``train_data=``, else the calibration text) with the teacher's generations
    appended, and those generations alone (None when the config asks for none)."""
    if ctx.train_data:
        log.info(
            "training windows: the first %d windows of %d tokens packed from %s",
            config.train_windows,
            config.seq_len,
            ", ".join(map(str, ctx.train_data)),
        )
        train = packed_windows(tokenizer, ctx.train_data, config.seq_len, config.train_windows)
    else:
        train = calibration_windows(
            tokenizer, ctx.calibration, config.seq_len, config.train_windows, at_least=config.batch_size
        )
        if train.shape[0] < config.train_windows:
            log.info("training windows: %d of %d tokens, all the calibration text holds (distill.train_windows=%d)",
                     train.shape[0], config.seq_len, config.train_windows)
    generated = teacher_generations(teacher, tokenizer, ctx.calibration, config)
    return (train if generated is None else torch.cat([train, generated])), generated


def _evaluation_windows(tokenizer, config: DistillConfig, ctx: RunContext) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Windows of the seen evaluation domains and of the unseen ones (all of them as "seen" where every domain is
    unseen)."""
    unseen_names = set(ctx.unseen_domains)
    evaluation = domain_windows(
        tokenizer, [s for s in ctx.evaluation if s.domain not in unseen_names], config.eval_windows
    )
    unseen = domain_windows(tokenizer, [s for s in ctx.evaluation if s.domain in unseen_names], config.eval_windows)
    return (unseen, None) if evaluation is None else (evaluation, unseen)


@dataclass(frozen=True)
class _Training:
    """What training a student takes besides the models: the tokenizer, the training windows, the teacher layers the
    student kept, the evaluation (seen windows, unseen windows, the student's figures before training), where
    checkpoints go and the folder the student ends in."""

    tokenizer: Any
    train: torch.Tensor
    kept_layers: list[int]
    evaluation: tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]
    checkpoints: Path
    out: Path


def _train(student, teacher, training: _Training, config: DistillConfig, ctx: RunContext,
           source: Artifact) -> tuple[Any, list, int | None]:
    """Train the student (in worker processes where ``config.processes`` > 1) into ``training.out``; returns the trained
    student, its curve and the step it stopped early at (None: it ran every step)."""
    windows, unseen, before = training.evaluation
    tokenizer, train, kept_layers, checkpoints, out = (training.tokenizer, training.train, training.kept_layers,
                                                       training.checkpoints, training.out)
    if config.processes > 1:
        init = ctx.stage_dir / "student_init"
        save_model_folder(student, tokenizer, source.path, init)
        folders = JobFolders(checkpoints, out, ctx.stage_dir)
        history = train_distributed(init, source.path, train, config, kept_layers, folders)
        shutil.rmtree(init)
        student = load_causal_lm(out)
        tokenizer.save_pretrained(out)
        return student, history, None
    distiller = Distiller(student, teacher if config.loss == "kd" else None, train, config, checkpoints, kept_layers)
    history = distiller.run(seen_and_unseen_perplexity(student, windows, unseen), progress=ctx.progress, initial=before)
    save_model_folder(student, tokenizer, source.path, out)
    return student, history, distiller.stopped_early_at


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def describe(config: DistillConfig, model_config: ModelConfig, target) -> dict:
    """The student's shape, memory per GPU and launch command, from the teacher's config alone (``--dry-run``)."""
    return plan_from_config(model_config, config, gpu_memory_gb=target.memory_gb)


def run_distill_encoder(source: Artifact, config: DistillEncoderConfig, ctx: RunContext) -> StageResult:
    """Heal the (pruned) encoder by embedding distillation from the run's unpruned one, on the calibration text."""
    # lazy: BERT's modelling code, never needed to plan
    from compress.models.pruned_bert import save_pruned_encoder

    teacher_artifact = ctx.first_artifact(HF_MODEL)
    if teacher_artifact is None or Path(teacher_artifact.path) == Path(source.path):
        raise UsageError("distill_encoder heals a pruned encoder against the run's original one: put it after "
                         "prune_encoder_heads")
    tokenizer = load_tokenizer(source.path)
    student, teacher = load_encoder(source.path), load_encoder(teacher_artifact.path)
    batches = calibration_batches(tokenizer, ctx.calibration, config.calib_sentences, config.batch_size,
                                  config.max_length, seed=0)
    healed = heal_encoder(student, teacher, batches, config, progress=ctx.progress)
    out = ctx.stage_dir / "model"
    plan = getattr(student.config, "heads_kept_per_layer", None)
    if plan:
        save_pruned_encoder(student, tokenizer, plan, out)
    else:
        save_model_folder(student, tokenizer, source.path, out)
    meta = source.meta.carried(metrics={**healed, "parameters": count_parameters(student),
                                        "teacher_parameters": count_parameters(teacher)})
    return StageResult(Artifact(HF_MODEL, out, meta),
                       f"held-out cosine to the teacher {healed['held_out_cosine_before']:.4f} → "
                       f"{healed['held_out_cosine_after']:.4f} in {healed['steps']} steps")


STAGE = register(StageDef(
    name="distill",
    summary="build a smaller student (depth/width pruning) and train it by distillation from the teacher; an encoder: "
            "heal a pruned one by embedding distillation from the unpruned one (distill_encoder)",
    input_kind=HF_MODEL,
    output_kind=HF_MODEL,
    variants={DECODER: StageVariant(DistillConfig, run_distill, describe=describe),
              ENCODER: StageVariant(DistillEncoderConfig, run_distill_encoder)},
), aliases={"distill_encoder": ENCODER})
