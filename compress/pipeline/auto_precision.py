"""``quantize.method=auto`` as the quantize stage runs it: the fastest mixed-precision plan the gate's budgets allow.

The library pieces are in :mod:`compress.transforms.quantize.mixed`; this module supplies what they
need from the run:

* the candidate formats: those the target's deployment runs (its Edge-LLM precisions and GPU
  formats), each group of linears admitting only the formats its shapes are legal in (INT4 in
  groups of 128 where the kernels tile it, :mod:`compress.backends.edgellm.contracts`), and a plan
  only formats one bundle can hold side by side (no NVFP4 beside INT8 or INT4);
* the cost of a group in a format: the decode milliseconds its bytes take at the target's power
  mode, from the latency model (:func:`compress.eval.perf_model.linear_ms_per_param`);
* the budget: ``margin`` times the per-token KL the gate's perplexity budget allows
  (``ln(1 + max_ppl_increase_pct / 100)``), and no more than ``margin`` times its mean-KL budget;
* the measurement: every candidate plan against the teacher, block by block on the compute device,
  on calibration windows calibration did not read (:func:`compress.core.text.held_out_windows`),
  never on the evaluation text the gate later judges; for a chat model also its answers to the chat
  calibration prompts (never the gate's), against the teacher's greedy answers, read in one pass
  (:func:`compress.eval.prompts.forced_answer_pairs`). A plan is accepted when its worst domain's
  perplexity change stays within ``margin`` of the gate's budget, its top-1 agreement and mean KL
  within the gate's, and its answers clear the gate's prompt limits by two standard errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compress.algorithms.formats import PRECISIONS
from compress.backends.edgellm import contracts
from compress.core.config import Target
from compress.core.devices import Compute
from compress.core.memory import phase_peak
from compress.core.text import TextSource, has_chat_template, held_out_windows
from compress.eval.decoder import deployed_generator, model_eos_ids, pad_id_of, teacher_answers
from compress.eval.fidelity import compare_window_pairs, worst_domain
from compress.eval.perf_model import ModelShape, linear_ms_per_param, predict_mixed
from compress.eval.prompts import (
    answer_ids,
    forced_answer_pairs,
    forced_rows,
    passes_expect,
    prompt_ids,
    selection_expect_prompts,
    selection_prompts,
)
from compress.models.compute import holding_device, largest_part_float32_bytes, tensor_bytes
from compress.models.config_file import ModelConfig
from compress.models.families import decoder_blocks, family_of, linear_shapes
from compress.models.loading import load_causal_lm
from compress.models.weights import CheckpointReader, empty_causal_lm, materialize, module_prefix
from compress.pipeline.plan_search import Candidate, SearchLimits, search
from compress.transforms.checkpoint_logits import window_logits
from compress.transforms.quantize.config import AutoConfig, candidate_configs
from compress.transforms.quantize.decoder import lm_head_of, quantize_folder
from compress.transforms.quantize.mixed import (
    FLOAT,
    HEAD,
    HEAD_INDEX,
    MixedPlan,
    SensitivityJob,
    SensitivityTable,
    choices_from,
    output_fisher,
    sensitivity,
)
from compress.transforms.quantize.saved import QuantResult
from compress.transforms.walk import StreamedBlocks

log = logging.getLogger(__name__)
# A plan's answers to the held-out chat prompts must clear each of the gate's prompt limits by this many standard errors
# of their mean: the gate asks other prompts, so the search's figure is one sample of what the gate will see.
ANSWER_STANDARD_ERRORS = 2.0


def candidate_formats(config: AutoConfig, target: Target) -> list[str]:
    """The formats a plan may use on ``target``: the config's, else every one the target's deployment runs in a
    bundle."""
    if config.formats:
        return list(config.formats)
    return [
        name
        for name in contracts.MIXED_FORMATS
        if PRECISIONS[name].edgellm in target.edgellm.precisions
        and PRECISIONS[name].gpu_format in target.gpu.precisions
    ]


def point_shapes(model_config: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """Each activation point's linears as (out, in) shapes, and the LM head's (``HEAD``)."""
    shapes = linear_shapes(model_config)
    family = family_of(model_config)
    points = {point.name: [shapes[name.rsplit(".", 1)[-1]] for name in point.consumers] for point in family.points}
    return {**points, HEAD: [(int(model_config["vocab_size"]), int(model_config["hidden_size"]))]}


def mix_of(plan: MixedPlan, model_config: ModelConfig) -> dict[str, float]:
    """The share of the decoder-linear parameters each precision holds (``fp16`` for the float groups)."""
    params = {
        point: sum(out * inp for out, inp in shapes)
        for point, shapes in point_shapes(model_config).items()
        if point != HEAD
    }
    totals: dict[str, float] = {}
    for index in range(int(model_config["num_hidden_layers"])):
        for point, count in params.items():
            name = plan.formats.get(index, {}).get(point, FLOAT)
            totals[name] = totals.get(name, 0.0) + count
    whole = sum(totals.values())
    return {name: count / whole for name, count in sorted(totals.items())}


def kl_budget(margin: float, target: Target) -> float:
    """The predicted per-token KL a plan may spend: ``margin`` of what the gate's perplexity budget allows, and of its
    mean-KL budget, whichever is smaller."""
    return margin * min(math.log1p(target.budgets.max_ppl_increase_pct / 100), target.budgets.max_mean_kl)


@dataclass(frozen=True)
class SearchRun:
    """Where a search reads and writes and how it computes: the model to quantize, the teacher plans are measured
    against, the folder the chosen plan ends in, a work folder for candidates, the compute device."""

    source: Path
    teacher: Path
    out: Path
    work: Path
    device: str
    progress: bool
    trust_remote_code: bool = False


@dataclass(frozen=True)
class _Selection:
    """The held-out calibration windows plans are measured on (by domain), their rows, and the teacher's logits on
    them."""

    windows: list[tuple[str, torch.Tensor]]
    rows: torch.Tensor
    reference: Any


def run_search(run: SearchRun, windows: torch.Tensor, calibration: list[TextSource], tokenizer, config: AutoConfig,
               target: Target, power_mode: str) -> tuple[QuantResult, dict[str, Any]]:
    """Search, quantize the chosen plan into ``run.out``; returns its quantization and what the search found (for the
    report)."""
    model_config = ModelConfig.read(run.source)
    formats = candidate_formats(config, target)
    shapes = point_shapes(model_config)

    def allowed(index: int, point: str, name: str) -> bool:
        if point == HEAD and (not config.lm_head or name not in contracts.LM_HEAD_FORMATS):
            return False
        return name in formats and contracts.mixed_format_fits(name, shapes[point])

    configs = candidate_configs(formats, config.shared_options())
    head_formats = [name for name in formats if allowed(HEAD_INDEX, HEAD, name)]
    log.info("auto precision: candidate formats %s on %s (the LM head: %s)", ", ".join(formats), target.name,
             ", ".join([FLOAT, *head_formats]))
    peaks: dict[str, float] = {}
    with _phase(peaks, "fisher"):
        fisher = _fisher(run, windows[: config.fisher_windows], model_config, bool(head_formats))
    with _phase(peaks, "sensitivity"):
        table = _sensitivities(run, windows, SensitivityJob(configs, allowed, fisher))
    budget = kl_budget(config.margin, target)
    with _phase(peaks, "teacher"):
        selection = _selection(run, tokenizer, calibration, config, budget)
        answers = _held_out_answers(config, tokenizer, run.teacher, run.progress, run.trust_remote_code, run.device)
    measure = _measurer(selection, answers, target, config.margin, run.device, run.progress)

    def quantize(plan: MixedPlan, folder: Path) -> QuantResult:
        log.info("auto precision: quantizing a plan (%s)", ", ".join(f"{n} {c}" for n, c in plan.counts().items()))
        return quantize_folder(run.source, folder, windows, config, Compute(run.device, run.progress),
                               trust_remote_code=run.trust_remote_code, plan=plan)

    format_sets = contracts.mixed_format_sets(formats)
    if len(format_sets) > 1:
        log.info("auto precision: one bundle holds %s", " or ".join("+".join(s) for s in format_sets))
    limits = SearchLimits(config.max_rounds, config.refine_rounds, format_sets)
    with _phase(peaks, "plans"):
        found = search(
            _choices(table, shapes, formats, target, power_mode), configs, budget, quantize, measure, run.work, limits
        )
    shutil.move(str(found.folder), str(run.out))
    shutil.rmtree(run.work, ignore_errors=True)
    shape = ModelShape.from_config(model_config)
    result = found.quantization
    report = {
        "formats": formats,
        "format_sets": [list(names) for names in format_sets],
        "budget_kl": budget,
        "margin": config.margin,
        "selection": {"windows": int(selection.rows.shape[0]), "domains": [d for d, _ in selection.windows]},
        "candidates": [_candidate_json(c, model_config, target, power_mode, shape) for c in found.candidates],
        "references": _uniform_references(table, formats, model_config, target, power_mode, shape, allowed),
        "sensitivity": table.to_json(),
        "plan": result.plan.to_json(),
        "lm_head": result.plan.head,
        "mix": mix_of(result.plan, model_config),
        "phase_peak_rss_mb": peaks,
    }
    return result, report


def _choices(table: SensitivityTable, shapes: dict[str, list[tuple[int, int]]], formats: list[str], target: Target,
             power_mode: str):
    """Each group's options, costed in predicted decode milliseconds on the target at its power mode."""
    ms_per_param = {name: linear_ms_per_param(target, power_mode, name) for name in [FLOAT, *formats]}
    params = {point: sum(o * i for o, i in group) for point, group in shapes.items()}
    return choices_from(table, lambda index, point, name: params[point] * ms_per_param[name])


