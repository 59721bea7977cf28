"""``export_edgellm``: the quantized model as a TensorRT Edge-LLM deploy bundle, proven to hold the measured numbers.

Reads the quantized Hugging Face folder (after ``export_onnx``, the one the ONNX was exported from,
so the portable Q/DQ ONNX and the bundle carry the same integers and scales; or straight after
``quantize`` when the recipe leaves the ONNX out, ``export_onnx=off``): writes the unified
checkpoint, runs NVIDIA's ``tensorrt-edgellm-export`` on it, and checks the chain of custody (see
:mod:`compress.backends.edgellm.bundle`); the checkpoint is then removed (``keep_checkpoint=true``
keeps it). What Edge-LLM cannot express is refused when the plan is checked, before any work.
"""

from __future__ import annotations

import logging
from pathlib import Path

from compress.algorithms.formats import PRECISIONS
from compress.backends.edgellm import contracts
from compress.backends.edgellm.bundle import export_bundle
from compress.backends.edgellm.env import EDGELLM_VERSION
from compress.core.artifact import EDGELLM_BUNDLE, HF_MODEL, ONNX, Artifact, BundleMeta
from compress.core.config import StrictModel, Target
from compress.core.errors import UsageError
from compress.models.config_file import ModelConfig
from compress.pipeline.auto_precision import candidate_formats
from compress.pipeline.stage import DECODER, RunContext, StageDef, StageResult, StageVariant, register

log = logging.getLogger(__name__)


class ExportEdgeLLMConfig(StrictModel):
    """Options of the Edge-LLM export (the pinned exporter's defaults otherwise)."""

    # keep the unified checkpoint the bundle is exported from (the quantized numbers again)
    keep_checkpoint: bool = False


def check_plan(
    config: ExportEdgeLLMConfig, earlier: dict[str, StrictModel], target: Target, model_config: ModelConfig | None
) -> None:
    """Refuse, before any work, what the pinned Edge-LLM cannot express; each message names the limit and the way
    out."""
    if "sparsify" in earlier:
        raise UsageError(
            "export_edgellm: Edge-LLM builds engines without sparse weights, and 2:4 sparsity does not speed up "
            "bandwidth-bound decode; drop the sparsify stage (or end the recipe at export_onnx for a generic TensorRT "
            "build)"
        )
    if "prune_heads" in earlier and earlier["prune_heads"].mode != "uniform":
        raise UsageError(
            "export_edgellm: prune_heads.mode=per_layer keeps a different set of heads in each layer, which the "
            "portable ONNX takes; an Edge-LLM bundle is made from the uniform mode (the same heads kept in every "
            "layer, "
            f"{contracts.RULES['one-head-count']}): set prune_heads.mode=uniform, or end the recipe at export_onnx"
        )
    quantize = earlier.get("quantize")
    if quantize is not None:
        contracts.check_no_online_rotation(quantize)
    if model_config is None:
        return
    contracts.check_model_type(model_config)
    contracts.check_attention_shape(model_config)
    contracts.check_attention_window(model_config, target)
    if quantize is not None and quantize.is_mixed():  # a plan: every format it may choose
        for name in candidate_formats(quantize, target):
            contracts.check_precision_on_target(PRECISIONS[name].edgellm, target)
    else:
        contracts.check_precision_on_target(quantize.precision().edgellm if quantize is not None else "fp16", target)
    if quantize is not None:
        contracts.check_quantization(quantize, model_config)


def run_export_edgellm(source: Artifact, config: ExportEdgeLLMConfig, ctx: RunContext) -> StageResult:
    quantized = ctx.last_artifact(HF_MODEL)
    metrics = export_bundle(Path(quantized.path), ctx.stage_dir, config.keep_checkpoint)
    bundle = ctx.stage_dir / "bundle"
    meta = BundleMeta(precision=source.meta.precision, quant_algo=metrics["checkpoint"]["quant_algo"], metrics=metrics)
    custody = metrics["custody"]
    line = (
        f"Edge-LLM bundle {metrics['checkpoint']['quant_algo']}, {custody['tensors_compared']} tensors checked against "
        f"the quantized model, {custody['mismatches']} mismatches"
    )
    return StageResult(Artifact(EDGELLM_BUNDLE, bundle, meta), line)


STAGE = register(
    StageDef(
        name="export_edgellm",
        summary=f"unified quantized checkpoint -> TensorRT Edge-LLM {EDGELLM_VERSION} bundle, with a chain-of-custody "
            "check",
        input_kind=(
            ONNX,
            HF_MODEL,
        ),  # after the portable ONNX, or straight from the quantized checkpoint (export_onnx=off)
        output_kind=EDGELLM_BUNDLE,
        variants={DECODER: StageVariant(ExportEdgeLLMConfig, run_export_edgellm, check_plan=check_plan)},
    )
)
