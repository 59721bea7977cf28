"""Stand-ins for cuda-python's runtime API and TensorRT's Python API that enforce their documented contracts.

They prove compress's glue (buffers, streams, shapes, profiles, build flags, provenance), not
TensorRT: the stand-in "engine" runs the ONNX graph it was built from in ONNX Runtime, and device
memory is host memory. The contracts enforced, each from NVIDIA's documentation:

CUDA runtime
- every call returns ``(cudaError_t, *values)``; ``cudaMalloc(0)`` yields a null pointer;
- asynchronous copies and kernel launches run in stream order and only when their stream is
  synchronized: work queued on one stream is not seen by another that did not wait for it;
- host-to-device copies read the host buffer when called; device-to-host copies write it when the
  stream runs.

TensorRT
- a strongly typed network (``NetworkDefinitionCreationFlag.STRONGLY_TYPED``) takes no precision
  flags; TensorRT 11 has no ``BuilderFlag.FP16/INT8/INT4`` at all and every network is strongly typed;
- a weakly typed network with INT4 weight-only Q/DQ needs ``BuilderFlag.INT4``; INT4 block scales are FP16;
- every dynamic input has a range in every optimization profile, and the network must accept the
  shapes at each profile's min, opt and max (the builder infers shapes there);
- a context gets profile 0 when it is the engine's first, otherwise none until
  ``set_optimization_profile_async`` selects one no other live context holds;
- ``set_input_shape`` returns False outside the active profile's range;
- every input and output needs a non-null, 256-byte-aligned address of its own, empty tensors
  included, backed by enough memory;
- an engine runs only on the GPU architecture and the TensorRT version that built it; a
  version-compatible engine also on later versions, and only with ``engine_host_code_allowed``.
"""

from __future__ import annotations

import base64
import ctypes
import enum
import importlib.machinery
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto


class cudaError_t(enum.IntEnum):  # noqa: N801 - the CUDA name
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidDevicePointer = 17
    cudaErrorInvalidResourceHandle = 400


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


class _StreamHandle:
    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


OK = cudaError_t.cudaSuccess


class StandInCuda:
    """cuda-python's ``cuda.bindings.runtime``, on host memory, with lazily executed streams."""

    def __init__(self, sm: int = 87, name: str = "Stand-in Orin", total_bytes: int = 8 << 30) -> None:
        self.sm, self.name, self.total_bytes = sm, name, total_bytes
        self.allocations: dict[int, bytearray] = {}
        self.queues: dict[int, list] = {}
        self._next_pointer = 0x7F00_0000_0000
        self._next_stream = 0x1000
        self.cudaError_t, self.cudaMemcpyKind = cudaError_t, cudaMemcpyKind

    def module(self) -> types.ModuleType:
        module = types.ModuleType("cuda.bindings.runtime")
        for name in dir(self):
            if name.startswith("cuda"):
                setattr(module, name, getattr(self, name))
        return module

    def cudaGetDeviceCount(self):  # noqa: N802
        return OK, 1

    def cudaGetDeviceProperties(self, index: int):  # noqa: N802
        return OK, types.SimpleNamespace(name=self.name.encode(), major=self.sm // 10, minor=self.sm % 10,
                                         totalGlobalMem=self.total_bytes)

    def cudaMemGetInfo(self):  # noqa: N802
        used = sum(len(b) for b in self.allocations.values())
        return OK, self.total_bytes - used, self.total_bytes

    def cudaMalloc(self, size: int):  # noqa: N802
        if size == 0:
            return OK, 0
        pointer = self._next_pointer
        self._next_pointer += (size + 255) // 256 * 256 + 256
        self.allocations[pointer] = bytearray(size)
        return OK, pointer

    def cudaFree(self, pointer: int):  # noqa: N802
        if pointer == 0:
            return (OK,)
        if pointer not in self.allocations:
            return (cudaError_t.cudaErrorInvalidDevicePointer,)
        del self.allocations[pointer]
        return (OK,)

    def cudaStreamCreate(self):  # noqa: N802
        self._next_stream += 16
        self.queues[self._next_stream] = []
        return OK, _StreamHandle(self._next_stream)

    def cudaStreamDestroy(self, stream):  # noqa: N802
        self.queues.pop(int(stream), None)
        return (OK,)

    def cudaStreamSynchronize(self, stream):  # noqa: N802
        queue = self.queues.get(int(stream))
        if queue is None:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        while queue:
            queue.pop(0)()
        return (OK,)

    def device_bytes(self, pointer: int, size: int) -> memoryview | None:
        """The device memory at ``pointer`` (inside one allocation), or None when it is not ``size`` bytes of one."""
        for base, buffer in self.allocations.items():
            if base <= pointer and pointer + size <= base + len(buffer):
                return memoryview(buffer)[pointer - base:pointer - base + size]
        return None

    def cudaMemcpyAsync(self, dst: int, src: int, count: int, kind, stream):  # noqa: N802
        queue = self.queues.get(int(stream))
        if queue is None:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        if kind == cudaMemcpyKind.cudaMemcpyHostToDevice:
            target = self.device_bytes(dst, count)
            if target is None:
                return (cudaError_t.cudaErrorInvalidValue,)
            data = ctypes.string_at(src, count)

            def write() -> None:
                target[:] = data
            queue.append(write)
        elif kind == cudaMemcpyKind.cudaMemcpyDeviceToHost:
            source = self.device_bytes(src, count)
            if source is None:
                return (cudaError_t.cudaErrorInvalidValue,)
            queue.append(lambda: ctypes.memmove(dst, bytes(source), count))
        else:
            return (cudaError_t.cudaErrorInvalidValue,)
        return (OK,)

    def enqueue(self, stream: int, work) -> bool:
        if stream not in self.queues:
            return False
        self.queues[stream].append(work)
        return True


