"""Model surgery: physically smaller decoders that still load with plain transformers.

Every change here is exact bookkeeping on a family's wiring (:mod:`compress.models.families`):
query heads removed from attention (GQA groups kept whole), whole layers dropped, MLP channels
narrowed. Choosing *what* to remove is the transforms' job; this module only removes it.
"""

from __future__ import annotations

import torch

from compress.core.errors import UsageError
from compress.models.families import attention_geometry, decoder_blocks, family_of, rows_keeping


def replace_module(block, path: str, module: torch.nn.Module) -> None:
    """Put ``module`` at ``path`` inside ``block``."""
    parent, _, name = path.rpartition(".")
    setattr(block.get_submodule(parent) if parent else block, name, module)


def select_linear(linear: torch.nn.Linear, index: torch.Tensor, dim: int) -> torch.nn.Linear:
    """A new linear keeping the rows (``dim=0``, with their biases) or input columns (``dim=1``) at ``index``."""
    weight = linear.weight.detach().index_select(dim, index).clone()
    bias = linear.bias
    if bias is not None and dim == 0:
        bias = bias.detach().index_select(0, index).clone()
    new = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
    return new


def prune_heads(model, plan: list[list[int]]) -> None:
    """Remove query heads physically: fewer query rows (``q_proj``, or the q part of a fused ``qkv_proj``, with
    their biases) and fewer attention-output columns; KV heads, per-head q/k norms and the config follow."""
    family = family_of(model.config)
    _, kv, head_dim = attention_geometry(model.config)
    counts = {len(kept) for kept in plan}
    if len(counts) != 1:
        raise UsageError("every layer must keep the same number of heads (GQA rule)")
    for block, kept in zip(decoder_blocks(model), plan, strict=True):
        if not kept:
            raise UsageError("a layer cannot lose its last head")
        query = torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in kept])
        for name in family.linears_with("q"):
            rows = rows_keeping(family, model.config, name, {"q": query})
            replace_module(block, name, select_linear(block.get_submodule(name), rows, dim=0))
        replace_module(block, family.attn_output, select_linear(block.get_submodule(family.attn_output), query, dim=1))
        attn = block.get_submodule(family.attention)
        attn.num_key_value_groups = len(kept) // kv
        if hasattr(attn, "num_heads"):
            attn.num_heads = len(kept)
    model.config.num_attention_heads = counts.pop()
    model.config.head_dim = head_dim


def drop_layers(model, kept: list[int]) -> None:
    """Keep only the decoder layers at ``kept`` (in order); each keeps its attention kind (sliding or full)."""
    blocks = decoder_blocks(model)
    model.model.layers = torch.nn.ModuleList([blocks[i] for i in kept])
    attention = family_of(model.config).attention
    for new_index, block in enumerate(decoder_blocks(model)):
        if hasattr(block.get_submodule(attention), "layer_idx"):
            block.get_submodule(attention).layer_idx = new_index
    model.config.num_hidden_layers = len(kept)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in kept]


def narrow_mlp(model, importance: list[torch.Tensor], width: int) -> None:
    """Keep the ``width`` most important intermediate channels of every layer: rows of the gate and up parts
    (separate or fused) and the matching input columns of the output projection."""
    family = family_of(model.config)
    widened = [name for name in family.linears() if {"gate", "up"} & set(family.parts(name))]
    for block, scores in zip(decoder_blocks(model), importance, strict=True):
        keep = torch.sort(scores.topk(width).indices).values
        for name in widened:
            rows = rows_keeping(family, model.config, name, {"gate": keep, "up": keep})
            replace_module(block, name, select_linear(block.get_submodule(name), rows, dim=0))
        replace_module(block, family.mlp_output, select_linear(block.get_submodule(family.mlp_output), keep, dim=1))
        mlp = block.get_submodule(family.mlp_output.rsplit(".", 1)[0])
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = width
    model.config.intermediate_size = width
