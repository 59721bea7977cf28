"""``distill``: build a smaller student from the teacher and train it with knowledge distillation.

Checkpoints live outside the stage's staging folder (``RUN_DIR/checkpoints/``), so a killed run
resumes training from the last checkpoint and continues to the same step count.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from compress.artifact import HF_MODEL, Artifact
from compress.data import EVAL_SKIP_CHARS, TextSource, calibration_windows, token_windows
from compress.distillation import DistillConfig, Distiller, build_student, student_shape, write_job
from compress.errors import StageError
from compress.eval.perplexity import perplexity, torch_logits_fn
from compress.models import count_parameters, load_causal_lm, load_tokenizer, save_model_folder
from compress.stages import StageDef, register

log = logging.getLogger(__name__)


def _evaluator(model, seen: torch.Tensor, unseen: torch.Tensor | None):
    """Perplexity on windows of the domains training saw, and of the domains it never saw."""
    def evaluate() -> dict[str, float]:
        figures = {"perplexity": perplexity(torch_logits_fn(model), seen, progress=False)}
        if unseen is not None:
            figures["perplexity_unseen"] = perplexity(torch_logits_fn(model), unseen, progress=False)
        return figures

    return evaluate


def _teacher_generations(teacher, tokenizer, calibration: list[TextSource], config: DistillConfig) -> torch.Tensor | None:
    """``teacher_generations`` windows of ``seq_len`` tokens: calibration openings continued by the teacher, sampled at T=1."""
    if not config.teacher_generations:
        return None
    prompts = calibration_windows(tokenizer, calibration, config.generation_prompt_tokens, config.teacher_generations)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(config.seed)
    rows = []
    started = time.perf_counter()
    for batch in prompts.split(16):
        with torch.no_grad():
            out = teacher.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                   max_new_tokens=config.seq_len - batch.shape[1], min_new_tokens=config.seq_len - batch.shape[1],
                                   pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        rows.append(out[:, : config.seq_len])
    torch.random.set_rng_state(generator_state)
    generated = torch.cat(rows)
    log.info("teacher generated %d windows of %d tokens in %.1fs", generated.shape[0], config.seq_len, time.perf_counter() - started)
    return generated


def _domain_windows(tokenizer, sources: list[TextSource], windows: int) -> torch.Tensor | None:
    """``windows`` windows of 512 tokens spread over ``sources`` (the first windows of each domain in turn)."""
    if not sources:
        return None
    per_domain = -(-windows // len(sources))
    picked = [token_windows(tokenizer, s.text, 512, per_domain * 512, skip_chars=EVAL_SKIP_CHARS if len(s.text) > 4 * EVAL_SKIP_CHARS
                            else 0) for s in sources]
    rows = [w[i] for i in range(per_domain) for w in picked if i < w.shape[0]]
    return torch.stack(rows[:windows])


def _train_distributed(student_dir: Path, teacher_dir: Path, windows: torch.Tensor, config: DistillConfig, checkpoints: Path,
                       out: Path, kept_layers: list[int], work: Path) -> list[dict]:
    torch.save(windows, work / "windows.pt")
    job = work / "job.json"
    write_job(job, {"student": str(student_dir), "teacher": str(teacher_dir), "windows": str(work / "windows.pt"),
                    "config": config.model_dump(mode="json"), "checkpoints": str(checkpoints), "out": str(out),
                    "kept_layers": kept_layers})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={config.processes}",
               "-m", "compress.distill_worker", "--job", str(job)]
    log.info("launching: %s", " ".join(command))
    if subprocess.run(command, check=False).returncode != 0:
        raise StageError(f"distributed distillation failed ({' '.join(command)})")
    return json.loads((out / "history.json").read_text())


def run_distill(source: Artifact, config: DistillConfig, ctx) -> Artifact:
    tokenizer = load_tokenizer(source.path)
    teacher = load_causal_lm(source.path)
    shape = student_shape(teacher.config.to_dict(), config)
    calib = calibration_windows(tokenizer, ctx.plan.calibration, 512, 8)
    train = calibration_windows(tokenizer, ctx.plan.calibration, config.seq_len, config.train_windows)
    generated = _teacher_generations(teacher, tokenizer, ctx.plan.calibration, config)
    if generated is not None:
        train = torch.cat([train, generated])
    unseen_names = set(ctx.plan.unseen_domains)
    evaluation = _domain_windows(tokenizer, [s for s in ctx.plan.evaluation if s.domain not in unseen_names], config.eval_windows)
    unseen = _domain_windows(tokenizer, [s for s in ctx.plan.evaluation if s.domain in unseen_names], config.eval_windows)
    if evaluation is None:
        evaluation, unseen = unseen, None
    student = copy.deepcopy(teacher)
    log.info("building the student: %s", shape)
    built = build_student(student, calib, shape)
    student_params = count_parameters(student)
    before = _evaluator(student, evaluation, unseen)()
    teacher_figures = _evaluator(teacher, evaluation, unseen)()
    ppl_before, ppl_teacher = before["perplexity"], teacher_figures["perplexity"]
    log.info("student: %s parameters (teacher %s); perplexity before training %.2f seen / %s unseen domains "
             "(teacher %.2f / %s)", f"{student_params:,}", f"{count_parameters(teacher):,}", ppl_before,
             _fmt(before.get("perplexity_unseen")), ppl_teacher, _fmt(teacher_figures.get("perplexity_unseen")))
    checkpoints = ctx.run_dir / "checkpoints" / f"{ctx.stage_name}-{ctx.fingerprint[:16]}"
    out = ctx.stage_dir / "model"
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    stopped_early_at = None
    if config.processes > 1:
        init = ctx.stage_dir / "student_init"
        save_model_folder(student, tokenizer, source.path, init)
        history = _train_distributed(init, source.path, train, config, checkpoints, out, built["kept_layers"], ctx.stage_dir)
        shutil.rmtree(init)
        student = load_causal_lm(out)
        tokenizer.save_pretrained(out)
    else:
        distiller = Distiller(student, teacher if config.loss == "kd" else None, train, config, checkpoints, built["kept_layers"])
        history = distiller.run(_evaluator(student, evaluation, unseen), progress=ctx.progress, initial=before)
        stopped_early_at = distiller.stopped_early_at
        save_model_folder(student, tokenizer, source.path, out)
    seconds = time.perf_counter() - started
    after = _evaluator(student, evaluation, unseen)()
    ppl_after = after["perplexity"]
    log.info("student after training: perplexity %.2f seen / %s unseen domains", ppl_after, _fmt(after.get("perplexity_unseen")))
    shutil.rmtree(checkpoints, ignore_errors=True)
    with contextlib.suppress(OSError):
        checkpoints.parent.rmdir()  # only when no other stage keeps checkpoints there
    meta = {
        **{k: v for k, v in source.meta.items() if k != "metrics"},
        "metrics": {"parameters": student_params, "teacher_parameters": count_parameters(teacher), "student_shape": shape,
                    "kept_layers": built["kept_layers"], "layer_influence": built["layer_influence"],
                    "loss": config.loss, "steps": config.steps, "tokens_trained": config.steps * config.batch_size * config.seq_len,
                    "train_seconds": round(seconds, 1),
                    "tokens_per_s": round(config.steps * config.batch_size * config.seq_len / max(seconds, 1e-9), 1),
                    "perplexity_teacher": ppl_teacher, "perplexity_before": ppl_before, "perplexity_after": ppl_after,
                    "perplexity_teacher_unseen": teacher_figures.get("perplexity_unseen"),
                    "perplexity_before_unseen": before.get("perplexity_unseen"),
                    "perplexity_after_unseen": after.get("perplexity_unseen"),
                    "eval_tokens": int(evaluation.numel()), "curve": history,
                    "unseen_domains": ctx.plan.unseen_domains, "stopped_early_at": stopped_early_at,
                    "teacher_generations": 0 if generated is None else int(generated.shape[0])},
    }
    return Artifact(HF_MODEL, out, meta)


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


STAGE = register(StageDef(
    name="distill",
    summary="build a smaller student (depth/width pruning) and train it by distillation from the teacher",
    input_kind=HF_MODEL,
    output_kind=HF_MODEL,
    config_cls=DistillConfig,
    run=run_distill,
))
