"""Measuring a deployed decoder and gating it: quality on every evaluation domain, fidelity to the teacher, the app's
prompts, host latency, the latency model's predictions for the target, and the checks against the target's budgets.

Measurements (target-independent): perplexity of the deployed numbers (the quantized checkpoint, computed in torch on
the run's device block by block, :mod:`compress.transforms.checkpoint_logits`) and of the teacher on every evaluation
domain (the gate takes the worst), top-1 agreement and KL divergence against the teacher on the mixed evaluation text,
greedy answers to the app's prompts (the deployed numbers' in torch too); where a portable ONNX was exported, ONNX
Runtime's agreement with the torch figures on a sample of windows and host ONNX Runtime latency, taken after the torch
models are gone (ONNX Runtime's CPU session holds float32 copies of the 16-bit tensors: the largest allocation of the
stage). The gate (target-dependent) compares them, and the latency model's predictions for the target, with the budgets;
``compress validate RUN_DIR`` re-gates a finished run from the stored measurements.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import PositiveInt

from compress.backends.onnx.runtime import DecoderLayout, OnnxDecoder
from compress.backends.onnx.slices import SlicedDecoder, slices_over
from compress.core.artifact import DeployedQuantization, Deployment
from compress.core.config import StrictModel, Target
from compress.core.devices import ON_CPU, Compute
from compress.core.memory import phase_peak
from compress.core.text import (
    TextSource,
    eval_skip,
    evaluated_span,
    prefix_tokens,
    source_ids,
    token_windows,
    usable_sources,
    window_prefix,
)
from compress.eval.fidelity import compare_window_pairs, worst_domain
from compress.eval.figures import DecoderFigures, DecoderPredictions, DeviceReference, PromptComparison, PromptJson, Row
from compress.eval.gate import Check, lower_bound_check, require_measured, upper_bound_check
from compress.eval.latency import measure_decoder_latency
from compress.eval.perf_model import (
    KV_CACHE_ELEMENT_BYTES,
    ModelShape,
    Storage,
    lowest_power_mode_meeting_budget,
    predict,
    predict_all_modes,
    predict_mixed,
)
from compress.eval.perplexity import targets_nll
from compress.eval.prompts import (
    PROMPT_BATCH,
    BatchGenerate,
    answer_prompts,
    compare_answers,
    prompt_checks,
    resolve_prompts,
    torch_greedy_batched,
)
from compress.models.compute import computed_in_float32
from compress.models.config_file import ModelConfig
from compress.models.loading import load_tokenizer
from compress.transforms.checkpoint_logits import WindowLogits, window_logits
from compress.transforms.quantize.saved import held_deployed_causal_lm
from compress.transforms.walk import release_freed_memory

log = logging.getLogger(__name__)


ONNX_VS_TORCH_QUANTIZED_LIMIT_PCT = 1.0


class ValidateConfig(StrictModel):
    """Options of the validate stage."""

    eval_tokens: PositiveInt = 2048  # per evaluation domain
    window: PositiveInt = 512
    latency_prompt_tokens: PositiveInt = 128
    latency_new_tokens: PositiveInt = 64
    latency_repeats: PositiveInt = 1
    device_prompt_tokens: PositiveInt = 64  # per evaluation domain, for the on-device greedy comparison
    device_new_tokens: PositiveInt = 24
    onnx_parity_windows: PositiveInt = 2  # per domain: ONNX Runtime against the torch measurement on these windows
    # The most graph weights (MiB, as stored) one ONNX Runtime session holds (it holds about twice that in float32): a
    # larger graph's parity check runs it in slices of whole blocks, one session at a time, and host latency is not
    # taken.
    onnx_session_mb: PositiveInt = 1024
    prompt_new_tokens: PositiveInt = 32  # greedy answer length to each app prompt (prompts=)


def device_reference(generate: BatchGenerate, tokenizer, evaluation: list[TextSource], config: ValidateConfig,
                     answers: PromptComparison | None = None, host: str = "") -> DeviceReference:
    """Greedy continuations by the host model (``generate``, the deployed numbers), for ``validate --on-device`` to
    compare with: one prompt per evaluation domain, then the app prompts (their measured answers, cut to length: a
    greedy answer's start is the shorter answer).

    The prompts are stored as text decoded from their token ids, so the device's tokenizer reads the same tokens.
    """
    prompts: list[PromptJson] = []
    expected: list[list[int] | None] = []
    prefix = window_prefix(tokenizer)
    for source in usable_sources(tokenizer, evaluation):
        ids = source_ids(tokenizer, source, eval_skip(source), max_tokens=config.device_prompt_tokens).tolist()
        text = tokenizer.decode(prefix + ids, skip_special_tokens=False)
        prompts.append(
            {"domain": source.domain, "text": text, "prompt_ids": tokenizer(text, add_special_tokens=False).input_ids}
        )
        expected.append(None)
    for row in sorted((answers or {}).get("rows", []), key=lambda r: r["order"]):
        prompts.append(
            {
                "domain": f"prompt {row['id']}",
                "text": tokenizer.decode(row["prompt_ids"], skip_special_tokens=False),
                "prompt_ids": row["prompt_ids"],
            }
        )
        answer = row["model_ids"]
        # Greedy decoding stops early only at an end token: a shorter answer than asked for is complete.
        complete = len(answer) < answers["new_tokens"] or len(answer) >= config.device_new_tokens
        expected.append(answer[: config.device_new_tokens] if complete else None)
    missing = [index for index, ids in enumerate(expected) if ids is None]
    for start in range(0, len(missing), PROMPT_BATCH):
        chunk = missing[start:start + PROMPT_BATCH]
        for index, ids in zip(
            chunk, generate([prompts[i]["prompt_ids"] for i in chunk], config.device_new_tokens), strict=True
        ):
            expected[index] = ids
    return {"max_new_tokens": config.device_new_tokens, "prompts": prompts, "host_output_ids": expected, "host": host}


def evaluation_windows(
    tokenizer, evaluation: list[TextSource], config: ValidateConfig
) -> list[tuple[str, torch.Tensor]]:
    """Each domain's first ``eval_tokens`` tokens (after its opening 5,000 characters when it is long) as windows."""
    return [
        (
            source.domain,
            token_windows(tokenizer, source, config.window, config.eval_tokens, skip_chars=eval_skip(source)),
        )
        for source in usable_sources(tokenizer, evaluation)
    ]


def parity_sample(domains: list[tuple[str, torch.Tensor]], per_domain: int) -> list[int]:
    """Indices (counting through every domain's windows) of the first ``per_domain`` windows of each domain."""
    indices, start = [], 0
    for _, windows in domains:
        indices += list(range(start, start + min(per_domain, windows.shape[0])))
        start += windows.shape[0]
    return indices


@dataclass(frozen=True)
class TorchWindow:
    """What the parity check compares of one window measured in torch: its summed NLL and its next-token argmax."""

    nll: float
    argmax: np.ndarray


def torch_side(model: WindowLogits, windows: torch.Tensor, sample: list[int]) -> dict[int, TorchWindow]:
    """The torch measurement of the sampled windows, kept so the model can go before ONNX Runtime's session comes."""
    side = {}
    for index in sample:
        ids = windows[index].numpy()
        predicting = model.rows(index, stop=len(ids) - 1)  # the last position predicts nothing
        argmax = np.concatenate([predicting[start:start + predicting.block].argmax(-1)
                                 for start in range(0, len(predicting), predicting.block)])
        side[index] = TorchWindow(targets_nll(predicting, ids[1:])[0], argmax)
    return side


# Tokens ONNX Runtime computes at a time in the parity check (through the KV cache): a 512-token window's float32 logits
# at a 150k vocabulary are 0.3 GB, and its arena keeps the largest it held.
PARITY_CHUNK = 128


def onnx_parity(
    decoder: OnnxDecoder | SlicedDecoder, measured: dict[int, TorchWindow], windows: torch.Tensor
) -> dict[str, Any]:
    """ONNX Runtime against the torch measurement on a sample of windows: perplexity of each and top-1 agreement (the
    graph run :data:`PARITY_CHUNK` tokens at a time through its KV cache, as it decodes when deployed; whole, or slice
    by slice)."""
    onnx_nll = torch_nll = 0.0
    count = agree = 0
    sample = list(measured)
    for position, start, logits in decoder.sequences_in_chunks(
        [windows[index].numpy() for index in sample], PARITY_CHUNK
    ):
        ids, torch_window = windows[sample[position]].numpy(), measured[sample[position]]
        targets = ids[start + 1:start + 1 + logits.shape[1]]
        rows = logits[0, :len(targets)]
        nll, n = targets_nll(rows, targets)
        onnx_nll += nll
        count += n
        agree += int((rows.argmax(-1) == torch_window.argmax[start:start + n]).sum())
    torch_nll = sum(torch_window.nll for torch_window in measured.values())
    ppl_onnx, ppl_torch = math.exp(onnx_nll / count), math.exp(torch_nll / count)
    return {"windows": len(measured), "tokens": count, "perplexity_onnx": ppl_onnx, "perplexity_torch": ppl_torch,
            "difference_pct": 100.0 * abs(ppl_onnx / ppl_torch - 1.0), "top1_agreement": agree / count}


@dataclass(frozen=True)
class DeployedFiles:
    """What a decoder validation measures: ``model_dir``, the Hugging Face folder that was exported (the quantized
    checkpoint, or a float model); ``teacher_dir``, what it is compared with (None: no teacher); ``onnx_dir``, its
    portable ONNX where one was exported."""

    model_dir: Path
    teacher_dir: Path | None
    onnx_dir: Path | None = None


def measure(files: DeployedFiles, evaluation: list[TextSource], config: ValidateConfig, progress: bool,
            unseen: list[str] | None = None, prompts: str | None = None, device: str = "cpu") -> DecoderFigures:
    """Every target-independent measurement of a decoder as deployed.

    The exported model is measured in torch on ``device`` block by block with exactly the deployed numbers (and so are
    the app prompts' answers); its ONNX, where there is one, in ONNX Runtime on a sample of windows (parity) and for
    host latency, after the torch models are gone; ``prompts``: the run's ``prompts=``.
    """
    model_dir, teacher_dir, onnx_dir = files.model_dir, files.teacher_dir, files.onnx_dir
    tokenizer = load_tokenizer(model_dir)
    domains = evaluation_windows(tokenizer, evaluation, config)
    windows = torch.cat([w for _, w in domains])
    names = ", ".join(name for name, _ in domains)
    log.info("measuring the deployed numbers in torch (%s) on %d domains (%s), %d windows of %d tokens, block by block",
             device, len(domains), names, windows.shape[0], config.window)
    peaks: dict[str, float] = {}  # MB, per phase: which of them sets the stage's peak
    with phase_peak(peaks, "passes"):
        quality, measured = _torch_passes(files, domains, windows, (unseen or [], config, progress, device))
    cases, prompt_source = resolve_prompts(prompts, tokenizer)
    answers = None
    if cases and teacher_dir is not None:
        answers = _prompt_answers(cases, prompt_source, tokenizer, files, config, _Compute(progress, device, peaks))
    parity = latency = None
    if onnx_dir is not None:  # ONNX Runtime's session (float32 copies of the 16-bit tensors) is alone in memory
        with phase_peak(peaks, "onnx_runtime"):
            parity, latency = _onnx_runtime_side(onnx_dir, measured, windows, evaluation, tokenizer, config)
    log.info("validation's peak resident memory by phase: %s",
             ", ".join(f"{name} {mb / 1024:.2f} GiB" for name, mb in peaks.items()))
    return {
        "eval_tokens": int(windows.numel()),
        "eval_windows": int(windows.shape[0]),
        "window_prefix": prefix_tokens(tokenizer),
        "measured_with": (
            f"torch on {device}: the deployed numbers (quantized linears rebuilt from their levels, "
            "inputs and KV cache quantized as deployed), block by block"
        ),
        **quality,
        "prompts": answers,
        "prompts_source": prompt_source,
        "onnx_parity": parity,
        "perplexity_onnx": parity["perplexity_onnx"] if parity else None,
        "perplexity_torch_quantized": parity["perplexity_torch"] if parity else None,
        "onnx_vs_torch_quantized_pct": parity["difference_pct"] if parity else None,
        "host_latency": latency,
        "phase_peak_rss_mb": peaks,
    }


def _torch_passes(files: DeployedFiles, domains: list, windows: torch.Tensor,
                  how: tuple[list[str], ValidateConfig, bool, str]) -> tuple[dict[str, Any], dict]:
    """The deployed model's and the teacher's logits block by block in torch (``how``: unseen domains, config,
    progress, device): the quality figures, and torch's side of the ONNX parity sample where there is an ONNX."""
    unseen, config, progress, device = how
    model_dir, teacher_dir = files.model_dir, files.teacher_dir
    deployed = window_logits(model_dir, windows, device, progress, desc="model")
    teacher = None
    if teacher_dir is not None:  # a float export measures the teacher itself
        same = Path(teacher_dir) == Path(model_dir)
        teacher = deployed if same else window_logits(teacher_dir, windows, device, progress, "teacher")
    quality = _quality(deployed, teacher, domains, windows, unseen, progress)
    measured = {}
    if files.onnx_dir is not None:
        measured = torch_side(deployed, windows, parity_sample(domains, config.onnx_parity_windows))
    deployed = teacher = None
    release_freed_memory()
    return quality, measured


def _onnx_runtime_side(
    onnx_dir: Path,
    measured: dict[int, TorchWindow],
    windows: torch.Tensor,
    evaluation: list[TextSource],
    tokenizer,
    config: ValidateConfig,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """ONNX Runtime's parity with the torch measurement on the sampled windows, and its host latency (not measured when
    the graph is run in slices)."""
    sliced = _sliced_decoder(onnx_dir, config.onnx_session_mb * 2**20)
    if sliced is not None:
        log.info(
            "ONNX Runtime against torch on %d windows, the graph in %d slices of whole blocks "
            "(validate.onnx_session_mb="
            "%d), one session at a time; host latency not measured (it needs the whole graph)",
            len(measured),
            len(sliced.slices),
            config.onnx_session_mb,
        )
        return {**onnx_parity(sliced, measured, windows), "slices": len(sliced.slices)}, None
    decoder = OnnxDecoder(onnx_dir)
    log.info("ONNX Runtime against torch on %d windows", len(measured))
    parity = onnx_parity(decoder, measured, windows)
    opening = evaluated_span(evaluation[0], config.latency_prompt_tokens)
    prompt = (window_prefix(tokenizer) + tokenizer(opening, add_special_tokens=False).input_ids)[
        : config.latency_prompt_tokens
    ]
    log.info("host ONNX Runtime latency: %d-token prompt, %d new tokens", len(prompt), config.latency_new_tokens)
    latency = measure_decoder_latency(decoder, prompt, config.latency_new_tokens, repeats=config.latency_repeats)
    del decoder
    release_freed_memory()
    return {**parity, "slices": 1}, latency


def _sliced_decoder(onnx_dir: Path, max_weight_bytes: int) -> SlicedDecoder | None:
    """The graph as slices of at most ``max_weight_bytes`` of weights each, or None where it is run whole
    (:func:`~compress.backends.onnx.slices.slices_over`)."""
    slices = slices_over(onnx_dir, DecoderLayout.load(onnx_dir), max_weight_bytes)
    return SlicedDecoder(onnx_dir, slices) if slices else None


def _quality(
    deployed: WindowLogits,
    teacher: WindowLogits | None,
    domains: list[tuple[str, torch.Tensor]],
    windows: torch.Tensor,
    unseen: list[str],
    progress: bool,
) -> dict[str, Any]:
    """Per-domain quality against the teacher, or the deployed model's perplexity alone when there is none."""
    if teacher is not None:
        return domain_quality(
            compare_window_pairs(lambda i: (deployed.rows(i), teacher.rows(i)), domains, progress), unseen
        )
    predicting = windows.shape[1] - 1
    nll = sum(targets_nll(deployed.rows(i, stop=predicting), windows[i, 1:].numpy())[0] for i in range(len(deployed)))
    return {"perplexity_teacher": None, "perplexity_increase_pct": None,
            "perplexity_model": math.exp(nll / (windows.shape[0] * predicting))}


@dataclass(frozen=True)
class _Compute:
    """How validation computes: progress bars or not, the device, and each phase's peak memory (MB, filled in)."""

    progress: bool
    device: str
    peaks: dict[str, float]


def _prompt_answers(cases, source: str, tokenizer, files: DeployedFiles, config: ValidateConfig,
                    compute: _Compute) -> dict[str, Any]:
    """The teacher's greedy answers to the app prompts, then the deployed numbers' in torch (one model held at a time;
    each phase's peak memory in ``compute.peaks``)."""
    teacher_dir, model_dir = files.teacher_dir, files.model_dir
    progress, peaks, device = compute.progress, compute.peaks, compute.device
    log.info(
        "app prompts: %d from %s, greedy %d tokens, deployed numbers vs teacher, both in torch",
        len(cases),
        source,
        config.prompt_new_tokens,
    )
    eos = model_eos_ids(model_dir, tokenizer)
    with phase_peak(peaks, "prompts_teacher"):
        on = Compute(device, progress)
        answers = teacher_answers(cases, tokenizer, teacher_dir, eos, config.prompt_new_tokens, on)
    with (
        phase_peak(peaks, "prompts_deployed"),
        deployed_generator(model_dir, eos, pad_id_of(tokenizer, eos), device) as generate,
    ):
        deployed = answer_prompts(cases, tokenizer, generate, config.prompt_new_tokens, progress, "deployed")
    return compare_answers(cases, tokenizer, answers, deployed, config.prompt_new_tokens, source)


def teacher_answers(cases, tokenizer, teacher_dir: Path, eos: list[int], new_tokens: int, compute: Compute = ON_CPU,
                    trust_remote_code: bool = False) -> list[list[int]]:
    """The teacher's greedy answers (token ids) to ``cases``: the model held in its own dtype (on the compute device
    where it fits there), computed in float32."""
    teacher, _ = held_deployed_causal_lm(teacher_dir, trust_remote_code, compute.device)
    with computed_in_float32(teacher):
        generate = torch_greedy_batched(teacher, eos, pad_id_of(tokenizer, eos))
        answers = answer_prompts(cases, tokenizer, generate, new_tokens, compute.progress, "teacher")
    del teacher
    release_freed_memory()
    return answers


def pad_id_of(tokenizer, eos: list[int]) -> int:
    """What pads a batch of prompts (masked out: any id would do, the tokenizer's own where it has one)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)


def model_eos_ids(folder: Path, tokenizer) -> list[int]:
    """The tokens greedy decoding stops at: the generation config's end tokens, else the tokenizer's."""
    from transformers import AutoConfig, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json: the model config's, then the tokenizer's
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder))
    eos = generation.eos_token_id if generation.eos_token_id is not None else tokenizer.eos_token_id
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


@contextlib.contextmanager
def deployed_generator(model_dir: Path, eos: list[int], pad_id: int, device: str = "cpu") -> Iterator[BatchGenerate]:
    """Batched greedy decoding of the deployed numbers in torch: the quantized checkpoint held as its levels (on
    ``device`` where it fits there), each linear rebuilt while its block computes (the numbers the custody check proves
    the bundle holds)."""
    model, rebuilt = held_deployed_causal_lm(model_dir, device=device)
    with computed_in_float32(model, rebuilt):
        yield torch_greedy_batched(model, eos, pad_id)
    del model
    release_freed_memory()


def domain_quality(per_domain: dict[str, dict[str, Any]], unseen: list[str]) -> dict[str, Any]:
    """Metrics from :func:`compare_on_domains`: the worst domain's perplexity change, and fidelity on the mixed text."""
    mixed = per_domain.pop("mixed")
    worst = worst_domain(per_domain)
    for name, row in per_domain.items():
        row["seen"] = name not in unseen
    return {
        "perplexity_model": mixed["perplexity_model"],
        "perplexity_teacher": mixed["perplexity_reference"],
        "perplexity_increase_pct": per_domain[worst]["perplexity_increase_pct"],
        "perplexity_increase_pct_mixed": mixed["perplexity_increase_pct"],
        "worst_domain": worst,
        "unseen_domains": [name for name in per_domain if name in unseen],
        "top1_agreement": mixed["top1_agreement"],
        "mean_kl": mixed["mean_kl"],
        "domains": per_domain,
        "mixed": mixed,
    }


def gate_checks(
    metrics: DecoderFigures, predictions: DecoderPredictions, target: Target, must_measure: bool
) -> list[Check]:
    """Compare measurements and predictions with the target's budgets."""
    checks = [
        *_quality_checks(metrics, target.budgets),
        *_predicted_checks(predictions["chosen"], target),
        *prompt_checks(metrics.get("prompts"), target.budgets),
        *_export_checks(metrics),
    ]
    return require_measured(checks) if must_measure else checks


def _quality_checks(metrics: DecoderFigures, budgets) -> list[Check]:
    """The measured quality against the teacher: the worst domain's perplexity, top-1 agreement and KL."""
    worst = metrics.get("worst_domain")
    where = "the evaluation text"
    if worst:
        unseen = " (unseen)" if worst in metrics.get("unseen_domains", []) else ""
        where = f"worst of {len(metrics['domains'])} evaluation domains: {worst}{unseen}"
    return [
        upper_bound_check("perplexity_increase_pct", metrics.get("perplexity_increase_pct"),
                          budgets.max_ppl_increase_pct, "measured", "%",
                          f"the deployed numbers vs the teacher, {where}"),
        lower_bound_check("top1_agreement", metrics.get("top1_agreement"), budgets.min_top1_agreement, "measured", "",
                          "next-token argmax equal to the teacher's, mixed evaluation text"),
        upper_bound_check("mean_kl", metrics.get("mean_kl"), budgets.max_mean_kl, "measured", "nats",
                          "mean KL(teacher || model) per token, mixed evaluation text"),
    ]


def _predicted_checks(chosen: Row, target: Target) -> list[Check]:
    """The latency model's decode latency, TTFT and memory in the chosen power mode against the budgets."""
    budgets, mode = target.budgets, chosen["power_mode"]
    return [
        upper_bound_check("decode_latency_ms", chosen["decode_latency_ms"], budgets.max_decode_latency_ms,
                          "predicted", "ms",
                          f"{target.name} {mode}, {chosen['precision']}, context {budgets.context_length}"),
        upper_bound_check("ttft_ms", chosen["ttft_ms"], budgets.max_ttft_ms, "predicted", "ms",
                          f"{target.name} {mode}, prompt {budgets.prompt_length} tokens"),
        upper_bound_check("memory_gb", chosen["memory_gb"], budgets.max_memory_gb, "predicted", "GB",
                          f"weights + KV cache at {budgets.context_length} + runtime"),
    ]


def _export_checks(metrics: DecoderFigures) -> list[Check]:
    """What the export must keep: the 2:4 pattern where the model is sparse, ONNX Runtime agreeing with torch."""
    checks = []
    if metrics.get("onnx_pattern_24_fraction") is not None:
        checks.append(upper_bound_check(
            "sparsity_24_violations_pct", 100.0 * (1.0 - metrics["onnx_pattern_24_fraction"]), 0.0, "measured", "%",
            "share of exported linear weight 4-groups outside the 2:4 pattern"))
    parity = metrics.get("onnx_parity")
    if parity:
        checks.append(upper_bound_check(
            "onnx_vs_torch_quantized_pct", parity["difference_pct"], ONNX_VS_TORCH_QUANTIZED_LIMIT_PCT, "measured", "%",
            f"|ppl ONNX Runtime / ppl torch - 1| of the deployed numbers on {parity['windows']} windows"))
    return checks


def target_predictions(model: ModelConfig | Path, precision: str, target: Target, power_mode: str,
                       deployment: Deployment | None = None) -> DecoderPredictions:
    """Latency-model predictions for every power mode and the chosen one, for a decoder (its ``config.json`` mapping, or
    the folder holding it) shipping as its artifact's ``meta`` says (the share of linears left FP16, the weight group
    size, the KV-cache precision), and the same model in FP16 for reference."""
    config = ModelConfig.of(model)
    deployment = deployment or Deployment()
    quantization = deployment.quantization or DeployedQuantization(method="none", format="float")
    shape = replace(ModelShape.from_config(config), kv_cache_bytes=KV_CACHE_ELEMENT_BYTES[quantization.kv_cache])
    if quantization.mix:  # a mixed-precision plan: each precision's share of the linears
        head = quantization.lm_head or "fp16"
        all_modes = [predict_mixed(target, shape, quantization.mix, m.name, head=head) for m in target.power_modes]
        chosen = predict_mixed(target, shape, quantization.mix, power_mode, head=head).to_json()
    else:
        storage = Storage(quantization.group_size or 128, float_fraction=deployment.float_linear_fraction or 0.0)
        all_modes = predict_all_modes(target, shape, precision, storage=storage)
        chosen = predict(target, shape, precision, power_mode, storage=storage).to_json()
    lowest = lowest_power_mode_meeting_budget(all_modes, target.budgets.max_decode_latency_ms)
    return {"target": target.name, "modes": [p.to_json() for p in all_modes], "chosen": chosen,
            "lowest_power_mode_meeting_latency_budget": lowest.power_mode if lowest else None,
            "reference_fp16": predict(target, ModelShape.from_config(config), "fp16", power_mode).to_json()}
