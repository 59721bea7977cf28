"""TensorRT engines: static checks of an ONNX graph against a target, build plans, and the builder."""
