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
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

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
def computed_in_float32(model: torch.nn.Module, rebuilt: dict[str, Rebuild] | None = None) -> Iterator[torch.nn.Module]:
    """Within, every forward pass of ``model`` computes in float32 part by part (see the module docstring);
    ``rebuilt``: parameter name -> the function that gives its float32 value."""
    by_id = {id(p): rebuilt[name] for name, p in model.named_parameters(remove_duplicate=False) if rebuilt and name in rebuilt}
    blocks = {id(block) for block in decoder_blocks(model)}
    helds: list[list[tuple[torch.nn.Parameter, torch.Tensor]]] = []
    handles = []
    sliced: list[torch.nn.Module] = []
    for part in _parts(model):
        forward = None if any(id(p) in by_id for p in part.parameters()) else _sliced_forward(part)
        if forward is not None:  # computed from its own tensors a slice at a time: nothing to upcast
            part.forward = forward
            sliced.append(part)
            continue
        held: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        helds.append(held)

        def upcast(_module, _args, part=part, held=held):
            for parameter in part.parameters(recurse=id(part) in blocks):
                held.append((parameter, parameter.data))
                make = by_id.get(id(parameter))
                parameter.data = make().to(parameter.device) if make else parameter.data.float()

        def restore(_module, _args, _output, held=held):
            _give_back(held)

        handles.append(part.register_forward_pre_hook(upcast))
        handles.append(part.register_forward_hook(restore))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for held in helds:  # a forward pass that raised left its part upcast
            _give_back(held)
        for part in sliced:
            del part.forward  # the class's forward again


def _sliced_forward(part: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A float32 forward for a plain token embedding or a large linear that never copies its whole weight, else None."""
    weight = getattr(part, "weight", None)
    if weight is None or weight.dtype == torch.float32:
        return None
    if type(part) is torch.nn.Embedding and part.max_norm is None:
        return lambda ids: F.embedding(ids, part.weight, part.padding_idx).float()
    if type(part) is torch.nn.Linear and part.out_features > HEAD_ROWS:
        return lambda inputs: linear_in_row_slices(inputs, part.weight, part.bias)
    return None


def linear_in_row_slices(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in float32 with ``weight`` (any dtype) taken :data:`HEAD_ROWS` rows at a time."""
    inputs = inputs.to(torch.float32)
    out = torch.empty(*inputs.shape[:-1], weight.shape[0], dtype=torch.float32, device=inputs.device)
    for start in range(0, weight.shape[0], HEAD_ROWS):
        stop = min(start + HEAD_ROWS, weight.shape[0])
        out[..., start:stop] = F.linear(inputs, weight[start:stop].float(), None if bias is None else bias[start:stop].float())
    return out


def tensor_bytes(tensors) -> int:
    """The bytes ``tensors`` hold (each storage once: tied weights count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None and tensor.numel():
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


def holding_device(device: str, held_bytes: int, float32_part_bytes: int) -> str:
    """Where a model of ``held_bytes`` (as held: 16-bit tensors, levels) computes in float32 a part at a time: ``device``
    when that is the CPU, or when the CUDA device has room for the model, its largest part in float32 and as much again
    for activations; else the CPU (slower, and said so in the log)."""
    if not device.startswith("cuda"):
        return "cpu"
    free, _total = torch.cuda.mem_get_info(device)
    needed = held_bytes + 2 * float32_part_bytes
    if needed > 0.9 * free:
        log.info("the model needs %.1f GB on %s, which has %.1f GB free: computed on the CPU", needed / 1e9, device, free / 1e9)
        return "cpu"
    return device


def largest_part_float32_bytes(model: torch.nn.Module) -> int:
    """The float32 size of the largest part :func:`computed_in_float32` upcasts at once (a decoder block, usually)."""
    return max((4 * sum(p.numel() for p in part.parameters()) for part in _parts(model)), default=0)


def _give_back(held: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    while held:
        parameter, data = held.pop()
        parameter.data = data
