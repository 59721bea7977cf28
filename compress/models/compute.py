"""A model held in 16 bits (or as quantized levels) and computed in float32, one part at a time.

Holding a 7B model in float32 needs 28 GB; holding it in bf16 needs 14. Inside
:func:`computed_in_float32`, each part of a causal LM (every decoder block, and each module outside
the blocks that owns parameters: embeddings, final norm, LM head) gets float32 copies of its
parameters for the duration of its own forward pass and its own tensors back after, so the model
computes exactly what its float32 copy would (the weights hold the same numbers) while at most one
part is ever held in float32. A parameter may instead be rebuilt by a function each time its part
runs (a quantized linear, held as its levels and scales).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from compress.models.families import decoder_blocks

Rebuild = Callable[[], torch.Tensor]  # a parameter's float32 value, computed when its part runs


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
    for part in _parts(model):
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


def _give_back(held: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    while held:
        parameter, data = held.pop()
        parameter.data = data
