"""``quantize``: calibrated W8A8 (INT8 or FP8, SmoothQuant), INT4 weight-only (AWQ / GPTQ), NVFP4 or RTN for a decoder;
static W8A8 with smoothing placed where it is exact for an encoder (``quantize_encoder``).

The output is the quantized checkpoint: a Hugging Face folder in the model's own dtype whose quantized
linears are stored as grid values and scales (:mod:`compress.transforms.quantize.saved`), never as a
float copy; ``export_onnx`` turns it into real Q/DQ nodes, ``export_edgellm`` into Edge-LLM's checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from compress.core.artifact import HF_MODEL, Artifact, DeployedQuantization
from compress.core.config import Target
from compress.core.devices import Compute
from compress.core.errors import UsageError
from compress.core.files import read_json
from compress.core.text import calibration_batches, calibration_windows
from compress.models.config_file import ModelConfig
from compress.models.families import linear_parameter_fraction, linear_shapes
from compress.models.loading import load_encoder, load_tokenizer, save_side_files
from compress.pipeline.auto_precision import SearchRun, candidate_formats, run_search
from compress.pipeline.stage import DECODER, ENCODER, RunContext, StageDef, StageResult, StageVariant, register
from compress.report.figures import LAYER_SQNR, PRECISION_SEARCH, QUANTIZATION
from compress.transforms.quantize.config import METHODS, QUANTIZE_CONFIG, AutoConfig, QuantizeConfig
from compress.transforms.quantize.decoder import check_group_size, quantize_folder
from compress.transforms.quantize.encoder import (
    EncoderQuantizeConfig,
    quantize_encoder,
    save_encoder_quantization,
    summary,
)
from compress.transforms.quantize.mixed import FLOAT
from compress.transforms.quantize.saved import MIXED, QuantResult

log = logging.getLogger(__name__)


def check_target(config: QuantizeConfig, target: Target) -> None:
    """Refuse a precision the target's GPU cannot run, naming the target and the precisions it has."""
    if config.is_mixed():
        for candidate in config.uniform_configs():
            check_target(candidate, target)
        if config.kv_cache == "fp8":
            raise UsageError("quantize.kv_cache=fp8 with method auto: a mixed-precision plan keeps the KV cache FP16")
        if not candidate_formats(config, target):
            raise UsageError(f"quantize.method=auto: target {target.name} deploys no quantized format a plan could use")
        return
    precision = config.precision()
    if config.kv_cache == "fp8" and "fp8" not in target.gpu.precisions:
        raise UsageError(
            f"quantize.kv_cache=fp8: target {target.name} ({target.gpu.arch} sm_{target.gpu.sm}) has no FP8; its "
            "precisions "
            f"are {', '.join(target.gpu.precisions)} (an FP8 KV cache needs FP8, such as target=jetson-agx-thor)"
        )
    if precision.gpu_format not in target.gpu.precisions:
        hint = (
            " (FP8 and NVFP4 need a Blackwell GPU, such as target=jetson-agx-thor)"
            if precision.gpu_format in ("fp8", "fp4")
            else ""
        )
        raise UsageError(
            f"quantize.method={config.method}: target {target.name} ({target.gpu.arch} sm_{target.gpu.sm}) has no "
            f"{precision.name} tensor cores; its precisions are {', '.join(target.gpu.precisions)}{hint}"
        )


def check_plan(config: QuantizeConfig, earlier: dict, target: Target, model_config: ModelConfig | None) -> None:
    """Refuse, before any work, a group size that does not divide a quantized linear's input."""
    if model_config is not None and not config.is_mixed():  # a plan gives each group only the formats its widths take
        check_group_size(config, linear_shapes(model_config))


