"""The one block walker: every transform that works on a decoder block by block runs through it.

Calibration enters as token windows or as a ``forward_loop(model)`` callable (Model Optimizer's
convention), so transforms never load data. The walker captures what the first decoder block
receives, and what every block receives besides its hidden states (the attention mask and rotary
tables: a sliding-window layer of Gemma 3 gets a banded mask and its own rotary base, a full layer
the causal mask and the global base), then for each block in order:

1. moves the block and its inputs to the compute device, in the compute dtype (float32 by default,
   whatever the model is held in; the walker's business, never a visitor's),
2. hands the block and its inputs to every visitor (:meth:`BlockVisitor.visit`: calibrate,
   quantize, sparsify, score in place),
3. runs the block on its inputs to produce the next block's inputs, with whatever simulation the
   visitors ask for (:meth:`BlockVisitor.propagation_hooks`, e.g. quantized activations),
4. shows visitors the outputs (:meth:`BlockVisitor.after`), moves the block back and releases what
   it freed.

Only the hidden states entering the current block are held (``windows x tokens x hidden``), so peak
memory grows with the calibration set and one block, not with depth. Where the blocks come from is
the caller's choice: :class:`HeldBlocks` for a model held in memory (each block moves to the
device and back), :class:`StreamedBlocks` for one built empty (:func:`compress.models.weights.empty_causal_lm`)
whose blocks are read from its checkpoint when their turn comes and released after, so that the
model is never in memory at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from compress.algorithms.stats import InputStats
from compress.models.families import decoder_blocks
from compress.models.weights import CheckpointReader, materialize, module_prefix, release, set_parameter

log = logging.getLogger(__name__)

# Token windows ``(n, tokens)``, or a callable that runs the model over the calibration data.
Calibration = torch.Tensor | Callable[[torch.nn.Module], None]


class _Captured(Exception):
    """Raised by the stand-in first block to stop the forward pass once its inputs are captured."""


@dataclass
class BlockInputs:
    """Hidden states entering a decoder block, one tensor per calibration batch, and the block's keyword arguments."""

    hidden: list[torch.Tensor]
    kwargs: dict[str, Any]

    def to(self, device: torch.device | str | None, dtype: torch.dtype | None = None) -> BlockInputs:
        """These inputs on ``device`` with their float tensors in ``dtype`` (None: unchanged)."""
        if device is None and dtype is None:
            return self
        return BlockInputs([_move(h, device, dtype) for h in self.hidden], _move(self.kwargs, device, dtype))


