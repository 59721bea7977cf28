"""The TensorRT engine builder (TensorRT 10.x / 11.x Python API), imported lazily.

:func:`local_build_support` says whether this host can build for a target: ``tensorrt``
importable, a CUDA device present, and its compute capability equal to the target's. Otherwise
the build is deferred to the device with the written plan; no engine is written without a real build.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from compress.engine.plan import BuildPlan
from compress.errors import MissingBackendError, StageError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildSupport:
    """Whether the local machine can build for a target, and why not."""

    can_build: bool
    reason: str
    device: str | None = None
    tensorrt_version: str | None = None


def cuda_device() -> tuple[str, int] | None:
    """(name, sm) of the first CUDA device, or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return torch.cuda.get_device_name(0), major * 10 + minor


def tensorrt_version() -> str | None:
    """The installed TensorRT version, without importing it when absent."""
    if importlib.util.find_spec("tensorrt") is None:
        return None
    import tensorrt as trt

    return str(trt.__version__)


def local_build_support(target_sm: int) -> BuildSupport:
    """Can this host build an engine for a GPU of compute capability ``target_sm``?"""
    device = cuda_device()
    if device is None:
        return BuildSupport(False, "not run: no CUDA device")
    version = tensorrt_version()
    if version is None:
        return BuildSupport(False, "not run: tensorrt is not installed (pip install -e '.[gpu]')", device[0])
    if device[1] != target_sm:
        return BuildSupport(False, f"not run: local GPU {device[0]} is sm_{device[1]}, the target is sm_{target_sm}; "
                                   "build on the device", device[0], version)
    return BuildSupport(True, "local GPU matches the target", device[0], version)


def _import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise MissingBackendError("tensorrt is not installed; install it on the device (JetPack ships it) "
                                  "or pip install -e '.[gpu]' on a desktop GPU") from exc
    return trt


def build_engine(plan: BuildPlan, onnx_path: Path, engine_path: Path, timing_cache: Path) -> dict:
    """Parse the ONNX file, apply the plan's settings and profiles, and write a serialized engine."""
    trt = _import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if plan.strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise StageError(f"TensorRT could not parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.workspace_bytes)
    config.builder_optimization_level = plan.builder_optimization_level
    if not plan.strongly_typed:
        if plan.fp16:
            config.set_flag(trt.BuilderFlag.FP16)
        if plan.int8 and hasattr(trt.BuilderFlag, "INT8"):
            config.set_flag(trt.BuilderFlag.INT8)
    if plan.sparse_weights:
        config.set_flag(trt.BuilderFlag.SPARSE_WEIGHTS)
    if plan.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    profile = builder.create_optimization_profile()
    for shape in plan.profiles:
        profile.set_shape(shape.name, shape.min, shape.opt, shape.max)
    config.add_optimization_profile(profile)
    log.info("building the TensorRT engine (optimization level %d)", plan.builder_optimization_level)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise StageError("TensorRT failed to build the engine (see the TensorRT log above)")
    engine_path.write_bytes(bytes(serialized))
    timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    return {"engine_bytes": engine_path.stat().st_size, "tensorrt_version": str(trt.__version__)}
