"""Layer-by-layer calibration: the decoder is walked one block at a time.

Only the hidden states entering the current block are held (``windows x tokens x hidden``), so
peak memory grows with the calibration set and one block's activations, not with depth.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from compress.algorithms.rotation import rotate, rotate_gram


class _Captured(Exception):
    """Raised by the stand-in first block to stop the forward pass once its inputs are captured."""


@dataclass
class BlockInputs:
    """Hidden states entering a decoder block, one tensor per calibration window, and the shared kwargs."""

    hidden: list[torch.Tensor]
    kwargs: dict[str, Any]


def decoder_blocks(model) -> torch.nn.ModuleList:
    """The decoder blocks of a causal LM of a described family."""
    return model.model.layers


def capture_first_block_inputs(model, windows: torch.Tensor) -> BlockInputs:
    """Run the embeddings on each window and capture what the first block receives."""
    blocks = decoder_blocks(model)
    first = blocks[0]
    hidden: list[torch.Tensor] = []
    shared: dict[str, Any] = {}

    class _Stand(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_type = getattr(first, "attention_type", "full_attention")

        def forward(self, hidden_states, *args, **kwargs):
            hidden.append(hidden_states.detach())
            if not shared:
                shared.update({k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "use_cache")})
            raise _Captured

    blocks[0] = _Stand()
    try:
        with torch.no_grad():
            for row in windows:
                with contextlib.suppress(_Captured):
                    model(row[None], use_cache=False)
    finally:
        blocks[0] = first
    return BlockInputs(hidden, shared)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(name).malloc_trim if name else None
    return None


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Each block frees its inputs, statistics and Hessians before the next one allocates its own;
    trimming keeps glibc from holding those pages between blocks.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def run_block(block, inputs: BlockInputs) -> list[torch.Tensor]:
    """The block's outputs for every window."""
    outputs = []
    with torch.no_grad():
        for hidden in inputs.hidden:
            out = block(hidden, **inputs.kwargs)
            outputs.append(out[0] if isinstance(out, tuple) else out)
    return outputs


# The first position of every window is an attention sink: its activations are orders of magnitude
# larger than other tokens' in a few channels. Kept in the statistics (absmax, Hessian), it is left
# out of the sampled rows, where a single sink row would dominate the output-error searches (AWQ
# scales and clipping, SmoothQuant strength) and tune them to a token attention mostly ignores.
SINK_POSITIONS = 1


@dataclass
class InputStats:
    """Statistics of the input of one linear layer over the calibration set."""

    absmax: torch.Tensor | None = None
    sq_sum: torch.Tensor | None = None
    hessian: torch.Tensor | None = None
    samples: list[torch.Tensor] = field(default_factory=list)
    tokens: int = 0
    rotation: int = 0
    rotated_absmax: torch.Tensor | None = None

    def add(self, x: torch.Tensor, want_hessian: bool, sample_rows: int, generator: torch.Generator) -> None:
        rows = x.reshape(-1, x.shape[-1]).float()
        absmax = rows.abs().amax(dim=0)
        self.absmax = absmax if self.absmax is None else torch.maximum(self.absmax, absmax)
        squares = rows.double().pow(2).sum(dim=0)
        self.sq_sum = squares if self.sq_sum is None else self.sq_sum + squares
        if want_hessian:
            gram = rows.T.double() @ rows.double()
            self.hessian = gram if self.hessian is None else self.hessian + gram
        self.tokens += rows.shape[0]
        if self.rotation:
            absmax = rotate(rows, self.rotation).abs().amax(dim=0)
            self.rotated_absmax = absmax if self.rotated_absmax is None else torch.maximum(self.rotated_absmax, absmax)
        if sample_rows:
            pool = _without_sink_positions(x).reshape(-1, x.shape[-1]).float()
            picks = torch.randperm(pool.shape[0], generator=generator)[:sample_rows]
            self.samples.append(pool[picks])

    def rotated_view(self) -> InputStats:
        """The statistics of the input after its Hadamard rotation (requires ``rotation`` set before ``add``)."""
        if not self.rotation or self.rotated_absmax is None:
            raise ValueError("these statistics were gathered without a rotation")
        hessian = None if self.hessian is None else rotate_gram(self.hessian, self.rotation)
        return InputStats(
            absmax=self.rotated_absmax,
            sq_sum=None if hessian is None else hessian.diagonal().clone(),  # sums of squares of the rotated input
            hessian=hessian,
            samples=[rotate(s, self.rotation) for s in self.samples],
            tokens=self.tokens,
        )

    def sample_matrix(self, limit: int) -> torch.Tensor:
        rows = torch.cat(self.samples)
        return rows[:limit]

    def column_norms(self) -> torch.Tensor:
        """``||X_j||_2`` over every calibration token, per input channel."""
        return self.sq_sum.sqrt().float()

    def mean_hessian(self) -> torch.Tensor:
        return (2 * self.hessian / self.tokens).float()

    def rescale(self, scales: torch.Tensor) -> None:
        """Statistics of ``x / scales`` (after a smoothing scale is folded into the producer)."""
        self.absmax = self.absmax / scales
        self.sq_sum = self.sq_sum / scales.double().pow(2)
        self.samples = [s / scales for s in self.samples]
        if self.hessian is not None:
            inv = (1.0 / scales).double()
            self.hessian = self.hessian * inv[:, None] * inv[None, :]


def _without_sink_positions(x: torch.Tensor) -> torch.Tensor:
    """``x`` (batch, tokens, channels) without its first ``SINK_POSITIONS`` tokens, if longer than that."""
    if x.dim() == 3 and x.shape[1] > SINK_POSITIONS:
        return x[:, SINK_POSITIONS:]
    return x


def collect_input_stats(block, inputs: BlockInputs, linears: dict[str, torch.nn.Module], want_hessian: bool,
                        sample_rows_per_window: int, seed: int = 0, rotations: dict[str, int] | None = None
                        ) -> dict[str, InputStats]:
    """Run the block once with hooks on the given linears' inputs (``rotations``: also the rotated view's ranges)."""
    stats = {name: InputStats(rotation=(rotations or {}).get(name, 0)) for name in linears}
    generator = torch.Generator().manual_seed(seed)
    handles = []

    def make_hook(name: str) -> Callable:
        def hook(_module, args):
            stats[name].add(args[0].detach(), want_hessian, sample_rows_per_window, generator)
        return hook

    for name, module in linears.items():
        handles.append(module.register_forward_pre_hook(make_hook(name)))
    try:
        run_block(block, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return stats


def run_encoder_batches(model, batches: list[dict[str, torch.Tensor]], mask: list[torch.Tensor], handles: list) -> None:
    """Run ``batches`` through an encoder without gradients, exposing each batch's attention mask as ``mask[0]`` to the
    hooks in ``handles``, which are removed afterwards."""
    try:
        with torch.no_grad():
            for batch in batches:
                mask[:] = [batch["attention_mask"]]
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
