"""Block-diagonal Hadamard rotations of a linear layer's input.

A linear ``y = x W^T`` computes the same ``y`` as ``(x R)(W R)^T`` for any orthogonal ``R``. With
``R`` block-diagonal, built from normalized Sylvester Hadamard blocks, an outlier channel of ``x``
is spread over its whole block, so one static per-tensor INT8 scale covers the rotated input with
a finer step (QuaRot, SpinQuant). A Sylvester block is symmetric and its own inverse, so the same
function rotates and rotates back.
"""

from __future__ import annotations

import functools

import numpy as np
import torch


def check_block(size: int) -> None:
    """A Sylvester block size is a power of two."""
    if size < 2 or size & (size - 1):
        raise ValueError(f"Hadamard block size must be a power of two, got {size}")


@functools.cache
def hadamard(size: int) -> torch.Tensor:
    """The ``size x size`` normalized Sylvester Hadamard matrix (orthogonal, symmetric, involutory)."""
    check_block(size)
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / size ** 0.5


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` with its last axis multiplied by the block-diagonal Hadamard matrix (its own inverse)."""
    shape = x.shape
    if shape[-1] % block:
        raise ValueError(f"Hadamard block {block} does not divide width {shape[-1]}")
    blocks = x.reshape(*shape[:-1], shape[-1] // block, block)
    return (blocks @ hadamard(block).to(x.device, x.dtype)).reshape(shape)


def rotate_gram(gram: torch.Tensor, block: int) -> torch.Tensor:
    """``R^T G R`` for a Gram (Hessian) matrix ``G`` of inputs, i.e. the Gram matrix of the rotated inputs."""
    return rotate(rotate(gram, block).T.contiguous(), block).T.contiguous()


def rotate_numpy(x: np.ndarray, block: int) -> np.ndarray:
    """:func:`rotate` for float32 NumPy arrays (the exporter's side)."""
    return rotate(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64)), block).numpy().astype(np.float32)


def random_orthogonal(size: int, seed: int) -> torch.Tensor:
    """A ``size x size`` orthogonal matrix drawn uniformly (Haar) from a seeded generator, in float64."""
    generator = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


def randomized_hadamard(size: int, seed: int = 0) -> torch.Tensor:
    """An orthogonal ``size x size`` rotation that spreads every coordinate over all others: random signs times the
    Kronecker product of the largest normalized Hadamard matrix whose order divides ``size`` and a random orthogonal
    matrix of the odd rest (``576 = 64 x 9``; a power of two is a plain Hadamard matrix). Float64."""
    power = size & -size  # the largest power of two dividing size
    rest = size // power
    matrix = hadamard(power) if power > 1 else torch.ones(1, 1, dtype=torch.float64)
    if rest > 1:
        matrix = torch.kron(matrix.contiguous(), random_orthogonal(rest, seed + 1).contiguous())
    signs = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64) * 2 - 1
    return signs.to(torch.float64)[:, None] * matrix