def _move(value: Any, device: torch.device | str | None, dtype: torch.dtype | None = None) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if dtype is not None and value.is_floating_point() else None)
    if isinstance(value, tuple):
        return tuple(_move(v, device, dtype) for v in value)
    if isinstance(value, list):
        return [_move(v, device, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _move(v, device, dtype) for k, v in value.items()}
    return value


@dataclass
class BlockKwargs:
    """The keyword arguments each decoder block receives besides its hidden states, each distinct set stored once (the
    blocks of one attention kind share one mask and one rotary table)."""

    sets: list[dict[str, Any]]
    of_block: list[int]

    def for_block(self, index: int) -> dict[str, Any]:
        """What block ``index`` receives."""
        return self.sets[self.of_block[index]] if self.sets else {}

    def to(self, device: torch.device | str | None, dtype: torch.dtype | None = None) -> BlockKwargs:
        """These kwargs on ``device`` with their float tensors in ``dtype`` (None: unchanged)."""
        if device is None and dtype is None:
            return self
        return BlockKwargs([_move(kwargs, device, dtype) for kwargs in self.sets], self.of_block)


@dataclass
class CapturedInputs:
    """What :func:`capture_block_inputs` captured: the hidden states entering the first block and every block's
    kwargs."""

    hidden: list[torch.Tensor]
    kwargs: BlockKwargs


def forward_loop_of(windows: torch.Tensor) -> Callable[[torch.nn.Module], None]:
    """A ``forward_loop`` running the model on each window, one at a time, without a KV cache."""
    def loop(model: torch.nn.Module) -> None:
        device = _model_device(model)
        for row in windows:
            model(row[None].to(device), use_cache=False)
    return loop


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def capture_block_inputs(model, calibration: Calibration) -> CapturedInputs:
    """Run the model's embeddings over the calibration data and capture what the first block receives, and the kwargs
    every block receives (read from the first batch; the blocks are stood in for, so none of them computes)."""
    loop = forward_loop_of(calibration) if isinstance(calibration, torch.Tensor) else calibration
    blocks = decoder_blocks(model)
    originals = list(blocks)
    hidden: list[torch.Tensor] = []
    per_block: list[dict[str, Any] | None] = [None] * len(originals)

    class _Stand(torch.nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index
            self.attention_type = getattr(originals[index], "attention_type", "full_attention")

        def forward(self, hidden_states, *args, **kwargs):
            if self.index == 0:
                hidden.append(hidden_states.detach())
            if per_block[self.index] is None:
                per_block[self.index] = {k: v for k, v in kwargs.items() if k not in _NOT_CAPTURED}
            if self.index == len(originals) - 1:
                raise _Captured
            return hidden_states

    forward = model.forward

    def stopping_forward(*args, **kwargs):
        with contextlib.suppress(_Captured):
            return forward(*args, **kwargs)
        return None

    for index in range(len(originals)):
        blocks[index] = _Stand(index)
    model.forward = stopping_forward
    try:
        with torch.no_grad():
            loop(model)
    finally:
        for index, block in enumerate(originals):
            blocks[index] = block
        del model.forward
    return CapturedInputs(hidden, _shared_sets(per_block))


_NOT_CAPTURED = ("past_key_values", "past_key_value", "cache", "use_cache")


def _shared_sets(per_block: list[dict[str, Any] | None]) -> BlockKwargs:
    """One set per distinct kwargs (the same objects under the same names), so a mask is moved and held once."""
    sets: list[dict[str, Any]] = []
    of_block: list[int] = []
    for kwargs in per_block:
        kwargs = kwargs or {}
        match = next((i for i, known in enumerate(sets) if known.keys() == kwargs.keys()
                      and all(known[k] is kwargs[k] for k in kwargs)), None)
        if match is None:
            sets.append(kwargs)
            match = len(sets) - 1
        of_block.append(match)
    return BlockKwargs(sets, of_block)


def capture_first_block_inputs(model, calibration: Calibration) -> BlockInputs:
    """What the first decoder block receives over the calibration data (see :func:`capture_block_inputs`)."""
    captured = capture_block_inputs(model, calibration)
    return BlockInputs(captured.hidden, captured.kwargs.for_block(0))


def run_block(block, inputs: BlockInputs) -> list[torch.Tensor]:
    """The block's outputs for every calibration batch."""
    outputs = []
    with torch.no_grad():
        for hidden in inputs.hidden:
            out = block(hidden, **inputs.kwargs)
            outputs.append(out[0] if isinstance(out, tuple) else out)
    return outputs


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


class BlockVisitor:
    """What a transform does with each decoder block the walker hands it; every method is optional."""

    needs_inputs: bool = True  # False: the visitor reads weights only, so nothing is captured or propagated

    def visit(self, index: int, block: torch.nn.Module, inputs: BlockInputs) -> None:
        """Calibrate, transform or score ``block`` in place, on the device it is on."""

    def propagation_hooks(self, index: int, block: torch.nn.Module) -> list:
        """Hooks (removable handles) in force while the block computes the next block's inputs."""
        return []

    def after(self, index: int, block: torch.nn.Module, inputs: BlockInputs, outputs: list[torch.Tensor]) -> None:
        """The block's inputs and the outputs it propagated."""


@contextlib.contextmanager
def onloaded(
    block: torch.nn.Module, device: torch.device | str | None, dtype: torch.dtype | None = None
) -> Iterator[None]:
    """``block`` on ``device`` and in ``dtype`` for the duration (None: as it is), then back where and as it was."""
    first = next(block.parameters())
    home, home_dtype = first.device, first.dtype
    moved = (device is not None and torch.device(device) != home) or (dtype is not None and dtype != home_dtype)
    if moved:
        block.to(device=device, dtype=dtype)
    try:
        yield
    finally:
        if moved:
            block.to(device=home, dtype=home_dtype)


class HeldBlocks:
    """Blocks of a model held in memory: each is moved to the compute device and dtype while visited, then back."""

    def onloaded(self, index: int, block: torch.nn.Module, device: torch.device | str | None,
                 dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
        return onloaded(block, device, dtype)


class StreamedBlocks:
    """Blocks read from the model's checkpoint when visited, straight onto the compute device and dtype, and released
    after (the model was built empty: its blocks hold no memory between visits).

    ``extra(block_prefix)`` gives, by full name, the tensors of parameters the checkpoint does not hold as such (a
    quantized linear's weight, rebuilt from its levels).
    """

    def __init__(self, model: torch.nn.Module, reader: CheckpointReader,
                 extra: Callable[[str], dict[str, torch.Tensor]] | None = None) -> None:
        self.prefix = module_prefix(model, decoder_blocks(model))
        self.reader = reader
        self.extra = extra

    @contextlib.contextmanager
    def onloaded(self, index: int, block: torch.nn.Module, device: torch.device | str | None,
                 dtype: torch.dtype | None) -> Iterator[None]:
        prefix = f"{self.prefix}.{index}"
        extra = self.extra(prefix) if self.extra else {}
        local = {name.removeprefix(prefix + "."): tensor for name, tensor in extra.items()}
        materialize(block, prefix, self.reader, device=device, dtype=dtype, skip=frozenset(local))
        for name, tensor in local.items():
            set_parameter(block, name, tensor.to(device=device, dtype=dtype))
        try:
            yield
        finally:
            release(block)


COMPUTE_DTYPE = torch.float32  # what a block computes in while the walker visits it


def walk_blocks(
    model,
    calibration: Calibration | None,
    visitors: Sequence[BlockVisitor],
    *,
    device: torch.device | str | None = None,
    progress: bool = False,
    desc: str = "blocks",
    blocks: HeldBlocks | StreamedBlocks | None = None,
) -> None:
    """Drive ``model``'s decoder blocks once, in order, through ``visitors`` (see the module docstring).

    ``device`` is where each block and its inputs are computed (None: where the model is); between
    blocks the hidden states stay there too. Each block computes in float32 (:data:`COMPUTE_DTYPE`) while it
    is visited: a model held in bf16 is computed on in float32 one block at a time, and each block returns to bf16
    after. ``blocks``: where the blocks come from (:class:`HeldBlocks` by default).
    """
    home = blocks or HeldBlocks()
    propagate = any(v.needs_inputs for v in visitors)
    hidden: list[torch.Tensor] = []
    kwargs = BlockKwargs([], [])
    if propagate:
        with _embeddings_in(model, COMPUTE_DTYPE):
            captured = capture_block_inputs(model, calibration)
        hidden = _move(captured.hidden, device, COMPUTE_DTYPE)
        kwargs = captured.kwargs.to(device, COMPUTE_DTYPE)
        del captured
    layers = decoder_blocks(model)
    started = time.perf_counter()
    for index in tqdm(range(len(layers)), desc=desc, unit="layer", disable=not progress, leave=False):
        _log_progress(desc, index, len(layers), started)
        block = layers[index]
        inputs = BlockInputs(hidden, kwargs.for_block(index))
        with home.onloaded(index, block, device, COMPUTE_DTYPE):
            for visitor in visitors:
                visitor.visit(index, block, inputs)
            if not propagate:
                continue
            handles = [handle for visitor in visitors for handle in visitor.propagation_hooks(index, block)]
            try:
                outputs = run_block(block, inputs)
            finally:
                for handle in handles:
                    handle.remove()
            for visitor in visitors:
                visitor.after(index, block, inputs, outputs)
        hidden = outputs
        del inputs, outputs
        release_freed_memory()


@contextlib.contextmanager
def _embeddings_in(model, dtype: torch.dtype | None) -> Iterator[None]:
    """The input embeddings' output cast to ``dtype`` for the duration: what enters the first block, and the rotary
    tables computed in its dtype, are then the float32 model's, not rounded to the 16 bits the model is held in."""
    if dtype is None:
        yield
        return
    handle = model.get_input_embeddings().register_forward_hook(lambda _module, _args, output: output.to(dtype))
    try:
        yield
    finally:
        handle.remove()


def _log_progress(desc: str, index: int, total: int, started: float) -> None:
    """A log line (the terminal and ``run.log``) about every tenth of the blocks, with the time left at this pace."""
    step = max(1, total // 10)
    if index == 0 or index % step:
        return
    elapsed = time.perf_counter() - started
    log.info(
        "%s: %d of %d blocks in %.0f s, about %.0f s left",
        desc,
        index,
        total,
        elapsed,
        elapsed / index * (total - index),
    )


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
