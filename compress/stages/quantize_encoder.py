"""``quantize_encoder``: static W8A8 for an encoder, smoothing placed where it is exact (:mod:`compress.encoder_quantization`)."""

from __future__ import annotations

import logging

from compress.artifact import HF_MODEL, Artifact
from compress.config import Target
from compress.encoder_quantization import EncoderQuantizeConfig, quantize_encoder, save_encoder_quantization, summary
from compress.errors import UsageError
from compress.models import load_encoder, load_tokenizer
from compress.stages import StageDef, register
from compress.stages.prune_encoder_heads import calibration_batches

log = logging.getLogger(__name__)


def check_target(config: EncoderQuantizeConfig, target: Target) -> None:
    if "int8" not in target.gpu.precisions:
        raise UsageError(f"target {target.name} (sm_{target.gpu.sm}) does not support int8")


def run_quantize_encoder(source: Artifact, config: EncoderQuantizeConfig, ctx) -> Artifact:
    tokenizer = load_tokenizer(source.path)
    model = load_encoder(source.path)
    batches = calibration_batches(tokenizer, ctx, config.calib_sentences, config.batch_size, config.max_length)
    log.info("quantizing the encoder (W8A8, SmoothQuant) on %d calibration sentences", sum(len(b["input_ids"]) for b in batches))
    linears = quantize_encoder(model, batches, config)
    out = ctx.stage_dir / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_encoder_quantization(linears, config, out)
    metrics = {"method": config.method, "algorithm": "smoothquant (online for LayerNorm outputs, value rows for attention)",
               "weight_bits": 8, **summary(linears)}
    if metrics["float_input_linears"]:
        log.info("linears keeping float inputs (INT8 weights only): %s", ", ".join(metrics["float_input_linears"]))
    meta = {**{k: v for k, v in source.meta.items() if k != "metrics"}, "precision": "int8", "metrics": metrics}
    return Artifact(HF_MODEL, out, meta)


STAGE = register(StageDef(
    name="quantize_encoder",
    summary="static W8A8 for an encoder: SmoothQuant scales online or folded into the value rows, GELU float",
    input_kind=HF_MODEL,
    output_kind=HF_MODEL,
    config_cls=EncoderQuantizeConfig,
    run=run_quantize_encoder,
    check_target=check_target,
    model_kinds=("encoder",),
))
