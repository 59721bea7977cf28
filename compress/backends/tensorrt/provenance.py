"""Which engine may run where: the manifest a build writes, and the check before an engine is used.

TensorRT engines are tied to the GPU architecture and the TensorRT version that built them (a
version-compatible engine runs on later TensorRT too). ``engine_manifest.json`` records who built
the engine, for what, and the hashes of the engine and of the graphs it came from.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TypedDict

from compress.backends.onnx.graph import onnx_files_sha256
from compress.backends.tensorrt.builder import cuda_device, missing_tensorrt_reason, tensorrt_version
from compress.backends.tensorrt.plan import BuildPlan, BuildResult
from compress.core.errors import MissingBackendError, UsageError
from compress.core.files import read_json, sha256_file
from compress.core.rundir import BUILD_PLAN, ENGINE_MANIFEST


class EngineManifest(TypedDict):
    """``engine_manifest.json``: who built the engine, for what, from which graphs."""

    target: str
    gpu: str
    sm: int
    tensorrt_version: str
    builder: str
    version_compatible: bool
    model_kind: str
    engine_sha256: str
    engine_graph_sha256: str
    onnx_sha256: str


def engine_manifest(plan: BuildPlan, engine_dir: Path, onnx_dir: Path, gpu: str, built: BuildResult
                    ) -> EngineManifest:
    """What :func:`check_engine_provenance` and the runtime read: who built the engine, for what, from which graph."""
    return {"target": plan.target, "gpu": gpu, "sm": plan.gpu_sm, "tensorrt_version": built["tensorrt_version"],
            "builder": built["builder"], "version_compatible": plan.version_compatible, "model_kind": plan.model_kind,
            "engine_sha256": sha256_file(engine_dir / plan.engine_file),
            "engine_graph_sha256": onnx_files_sha256(engine_dir / plan.engine_onnx_file),
            "onnx_sha256": onnx_files_sha256(onnx_dir / plan.onnx_file)}


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def check_engine_provenance(engine_dir: Path) -> EngineManifest:
    """The engine can run here: same GPU architecture, and the TensorRT that built it, or a later one for a
    version-compatible engine; otherwise a clear error telling to rebuild."""
    device = cuda_device()
    if device is None:
        raise MissingBackendError("not run: no CUDA device")
    manifest_path = engine_dir / ENGINE_MANIFEST
    if not manifest_path.is_file():
        raise UsageError(f"{engine_dir} has no built engine; run `compress build-engine RUN_DIR` on the device")
    manifest = read_json(manifest_path)
    here = tensorrt_version()
    if here is None:
        raise MissingBackendError(missing_tensorrt_reason())
    built = manifest["tensorrt_version"]
    if manifest.get("version_compatible"):
        runs_here = _version_tuple(here) >= _version_tuple(built)
        needed = f"TensorRT {built} or later"
    else:  # trtexec prints major.minor.patch, the Python module may add the build number
        runs_here = _version_tuple(here) == _version_tuple(built)
        needed = f"TensorRT {built}"
    if not runs_here or device[1] != manifest["sm"]:
        raise UsageError(
            f"engine built with TensorRT {built} for sm_{manifest['sm']} ({manifest['gpu']}) needs {needed} on "
            f"sm_{manifest['sm']}; this machine has TensorRT {here} on sm_{device[1]} ({device[0]}): "
            "rebuild it here with `compress build-engine RUN_DIR`"
        )
    if sha256_file(engine_dir / read_json(engine_dir / BUILD_PLAN)["engine_file"]) != manifest["engine_sha256"]:
        raise UsageError(
            f"the engine in {engine_dir} does not match its manifest's hash; rebuild it with `compress build-engine "
            "RUN_DIR`"
        )
    return manifest
