"""``build_engine``: a TensorRT engine for the target, or a build plan to run on the device.

From a TensorRT Edge-LLM bundle the engine is built by Edge-LLM's own ``llm_build`` with the
batch, input length and KV capacity of the target's budgets (:mod:`compress.backends.edgellm.tools`).
From our Q/DQ ONNX (the generic path) the graph is first checked against the target (operators,
data types, opset, shapes) and built with TensorRT's Python API. Either way, when the tools and a
CUDA device are present the engine is built here; otherwise the stage is ``deferred``: the exact
commands go to ``build_on_device.sh``, to run on the device or through ``compress build-engine
RUN_DIR``. No engine is written without a real build.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt

from compress.backends.edgellm import tools as edgellm_tools
from compress.backends.tensorrt.builder import build_engine, local_build_support, timing_cache_path
from compress.backends.tensorrt.engine_graph import write_engine_input
from compress.backends.tensorrt.plan import parity_feeds, plan_for_export, write_plan
from compress.backends.tensorrt.static_check import check_parses_fp4
from compress.core.artifact import EDGELLM_BUNDLE, ENGINE, ONNX, Artifact, EngineMeta
from compress.core.config import StrictModel, Target
from compress.core.errors import MissingBackendError
from compress.core.files import atomic_write_json, atomic_write_text
from compress.core.rundir import BUILD_PLAN, DEVICE_SCRIPT, EDGELLM_BUILD_PLAN, ENGINE_MANIFEST, TRTEXEC_LOG
from compress.models.config_file import ModelConfig
from compress.pipeline.stage import DECODER, ENCODER, RunContext, StageDef, StageResult, StageVariant, register

log = logging.getLogger(__name__)

DEFERRED = "engine build deferred to the device ({reason}); run `compress build-engine RUN_DIR` there"


class BuildEngineConfig(StrictModel):
    """Options of the engine build."""

    max_batch: PositiveInt = 1
    # The settings below apply to the generic TensorRT path; Edge-LLM's builder chooses its own.
    workspace_fraction: float = Field(0.25, gt=0.0, le=1.0)
    optimization_level: int = Field(3, ge=0, le=5)
    version_compatible: bool = False
    build: Literal["auto", "defer"] = "auto"
    min_engine_graph_cosine: float = Field(0.99, gt=0.0, le=1.0)  # FP16 engine graph vs exported graph, per position


def run_edgellm_build(source: Artifact, config: BuildEngineConfig, ctx: RunContext) -> StageResult:
    out = ctx.stage_dir / "engine"
    out.mkdir()
    plan = edgellm_tools.edgellm_plan(ctx.target, Path(source.path), out, config.max_batch)
    atomic_write_json(out / EDGELLM_BUILD_PLAN, plan)
    profile = edgellm_tools.EngineProfile(**plan["profile"])
    atomic_write_text(
        out / DEVICE_SCRIPT, edgellm_tools.device_script(ctx.target, profile, plan["onnx_dir"], plan["engine_dir"])
    )
    (out / DEVICE_SCRIPT).chmod(0o755)
    meta = EngineMeta(runtime="edgellm", bundle=str(source.path), profile=plan["profile"],
                      precision=source.meta.precision)
    line = (f"Edge-LLM engine profile: batch {profile.max_batch_size}, input {profile.max_input_len}, "
            f"KV capacity {profile.max_kv_cache_capacity}")
    try:
        if config.build == "defer":
            raise MissingBackendError("deferred by configuration")
        built = edgellm_tools.build_edgellm_engine(out, plan)
    except MissingBackendError as exc:
        log.info("Edge-LLM engine build deferred: %s; commands written to %s", exc, DEVICE_SCRIPT)
        meta = meta.model_copy(update={
            "deferred": True,
            "metrics": {"status": "deferred", "reason": str(exc), "runtime": "edgellm", **plan["profile"]},
        })
        later = (f"engine/{plan['engine_dir']}/", f"engine/{ENGINE_MANIFEST}", "engine/llm_build.log")
        return StageResult(Artifact(ENGINE, out, meta), f"{line}; {DEFERRED.format(reason=exc)}", device_files=later)
    meta = meta.model_copy(update={
        "engine_file": plan["engine_dir"],
        "metrics": {"status": "built", "runtime": "edgellm", **plan["profile"], **built},
    })
    return StageResult(Artifact(ENGINE, out, meta), line)


def run_build_engine(source: Artifact, config: BuildEngineConfig, ctx: RunContext) -> StageResult:
    if source.kind == EDGELLM_BUNDLE:
        return run_edgellm_build(source, config, ctx)
    target = ctx.target
    onnx_dir = Path(source.path)
    plan, facts = plan_for_export(
        onnx_dir,
        source.meta.model_kind,
        target,
        config.max_batch,
        sparse_24=source.meta.sparse_24,
        workspace_fraction=config.workspace_fraction,
        optimization_level=config.optimization_level,
        version_compatible=config.version_compatible,
    )
    out = ctx.stage_dir / "engine"
    out.mkdir()
    engine_input = write_engine_input(
        onnx_dir / plan.onnx_file,
        out / plan.engine_onnx_file,
        parity_feeds(onnx_dir, plan.model_kind),
        config.min_engine_graph_cosine,
    )
    write_plan(out, plan)
    support = local_build_support(target.gpu.sm)
    meta = source.meta.carried_as(EngineMeta, onnx=str(source.path), trtexec=plan.trtexec_command(),
                                  static_check="passed", **engine_input)
    if config.build == "defer" or not support.can_build:
        reason = "deferred by configuration" if config.build == "defer" else support.reason
        log.info("engine build deferred: %s; plan written to %s", reason, BUILD_PLAN)
        meta = meta.model_copy(update={
            "deferred": True,
            "metrics": {
                "status": "deferred",
                "reason": reason,
                "trtexec": plan.trtexec_command(),
                "graph_nodes": facts.num_nodes,
                "qdq": facts.has_qdq,
                "int4": facts.has_int4,
                "profiles": [p.name for p in plan.profiles],
                **engine_input,
            },
        })
        later = tuple(f"engine/{name}" for name in (plan.engine_file, ENGINE_MANIFEST, TRTEXEC_LOG))
        return StageResult(Artifact(ENGINE, out, meta), DEFERRED.format(reason=reason), device_files=later)
    cache = timing_cache_path(target.name, support.tensorrt_version or "unknown")
    cache.parent.mkdir(parents=True, exist_ok=True)
    built = build_engine(plan, out / plan.engine_onnx_file, out / plan.engine_file, cache)
    meta = meta.model_copy(update={
        "engine_file": plan.engine_file, "device": support.device, "tensorrt_version": built["tensorrt_version"],
        "metrics": {"status": "built", "device": support.device, **built, **engine_input},
    })
    return StageResult(
        Artifact(ENGINE, out, meta), f"TensorRT {built['tensorrt_version']} engine built on {support.device}"
    )


def check_plan(config: BuildEngineConfig, earlier: dict, target: Target, model_config: ModelConfig | None) -> None:
    """Refuse, before any work, a generic TensorRT build of a graph the target's ONNX parser cannot read."""
    quantize = earlier.get("quantize")
    nvfp4 = quantize is not None and any(config.binds_global_scale() for config in quantize.uniform_configs())
    if nvfp4 and "export_edgellm" not in earlier:
        check_parses_fp4(target)


_VARIANT = StageVariant(BuildEngineConfig, run_build_engine, check_plan=check_plan)
STAGE = register(
    StageDef(
        name="build_engine",
        summary="build the TensorRT engine (Edge-LLM's llm_build for a bundle, TensorRT for our ONNX), or defer with "
            "the commands",
        input_kind=(EDGELLM_BUNDLE, ONNX),
        output_kind=ENGINE,
        variants={DECODER: _VARIANT, ENCODER: _VARIANT},
        uses_target=True,
    )
)
