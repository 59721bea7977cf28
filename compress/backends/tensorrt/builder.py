"""The TensorRT engine builder (TensorRT 10.x / 11.x Python API), imported lazily.

:func:`local_build_support` says whether this host can build for a target: ``tensorrt``
importable, a CUDA device present (asked through cuda-python: the PyPI torch on a Jetson has no
CUDA), and its compute capability equal to the target's. Otherwise the build is deferred to the
device with the written plan; no engine is written without a real build. A venv on JetPack hides
the system TensorRT; the message says so and how to fix it.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from compress.backends.tensorrt.cuda import device_info
from compress.backends.tensorrt.plan import BuildPlan, BuildResult
from compress.core.errors import MissingBackendError, StageError
from compress.core.files import atomic_write_bytes, cache_root

log = logging.getLogger(__name__)

# Where JetPack's apt packages put TensorRT's Python bindings.
SYSTEM_TENSORRT_GLOBS = (
    "usr/lib/python3*/dist-packages/tensorrt/__init__.py",
    "usr/lib/python3/dist-packages/tensorrt/__init__.py",
)


@dataclass(frozen=True)
class BuildSupport:
    """Whether the local machine can build for a target, and why not."""

    can_build: bool
    reason: str
    device: str | None = None
    tensorrt_version: str | None = None


def cuda_device() -> tuple[str, int] | None:
    """(name, sm) of the first CUDA device (through cuda-python, not torch), or None."""
    info = device_info()
    return None if info is None else (info.name, info.sm)


def system_tensorrt() -> Path | None:
    """JetPack's TensorRT Python package when this interpreter cannot see it (a venv without system site packages)."""
    if importlib.util.find_spec("tensorrt") is not None:
        return None
    for pattern in SYSTEM_TENSORRT_GLOBS:
        found = sorted(Path("/").glob(pattern))
        if found:
            return found[-1].parent
    return None


def tensorrt_version() -> str | None:
    """The installed TensorRT version, without importing it when absent."""
    if importlib.util.find_spec("tensorrt") is None:
        return None
    import tensorrt as trt

    return str(trt.__version__)


def missing_tensorrt_reason() -> str:
    """Why TensorRT cannot be imported here, with the fix."""
    hidden = system_tensorrt()
    if hidden is not None:
        return (
            f"not run: TensorRT is installed system-wide ({hidden}) but this Python environment hides it; "
            "create the environment with `python3 -m venv --system-site-packages .venv` (JetPack's TensorRT is not on "
            "PyPI for Jetson) and reinstall compress in it"
        )
    return "not run: tensorrt is not installed (JetPack ships it; on a desktop GPU pip install -e '.[gpu]')"


def local_build_support(target_sm: int) -> BuildSupport:
    """Can this host build an engine for a GPU of compute capability ``target_sm``?"""
    try:
        device = cuda_device()
    except MissingBackendError as exc:
        return BuildSupport(False, str(exc))
    if device is None:
        return BuildSupport(False, "not run: no CUDA device")
    version = tensorrt_version()
    if version is None:
        return BuildSupport(False, missing_tensorrt_reason(), device[0])
    if device[1] != target_sm:
        return BuildSupport(False, f"not run: local GPU {device[0]} is sm_{device[1]}, the target is sm_{target_sm}; "
                                   "build on the device", device[0], version)
    return BuildSupport(True, "local GPU matches the target", device[0], version)


def import_tensorrt():
    """The ``tensorrt`` module, or a "not run" error saying how to get it."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise MissingBackendError(missing_tensorrt_reason()) from exc
    return trt


def _network_flags(trt, plan: BuildPlan) -> tuple[int, bool]:
    """Creation flags and whether the network is strongly typed (TensorRT without the flag builds weakly typed)."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if plan.strongly_typed and flag is not None:
        return 1 << int(flag), True
    return 0, False


def _weak_typing_flags(trt, plan: BuildPlan) -> list:
    """Precision flags of a weakly typed build; a flag the graph needs but this TensorRT lacks is an error."""
    wanted = ["FP16"] + ["INT8"] * plan.int8 + ["INT4"] * plan.int4
    missing = [name for name in wanted if not hasattr(trt.BuilderFlag, name)]
    if missing:
        raise StageError(f"TensorRT {trt.__version__} has neither strongly typed networks nor BuilderFlag.{missing[0]}")
    return [getattr(trt.BuilderFlag, name) for name in wanted]


def build_engine(plan: BuildPlan, onnx_path: Path, engine_path: Path, timing_cache: Path) -> BuildResult:
    """Parse the engine graph, apply the plan's settings and profiles, and write a serialized engine.

    The network is strongly typed wherever this TensorRT has strong typing (the graph's types give
    the precision, no precision flags); older versions build weakly typed with FP16 and the
    INT8/INT4 flags the graph's Q/DQ nodes need.
    """
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags, strongly_typed = _network_flags(trt, plan)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise StageError(f"TensorRT could not parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.workspace_bytes)
    config.builder_optimization_level = plan.builder_optimization_level
    if not strongly_typed:
        for flag in _weak_typing_flags(trt, plan):
            config.set_flag(flag)
    if plan.sparse_weights:
        config.set_flag(trt.BuilderFlag.SPARSE_WEIGHTS)
    if plan.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    for profile in plan.profiles:
        shapes = builder.create_optimization_profile()
        for shape in profile.shapes:
            shapes.set_shape(shape.name, shape.min, shape.opt, shape.max)
        config.add_optimization_profile(shapes)
    log.info(
        "building the TensorRT engine (%s typed, profiles %s, optimization level %d)",
        "strongly" if strongly_typed else "weakly",
        ", ".join(p.name for p in plan.profiles),
        plan.builder_optimization_level,
    )
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise StageError("TensorRT failed to build the engine (see the TensorRT log above)")
    atomic_write_bytes(engine_path, bytes(serialized))
    atomic_write_bytes(timing_cache, bytes(config.get_timing_cache().serialize()))
    return {"engine_bytes": engine_path.stat().st_size, "tensorrt_version": str(trt.__version__),
            "typing": "strong" if strongly_typed else "weak", "profiles": [p.name for p in plan.profiles]}


def timing_cache_path(target: str, tensorrt: str) -> Path:
    """The timing cache kept per target and TensorRT version, shared by runs."""
    return cache_root() / "timing" / f"{target}-trt{tensorrt}.cache"
