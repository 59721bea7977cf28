"""Work that needs the target device: ``compress build-engine RUN_DIR`` and ``compress validate RUN_DIR --on-device``.

A run whose engine comes from a TensorRT Edge-LLM bundle is built with Edge-LLM's ``llm_build``
and measured with its ``llm_inference`` (:mod:`compress.backends.edgellm.tools`); a run on the
generic path uses TensorRT's Python API, or ``trtexec`` where only that is installed. On a machine
without the tools or a CUDA device both say "not run: ..." and change nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.backends.edgellm import tools as edgellm_tools
from compress.backends.tensorrt.builder import (
    build_engine,
    cuda_device,
    local_build_support,
    tensorrt_version,
    timing_cache_path,
)
from compress.backends.tensorrt.plan import BuildPlan
from compress.backends.tensorrt.provenance import check_engine_provenance, engine_manifest
from compress.backends.tensorrt.trtexec import build_with_trtexec, find_trtexec
from compress.core.artifact import ENGINE, ONNX, REPORT
from compress.core.errors import MissingBackendError, UsageError
from compress.core.files import atomic_write_json, read_json, sha256_file, sha256_path
from compress.core.rundir import (
    BUILD_PLAN,
    DEVICE_REFERENCE,
    EDGELLM_BUILD_PLAN,
    ENGINE_MANIFEST,
    REPORT_JSON,
    RunDir,
    locked,
    record_written,
    rerecord_stage,
)
from compress.eval import on_device


def _generic_engine(run: RunDir) -> tuple[Path, BuildPlan, Path]:
    """The engine folder of a generic TensorRT build, its plan, and the exported folder it is built from."""
    engine_dir = run.output_path(ENGINE, "an engine or a build plan")
    plan = BuildPlan.from_json(read_json(engine_dir / BUILD_PLAN))
    return engine_dir, plan, run.output_path(ONNX, "an exported ONNX model")


def build_on_device(run_dir: Path) -> dict[str, Any]:
    """Build the run's engine here, from its plan; refuses when this host cannot build for the target, or when the run
    directory no longer holds what compress wrote."""
    RunDir(run_dir).require_manifest()
    with locked(Path(run_dir)):
        RunDir(run_dir).require_intact()
        return _build_on_device(Path(run_dir))


def _build_on_device(run_dir: Path) -> dict[str, Any]:
    folder = RunDir(run_dir).edgellm_engine_folder()
    if folder is not None:
        return _build_edgellm_on_device(run_dir, folder)
    engine_dir, plan, onnx_dir = _generic_engine(RunDir(run_dir))
    device = cuda_device()
    if device is None:
        raise MissingBackendError("not run: no CUDA device")
    if device[1] != plan.gpu_sm:
        raise MissingBackendError(
            f"not run: local GPU {device[0]} is sm_{device[1]}, the plan is for sm_{plan.gpu_sm}; build on the device"
        )
    source = engine_dir / plan.engine_onnx_file
    trtexec = find_trtexec() if tensorrt_version() is None else None
    if trtexec is not None:
        built = build_with_trtexec(plan, engine_dir, trtexec)
    else:
        support = local_build_support(plan.gpu_sm)
        if not support.can_build:
            raise MissingBackendError(support.reason)
        cache = timing_cache_path(plan.target, support.tensorrt_version or "unknown")
        cache.parent.mkdir(parents=True, exist_ok=True)
        built = {**build_engine(plan, source, engine_dir / plan.engine_file, cache), "builder": "tensorrt-python"}
    manifest = engine_manifest(plan, engine_dir, onnx_dir, device[0], built)
    atomic_write_json(engine_dir / ENGINE_MANIFEST, manifest)
    _record_built_engine(run_dir, str((engine_dir / plan.engine_file).relative_to(run_dir)), manifest)
    return manifest


def _build_edgellm_on_device(run_dir: Path, folder: Path) -> dict[str, Any]:
    plan = read_json(folder / EDGELLM_BUILD_PLAN)
    built = edgellm_tools.build_edgellm_engine(folder, plan)
    manifest = {"runtime": "edgellm", "target": plan["target"], "edgellm_version": plan["edgellm_version"],
                "profile": plan["profile"], "power_mode": edgellm_tools.read_power_mode(),
                "engine_sha256": {name: sha256_file(folder / name) for name in built["engine_files"]},
                "llm_build": built["llm_build"]}
    atomic_write_json(folder / ENGINE_MANIFEST, manifest)
    _record_built_engine(run_dir, str((folder / plan["engine_dir"]).relative_to(run_dir)), manifest)
    return manifest


def _record_built_engine(run_dir: Path, engine_path: str, manifest: dict[str, Any]) -> None:
    """The engine stage's record now lists the built files; a finished run's report names the engine, its stage done."""
    folder, record = RunDir(run_dir).require_stage_producing(ENGINE, "an engine")
    output = record.output.model_copy(update={"sha256": sha256_path(folder / record.output.path)})
    rerecord_stage(run_dir, folder.name, record.model_copy(update={"output": output}))
    report_path = run_dir / REPORT_JSON
    if not report_path.is_file():
        return
    report = read_json(report_path)
    report["artifacts"]["engine"] = engine_path
    engine_stage = RunDir(run_dir).stage_producing(ENGINE)
    for stage in report["stages"]:
        if engine_stage is not None and stage["dir"] == engine_stage[0].name:
            stage["status"] = "done"
            stage["metrics"] = {**stage.get("metrics", {}), "status": "built", **manifest}
    atomic_write_json(report_path, report)
    record_written(run_dir, [report_path])


def measure_on_device(run_dir: Path, prompt_len: int | None = None, encoder_batch: int | None = None) -> dict[str, Any]:
    """Measure the run's engine on this GPU: an Edge-LLM engine with ``llm_inference``; a generic decoder engine for
    TTFT and decode latency (>= 1024 steps or 60 s, p50/p90/p99); an encoder engine per batch size."""
    run = RunDir(run_dir)
    run.require_intact()
    folder = run.edgellm_engine_folder()
    if folder is not None:
        tool = edgellm_tools.require_device_tool(edgellm_tools.INFERENCE_TOOL)
        if not (folder / ENGINE_MANIFEST).is_file():
            raise UsageError(
                f"{folder} has no built engine; run `compress build-engine {run.path}` on the device first"
            )
        validation_dir, _ = run.require_stage_producing(REPORT, "a validation")
        return on_device.measure_edgellm_engine(folder, read_json(validation_dir / DEVICE_REFERENCE), tool)
    engine_dir, plan, onnx_dir = _generic_engine(run)
    manifest = check_engine_provenance(engine_dir)
    if plan.model_kind == "encoder":
        return on_device.measure_encoder_engine(engine_dir, plan, onnx_dir, manifest, encoder_batch)
    return on_device.measure_decoder_engine(engine_dir, plan, onnx_dir, manifest, prompt_len)
