"""CUDA through NVIDIA's ``cuda-python`` runtime bindings, imported lazily: device facts, memory, streams.

Nothing here needs torch: the PyPI torch wheel on a Jetson has no CUDA, while JetPack's driver
and ``cuda-python`` do. Every call's status is checked; a failure raises :class:`CudaError`
naming the call and CUDA's error.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass

import numpy as np

from compress.core.errors import CompressError, MissingBackendError

# TensorRT wants distinct, non-null, aligned addresses even for empty tensors; cudaMalloc(0)
# returns null, so every buffer holds at least this many bytes (cudaMalloc aligns to 256).
MIN_ALLOCATION = 256


class CudaError(CompressError):
    """A CUDA runtime call failed."""


def runtime_api():
    """The ``cudart`` module of cuda-python (``cuda.bindings.runtime`` from 12.8, ``cuda.cudart`` before)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError as exc:
            raise MissingBackendError("not run: cuda-python is not installed (pip install -e '.[gpu]'; on JetPack 6, "
                                      "whose CUDA is 12.x, pip install 'cuda-python<13')") from exc
    return cudart


def _call(cudart, name: str, *args):
    """Call ``cudart.<name>`` and return its values after the status, raising on an error status."""
    status, *values = getattr(cudart, name)(*args)
    if status != cudart.cudaError_t.cudaSuccess:
        raise CudaError(f"{name} failed: {getattr(status, 'name', status)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def driver_device_count() -> int:
    """CUDA devices the driver reports (``libcuda`` directly, so it answers without cuda-python installed)."""
    for library in ("libcuda.so.1", "libcuda.so"):
        try:
            cuda = ctypes.CDLL(library)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    return 0


@dataclass(frozen=True)
class DeviceInfo:
    """The first CUDA device."""

    name: str
    sm: int
    total_memory_bytes: int


def device_info() -> DeviceInfo | None:
    """The first CUDA device, or None without a driver or device.

    Raises :class:`MissingBackendError` when the driver sees a device but cuda-python is missing,
    so the message says what to install rather than "no CUDA device".
    """
    try:
        cudart = runtime_api()
    except MissingBackendError:
        if driver_device_count() > 0:
            raise
        return None
    status, count = cudart.cudaGetDeviceCount()
    if status != cudart.cudaError_t.cudaSuccess or count == 0:
        return None
    props = _call(cudart, "cudaGetDeviceProperties", 0)
    name = props.name.decode(errors="replace").rstrip("\x00") if isinstance(props.name, bytes) else str(props.name)
    return DeviceInfo(name, props.major * 10 + props.minor, int(props.totalGlobalMem))


def memory_in_use_bytes() -> int:
    """Bytes in use on the current device, by every process (callers subtract a baseline)."""
    cudart = runtime_api()
    free, total = _call(cudart, "cudaMemGetInfo")
    return int(total) - int(free)


class Stream:
    """A CUDA stream: copies and engine launches queued on one stream run in order."""

    def __init__(self) -> None:
        self._cudart = runtime_api()
        self._stream = _call(self._cudart, "cudaStreamCreate")

    @property
    def handle(self) -> int:
        """The ``cudaStream_t`` as an integer, the form TensorRT's ``execute_async_v3`` takes."""
        return int(self._stream)

    @property
    def raw(self):
        return self._stream

    def synchronize(self) -> None:
        _call(self._cudart, "cudaStreamSynchronize", self._stream)

    def close(self) -> None:
        if self._stream is not None:
            _call(self._cudart, "cudaStreamDestroy", self._stream)
            self._stream = None


class DeviceArray:
    """A dense array in device memory: shape, dtype and a pointer that is never null."""

    def __init__(self, shape: tuple[int, ...], dtype) -> None:
        self._cudart = runtime_api()
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.ptr = int(_call(self._cudart, "cudaMalloc", max(self.nbytes, MIN_ALLOCATION)))

    @classmethod
    def from_host(cls, array: np.ndarray, stream: Stream) -> DeviceArray:
        """Copy ``array`` to the device, queued on ``stream`` (the engine's, so the launch sees the data)."""
        array = np.ascontiguousarray(array)
        device = cls(array.shape, array.dtype)
        if device.nbytes:
            _call(device._cudart, "cudaMemcpyAsync", device.ptr, array.ctypes.data, device.nbytes,
                  device._cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, stream.raw)
        return device

    def to_host(self, stream: Stream) -> np.ndarray:
        """Copy back after everything queued on ``stream`` (the call waits for the stream)."""
        out = np.empty(self.shape, dtype=self.dtype)
        if self.nbytes:
            _call(self._cudart, "cudaMemcpyAsync", out.ctypes.data, self.ptr, self.nbytes,
                  self._cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream.raw)
        stream.synchronize()
        return out

    def free(self) -> None:
        if self.ptr:
            _call(self._cudart, "cudaFree", self.ptr)
            self.ptr = 0

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown or a lost context: nothing left to free
            self.free()
