"""A model held in 16 bits (or as quantized levels) and computed in float32, one part at a time.

Holding a 7B model in float32 needs 28 GB; holding it in bf16 needs 14. Inside
:func:`computed_in_float32`, each part of a causal LM (every decoder block, and each module outside
the blocks that owns parameters: embeddings, final norm, LM head) gets float32 copies of its
parameters for the duration of its own forward pass and its own tensors back after, so the model
computes exactly what its float32 copy would (the weights hold the same numbers) while at most one
part is ever held in float32. A parameter may instead be rebuilt by a function each time its part
runs (a quantized linear, held as its levels and scales).

The two largest parts outside the blocks are never copied whole: the token embedding picks its rows in
their own dtype and converts only them (the same numbers), and the LM head is taken in float32
:data:`HEAD_ROWS` rows at a time. A 150k-token vocabulary's table in float32 is larger than a
0.3B model's blocks.

A model loaded from a memory-mapped checkpoint gives each part's pages back to the OS page cache
once the part has computed (:mod:`compress.core.mapped_pages`), so a pass over the model holds one
part of it, not the whole checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from compress.core.mapped_pages import MappedPages
from compress.models.families import decoder_blocks

log = logging.getLogger(__name__)

Rebuild = Callable[[], torch.Tensor]  # a parameter's float32 value, computed when its part runs
HEAD_ROWS = 16384  # rows of a large output linear (the LM head) taken in float32 at once


def _parts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks, then every module outside them that owns parameters itself."""
    blocks = list(decoder_blocks(model))
    inside = {id(m) for block in blocks for m in block.modules()}
    others = [m for m in model.modules() if id(m) not in inside and any(True for _ in m.parameters(recurse=False))]
    return blocks + others


@contextlib.contextmanager
def computed_in_float32(model: torch.nn.Module, rebuilt: dict[str, Rebuild] | None = None,
                        recompute_blocks: bool = False, hand_back_pages: bool = True) -> Iterator[torch.nn.Module]:
    """Within, every forward pass of ``model`` computes in float32 part by part (see the module docstring);
    ``rebuilt``: parameter name -> the function that gives its float32 value. With ``recompute_blocks``, a backward pass
    keeps only each decoder block's inputs and computes the block again when it reaches it (activation checkpointing):
    what it holds is one block's activations, not every block's. ``hand_back_pages``: each part's pages of a mapped
    checkpoint go back to the page cache once it has computed (off: the process keeps every page it read)."""
    by_id = {
        id(p): rebuilt[name]
        for name, p in model.named_parameters(remove_duplicate=False)
        if rebuilt and name in rebuilt
    }
    blocks = {id(block) for block in decoder_blocks(model)}
    helds: list[list[tuple[torch.nn.Parameter, torch.Tensor]]] = []
    handles = []
    patched: list[torch.nn.Module] = []
    copies = _Float32Copies()
    pages = MappedPages(p.data for p in model.parameters()) if hand_back_pages else MappedPages([])
    for part in _parts(model):
        forward = None if any(id(p) in by_id for p in part.parameters()) else _sliced_forward(part, copies)
        if forward is not None:  # computed from its own tensors a slice at a time: nothing to upcast
            part.forward = _handing_back(forward, part, pages)
            patched.append(part)
            continue
        held: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        helds.append(held)

        def upcast(_module, _args, part=part, held=held):
            for parameter in part.parameters(recurse=id(part) in blocks):
                held.append((parameter, parameter.data))
                make = by_id.get(id(parameter))
                parameter.data = copies.add(parameter.data, make)

        def restore(_module, _args, _output, part=part, held=held):
            copies.drop(parameter.data for parameter, _ in held)
            _give_back(held)
            pages.release(p.data for p in part.parameters(recurse=id(part) in blocks))

        if recompute_blocks and id(part) in blocks:
            part.forward = _recomputed_forward(part, by_id)
            patched.append(part)
            continue
        handles.append(part.register_forward_pre_hook(upcast))
        handles.append(part.register_forward_hook(restore))
    try:
        with torch.autograd.graph.saved_tensors_hooks(copies.pack, copies.unpack):
            yield model
    finally:
        copies.drop(parameter.data for held in helds for parameter, _ in held)
        for handle in handles:
            handle.remove()
        for held in helds:  # a forward pass that raised left its part upcast
            _give_back(held)
        for part in patched:
            del part.forward  # the class's forward again
        pages.close()


