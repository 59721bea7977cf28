"""Tensor math on plain tensors: number formats and precisions, SmoothQuant/AWQ/GPTQ, sparse masks, rotations, KV-cache
scales, input statistics."""
