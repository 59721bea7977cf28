"""Rotations folded into the weights: the residual stream (and each value head) in a rotated basis, the model unchanged.

RMSNorm commutes with an orthogonal rotation once its weight is folded into the linears that read it
(QuaRot, SpinQuant): ``norm(x R) = norm(x) R`` for a weightless norm. So with every norm weight folded
forward, the embedding table, every linear reading the residual stream (``W R``) and every linear
writing to it (``R^T W``) rotated, and the LM head rotated, the model computes the same logits, and
its activations carry no channel far above the others: an outlier is spread over the whole width,
which is what a static per-tensor activation scale and a 4-bit grid need. Within attention, each
value head is rotated too (the value rows by ``H^T``, the output projection's columns by ``H``),
which attention's weighted sum of values passes through unchanged.

Nothing is added to the graph: the result is a plain checkpoint of the same family. A tied LM head
becomes a linear of its own (the folded final norm makes it differ from the embedding table), which
the quantize stage's report says. Families whose blocks normalise a branch's output before the
residual add (Gemma 3's post-norms) cannot carry the rotation through and are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from compress.algorithms.rotation import randomized_hadamard
from compress.core.errors import UsageError
from compress.models.families import Family, attention_geometry, decoder_blocks, family_of, final_norm, part_rows

ROWS_AT_A_TIME = 8192  # rows of an embedding table rotated at a time (a 150k-word table is never copied whole)


@dataclass(frozen=True)
class ResidualRotation:
    """The rotation of one model's residual stream (``matrix``, hidden x hidden) and value heads (``head``, head_dim x
    head_dim), both float64, and how its blocks are wired."""

    matrix: torch.Tensor
    head: torch.Tensor
    family: Family
    config: Any

    @classmethod
    def for_config(cls, config: Any, seed: int = 0) -> ResidualRotation:
        """The randomized Hadamard rotation for a model of ``config``; a usage error for a family it cannot pass."""
        family = family_of(config)
        if family.post_norms:
            raise UsageError(
                f"quantize.rotate=hadamard: model_type {config.model_type} normalises each branch's output before the "
                "residual add, which a rotation folded into the weights cannot pass through; use quantize.rotate=none"
            )
        _, _, head_dim = attention_geometry(config)
        return cls(randomized_hadamard(config.hidden_size, seed), randomized_hadamard(head_dim, seed + 7), family,
                   config)

    def rotate_block(self, block: torch.nn.Module) -> None:
        """Fold the block's norms into the linears reading them and rotate its linears, in place."""
        with torch.no_grad():
            for point in self.family.points:
                if point.producer_kind != "norm":
                    continue
                norm = block.get_submodule(point.producer)
                gain = norm.weight.double() + self.family.norm_offset
                for name in point.consumers:
                    linear = block.get_submodule(name)
                    _set(linear.weight, (linear.weight.double() * gain[None, :]) @ self.matrix)
                norm.weight.fill_(1.0 - self.family.norm_offset)
            for name in (self.family.attn_output, self.family.mlp_output):
                linear = block.get_submodule(name)
                _set(linear.weight, self.matrix.T @ linear.weight.double())
                if linear.bias is not None:
                    _set(linear.bias, linear.bias.double() @ self.matrix)
            self._rotate_values(block)

    def _rotate_values(self, block: torch.nn.Module) -> None:
        """Each value head's outputs by ``head`` (its rows by ``head^T``), and the output projection's columns to
        match."""
        heads, kv_heads, head_dim = attention_geometry(self.config)
        value = next(name for name in self.family.linears_with("v"))
        linear = block.get_submodule(value)
        rows = part_rows(self.family, self.config, value, "v")
        weight = linear.weight.double()
        per_head = weight[rows].reshape(kv_heads, head_dim, -1)
        weight[rows] = torch.einsum("dk,hdi->hki", self.head, per_head).reshape(kv_heads * head_dim, -1)
        _set(linear.weight, weight)
        if linear.bias is not None:
            bias = linear.bias.double()
            bias[rows] = (bias[rows].reshape(kv_heads, head_dim) @ self.head).reshape(-1)
            _set(linear.bias, bias)
        output = block.get_submodule(self.family.attn_output)
        columns = output.weight.double().reshape(output.weight.shape[0], heads, head_dim)
        _set(output.weight, (columns @ self.head).reshape(output.weight.shape[0], heads * head_dim))

    def rotate_embedding(self, table: torch.Tensor) -> None:
        """An embedding table's rows (hidden states entering the first block) into the rotated basis, in place."""
        with torch.no_grad():
            for rows in _row_slices(table):
                rows.copy_((rows.double() @ self.matrix).to(rows.dtype))

    def rotated_head(self, head_weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
        """The LM head with the final norm's weight folded in, reading the rotated basis (a new tensor in
        ``head_weight``'s dtype)."""
        gain = norm_weight.double() + self.family.norm_offset
        out = torch.empty_like(head_weight)
        with torch.no_grad():
            for source, target in zip(_row_slices(head_weight), _row_slices(out), strict=True):
                target.copy_(((source.double() * gain[None, :]) @ self.matrix).to(out.dtype))
        return out

    def weightless_norm(self, norm_weight: torch.Tensor) -> torch.Tensor:
        """A norm weight that multiplies by one (what a folded norm keeps)."""
        return torch.full_like(norm_weight, 1.0 - self.family.norm_offset)


def _set(parameter: torch.Tensor, value: torch.Tensor) -> None:
    parameter.copy_(value.to(parameter.dtype))


def _row_slices(table: torch.Tensor) -> Iterator[torch.Tensor]:
    return iter(table.split(ROWS_AT_A_TIME))


def rotate_model(model, rotation: ResidualRotation) -> bool:
    """Rotate a whole float model held in memory (every block, the embedding, the final norm into the LM head); the
    model computes the same logits. Returns whether a tied LM head was untied."""
    for block in decoder_blocks(model):
        rotation.rotate_block(block)
    return rotate_ends(model, rotation)


def rotate_ends(model, rotation: ResidualRotation) -> bool:
    """Rotate what surrounds the blocks of a model held in memory: the embedding, and the final norm folded into the
    LM head. Returns whether a tied LM head was untied (it is a linear of its own after)."""
    embeddings, head, norm = model.get_input_embeddings(), model.get_output_embeddings(), final_norm(model)
    tied = head.weight is embeddings.weight
    new_head = rotation.rotated_head(head.weight.detach(), norm.weight.detach())
    rotation.rotate_embedding(embeddings.weight)
    with torch.no_grad():
        norm.weight.copy_(rotation.weightless_norm(norm.weight))
    head.weight = torch.nn.Parameter(new_head, requires_grad=head.weight.requires_grad)
    if tied:
        model.config.tie_word_embeddings = False
    return tied
