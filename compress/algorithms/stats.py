"""Statistics of a linear layer's input over calibration data: ranges, sums of squares, Hessians, sampled rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compress.algorithms.rotation import rotate, rotate_gram

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