_NUMPY = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.INT64: np.int64,
          TensorProto.INT32: np.int32, TensorProto.BOOL: np.bool_, TensorProto.INT8: np.int8}


@dataclass
class _Network:
    strongly_typed: bool
    inputs: list = field(default_factory=list)  # (name, elem_type, dims with -1 for dynamic)
    outputs: list = field(default_factory=list)
    model: onnx.ModelProto | None = None


def _zeros(name: str, shape, elem_type: int) -> np.ndarray:
    fill = 1 if name == "attention_mask" else 0
    return np.full(shape, fill, dtype=_NUMPY[elem_type])


def _session(model_bytes: bytes):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    # plain arithmetic, no fused integer kernels
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    )
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def _int4_dq_scales(model: onnx.ModelProto) -> list[int]:
    initializers = {i.name: i for i in model.graph.initializer}
    types_ = []
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in initializers \
                and initializers[node.input[0]].data_type in (TensorProto.INT4, TensorProto.UINT4):
            types_.append(initializers[node.input[1]].data_type)
    return types_


def make_tensorrt(cuda: StandInCuda, version: str = "10.3.0", sm: int | None = None) -> types.ModuleType:
    """A ``tensorrt`` module for TensorRT ``version`` (``11.x``: strong typing only, no precision flags)."""
    major = int(version.split(".")[0])
    built_sm = cuda.sm if sm is None else sm
    trt = types.ModuleType("tensorrt")
    trt.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)
    trt.__version__ = version
    trt.log: list[str] = []

    class Logger:
        WARNING, ERROR, INFO = 2, 1, 3

        def __init__(self, severity: int = 2) -> None:
            self.severity = severity

    def error(message: str) -> None:
        trt.log.append(message)

    flags = {"SPARSE_WEIGHTS": 10, "VERSION_COMPATIBLE": 11}
    if major < 11:
        flags.update(FP16=0, INT8=1, INT4=20)
    trt.BuilderFlag = enum.IntEnum("BuilderFlag", flags)
    trt.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", {"STRONGLY_TYPED": 1})
    trt.MemoryPoolType = enum.IntEnum("MemoryPoolType", {"WORKSPACE": 0})
    trt.DataType = enum.IntEnum("DataType", {"FLOAT": 0, "HALF": 1, "INT8": 2, "INT32": 3, "BOOL": 4, "INT64": 8})
    trt.TensorIOMode = enum.IntEnum("TensorIOMode", {"NONE": 0, "INPUT": 1, "OUTPUT": 2})
    to_trt = {
        TensorProto.FLOAT: trt.DataType.FLOAT,
        TensorProto.FLOAT16: trt.DataType.HALF,
        TensorProto.INT64: trt.DataType.INT64,
        TensorProto.INT32: trt.DataType.INT32,
        TensorProto.BOOL: trt.DataType.BOOL,
        TensorProto.INT8: trt.DataType.INT8,
    }

    class OnnxParser:
        def __init__(self, network: _Network, logger: Logger) -> None:
            self.network, self.errors = network, []

        @property
        def num_errors(self) -> int:
            return len(self.errors)

        def get_error(self, index: int) -> str:
            return self.errors[index]

        def parse_from_file(self, path: str) -> bool:
            model = onnx.load(path)
            self.network.model = model

            def describe(values):
                return [
                    (
                        v.name,
                        v.type.tensor_type.elem_type,
                        [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim],
                    )
                    for v in values
                ]

            self.network.inputs, self.network.outputs = describe(model.graph.input), describe(model.graph.output)
            return True

    class OptimizationProfile:
        def __init__(self) -> None:
            self.shapes: dict[str, tuple] = {}

        def set_shape(self, name: str, low, opt, high) -> None:
            self.shapes[name] = (tuple(low), tuple(opt), tuple(high))

    class TimingCache:
        def __init__(self, data: bytes) -> None:
            self.data = data

        def serialize(self) -> bytes:
            return self.data or b"stand-in timing cache"

    class BuilderConfig:
        def __init__(self) -> None:
            self.flags: set = set()
            self.profiles: list[OptimizationProfile] = []
            self.builder_optimization_level = 3
            self.cache = None

        def set_memory_pool_limit(self, pool, size: int) -> None:
            self.workspace = size

        def set_flag(self, flag) -> None:
            self.flags.add(flag)

        def create_timing_cache(self, data: bytes) -> TimingCache:
            return TimingCache(data)

        def set_timing_cache(self, cache: TimingCache, ignore_mismatch: bool) -> bool:
            self.cache = cache
            return True

        def get_timing_cache(self) -> TimingCache:
            return self.cache

        def add_optimization_profile(self, profile: OptimizationProfile) -> int:
            self.profiles.append(profile)
            return len(self.profiles) - 1

    def check_build(network: _Network, config: BuilderConfig) -> str | None:
        precision_flags = {f for f in config.flags if f.name in ("FP16", "INT8", "INT4")}
        if network.strongly_typed and precision_flags:
            return (
                f"precision flags {sorted(f.name for f in precision_flags)} are not allowed on a strongly typed network"
            )
        scales = _int4_dq_scales(network.model)
        if scales and not network.strongly_typed and "INT4" not in {f.name for f in config.flags}:
            return "INT4 weight-only quantization in a weakly typed network needs BuilderFlag.INT4"
        if any(t != TensorProto.FLOAT16 for t in scales):
            return "INT4 block-quantized weights need FP16 scales"
        dynamic = [(name, elem, dims) for name, elem, dims in network.inputs if -1 in dims]
        if dynamic and not config.profiles:
            return "dynamic inputs need an optimization profile"
        session = _session(network.model.SerializeToString())
        for index, profile in enumerate(config.profiles):
            for name, _elem, dims in dynamic:
                if name not in profile.shapes:
                    return f"profile {index} has no shapes for {name}"
                low, opt, high = profile.shapes[name]
                if not len(low) == len(opt) == len(high) == len(dims):
                    return f"profile {index}: {name} has rank {len(dims)}"
                if any(not lo <= op <= hi for lo, op, hi in zip(low, opt, high, strict=True)) or \
                        any(d != -1 and d != lo for d, lo in zip(dims, low, strict=True)):
                    return f"profile {index}: {name} min/opt/max out of order or off its fixed dimensions"
            for kind in range(3):
                feeds = {name: _zeros(name, profile.shapes[name][kind], elem) for name, elem, _ in dynamic}
                try:
                    session.run(None, feeds)
                except Exception as exc:  # the graph rejects this shape combination
                    return f"profile {index}: the network cannot take its {('min', 'opt', 'max')[kind]} shapes: {exc}"
        return None

    class Builder:
        def __init__(self, logger: Logger) -> None:
            self.logger = logger

        def create_network(self, flags: int = 0) -> _Network:
            strong = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)  # absent before TensorRT 9
            return _Network(strongly_typed=major >= 11 or (strong is not None and bool(flags & (1 << int(strong)))))

        def create_builder_config(self) -> BuilderConfig:
            return BuilderConfig()

        def create_optimization_profile(self) -> OptimizationProfile:
            return OptimizationProfile()

        def build_serialized_network(self, network: _Network, config: BuilderConfig):
            problem = check_build(network, config)
            if problem:
                error(problem)
                return None
            engine = {
                "version": version,
                "sm": built_sm,
                "version_compatible": trt.BuilderFlag.VERSION_COMPATIBLE in config.flags,
                "strongly_typed": network.strongly_typed,
                "flags": sorted(f.name for f in config.flags),
                "inputs": network.inputs,
                "outputs": network.outputs,
                "profiles": [{n: [list(s) for s in shapes] for n, shapes in p.shapes.items()} for p in config.profiles],
                "onnx": base64.b64encode(network.model.SerializeToString()).decode(),
            }
            return json.dumps(engine).encode()

    class ExecutionContext:
        def __init__(self, engine: Engine, profile: int | None) -> None:
            self.engine, self.profile = engine, profile
            self.shapes: dict[str, tuple] = {}
            self.addresses: dict[str, int] = {}

        def set_optimization_profile_async(self, index: int, stream: int) -> bool:
            held = {c.profile for c in self.engine.contexts if c is not self}
            if not 0 <= index < self.engine.num_optimization_profiles or index in held or stream not in cuda.queues:
                return False
            self.profile = index
            self.shapes.clear()
            return True

        def set_input_shape(self, name: str, shape) -> bool:
            if self.profile is None or name not in self.engine.input_names:
                return False
            low, _, high = self.engine.get_tensor_profile_shape(name, self.profile)
            shape = tuple(shape)
            if len(shape) != len(low) or any(not lo <= d <= hi for d, lo, hi in zip(shape, low, high, strict=True)):
                return False
            self.shapes[name] = shape
            return True

        def _output_shapes(self) -> dict[str, tuple]:
            feeds = {name: _zeros(name, self.shapes[name], elem) for name, elem, _ in self.engine.spec["inputs"]}
            values = self.engine.session.run(None, feeds)
            return {name: tuple(v.shape) for (name, _, _), v in zip(self.engine.spec["outputs"], values, strict=True)}

        def get_tensor_shape(self, name: str):
            if name in self.engine.input_names:
                return self.shapes.get(name, tuple(self.engine.dims[name]))
            if set(self.shapes) != set(self.engine.input_names):
                return tuple(self.engine.dims[name])
            return self._output_shapes()[name]

        def set_tensor_address(self, name: str, pointer: int) -> bool:
            self.addresses[name] = pointer
            return True

        def execute_async_v3(self, stream: int) -> bool:
            if self.profile is None or set(self.shapes) != set(self.engine.input_names):
                error("execute_async_v3: an input shape is not set")
                return False
            shapes = {**self.shapes, **self._output_shapes()}
            names = [n for n, _, _ in self.engine.spec["inputs"] + self.engine.spec["outputs"]]
            pointers = [self.addresses.get(n, 0) for n in names]
            if 0 in pointers or len(set(pointers)) != len(pointers) or any(p % 256 for p in pointers):
                error("execute_async_v3: every input and output needs its own non-null, 256-byte-aligned address")
                return False
            views = {}
            for (name, elem, _), pointer in zip(
                self.engine.spec["inputs"] + self.engine.spec["outputs"], pointers, strict=True
            ):
                size = int(np.prod(shapes[name], dtype=np.int64)) * np.dtype(_NUMPY[elem]).itemsize
                views[name] = cuda.device_bytes(pointer, max(size, 1))
                if views[name] is None:
                    error(f"execute_async_v3: {name}'s address does not hold {size} bytes of device memory")
                    return False

            def run() -> None:
                feeds = {
                    name: np.frombuffer(
                        views[name], dtype=_NUMPY[elem], count=int(np.prod(shapes[name], dtype=np.int64))
                    )
                    .reshape(shapes[name])
                    .copy()
                    for name, elem, _ in self.engine.spec["inputs"]
                }
                values = self.engine.session.run(None, feeds)
                for (name, elem, _), value in zip(self.engine.spec["outputs"], values, strict=True):
                    data = np.ascontiguousarray(value, dtype=_NUMPY[elem]).tobytes()
                    views[name][:len(data)] = data
            return cuda.enqueue(stream, run)

    class Engine:
        def __init__(self, spec: dict) -> None:
            self.spec = spec
            self.session = _session(base64.b64decode(spec["onnx"]))
            self.input_names = [n for n, _, _ in spec["inputs"]]
            self.dims = {n: d for n, _, d in spec["inputs"] + spec["outputs"]}
            self.types = {n: e for n, e, _ in spec["inputs"] + spec["outputs"]}
            self.contexts: list[ExecutionContext] = []

        @property
        def num_io_tensors(self) -> int:
            return len(self.types)

        @property
        def num_optimization_profiles(self) -> int:
            return max(1, len(self.spec["profiles"]))

        def get_tensor_name(self, index: int) -> str:
            return list(self.types)[index]

        def get_tensor_mode(self, name: str):
            return trt.TensorIOMode.INPUT if name in self.input_names else trt.TensorIOMode.OUTPUT

        def get_tensor_dtype(self, name: str):
            return to_trt[self.types[name]]

        def get_tensor_profile_shape(self, name: str, index: int):
            return [tuple(s) for s in self.spec["profiles"][index][name]]

        def create_execution_context(self) -> ExecutionContext:
            context = ExecutionContext(self, 0 if not self.contexts else None)
            self.contexts.append(context)
            return context

    def _version(text: str) -> tuple[int, ...]:
        return tuple(int(p) for p in text.split(".")[:3])

    class Runtime:
        def __init__(self, logger: Logger) -> None:
            self.engine_host_code_allowed = False

        def deserialize_cuda_engine(self, data: bytes):
            spec = json.loads(bytes(data))
            if spec["sm"] != cuda.sm:
                error(f"engine built for sm_{spec['sm']}, this GPU is sm_{cuda.sm}")
                return None
            if spec["version_compatible"]:
                if _version(version) < _version(spec["version"]):
                    error("a version-compatible engine runs only on the TensorRT that built it or a later one")
                    return None
                if not self.engine_host_code_allowed:
                    error("the engine carries host code (a version-compatible plan); set engine_host_code_allowed")
                    return None
            elif spec["version"] != version:
                error(f"engine built by TensorRT {spec['version']}, this is {version}")
                return None
            return Engine(spec)

    for item in (Logger, OnnxParser, Builder, Runtime):
        setattr(trt, item.__name__, item)
    return trt


def install(
    monkeypatch, cuda: StandInCuda | None = None, version: str = "10.3.0"
) -> tuple[StandInCuda, types.ModuleType]:
    """Put the stand-ins where ``import tensorrt`` and ``from cuda.bindings import runtime`` find them."""
    cuda = cuda or StandInCuda()
    runtime = cuda.module()
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime
    package = types.ModuleType("cuda")
    package.bindings = bindings
    package.__path__ = []
    trt = make_tensorrt(cuda, version)
    for name, module in (
        ("cuda", package),
        ("cuda.bindings", bindings),
        ("cuda.bindings.runtime", runtime),
        ("tensorrt", trt),
    ):
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    return cuda, trt


def swap_tensorrt(monkeypatch, cuda: StandInCuda, version: str) -> types.ModuleType:
    """Replace the installed stand-in TensorRT by another version (the device was upgraded)."""
    trt = make_tensorrt(cuda, version)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    return trt


def engine_spec(path: Path) -> dict:
    """What the stand-in builder recorded in an engine file."""
    return json.loads(path.read_bytes())
