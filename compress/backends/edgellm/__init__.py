"""TensorRT Edge-LLM: the unified quantized checkpoint, the exported bundle and its chain of custody, the kernel
contracts of the pinned release, and its device tools."""