def _handing_back(forward: Callable, part: torch.nn.Module, pages: MappedPages) -> Callable:
    """``forward``, then ``part``'s own mapped pages handed back."""
    def run(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        finally:
            pages.release(p.data for p in part.parameters(recurse=False))
    return run


def _recomputed_forward(part: torch.nn.Module, by_id: dict[int, Rebuild]) -> Callable:
    """``part``'s forward in float32 under non-reentrant activation checkpointing. Its parameters are replaced by
    float32 tensors for the call (each pass gets its own, the second as the backward pass reaches the block) rather than
    upcast in place: the tensors the second pass saves are then the ones the first pass saved."""
    from torch.utils.checkpoint import checkpoint

    def in_float32(*args, **kwargs):
        replaced = [(module, name, parameter) for module in part.modules()
                    for name, parameter in module._parameters.items() if parameter is not None]
        for module, name, parameter in replaced:
            make = by_id.get(id(parameter))
            module._parameters[name] = make().to(parameter.device) if make else parameter.detach().float()
        try:
            return type(part).forward(part, *args, **kwargs)
        finally:
            for module, name, parameter in replaced:
                module._parameters[name] = parameter

    return lambda *args, **kwargs: checkpoint(in_float32, *args, use_reentrant=False, **kwargs)


class _Float32Copies:
    """The float32 copies of parameters that parts are computing with, by storage.

    A backward pass needs the weights its forward used; kept as saved, they would be every part's float32 copy at once
    (a 0.6B model's blocks take 2.4 GB more). A saved tensor that views a copy is saved as the parameter's own tensor
    (or its rebuild) and upcast again when the backward pass reaches it: the same numbers.
    """

    def __init__(self) -> None:
        self.by_storage: dict[int, tuple[torch.Tensor, Rebuild | None]] = {}

    def add(self, own: torch.Tensor, make: Rebuild | None) -> torch.Tensor:
        copy = make().to(own.device) if make else own.float()
        self.by_storage[copy.untyped_storage().data_ptr()] = (own, make)
        return copy

    def drop(self, copies: Iterator[torch.Tensor]) -> None:
        for copy in copies:
            self.by_storage.pop(copy.untyped_storage().data_ptr(), None)

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.dtype != torch.float32 or tensor.layout != torch.strided or not self.by_storage:
            return tensor
        source = self.by_storage.get(tensor.untyped_storage().data_ptr())
        if source is None:
            return tensor
        return _SavedCopy(*source, tensor.size(), tensor.stride(), tensor.storage_offset())

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedCopy):
            return saved
        copy = saved.make().to(saved.own.device) if saved.make else saved.own.float()
        return copy.as_strided(saved.size, saved.stride, saved.offset)


@dataclass(frozen=True)
class _SavedCopy:
    own: torch.Tensor
    make: Rebuild | None
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _sliced_forward(part: torch.nn.Module, copies: _Float32Copies) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A float32 forward for a plain token embedding or a large linear that never copies its whole weight, else None."""
    weight = getattr(part, "weight", None)
    if weight is None or weight.dtype == torch.float32:
        return None
    if type(part) is torch.nn.Embedding and part.max_norm is None:
        return lambda ids: F.embedding(ids, part.weight, part.padding_idx).float()
    if type(part) is torch.nn.Linear and part.out_features > HEAD_ROWS:
        return lambda inputs: linear_in_row_slices(inputs, part.weight, part.bias, copies)
    return None


def linear_in_row_slices(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         copies: _Float32Copies | None = None) -> torch.Tensor:
    """``F.linear`` in float32 with ``weight`` (any dtype) taken :data:`HEAD_ROWS` rows at a time (``copies``: where a
    backward pass finds each slice, rather than keeping its float32 copy)."""
    inputs = inputs.to(torch.float32)
    out = torch.empty(*inputs.shape[:-1], weight.shape[0], dtype=torch.float32, device=inputs.device)
    for start in range(0, weight.shape[0], HEAD_ROWS):
        stop = min(start + HEAD_ROWS, weight.shape[0])
        rows = weight[start:stop].float() if copies is None else copies.add(weight[start:stop], None)
        out[..., start:stop] = F.linear(inputs, rows, None if bias is None else bias[start:stop].float())
        if copies is not None:
            copies.drop([rows])
    return out


def tensor_bytes(tensors) -> int:
    """The bytes ``tensors`` hold (each storage once: tied weights count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None and tensor.numel():
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


def holding_device(device: str, held_bytes: int, float32_part_bytes: int) -> str:
    """Where a model of ``held_bytes`` (as held: 16-bit tensors, levels) computes in float32 a part at a time:
    ``device`` when that is the CPU, or when the CUDA device has room for the model, its largest part in float32 and as
    much again for activations; else the CPU (slower, and said so in the log)."""
    if not device.startswith("cuda"):
        return "cpu"
    free, _total = torch.cuda.mem_get_info(device)
    needed = held_bytes + 2 * float32_part_bytes
    if needed > 0.9 * free:
        log.info(
            "the model needs %.1f GB on %s, which has %.1f GB free: computed on the CPU",
            needed / 1e9,
            device,
            free / 1e9,
        )
        return "cpu"
    return device


def largest_part_float32_bytes(model: torch.nn.Module) -> int:
    """The float32 size of the largest part :func:`computed_in_float32` upcasts at once (a decoder block, usually)."""
    return max((4 * sum(p.numel() for p in part.parameters()) for part in _parts(model)), default=0)


def _give_back(held: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    while held:
        parameter, data = held.pop()
        parameter.data = data