def _selection(
    run: SearchRun, tokenizer, calibration: list[TextSource], config: AutoConfig, budget: float
) -> _Selection:
    """Held-out calibration windows from every domain, and the teacher's logits on them."""
    domains = len({source.domain for source in calibration})
    windows = held_out_windows(tokenizer, calibration, config.calib_window, config.calib_windows,
                               per_domain=max(1, -(-config.selection_windows // domains)))
    rows = torch.cat([w for _, w in windows])
    log.info(
        "auto precision: plans measured against the teacher on %d held-out calibration windows (%s), KL budget %.4g",
        rows.shape[0],
        ", ".join(d for d, _ in windows),
        budget,
    )
    return _Selection(windows, rows, window_logits(run.teacher, rows, run.device, run.progress, desc="teacher"))


@contextlib.contextmanager
def _phase(peaks: dict[str, float], name: str) -> Iterator[None]:
    """A phase of the search, its peak resident memory recorded in ``peaks`` and, with its time, logged when it ends."""
    start = time.monotonic()
    try:
        with phase_peak(peaks, name):
            yield
    finally:
        log.info(
            "auto precision: %s took %.1f min, peak resident memory %.2f GiB",
            name,
            (time.monotonic() - start) / 60,
            peaks[name] / 1024,
        )


def _fisher(run: SearchRun, windows: torch.Tensor, model_config: ModelConfig, head: bool) -> dict[str, torch.Tensor]:
    """The output Fisher information of every decoder linear (and of the LM head, with ``head``), from the model held in
    its own dtype, on the run's device where it fits there."""
    model = load_causal_lm(run.source, trust_remote_code=run.trust_remote_code, own_dtype=True)
    model.to(holding_device(run.device, tensor_bytes(model.parameters()), largest_part_float32_bytes(model)))
    family = family_of(model_config)
    prefix = module_prefix(model, decoder_blocks(model))
    linears = [f"{prefix}.{index}.{name}" for index in range(len(decoder_blocks(model))) for name in family.linears()]
    if head:
        linears.append(module_prefix(model, model.get_output_embeddings()))
    log.info("auto precision: output Fisher information of %d linears on %d windows", len(linears), windows.shape[0])
    return output_fisher(model, windows, linears)


def _sensitivities(run: SearchRun, windows: torch.Tensor, job: SensitivityJob) -> SensitivityTable:
    """Every block quantized once per candidate format (one block in memory at a time)."""
    model = empty_causal_lm(run.source, run.trust_remote_code)
    reader = CheckpointReader(run.source)
    embeddings = model.get_input_embeddings()
    materialize(embeddings, module_prefix(model, embeddings), reader)
    if any(job.allowed(HEAD_INDEX, HEAD, name) for name in job.candidates):
        job = dataclasses.replace(job, head=lm_head_of(model, reader))
    return sensitivity(model, windows, job, run.device, run.progress, blocks=StreamedBlocks(model, reader))


@dataclass(frozen=True)
class HeldOutAnswers:
    """Chat prompts the gate does not evaluate, as token ids, the teacher's greedy answers to them, and, for those with
    an expected answer, its regular expression and whether the teacher's answer matches it."""

    prompts: list[list[int]]
    answers: list[list[int]]
    pad_id: int
    eos: list[int]
    expect: list[str | None]
    teacher_passes: list[bool | None]
    tokenizer: Any
    new_tokens: int  # the answers' length (the teacher's stop earlier where it ends them)


def _held_out_answers(config: AutoConfig, tokenizer, teacher: Path, progress: bool, trust_remote_code: bool,
                      device: str) -> HeldOutAnswers | None:
    """The teacher's answers to the chat calibration prompts and to the held-out prompts with expected answers, for a
    chat model (None otherwise, or with no prompts asked)."""
    if not (config.selection_prompts or config.expect_prompts) or not has_chat_template(tokenizer):
        return None
    cases = selection_prompts(config.selection_prompts) + selection_expect_prompts(config.expect_prompts)
    eos = model_eos_ids(teacher, tokenizer)
    log.info(
        "auto precision: plans also measured on their answers to %d chat prompts (%d of them with an expected answer; "
        "%d "
        "tokens, against the teacher's greedy answers)",
        len(cases),
        config.expect_prompts,
        config.answer_tokens,
    )
    answers = teacher_answers(cases, tokenizer, teacher, eos, config.answer_tokens, Compute(device, progress),
                              trust_remote_code)
    passes = [
        passes_expect(case.expect, tokenizer.decode(ids, skip_special_tokens=True))
        for case, ids in zip(cases, answers, strict=True)
    ]
    return HeldOutAnswers(
        [prompt_ids(tokenizer, case.prompt) for case in cases],
        answers,
        pad_id_of(tokenizer, eos),
        eos,
        [case.expect for case in cases],
        passes,
        tokenizer,
        config.answer_tokens,
    )


def _mean_and_error(values: list[float]) -> tuple[float, float]:
    """The mean of ``values`` and its standard error."""
    tensor = torch.tensor(values, dtype=torch.float64)
    error = float(tensor.std(unbiased=True)) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return float(tensor.mean()), error


def _answer_figures(
    folder: Path, held_out: HeldOutAnswers, budgets, device: str, progress: bool
) -> tuple[dict[str, float], list[float]]:
    """A plan's answers to the held-out prompts (read in one pass, :func:`forced_answer_pairs`) and, per prompt check of
    the gate, how far it is from clearing its limit by :data:`ANSWER_STANDARD_ERRORS` standard errors."""
    rows = forced_rows(held_out.prompts, held_out.answers, held_out.pad_id)
    logits = window_logits(folder, rows, device, progress, desc="candidate answers")
    pairs = forced_answer_pairs(held_out.prompts, held_out.answers, logits.logits)
    figures, ratios = {}, []
    for key, field, limit in (("answer_prefix_agreement", "prefix_fraction", budgets.min_answer_prefix_agreement),
                              ("first_token_agreement", "first_token_match", budgets.min_first_token_agreement),
                              ("identical_answers", "identical", budgets.min_identical_answers)):
        mean, error = _mean_and_error([float(pair[field]) for pair in pairs])
        figures[key] = mean
        if limit > 0:
            ratios.append((limit + ANSWER_STANDARD_ERRORS * error) / max(mean, 1e-9))
    expected = [i for i, expect in enumerate(held_out.expect) if expect is not None]
    if expected:
        passes = _plan_passes(folder, held_out, expected, pairs, device)
        drops = [100.0 * (float(held_out.teacher_passes[i]) - float(passes[i])) for i in expected]
        drop, error = _mean_and_error(drops)
        figures.update(expect_pass_teacher=sum(bool(held_out.teacher_passes[i]) for i in expected) / len(expected),
                       expect_pass_model=sum(passes[i] for i in expected) / len(expected), expect_pass_drop_pct=drop)
        ratios.append((drop + ANSWER_STANDARD_ERRORS * error) / max(budgets.max_expect_pass_drop_pct, 1e-9))
    return figures, ratios


def _plan_passes(folder: Path, held_out: HeldOutAnswers, expected: list[int], pairs: list[dict[str, Any]], device: str
                 ) -> dict[int, bool]:
    """Whether the plan's greedy answer to each prompt of ``expected`` matches its expected answer: the teacher's
    verdict where the answers are identical (the forced pass says so), else the plan's own answer, decoded with its
    deployed
    numbers."""
    passes = {i: bool(held_out.teacher_passes[i]) for i in expected if pairs[i]["identical"]}
    differ = [i for i in expected if not pairs[i]["identical"]]
    if differ:
        with deployed_generator(folder, held_out.eos, held_out.pad_id, device) as generate:
            answers = answer_ids([held_out.prompts[i] for i in differ], generate, held_out.new_tokens)
        for i, ids in zip(differ, answers, strict=True):
            passes[i] = bool(
                passes_expect(held_out.expect[i], held_out.tokenizer.decode(ids, skip_special_tokens=True))
            )
    return passes


def _measurer(selection: _Selection, held_out: HeldOutAnswers | None, target: Target, margin: float, device: str,
              progress: bool):
    """A plan's figures against the teacher on the held-out windows (and prompts), and whether they are within the
    budgets."""
    budgets = target.budgets

    def measure(folder: Path) -> tuple[bool, dict[str, Any]]:
        deployed = window_logits(folder, selection.rows, device, progress, desc="candidate")
        per_domain = compare_window_pairs(lambda i: (deployed.rows(i), selection.reference.rows(i)), selection.windows,
                                          progress=False)
        mixed = per_domain.pop("mixed")
        worst = worst_domain(per_domain)
        figures = {"worst_domain": worst, "worst_increase_pct": per_domain[worst]["perplexity_increase_pct"],
                   "top1_agreement": mixed["top1_agreement"], "mean_kl": mixed["mean_kl"]}
        ratios = [
            figures["worst_increase_pct"] / (margin * budgets.max_ppl_increase_pct),
            budgets.min_top1_agreement / max(figures["top1_agreement"], 1e-9),
            figures["mean_kl"] / budgets.max_mean_kl,
        ]
        if held_out is not None:
            answers, answer_ratios = _answer_figures(folder, held_out, budgets, device, progress)
            figures.update(answers)
            ratios += answer_ratios
        figures["overshoot"] = max(ratios)
        passed = figures["overshoot"] <= 1.0
        answered = (f", answer prefix {100 * figures['answer_prefix_agreement']:.1f}%" if held_out is not None else "")
        if "expect_pass_drop_pct" in figures:
            answered += (f", expected answers {100 * figures['expect_pass_model']:.0f}% (teacher "
                         f"{100 * figures['expect_pass_teacher']:.0f}%)")
        log.info("auto precision: worst held-out domain %s %+.2f%% (limit %+.2f%%), top-1 %.1f%%, KL %.4f%s: %s", worst,
                 figures["worst_increase_pct"], margin * budgets.max_ppl_increase_pct, 100 * figures["top1_agreement"],
                 figures["mean_kl"], answered, "accepted" if passed else "backing off")
        return passed, figures

    return measure


def _predicted(
    target: Target, shape: ModelShape, mix: dict[str, float], power_mode: str, head: str = FLOAT
) -> dict[str, float]:
    """The latency model's figures for one mix of formats (and the head's) at the run's power mode, as the search
    records them."""
    prediction = predict_mixed(target, shape, mix, power_mode, head=head)
    return {
        "predicted_decode_ms": prediction.decode_latency_ms,
        "predicted_tokens_per_s": prediction.decode_tokens_per_s,
        "predicted_memory_gb": prediction.memory_gb,
        "predicted_joules_per_token": prediction.joules_per_token,
    }


def _candidate_json(
    candidate: Candidate, model_config, target: Target, power_mode: str, shape: ModelShape
) -> dict[str, Any]:
    mix = mix_of(candidate.plan, model_config)
    return {**candidate.to_json(), **_predicted(target, shape, mix, power_mode, candidate.plan.head), "mix": mix}


def _uniform_references(table, formats: list[str], model_config, target: Target, power_mode: str, shape: ModelShape,
                        allowed) -> list[dict[str, Any]]:
    """Every uniform assignment as a reference point: each format wherever it is legal (FP16 elsewhere, the LM head
    included, as the uniform recipes ship it), predicted."""
    rows = []
    for name in [FLOAT, *formats]:
        formats_by_block: dict[int, dict[str, str]] = {}
        kl = 0.0
        for (index, point), values in table.kl.items():
            if point == HEAD:
                continue
            chosen = name if name in values and allowed(index, point, name) else FLOAT
            formats_by_block.setdefault(index, {})[point] = chosen
            kl += values.get(chosen, 0.0)
        mix = mix_of(MixedPlan(formats_by_block, {}), model_config)
        rows.append(
            {"name": f"uniform {name}", "mix": mix, "predicted_kl": kl, **_predicted(target, shape, mix, power_mode)}
        )
    return rows
