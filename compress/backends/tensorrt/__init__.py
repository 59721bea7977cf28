"""Generic TensorRT engines: static checks of a graph against a target, build plans, the FP16 engine graph, the builder,
cuda-python memory and streams, engine sessions."""
