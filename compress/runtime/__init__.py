"""Running what a compress run produced."""

from compress.runtime.onnx_decoder import OnnxDecoder

__all__ = ["OnnxDecoder"]
