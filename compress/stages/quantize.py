"""``quantize``: calibrated W8A8 (INT8 or FP8, SmoothQuant), INT4 weight-only (AWQ / GPTQ), NVFP4 or RTN.

The output is a Hugging Face folder whose weights lie on their quantization grid (dequantized
fp32), with ``quantization.json`` and ``quant_scales.safetensors`` beside it; ``export_onnx``
turns that into real Q/DQ nodes.
"""

from __future__ import annotations

import logging

from compress.algorithms.calibration import decoder_blocks
from compress.artifact import HF_MODEL, Artifact
from compress.config import Target
from compress.data import calibration_windows
from compress.errors import UsageError
from compress.families import linear_shapes
from compress.models import load_causal_lm, load_tokenizer, save_model_folder
from compress.quantization import QuantizeConfig, quantize_model, save_quantization
from compress.stages import StageDef, register

log = logging.getLogger(__name__)


# The GPU number format a deployment precision needs (NVFP4 is FP4 E2M1 values, weight-only or not).
GPU_FORMAT = {"int8": "int8", "int4": "int4", "fp8": "fp8", "nvfp4": "fp4", "nvfp4_a16": "fp4"}


def check_target(config: QuantizeConfig, target: Target) -> None:
    """Refuse a precision the target's GPU cannot run, naming the target and the precisions it has."""
    precision = config.precision()
    if config.kv_cache == "fp8" and "fp8" not in target.gpu.precisions:
        raise UsageError(f"quantize.kv_cache=fp8: target {target.name} ({target.gpu.arch} sm_{target.gpu.sm}) has no FP8; its precisions "
                         f"are {', '.join(target.gpu.precisions)} (an FP8 KV cache needs FP8, such as target=jetson-agx-thor)")
    if GPU_FORMAT[precision] not in target.gpu.precisions:
        hint = " (FP8 and NVFP4 need a Blackwell GPU, such as target=jetson-agx-thor)" if precision in ("fp8", "nvfp4", "nvfp4_a16") else ""
        raise UsageError(f"quantize.method={config.method}: target {target.name} ({target.gpu.arch} sm_{target.gpu.sm}) has no "
                         f"{precision} tensor cores; its precisions are {', '.join(target.gpu.precisions)}{hint}")


def float_linear_fraction(model_config, float_linears: list[str]) -> float:
    """Share of the decoder linear parameters the quantize stage leaves float (the latency model reads them at FP16)."""
    shapes = linear_shapes(model_config.to_dict())
    total = sum(out * inp for out, inp in shapes.values())
    return round(sum(shapes[name][0] * shapes[name][1] for name in float_linears) / total, 6)


def run_quantize(source: Artifact, config: QuantizeConfig, ctx) -> Artifact:
    tokenizer = load_tokenizer(source.path)
    windows = calibration_windows(tokenizer, ctx.plan.calibration, config.calib_window, config.calib_windows,
                                  min_tokens=config.min_calib_tokens)
    if windows.numel() < config.min_calib_tokens:
        raise UsageError(f"too little calibration text: {windows.numel()} tokens, need at least {config.min_calib_tokens}")
    if config.hadamard_block and source.meta.get("sparse_24"):
        log.warning("hadamard_block ignored: rotating down_proj inputs would break the model's 2:4 sparsity")
        config = config.model_copy(update={"hadamard_block": 0})
    model = load_causal_lm(source.path)
    log.info("quantizing (%s) on %d calibration tokens, block by block", config.method, windows.numel())
    result = quantize_model(model, windows, config, progress=ctx.progress)
    out = ctx.stage_dir / "model"
    save_model_folder(model, tokenizer, source.path, out)
    save_quantization(result, out)
    outliers = result.outliers()
    if outliers:
        worst = sorted(outliers, key=lambda o: o["sqnr_db"])[:5]
        log.warning("%d linears with outlying quantization error, worst: %s", len(outliers),
                    ", ".join(f"{o['name']} ({o['sqnr_db']} dB)" for o in worst))
    float_inputs = result.float_input_linears()
    if float_inputs:
        log.info("linears keeping float inputs (INT8 weights only): %s", ", ".join(float_inputs))
    rotated = result.rotated_linears()
    if config.hadamard_block:
        blocks = sorted({q.rotation for q in result.linears.values() if q.rotation})
        log.info("%d of %d down_proj inputs quantized after a Hadamard rotation (block %s)", len(rotated),
                 len(decoder_blocks(model)), "/".join(map(str, blocks)) or "-")
    bits, _, group = config.scheme()
    activation = config.activation_format()
    meta = {
        **{k: v for k, v in source.meta.items() if k != "metrics"},
        "precision": config.precision(),
        "float_linear_fraction": float_linear_fraction(model.config, config.float_linears),
        "quantization": {"method": config.method, "format": config.weight_format(), "weight_bits": bits, "group_size": group,
                         "activations": activation.name if activation else "float", "kv_cache": config.kv_cache},
        "metrics": {
            "method": config.method,
            "scheme": describe_scheme(config),
            "algorithm": _algorithm(config),
            "weight_bits": bits,
            "group_size": group,
            "calibration_tokens": result.calibration_tokens,
            "calibration_seconds": round(result.seconds, 2),
            "quantized_linears": len(result.linears),
            "min_sqnr_db": round(min(q.sqnr_db for q in result.linears.values()), 2),
            "median_sqnr_db": round(sorted(q.sqnr_db for q in result.linears.values())[len(result.linears) // 2], 2),
            "layer_sqnr_db": result.layer_errors(),
            "outlier_layers": outliers,
            "float_input_linears": float_inputs,
            "rotated_linears": rotated,
            "kv_cache_scales": {str(i): list(scales) for i, scales in result.kv_scales.items()} or None,
        },
    }
    return Artifact(HF_MODEL, out, meta)


def describe_scheme(config: QuantizeConfig) -> str:
    """The number formats of weights, activations and KV cache, in words a report can show."""
    bits, acts, group = config.scheme()
    if config.method == "fp8":
        weights = f"FP8 E4M3 weights (one scale per {'output channel' if config.fp8_weight_scale == 'channel' else 'tensor'})"
    elif config.method == "nvfp4":
        weights = "NVFP4 weights (E2M1 in blocks of 16, FP8 block scales, FP32 per-tensor scale)"
    else:
        weights = f"INT{bits} weights ({f'group {group}' if group else 'one scale per output channel'})"
    activation = config.activation_format()
    names = {"int8": "static INT8 activations", "fp8": "static FP8 activations",
             "nvfp4": "NVFP4 activations (dynamic blocks of 16, calibrated global scale)"}
    inputs = names[activation.name] if activation else "FP16 activations"
    return f"{weights}, {inputs}" + (", FP8 KV cache" if config.kv_cache == "fp8" else "")


def _algorithm(config: QuantizeConfig) -> str:
    """How the weights were chosen, in words a report can show."""
    if config.method in ("int4", "nvfp4"):
        return config.algorithm + ("+global-scale-search" if config.method == "nvfp4" and config.nvfp4_scale_search else "")
    if config.method in ("int8", "fp8"):
        return "smoothquant+" + config.weight_algorithm
    return "rtn"


STAGE = register(StageDef(
    name="quantize",
    summary="calibrated W8A8 (INT8 or FP8, SmoothQuant), INT4 AWQ/GPTQ weight-only, NVFP4 (W4A16 or W4A4), or RTN",
    input_kind=HF_MODEL,
    output_kind=HF_MODEL,
    config_cls=QuantizeConfig,
    run=run_quantize,
    check_target=check_target,
))
