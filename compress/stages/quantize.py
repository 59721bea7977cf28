"""``quantize``: calibrated INT8 (SmoothQuant W8A8), INT4 weight-only (AWQ / GPTQ) or RTN.

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


def check_target(config: QuantizeConfig, target: Target) -> None:
    """Refuse a precision the target's GPU cannot run."""
    precision = config.precision()
    if precision not in target.gpu.precisions:
        raise UsageError(f"target {target.name} (sm_{target.gpu.sm}) does not support {precision}")


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
    bits, acts, group = config.scheme()
    meta = {
        **{k: v for k, v in source.meta.items() if k != "metrics"},
        "precision": config.precision(),
        "float_linear_fraction": float_linear_fraction(model.config, config.float_linears),
        "quantization": {"method": config.method, "weight_bits": bits, "group_size": group,
                         "activations": "int8" if acts else "float"},
        "metrics": {
            "method": config.method,
            "algorithm": config.algorithm if config.method == "int4" else ("smoothquant+" + config.weight_algorithm
                                                                            if config.method == "int8" else "rtn"),
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
        },
    }
    return Artifact(HF_MODEL, out, meta)


STAGE = register(StageDef(
    name="quantize",
    summary="calibrated INT8 SmoothQuant W8A8, INT4 AWQ/GPTQ weight-only, or RTN",
    input_kind=HF_MODEL,
    output_kind=HF_MODEL,
    config_cls=QuantizeConfig,
    run=run_quantize,
    check_target=check_target,
))