def run_quantize(source: Artifact, config: QuantizeConfig, ctx: RunContext) -> StageResult:
    if config.is_mixed():
        return run_auto(source, config, ctx)
    tokenizer = load_tokenizer(source.path)
    windows = calibration_windows(tokenizer, ctx.calibration, config.calib_window, config.calib_windows,
                                  min_tokens=config.min_calib_tokens)
    if windows.numel() < config.min_calib_tokens:
        raise UsageError(
            f"too little calibration text: {windows.numel()} tokens, need at least {config.min_calib_tokens}"
        )
    if config.rotation_limit() and source.meta.sparse_24:
        log.warning("hadamard_block ignored: rotating down_proj inputs would break the model's 2:4 sparsity")
        config = config.model_copy(update={"hadamard_block": 0})
    log.info("quantizing (%s) on %d calibration tokens, block by block", config.method, windows.numel())
    out = ctx.stage_dir / "model"
    result = quantize_folder(source.path, out, windows, config, Compute(ctx.device, ctx.progress),
                             trust_remote_code=ctx.trust_remote_code)
    save_side_files(tokenizer, source.path, out)
    model_config = read_json(out / "config.json")
    _log_findings(result, config, model_config["num_hidden_layers"])
    bits, _, group = config.scheme()
    activation = config.activation_format()
    precision = config.precision()
    metrics = {
        **_result_metrics(config, result),
        "weight_bits": bits,
        "group_size": group,
        "rotated_linears": result.rotated_linears(),
        "kv_cache_scales": {str(i): list(scales) for i, scales in result.kv_scales.items()} or None,
    }
    quantization = DeployedQuantization(method=config.method, format=config.weight_format(), weight_bits=bits,
                                        group_size=group, activations=activation.name if activation else "float",
                                        kv_cache=config.kv_cache)
    meta = source.meta.carried(
        precision=precision.name,
        float_linear_fraction=linear_parameter_fraction(model_config, config.float_linears),
        quantization=quantization,
        metrics=metrics,
    )
    parts = [f"{metrics['scheme']} ({metrics['algorithm']}), median SQNR {metrics['median_sqnr_db']} dB, "
             f"{len(metrics['outlier_layers'])} outlier linears"]
    if metrics["rotated_linears"]:
        parts.append(f"{len(metrics['rotated_linears'])} inputs Hadamard-rotated")
    if metrics["float_input_linears"]:
        parts.append(f"{len(metrics['float_input_linears'])} linears with float inputs")
    figures = {LAYER_SQNR: {"method": config.method, "linears": metrics["layer_sqnr_db"]},
               QUANTIZATION: f"{config.method} ({metrics['algorithm']}), {metrics['scheme']}; calibrated on "
                             f"{result.calibration_tokens:,} tokens"}
    return StageResult(Artifact(HF_MODEL, out, meta), "; ".join(parts), figures)


def run_auto(source: Artifact, config: AutoConfig, ctx: RunContext) -> StageResult:
    """``method: auto``: the fastest mixed-precision plan the target's budgets allow
    (:mod:`compress.pipeline.auto_precision`)."""
    tokenizer = load_tokenizer(source.path)
    windows = calibration_windows(tokenizer, ctx.calibration, config.calib_window, config.calib_windows,
                                  min_tokens=config.min_calib_tokens)
    out = ctx.stage_dir / "model"
    teacher = ctx.first_artifact(HF_MODEL)
    run = SearchRun(Path(source.path), Path(teacher.path if teacher else source.path), out, ctx.stage_dir / "search",
                    ctx.device, ctx.progress, ctx.trust_remote_code)
    result, found = run_search(run, windows, ctx.calibration, tokenizer, config, ctx.target, ctx.power_mode)
    save_side_files(tokenizer, source.path, out)
    counts = result.plan.counts()
    metrics = {
        **_result_metrics(config, result),
        "formats_chosen": counts,
        "mix": found["mix"],
        "search": found,
        "rotated_linears": [],
        "kv_cache_scales": None,
    }
    quantization = DeployedQuantization(method=config.method, format=MIXED, group_size=128, activations="per linear",
                                        mix=found["mix"], lm_head=found["lm_head"])
    meta = source.meta.carried(precision=MIXED, float_linear_fraction=found["mix"].get(FLOAT, 0.0),
                               quantization=quantization, metrics=metrics)
    chosen = next(c for c in found["candidates"] if c["chosen"])
    line = (f"a format per group: {', '.join(f'{count} {name}' for name, count in counts.items())}; predicted "
            f"{chosen['predicted_tokens_per_s']:.1f} tok/s; held-out worst domain {chosen['measured']['worst_domain']} "
            f"{chosen['measured']['worst_increase_pct']:+.2f}% after {len(found['candidates'])} measured plans")
    figures = {
        LAYER_SQNR: {"method": config.method, "linears": metrics["layer_sqnr_db"]},
        PRECISION_SEARCH: found,
        QUANTIZATION: "auto (mixed precision: "
            f"{', '.join(f'{count} groups {name}' for name, count in counts.items())}); "
        f"calibrated on {result.calibration_tokens:,} tokens",
    }
    log.info("auto precision: %s", line)
    return StageResult(Artifact(HF_MODEL, out, meta), line, figures)


