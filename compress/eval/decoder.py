"""Measuring an exported decoder and gating it: quality on every evaluation domain, fidelity to the teacher, host latency,
the latency model's predictions for the target, and the checks against the target's budgets.

Measurements (target-independent): perplexity of the ONNX model in ONNX Runtime and of the torch
teacher on every evaluation domain (the gate takes the worst), top-1 agreement and KL divergence
against the teacher on the mixed evaluation text, host ONNX Runtime latency, model size. The gate
(target-dependent) compares them, and the latency model's predictions for the target, with the
budgets; ``compress validate RUN_DIR`` re-gates a finished run from the stored measurements.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from pydantic import PositiveInt

from compress.backends.onnx.runtime import ONNX_FILE, OnnxDecoder
from compress.core.config import StrictModel, Target
from compress.core.files import path_size
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
from compress.eval.fidelity import compare_on_domains, worst_domain
from compress.eval.gate import Check, lower_bound_check, require_measured, upper_bound_check
from compress.eval.latency import measure_decoder_latency
from compress.eval.perf_model import KV_CACHE_ELEMENT_BYTES, ModelShape, lowest_power_mode_meeting_budget, predict, predict_all_modes
from compress.eval.perplexity import perplexity, torch_logits_fn
from compress.eval.prompts import compare_prompts, prompt_checks, resolve_prompts, torch_greedy
from compress.models.compute import computed_in_float32
from compress.models.loading import load_causal_lm, load_tokenizer
from compress.transforms.quantize.saved import attach_quantization, held_quantized_causal_lm, load_quantization

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
    prompt_new_tokens: PositiveInt = 32  # greedy answer length to each app prompt (prompts=)


def device_reference(decoder: OnnxDecoder, tokenizer, evaluation: list[TextSource], config: ValidateConfig,
                     answers: dict[str, Any] | None = None) -> dict[str, Any]:
    """Greedy continuations by the host model, for ``validate --on-device`` to compare with: one prompt per evaluation
    domain, then the app prompts (their measured answers, cut to length: a greedy answer's start is the shorter answer).

    The prompts are stored as text decoded from their token ids, so the device's tokenizer reads the same tokens.
    """
    prompts, expected = [], []
    prefix = window_prefix(tokenizer)
    for source in usable_sources(tokenizer, evaluation):
        ids = source_ids(tokenizer, source, eval_skip(source), max_tokens=config.device_prompt_tokens).tolist()
        text = tokenizer.decode(prefix + ids, skip_special_tokens=False)
        prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
        prompts.append({"domain": source.domain, "text": text, "prompt_ids": prompt_ids})
        expected.append(decoder.greedy(prompt_ids, config.device_new_tokens))
    for row in sorted((answers or {}).get("rows", []), key=lambda r: r["order"]):
        prompts.append({"domain": f"prompt {row['id']}", "text": tokenizer.decode(row["prompt_ids"], skip_special_tokens=False),
                        "prompt_ids": row["prompt_ids"]})
        answer = row["model_ids"]
        ended = bool(answer) and answer[-1] in decoder.layout.eos_token_ids
        complete = ended or len(answer) >= config.device_new_tokens
        expected.append(answer[: config.device_new_tokens] if complete else decoder.greedy(row["prompt_ids"], config.device_new_tokens))
    return {"max_new_tokens": config.device_new_tokens, "prompts": prompts, "host_output_ids": expected,
            "host": "our Q/DQ ONNX in ONNX Runtime (the numbers the bundle holds)"}


def quantized_reference_perplexity(model_dir: Path, windows, progress: bool) -> float | None:
    """Perplexity of the torch model the ONNX graph was exported from, with its simulated activation (and KV cache) quantization."""
    quantized = load_quantization(model_dir)
    if quantized is None:
        return None
    model, rebuilt = held_quantized_causal_lm(model_dir)
    attach_quantization(model, *quantized)
    with computed_in_float32(model, rebuilt):
        return perplexity(torch_logits_fn(model), windows, progress, desc="ppl torch quantized")


def evaluation_windows(tokenizer, evaluation: list[TextSource], config: ValidateConfig) -> list[tuple[str, torch.Tensor]]:
    """Each domain's first ``eval_tokens`` tokens (after its opening 5,000 characters when it is long) as windows."""
    return [(source.domain, token_windows(tokenizer, source, config.window, config.eval_tokens, skip_chars=eval_skip(source)))
            for source in usable_sources(tokenizer, evaluation)]


def measure(onnx_dir: Path, teacher_dir: Path | None, evaluation: list[TextSource], config: ValidateConfig, progress: bool,
            exported_from: Path | None = None, unseen: list[str] | None = None, prompts: str | None = None) -> dict[str, Any]:
    """Every target-independent measurement of an exported decoder (``prompts``: the run's ``prompts=``)."""
    tokenizer = load_tokenizer(onnx_dir)
    domains = evaluation_windows(tokenizer, evaluation, config)
    windows = torch.cat([w for _, w in domains])
    decoder = OnnxDecoder(onnx_dir)
    quality: dict[str, Any] = {"perplexity_teacher": None, "perplexity_increase_pct": None}
    answers = None
    cases, prompt_source = resolve_prompts(prompts, tokenizer)
    if teacher_dir is not None:
        log.info("ONNX model vs torch teacher on %d domains (%s), %d windows of %d tokens", len(domains),
                 ", ".join(name for name, _ in domains), windows.shape[0], config.window)
        teacher = load_causal_lm(teacher_dir, own_dtype=True)
        with computed_in_float32(teacher):
            quality = domain_quality(compare_on_domains(decoder.logits, torch_logits_fn(teacher), domains, progress), unseen or [])
            if cases:
                log.info("app prompts: %d from %s, greedy %d tokens, ONNX model vs torch teacher", len(cases), prompt_source,
                         config.prompt_new_tokens)
                answers = compare_prompts(cases, tokenizer, torch_greedy(teacher, decoder.layout.eos_token_ids), decoder.greedy,
                                          config.prompt_new_tokens, progress, prompt_source)
        del teacher
    else:
        quality["perplexity_onnx"] = perplexity(decoder.logits, windows, progress, desc="ppl onnx")
    ppl_quantized = quantized_reference_perplexity(exported_from, windows, progress) if exported_from else None
    opening = evaluated_span(evaluation[0], config.latency_prompt_tokens)
    prompt = (window_prefix(tokenizer) + tokenizer(opening, add_special_tokens=False).input_ids)[: config.latency_prompt_tokens]
    log.info("host ONNX Runtime latency: %d-token prompt, %d new tokens", len(prompt), config.latency_new_tokens)
    latency = measure_decoder_latency(decoder, prompt, config.latency_new_tokens, repeats=config.latency_repeats)
    ppl_onnx = quality["perplexity_onnx"]
    return {
        "eval_tokens": int(windows.numel()),
        "eval_windows": int(windows.shape[0]),
        "window_prefix": prefix_tokens(tokenizer),
        **quality,
        "prompts": answers,
        "prompts_source": prompt_source,
        "perplexity_torch_quantized": ppl_quantized,
        "onnx_vs_torch_quantized_pct": None if ppl_quantized is None else 100.0 * abs(ppl_onnx / ppl_quantized - 1.0),
        "host_latency": latency,
        "model_size_bytes": path_size(onnx_dir / ONNX_FILE) + sum(path_size(p) for p in onnx_dir.glob("*.data")),
    }


def domain_quality(per_domain: dict[str, dict[str, Any]], unseen: list[str]) -> dict[str, Any]:
    """Metrics from :func:`compare_on_domains`: the worst domain's perplexity change, and fidelity on the mixed text."""
    mixed = per_domain.pop("mixed")
    worst = worst_domain(per_domain)
    for name, row in per_domain.items():
        row["seen"] = name not in unseen
    return {
        "perplexity_onnx": mixed["perplexity_model"],
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


def gate_checks(metrics: dict[str, Any], predictions: dict[str, Any], target: Target, must_measure: bool) -> list[Check]:
    """Compare measurements and predictions with the target's budgets."""
    budgets = target.budgets
    chosen = predictions["chosen"]
    mode = chosen["power_mode"]
    worst = metrics.get("worst_domain")
    where = (f"worst of {len(metrics['domains'])} evaluation domains: {worst}" + (" (unseen)" if worst in metrics.get("unseen_domains", [])
             else "")) if worst else "the evaluation text"
    checks = [
        upper_bound_check("perplexity_increase_pct", metrics.get("perplexity_increase_pct"), budgets.max_ppl_increase_pct,
                          "measured", "%", f"ONNX Runtime vs torch teacher, {where}"),
        lower_bound_check("top1_agreement", metrics.get("top1_agreement"), budgets.min_top1_agreement, "measured", "",
                          "next-token argmax equal to the teacher's, mixed evaluation text"),
        upper_bound_check("mean_kl", metrics.get("mean_kl"), budgets.max_mean_kl, "measured", "nats",
                          "mean KL(teacher || model) per token, mixed evaluation text"),
        upper_bound_check("decode_latency_ms", chosen["decode_latency_ms"], budgets.max_decode_latency_ms, "predicted", "ms",
                          f"{target.name} {mode}, {chosen['precision']}, context {budgets.context_length}"),
        upper_bound_check("ttft_ms", chosen["ttft_ms"], budgets.max_ttft_ms, "predicted", "ms",
                          f"{target.name} {mode}, prompt {budgets.prompt_length} tokens"),
        upper_bound_check("memory_gb", chosen["memory_gb"], budgets.max_memory_gb, "predicted", "GB",
                          f"weights + KV cache at {budgets.context_length} + runtime"),
    ]
    checks += prompt_checks(metrics.get("prompts"), budgets)
    if metrics.get("onnx_pattern_24_fraction") is not None:
        checks.append(upper_bound_check("sparsity_24_violations_pct", 100.0 * (1.0 - metrics["onnx_pattern_24_fraction"]), 0.0,
                                        "measured", "%", "share of exported linear weight 4-groups outside the 2:4 pattern"))
    if metrics.get("perplexity_torch_quantized") is not None:
        checks.append(upper_bound_check("onnx_vs_torch_quantized_pct", metrics["onnx_vs_torch_quantized_pct"],
                                        ONNX_VS_TORCH_QUANTIZED_LIMIT_PCT, "measured", "%",
                                        "|ppl ONNX Runtime / ppl torch simulated-quant - 1| of the quantized model"))
    return require_measured(checks) if must_measure else checks


def deployment_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """What the latency model reads of an exported model's artifact ``meta``: how its linears ship (the quantization's
    group size and KV cache, the share of linears left FP16)."""
    return {key: meta[key] for key in ("quantization", "float_linear_fraction") if key in meta}


def target_predictions(model: dict[str, Any] | Path, precision: str, target: Target, power_mode: str,
                       meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Latency-model predictions for every power mode and the chosen one, for a decoder (its ``config.json`` mapping, or
    the folder holding it) shipping as its artifact's ``meta`` says (the share of linears left FP16, the weight group
    size, the KV-cache precision), and the same model in FP16 for reference."""
    config = model if isinstance(model, dict) else json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    meta = meta or {}
    quantization = meta.get("quantization") or {}
    shape = replace(ModelShape.from_config(config), kv_cache_bytes=KV_CACHE_ELEMENT_BYTES[quantization.get("kv_cache", "fp16")])
    options = {"float_fraction": meta.get("float_linear_fraction", 0.0), "group_size": quantization.get("group_size") or 128}
    all_modes = predict_all_modes(target, shape, precision, **options)
    chosen = predict(target, shape, precision, power_mode, **options).to_json()
    lowest = lowest_power_mode_meeting_budget(all_modes, target.budgets.max_decode_latency_ms)
    return {"target": target.name, "modes": [p.to_json() for p in all_modes], "chosen": chosen,
            "lowest_power_mode_meeting_latency_budget": lowest.power_mode if lowest else None,
            "reference_fp16": predict(target, ModelShape.from_config(config), "fp16", power_mode).to_json()}
