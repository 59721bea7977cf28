"""Deployment formats, one folder each: the portable ONNX (onnx/), TensorRT engines (tensorrt/), TensorRT Edge-LLM
(edgellm/)."""
