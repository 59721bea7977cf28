"""``build_engine``: a TensorRT engine for the target, or a build plan to run on the device.

From a TensorRT Edge-LLM bundle the engine is built by Edge-LLM's own ``llm_build`` with the
batch, input length and KV capacity of the target's budgets (:mod:`compress.deploy.edgellm_device`).
From our Q/DQ ONNX (the generic path) the graph is first checked against the target (operators,
data types, opset, shapes) and built with TensorRT's Python API. Either way, when the tools and a
CUDA device are present the engine is built here; otherwise the stage is ``deferred``: the exact
commands go to ``build_on_device.sh``, to run on the device or through ``compress build-engine
RUN_DIR``. No engine is written without a real build.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt

from compress.artifact import EDGELLM_BUNDLE, ENGINE, ONNX, Artifact
from compress.config import StrictModel, Target
from compress.deploy import edgellm_device
from compress.engine.builder import build_engine, local_build_support
from compress.engine.plan import BuildPlan, make_plan
from compress.engine.static_check import check_onnx_file
from compress.errors import MissingBackendError, StageError
from compress.fsutil import atomic_write_json, atomic_write_text
from compress.models import cache_root
from compress.runtime.onnx_decoder import ONNX_FILE, DecoderLayout
from compress.stages import StageDef, register

log = logging.getLogger(__name__)

PLAN_FILE = "build_plan.json"
EDGELLM_PLAN_FILE = "edgellm_build.json"
SCRIPT_FILE = "build_on_device.sh"


class BuildEngineConfig(StrictModel):
    """Options of the engine build."""

    max_batch: PositiveInt = 1
    # The settings below apply to the generic TensorRT path; Edge-LLM's builder chooses its own.
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


def edgellm_plan(target: Target, bundle: Path, folder: Path, max_batch: int) -> dict:
    """What ``llm_build`` is run with for this bundle and target, paths relative to the engine folder."""
    profile = edgellm_device.engine_profile(target, max_batch)
    return {"runtime": "edgellm", "edgellm_version": target.edgellm.version, "target": target.name,
            "stack": target.edgellm.model_dump(), "profile": profile.to_json(),
            "onnx_dir": os.path.relpath(bundle / "llm", folder), "engine_dir": edgellm_device.ENGINE_SUBDIR}


def build_edgellm_engine(folder: Path, plan: dict) -> dict:
    """Run ``llm_build`` for a written plan (raises "not run: ..." without a CUDA device or the tool)."""
    tool = edgellm_device.require_device_tool(edgellm_device.BUILD_TOOL)
    profile = edgellm_device.EngineProfile(**plan["profile"])
    command = edgellm_device.build_command(tool, folder / plan["onnx_dir"], folder / plan["engine_dir"], profile)
    log.info("building the Edge-LLM engine: %s", " ".join(command))
    log_file = folder / "llm_build.log"
    with log_file.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise StageError(f"llm_build failed (exit {code}); see {log_file}")
    engines = sorted((folder / plan["engine_dir"]).rglob("*.engine"))
    if not engines:
        raise StageError(f"llm_build exited 0 but wrote no .engine file under {folder / plan['engine_dir']}")
    return {"engine_files": [str(p.relative_to(folder)) for p in engines], "engine_bytes": sum(p.stat().st_size for p in engines),
            "llm_build": str(tool)}


def run_edgellm_build(source: Artifact, config: BuildEngineConfig, ctx) -> Artifact:
    out = ctx.stage_dir / "engine"
    out.mkdir()
    plan = edgellm_plan(ctx.target, Path(source.path), out, config.max_batch)
    atomic_write_json(out / EDGELLM_PLAN_FILE, plan)
    atomic_write_text(out / SCRIPT_FILE, edgellm_device.device_script(ctx.target, edgellm_device.EngineProfile(**plan["profile"]),
                                                                      plan["onnx_dir"], plan["engine_dir"]))
    (out / SCRIPT_FILE).chmod(0o755)
    meta = {"runtime": "edgellm", "bundle": str(source.path), "profile": plan["profile"], "precision": source.meta.get("precision")}
    try:
        if config.build == "defer":
            raise MissingBackendError("deferred by configuration")
        built = build_edgellm_engine(out, plan)
    except MissingBackendError as exc:
        log.info("Edge-LLM engine build deferred: %s; commands written to %s", exc, SCRIPT_FILE)
        meta.update(deferred=True, metrics={"status": "deferred", "reason": str(exc), "runtime": "edgellm", **plan["profile"]})
        return Artifact(ENGINE, out, meta)
    meta.update(engine_file=plan["engine_dir"], metrics={"status": "built", "runtime": "edgellm", **plan["profile"], **built})
    return Artifact(ENGINE, out, meta)


def run_build_engine(source: Artifact, config: BuildEngineConfig, ctx) -> Artifact:
    if source.kind == EDGELLM_BUNDLE:
        return run_edgellm_build(source, config, ctx)
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
    # Parsed where it was exported: TensorRT finds external weight files beside the graph.
    built = build_engine(plan, onnx_path, out / plan.engine_file, cache)
    meta.update(engine_file=plan.engine_file, device=support.device, tensorrt_version=built["tensorrt_version"],
                metrics={"status": "built", "device": support.device, **built})
    return Artifact(ENGINE, out, meta)


STAGE = register(StageDef(
    name="build_engine",
    summary="build the TensorRT engine (Edge-LLM's llm_build for a bundle, TensorRT for our ONNX), or defer with the commands",
    input_kind=(EDGELLM_BUNDLE, ONNX),
    output_kind=ENGINE,
    config_cls=BuildEngineConfig,
    run=run_build_engine,
    uses_target=True,
))
