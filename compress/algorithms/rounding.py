"""Learned rounding and clipping: a block's rounding decisions and scales tuned against its float outputs.

After AWQ / GPTQ has put each weight on its grid, the block's quantized outputs still differ from
the float block's. SignRound (Cheng et al., 2023; what AutoRound runs) tunes, per element, an offset
``v`` added to the weight before it is rounded, and per scale a clipping factor ``c``, by signed
gradient descent on the block's output error, with straight-through estimates of the rounding:

    w_q = dequantize(levels(w_start + v * unit, s * c), s * c)

``unit`` is one grid step of the starting scales, ``v`` stays within one step either way (so a
rounding decision can move to the neighbouring level) and ``c`` within :data:`CLIP_RANGE`. At
``v = 0, c = 1`` the weight is exactly the starting solution. Everything goes through the
:class:`~compress.algorithms.formats.WeightGrid` protocol, so INT4 groups, INT8 channels, FP8 and
NVFP4 blocks are tuned alike, and the tuned weight is on the grid by construction: its levels are
the grid's rounding of a float tensor under scales the grid snapped to its own format.

The block is computed with the tuned weights through ``torch.func.functional_call`` (its module
weights are not touched while tuning), quantized inputs with a straight-through estimate, on
whatever device the block is on. The tuned solution is kept only where it lowers the output error
on every calibration window against the start (:class:`TuneOutcome`), so tuning never makes a block
worse on the data it was measured on.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import functional_call

from compress.algorithms.formats import WeightGrid, expand_scales
from compress.algorithms.rotation import rotate

CLIP_RANGE = (0.6, 1.2)  # how far tuning may shrink or widen a scale
OFFSET_LIMIT = 1.0  # grid steps (of the starting scales) an element may move before rounding


@dataclass(frozen=True)
class TuneSettings:
    """How long to tune: signed-gradient ``iters`` per block on ``windows`` calibration windows each (a different
    random draw each iteration), at learning rate ``lr`` (grid steps per iteration, decaying linearly to zero;
    None: ``1 / iters``, AutoRound's)."""

    iters: int
    windows: int = 4
    lr: float | None = None
    seed: int = 0

    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else 1.0 / max(1, self.iters)


@dataclass
class TunableWeight:
    """One linear's weight on its grid, with the offsets and clipping factors being tuned.

    ``start`` is the on-grid starting weight in the basis its input is quantized in, ``scales`` its scales (per
    tensor, channel or group, as the grid keeps them); ``rotation`` the Hadamard block its input is rotated by (the
    module computes with the weight rotated back; 0: none)."""

    grid: WeightGrid
    start: torch.Tensor
    scales: torch.Tensor
    rotation: int = 0
    offset: torch.Tensor = field(init=False)
    clip: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.start.detach().float()
        self.scales = self.scales.detach().float()
        self._unit = self.grid.dequantize(torch.ones_like(self.start), expand_scales(self.scales, self.start.shape[1]))
        self.offset = torch.zeros_like(self.start, requires_grad=True)
        self.clip = torch.ones_like(self.scales, requires_grad=True)

    def module_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight in the input's basis as the module computes with it."""
        return rotate(weight, self.rotation) if self.rotation else weight

    def _target(self) -> torch.Tensor:
        return self.start + self.offset * self._unit

    def _snapped_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales as the grid stores them (no gradient) and the same values carrying the clip's gradient."""
        raw = self.scales * self.clip
        snapped = self.grid.snap_scales(raw.detach())
        return snapped, snapped + (raw - raw.detach())

    def quantized(self) -> torch.Tensor:
        """The on-grid weight (input basis) for the current offsets and clips, with straight-through gradients."""
        target = self._target()
        snapped, scales = self._snapped_scales()
        width = self.start.shape[1]
        levels = self.grid.levels(target.detach(), expand_scales(snapped, width))
        value = self.grid.dequantize(levels, expand_scales(scales, width))
        return value + (target - target.detach())

    def solution(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tuned on-grid weight (input basis) and its scales, as the grid stores them."""
        with torch.no_grad():
            snapped, _ = self._snapped_scales()
            expanded = expand_scales(snapped, self.start.shape[1])
            return self.grid.dequantize(self.grid.levels(self._target(), expanded), expanded), snapped

    def step(self, lr: float) -> None:
        """One signed-gradient step on the offsets and clips, each kept in its range."""
        with torch.no_grad():
            for tensor, low, high in ((self.offset, -OFFSET_LIMIT, OFFSET_LIMIT), (self.clip, *CLIP_RANGE)):
                if tensor.grad is not None:
                    tensor -= lr * tensor.grad.sign()
                    tensor.clamp_(low, high)
                    tensor.grad = None

    def reset(self) -> None:
        """Back to the starting solution."""
        with torch.no_grad():
            self.offset.zero_()
            self.clip.fill_(1.0)


@dataclass(frozen=True)
class TuneOutcome:
    """A block's output error (mean squared, over every calibration window) before and after tuning, and whether the
    tuned solution was kept (only when it is lower)."""

    error_before: float
    error_after: float
    kept: bool
    seconds: float = 0.0


@contextmanager
def _straight_through_inputs(block: torch.nn.Module,
                             quantizers: dict[str, Callable[[torch.Tensor], torch.Tensor]]):
    """The block's linear inputs fake-quantized as deployed, with the identity's gradient (so the linears before a
    quantized input are tuned too)."""
    def hook_for(quantize):
        def hook(_module, args):
            x = args[0]
            return (x + (quantize(x) - x).detach(), *args[1:])
        return hook

    handles = [block.get_submodule(name).register_forward_pre_hook(hook_for(q)) for name, q in quantizers.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _frozen(block: torch.nn.Module):
    """The block's own parameters take no gradient while its weights are tuned."""
    wanted = [(p, p.requires_grad) for p in block.parameters()]
    for parameter, _ in wanted:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter, requires in wanted:
            parameter.requires_grad_(requires)


class _Block:
    """The block computed with the weights being tuned (by their parameter names inside the block)."""

    def __init__(self, block: torch.nn.Module, weights: dict[str, TunableWeight], kwargs: dict[str, Any]) -> None:
        self.block, self.weights, self.kwargs = block, weights, kwargs
        self.batched = True

    def output(self, hidden: torch.Tensor) -> torch.Tensor:
        replaced = {f"{name}.weight": weight.module_weight(weight.quantized())
                    for name, weight in self.weights.items()}
        out = functional_call(self.block, replaced, (hidden,), self.kwargs)
        return out[0] if isinstance(out, tuple) else out

    def backward(self, chosen: list[int], inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> None:
        """Gradients of the mean squared error over the ``chosen`` windows, computed as one batch where the block's
        keyword arguments (mask, rotary tables) broadcast over it, else window by window."""
        if self.batched:
            try:
                hidden = torch.cat([inputs[i] for i in chosen])
                target = torch.cat([targets[i] for i in chosen])
                (self.output(hidden) - target).pow(2).mean().backward()
                return
            except RuntimeError:
                self.batched = False
                for weight in self.weights.values():
                    weight.offset.grad = weight.clip.grad = None
        for index in chosen:
            ((self.output(inputs[index]) - targets[index]).pow(2).mean() / len(chosen)).backward()

    def error(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> float:
        """Mean squared output error over every window with the current offsets and clips."""
        with torch.no_grad():
            total = sum(float((self.output(h) - t).pow(2).mean()) for h, t in zip(inputs, targets, strict=True))
        return total / len(inputs)


def tune_block(block: torch.nn.Module, weights: dict[str, TunableWeight], inputs: Sequence[torch.Tensor],
               targets: Sequence[torch.Tensor], kwargs: dict[str, Any], settings: TuneSettings,
               input_quantizers: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None) -> TuneOutcome:
    """Tune ``weights`` (by module path inside ``block``) so that ``block`` on ``inputs`` (one tensor per calibration
    window, the already-quantized earlier blocks' outputs) comes closer to ``targets`` (the float block's outputs on
    them). Each weight is left at its tuned solution where that lowers the error over all windows, else at its start;
    the caller writes :meth:`TunableWeight.solution` back."""
    started = time.perf_counter()
    computed = _Block(block, weights, kwargs)
    with _straight_through_inputs(block, input_quantizers or {}), _frozen(block):
        before = computed.error(inputs, targets)
        draw = random.Random(settings.seed)
        lr = settings.learning_rate()
        per_step = min(settings.windows, len(inputs))
        for iteration in range(settings.iters):
            computed.backward(draw.sample(range(len(inputs)), per_step), inputs, targets)
            decayed = lr * (1 - iteration / settings.iters)
            for weight in weights.values():
                weight.step(decayed)
        after = computed.error(inputs, targets)
    kept = math.isfinite(after) and after < before
    if not kept:
        for weight in weights.values():
            weight.reset()
    return TuneOutcome(before, after, kept, time.perf_counter() - started)
