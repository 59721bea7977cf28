"""A serialized TensorRT engine run through its Python API, with device memory and streams from cuda-python.

One execution context per optimization profile (a decoder engine has a prefill and a decode
profile): each context is switched to its profile once, on the session's stream, and a call picks
the first profile whose ranges hold every input shape. Host inputs are copied, the engine is
launched and outputs are read back on that one stream, so each step sees the data queued before
it. Every input gets a distinct non-null address, empty ones included, and a shape TensorRT
refuses is an error naming the input instead of a launch on stale shapes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from compress.backends.tensorrt.builder import import_tensorrt
from compress.backends.tensorrt.cuda import DeviceArray, Stream
from compress.core.errors import MissingBackendError, StageError, UsageError


def _numpy_dtype(trt, dtype) -> np.dtype:
    table = {trt.DataType.FLOAT: np.float32, trt.DataType.HALF: np.float16, trt.DataType.INT32: np.int32,
             trt.DataType.INT64: np.int64, trt.DataType.BOOL: np.bool_, trt.DataType.INT8: np.int8}
    if dtype not in table:
        raise StageError(f"engine input/output type {dtype} is not one compress exchanges with an engine")
    return np.dtype(table[dtype])


class EngineSession:
    """Deserialize an engine and run it on host arrays or device arrays.

    ``host_code_allowed`` must be set for a version-compatible engine: it carries TensorRT's lean
    runtime (host code), which the runtime only loads when told the plan is trusted.
    """

    def __init__(self, engine_path: Path, host_code_allowed: bool = False) -> None:
        trt = import_tensorrt()
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        if host_code_allowed:
            self._runtime.engine_host_code_allowed = True
        self.engine = self._runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise MissingBackendError(
                f"TensorRT could not load {engine_path}: rebuild it on this device (compress build-engine)"
            )
        self.stream = Stream()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.dtypes = {n: _numpy_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}
        self.profile_ranges = [{n: self.engine.get_tensor_profile_shape(n, index) for n in self.inputs}
                               for index in range(self.engine.num_optimization_profiles)]
        self.contexts = []
        for index in range(self.engine.num_optimization_profiles):
            context = self.engine.create_execution_context()
            if not context.set_optimization_profile_async(index, self.stream.handle):
                raise StageError(f"TensorRT refused optimization profile {index} of {engine_path}")
            self.contexts.append(context)
        self.stream.synchronize()

    def profile_for(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """The first profile whose min..max ranges hold every input shape."""
        for index, ranges in enumerate(self.profile_ranges):
            if all(len(shapes[n]) == len(ranges[n][0]) and
                   all(lo <= d <= hi for d, lo, hi in zip(shapes[n], ranges[n][0], ranges[n][2], strict=True))
                   for n in self.inputs):
                return index
        described = ", ".join(f"{n} {shapes[n]}" for n in self.inputs[:4])
        raise UsageError(f"no optimization profile of the engine takes these shapes ({described}); "
                         "rebuild with a larger context or batch (build_engine.max_batch, the target's budgets)")

    def run(self, feeds: dict[str, np.ndarray | DeviceArray]) -> dict[str, DeviceArray]:
        """One launch: outputs stay on the device (read them with ``.to_host(session.stream)``)."""
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise UsageError(f"engine input {missing[0]!r} not given")
        shapes = {n: tuple(feeds[n].shape) for n in self.inputs}
        context = self.contexts[self.profile_for(shapes)]
        device: dict[str, DeviceArray] = {}
        for name in self.inputs:
            value = feeds[name]
            if isinstance(value, DeviceArray):
                if value.dtype != self.dtypes[name]:
                    raise UsageError(f"{name}: device array is {value.dtype}, the engine takes {self.dtypes[name]}")
                device[name] = value
            else:
                device[name] = DeviceArray.from_host(
                    np.asarray(value).astype(self.dtypes[name], copy=False), self.stream
                )
            if not context.set_input_shape(name, shapes[name]):
                raise StageError(f"TensorRT refused the shape {shapes[name]} for {name}")
            context.set_tensor_address(name, device[name].ptr)
        outputs = {}
        for name in self.outputs:
            shape = tuple(context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise StageError(f"TensorRT could not infer the shape of {name} from the inputs")
            outputs[name] = DeviceArray(shape, self.dtypes[name])
            context.set_tensor_address(name, outputs[name].ptr)
        if not context.execute_async_v3(self.stream.handle):
            raise StageError("TensorRT could not launch the engine (see the TensorRT log above)")
        self.stream.synchronize()  # the uploaded inputs may be freed only after the launch has read them
        return outputs

    def close(self) -> None:
        self.contexts.clear()
        self.stream.close()
