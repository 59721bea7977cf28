"""A decoder engine in TensorRT with device buffers from torch (CUDA), imported lazily.

Same contract as :class:`compress.runtime.onnx_decoder.OnnxDecoder`, on torch CUDA tensors.
"""

from __future__ import annotations

from pathlib import Path

from compress.errors import MissingBackendError
from compress.runtime.onnx_decoder import DecoderLayout, past_names


def _backends():
    try:
        import tensorrt as trt
        import torch
    except ImportError as exc:
        raise MissingBackendError("not run: tensorrt is not installed") from exc
    if not torch.cuda.is_available():
        raise MissingBackendError("not run: no CUDA device")
    return trt, torch


class TrtDecoder:
    """Run a serialized decoder engine step by step."""

    def __init__(self, engine_path: Path, layout: DecoderLayout) -> None:
        trt, torch = _backends()
        self._torch = torch
        self.layout = layout
        self._logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self._logger).deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise MissingBackendError(f"TensorRT could not load {engine_path}: rebuild it on this device (compress build-engine)")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self._dtypes = {self.engine.get_tensor_name(i): self._torch_dtype(trt, self.engine.get_tensor_dtype(self.engine.get_tensor_name(i)))
                        for i in range(self.engine.num_io_tensors)}
        self._past = past_names(layout.num_layers)

    def _torch_dtype(self, trt, dtype):
        torch = self._torch
        table = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16, trt.DataType.INT32: torch.int32,
                 trt.DataType.INT64: torch.int64, trt.DataType.BOOL: torch.bool, trt.DataType.INT8: torch.int8}
        return table[dtype]

    def empty_past(self, batch: int) -> list:
        torch = self._torch
        return [torch.zeros((batch, self.layout.num_kv_heads[i // 2], 0, self.layout.head_dim), dtype=self._dtypes[name],
                            device="cuda") for i, name in enumerate(self._past)]

    def forward(self, input_ids, attention_mask, past):
        """One step on device tensors; returns logits and the grown cache (device tensors)."""
        torch = self._torch
        past_len = past[0].shape[2]
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past_len:]
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": positions,
                  **dict(zip(self._past, past, strict=True))}
        for name, tensor in inputs.items():
            tensor = tensor.to(self._dtypes[name]).contiguous()
            inputs[name] = tensor
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for index in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(index)
            if name in inputs:
                continue
            shape = tuple(self.context.get_tensor_shape(name))
            outputs[name] = torch.empty(shape, dtype=self._dtypes[name], device="cuda")
            self.context.set_tensor_address(name, outputs[name].data_ptr())
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise MissingBackendError("TensorRT execution failed")
        self.stream.synchronize()
        present = [outputs[f"present.{i}.{part}"] for i in range(self.layout.num_layers) for part in ("key", "value")]
        return outputs["logits"], present