def _result_metrics(config: QuantizeConfig, result: QuantResult) -> dict[str, Any]:
    """The figures every quantization reports: method and algorithm, calibration, the linears' SQNR, and which of the
    weight methods that are switched on (learned rounding, a rotation folded into the weights) ran."""
    sqnr = sorted(q.sqnr_db for q in result.linears.values())
    return {
        "method": config.method,
        "scheme": config.describe(),
        "algorithm": _algorithm(config),
        "calibration_tokens": result.calibration_tokens,
        "calibration_seconds": round(result.seconds, 2),
        "quantized_linears": len(result.linears),
        "min_sqnr_db": round(sqnr[0], 2) if sqnr else None,
        "median_sqnr_db": round(sqnr[len(sqnr) // 2], 2) if sqnr else None,
        "layer_sqnr_db": result.layer_errors(),
        "outlier_layers": result.outliers(),
        "float_input_linears": result.float_input_linears(),
        "learned_rounding": result.tuning_summary(),
        "residual_rotation": {"kind": config.rotate, "lm_head_untied": result.untied_head}
        if config.rotate != "none" else None,
    }


def _algorithm(config: QuantizeConfig) -> str:
    """How the weights were chosen: the format's method, and what ran before and after it."""
    name = config.algorithm_name()
    if config.rotate != "none":
        name = f"{config.rotate} rotation + {name}"
    if config.tuning() is not None:
        name += f" + learned rounding ({config.tune_iters} iterations)"
    return name


def _log_findings(result, config: QuantizeConfig, layers: int) -> None:
    outliers = result.outliers()
    if outliers:
        worst = sorted(outliers, key=lambda o: o["sqnr_db"])[:5]
        log.warning("%d linears with outlying quantization error, worst: %s", len(outliers),
                    ", ".join(f"{o['name']} ({o['sqnr_db']} dB)" for o in worst))
    float_inputs = result.float_input_linears()
    if float_inputs:
        log.info("linears keeping float inputs (INT8 weights only): %s", ", ".join(float_inputs))
    if config.rotation_limit():
        blocks = sorted({q.rotation for q in result.linears.values() if q.rotation})
        log.info(
            "%d of %d down_proj inputs quantized after a Hadamard rotation (block %s)",
            len(result.rotated_linears()),
            layers,
            "/".join(map(str, blocks)) or "-",
        )


def check_encoder_target(config: EncoderQuantizeConfig, target: Target) -> None:
    if "int8" not in target.gpu.precisions:
        raise UsageError(f"target {target.name} (sm_{target.gpu.sm}) does not support int8")


def run_quantize_encoder(source: Artifact, config: EncoderQuantizeConfig, ctx: RunContext) -> StageResult:
    tokenizer = load_tokenizer(source.path)
    model = load_encoder(source.path)
    batches = calibration_batches(
        tokenizer, ctx.calibration, config.calib_sentences, config.batch_size, config.max_length
    )
    log.info(
        "quantizing the encoder (W8A8, SmoothQuant) on %d calibration sentences",
        sum(len(b["input_ids"]) for b in batches),
    )
    linears = quantize_encoder(model, batches, config)
    out = ctx.stage_dir / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_encoder_quantization(linears, config, out)
    metrics = {
        "method": config.method,
        "algorithm": "smoothquant (online for LayerNorm outputs, value rows for attention)",
        "weight_bits": 8,
        **summary(linears),
    }
    if metrics["float_input_linears"]:
        log.info("linears keeping float inputs (INT8 weights only): %s", ", ".join(metrics["float_input_linears"]))
    meta = source.meta.carried(precision="int8", metrics=metrics)
    line = (
        f"INT8 weights and static INT8 activations ({metrics['algorithm']}), median SQNR {metrics['median_sqnr_db']} "
        f"dB, {len(metrics['float_input_linears'])} linears with float inputs"
    )
    return StageResult(Artifact(HF_MODEL, out, meta), line,
                       {QUANTIZATION: f"{config.method} ({metrics['algorithm']}), 8-bit weights, per output channel"})


STAGE = register(StageDef(
    name="quantize",
    summary="calibrated W8A8 (INT8 or FP8, SmoothQuant), INT4 AWQ/GPTQ weight-only, NVFP4 (W4A16 or W4A4), or RTN; "
            "static W8A8 for an encoder",
    input_kind=HF_MODEL,
    output_kind=HF_MODEL,
    variants={DECODER: StageVariant(QUANTIZE_CONFIG, run_quantize, check_target=check_target, check_plan=check_plan,
                                    choice_key="method", choices=METHODS),
              ENCODER: StageVariant(EncoderQuantizeConfig, run_quantize_encoder, check_target=check_encoder_target)},
), aliases={"quantize_encoder": ENCODER})
