"""``build_engine``: a TensorRT engine for the target, or a build plan to run on the device.

Before anything is built the ONNX graph is checked against the target (operators, data types,
opset, shapes). When ``tensorrt`` and a CUDA device of the target's compute capability are
present, the engine is built here; otherwise the stage is ``deferred``: the plan, the ``trtexec``
command and ``compress build-engine RUN_DIR`` are written for the device. No engine is written without a real build.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt

from compress.artifact import ENGINE, ONNX, Artifact
from compress.config import StrictModel
from compress.engine.builder import build_engine, local_build_support
from compress.engine.plan import BuildPlan, make_plan
from compress.engine.static_check import check_onnx_file
from compress.fsutil import atomic_write_json, atomic_write_text
from compress.models import cache_root
from compress.runtime.onnx_decoder import ONNX_FILE, DecoderLayout
from compress.stages import StageDef, register

log = logging.getLogger(__name__)

PLAN_FILE = "build_plan.json"
SCRIPT_FILE = "build_on_device.sh"


class BuildEngineConfig(StrictModel):
    """Options of the engine build."""

    max_batch: PositiveInt = 1
    workspace_fraction: float = Field(0.25, gt=0.0, le=1.0)
    optimization_level: int = Field(3, ge=0, le=5)
    version_compatible: bool = False
    build: Literal["auto", "defer"] = "auto"


def timing_cache_path(target: str, tensorrt: str) -> Path:
    """The timing cache kept per target and TensorRT version, shared by runs."""
    return cache_root() / "timing" / f"{target}-trt{tensorrt}.cache"


def device_script(plan: BuildPlan) -> str:
    """Shell script that rebuilds the engine on the device, with compress or with trtexec alone."""
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Build the TensorRT engine for {plan.target} (sm_{plan.gpu_sm}, TensorRT {plan.tensorrt_version}) on the device.",
        "# Either, from the run directory's parent with compress installed:",
        '#   compress build-engine "$RUN_DIR"',
        "# or with trtexec alone, from the folder holding model.onnx:",
        "set -euo pipefail",
        plan.trtexec_command(),
        "",
    ])


def write_plan(folder: Path, plan: BuildPlan) -> None:
    atomic_write_json(folder / PLAN_FILE, plan.to_json())
    atomic_write_text(folder / SCRIPT_FILE, device_script(plan))
    (folder / SCRIPT_FILE).chmod(0o755)


def run_build_engine(source: Artifact, config: BuildEngineConfig, ctx) -> Artifact:
    onnx_path = Path(source.path) / ONNX_FILE
    target = ctx.target
    facts = check_onnx_file(onnx_path, target, config.max_batch)
    layout = DecoderLayout.load(source.path)
    plan = make_plan(target, layout, has_qdq=facts.has_qdq, sparse_24=bool(source.meta.get("sparse_24", False)),
                     max_batch=config.max_batch, workspace_fraction=config.workspace_fraction,
                     optimization_level=config.optimization_level, version_compatible=config.version_compatible)
    out = ctx.stage_dir / "engine"
    out.mkdir()
    write_plan(out, plan)
    support = local_build_support(target.gpu.sm)
    meta = {**{k: v for k, v in source.meta.items() if k != "metrics"}, "onnx": str(source.path),
            "trtexec": plan.trtexec_command(), "static_check": "passed"}
    if config.build == "defer" or not support.can_build:
        reason = "deferred by configuration" if config.build == "defer" else support.reason
        log.info("engine build deferred: %s; plan written to %s", reason, PLAN_FILE)
        meta.update(deferred=True, metrics={"status": "deferred", "reason": reason, "trtexec": plan.trtexec_command(),
                                            "graph_nodes": facts.num_nodes, "qdq": facts.has_qdq, "int4": facts.has_int4})
        return Artifact(ENGINE, out, meta)
    cache = timing_cache_path(target.name, support.tensorrt_version or "unknown")
    cache.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(onnx_path, out / ONNX_FILE)
    built = build_engine(plan, out / ONNX_FILE, out / plan.engine_file, cache)
    (out / ONNX_FILE).unlink()
    meta.update(engine_file=plan.engine_file, device=support.device, tensorrt_version=built["tensorrt_version"],
                metrics={"status": "built", "device": support.device, **built})
    return Artifact(ENGINE, out, meta)


STAGE = register(StageDef(
    name="build_engine",
    summary="check the ONNX against the target; build a TensorRT engine, or defer with a build plan",
    input_kind=ONNX,
    output_kind=ENGINE,
    config_cls=BuildEngineConfig,
    run=run_build_engine,
    uses_target=True,
))
