"""A model's logits over evaluation windows, computed block by block from its checkpoint on the compute device.

Validation compares the deployed numbers with the teacher's on every evaluation window. Holding
both models (and, before, a float32 copy of each) is what made validation the largest stage; here
neither model is ever held. Each is built empty, its blocks are read from its folder one at a time
by the shared walker (:mod:`compress.transforms.walk`), onto the device in float32, and run over
all windows at once; only the hidden states between blocks (windows x tokens x hidden) and, at the
end, the final norm and LM head stay. A quantized folder's linears are rebuilt from their levels
exactly as the quantizer computed with them, their inputs (and an FP8 KV cache) quantized as the
deployed graph quantizes them: the numbers the Edge-LLM bundle is proven to hold.

The block-by-block pass computes what the model's own forward pass computes on each window (the
same operations on the same inputs), so the figures do not depend on which way they were taken.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from compress.algorithms import kv_cache
from compress.models.compute import linear_in_row_slices
from compress.models.families import decoder_blocks, final_norm
from compress.models.weights import CheckpointReader, empty_causal_lm, materialize, module_prefix
from compress.transforms.quantize.saved import (
    LinearQuant,
    attach_activation_quant,
    dequantized_weight,
    input_quantizer,
    load_quantization,
    quantization_meta,
)
from compress.transforms.walk import BlockInputs, BlockVisitor, StreamedBlocks, walk_blocks

log = logging.getLogger(__name__)


@dataclass
class WindowLogits:
    """A model's final hidden states over a list of windows, and the head that turns one window's into logits."""

    hidden: list[torch.Tensor]  # per window, (1, tokens, hidden) float32, after the final norm
    head_weight: torch.Tensor  # (vocab, hidden) as stored; computed with in float32, one window at a time
    head_bias: torch.Tensor | None
    softcap: float | None
    head_input: Callable[[torch.Tensor], torch.Tensor] | None = None  # a quantized head's input quantizer

    def __len__(self) -> int:
        return len(self.hidden)

    def logits(self, index: int, tokens: slice = slice(None)) -> np.ndarray:
        """Window ``index``'s ``(tokens, vocab)`` logits in float32 (``tokens``: those positions only), the head taken
        in float32 a slice of its rows at a time (a float32 copy of a 150k-token vocabulary's head is as large as a 0.3B
        model's blocks)."""
        with torch.no_grad():
            hidden = self.hidden[index][0][tokens]
            if self.head_input is not None:
                hidden = self.head_input(hidden)
            logits = linear_in_row_slices(hidden, self.head_weight, self.head_bias)
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.cpu().numpy()

    def rows(self, index: int, stop: int | None = None) -> WindowRows:
        """Window ``index``'s logits (its first ``stop`` positions), computed as they are sliced."""
        return WindowRows(self, index, len(self.hidden[index][0]) if stop is None else stop)


# The float32 logits of a block of positions computed at a time when a window's are read slice by slice: at a 150k
# vocabulary 192 positions (a 512-token window's are 0.3 GB, and a comparison holds two windows'); a 49k vocabulary's
# windows whole. Each block converts the 16-bit head to float32 once more, a slice at a time.
LOGIT_BLOCK_BYTES = 128 * 2**20
LOGIT_POSITIONS_STEP = 32  # what the readers take at a time (fidelity's and perplexity's rows in float64)


class WindowRows:
    """One window's ``(positions, vocab)`` logits, computed a block of positions at a time (:data:`LOGIT_BLOCK_BYTES`)
    as a reader slices them in order (``rows[32:64]``), so no reader holds a whole window's. Every head input is
    quantized position by position, so the logits are those of :meth:`WindowLogits.logits`."""

    def __init__(self, owner: WindowLogits, index: int, stop: int) -> None:
        self.owner = owner
        self.index = index
        self.stop = stop
        vocab = owner.head_weight.shape[0]
        self.block = max(
            LOGIT_POSITIONS_STEP, LOGIT_BLOCK_BYTES // (4 * vocab) // LOGIT_POSITIONS_STEP * LOGIT_POSITIONS_STEP
        )
        self._block_start = -1
        self._block: np.ndarray | None = None

    def __len__(self) -> int:
        return self.stop

    def __getitem__(self, positions: slice) -> np.ndarray:
        start, stop, step = positions.indices(self.stop)
        if step != 1:
            raise IndexError("a window's logits are read in runs of positions")
        block_start = start - start % self.block
        if stop > block_start + self.block:  # across blocks: computed on their own
            return self.owner.logits(self.index, slice(start, stop))
        if block_start != self._block_start:
            self._block = None  # the previous block goes before the next is computed
            self._block = self.owner.logits(self.index, slice(block_start, min(block_start + self.block, self.stop)))
            self._block_start = block_start
        return self._block[start - block_start:stop - block_start]


class _Deployed(BlockVisitor):
    """Gives each block of a quantized folder its linears rebuilt from their levels and quantizes their inputs while the
    block computes; keeps the last block's outputs."""

    def __init__(self, folder: Path | None, prefix: str, last: int) -> None:
        self.folder = folder
        self.prefix = prefix
        self.last = last
        self.block_linears: dict[str, LinearQuant] = {}
        self.outputs: list[torch.Tensor] = []

    def weights(self, block_prefix: str) -> dict[str, torch.Tensor]:
        """The rebuilt float32 weights of the quantized linears under ``block_prefix`` (full names)."""
        if self.folder is None:
            return {}
        meta, linears = load_quantization(self.folder, block_prefix + ".")
        self.block_linears = {name.removeprefix(block_prefix + "."): quant for name, quant in linears.items()}
        return {f"{name}.weight": dequantized_weight(quant) for name, quant in linears.items()}

    def propagation_hooks(self, index: int, block) -> list:
        return attach_activation_quant(block, self.block_linears)

    def after(self, index: int, block, inputs: BlockInputs, outputs: list[torch.Tensor]) -> None:
        if index == self.last:
            self.outputs = outputs


def window_logits(folder: Path, windows: torch.Tensor, device: torch.device | str = "cpu", progress: bool = False,
                  desc: str = "evaluate", trust_remote_code: bool = False) -> WindowLogits:
    """The model in ``folder`` (float, or quantized by the quantize stage) over ``windows`` ``(n, tokens)``, block by
    block."""
    model = empty_causal_lm(folder, trust_remote_code)
    reader = CheckpointReader(folder)
    embeddings = model.get_input_embeddings()
    materialize(embeddings, module_prefix(model, embeddings), reader)
    blocks = decoder_blocks(model)
    meta = quantization_meta(folder)
    visitor = _Deployed(folder if meta is not None else None, module_prefix(model, blocks), len(blocks) - 1)
    with _kv_cache_simulated(model, meta):
        walk_blocks(model, windows, [visitor], device=device, progress=progress, desc=desc,
                    blocks=StreamedBlocks(model, reader, extra=visitor.weights))
    norm = final_norm(model)
    materialize(norm, module_prefix(model, norm), reader, device=device, dtype=torch.float32)
    with torch.no_grad():
        hidden = [norm(h) for h in visitor.outputs]
    head = model.get_output_embeddings()
    head_name = module_prefix(model, head)
    quantized_head = load_quantization(folder, head_name) if meta is not None and head_name in meta.linears else None
    if quantized_head is not None:  # the head as deployed: its weight rebuilt from its levels, its input quantized
        (quant,) = quantized_head[1].values()
        return WindowLogits(hidden, dequantized_weight(quant).to(device), None,
                            getattr(model.config, "final_logit_softcapping", None), input_quantizer(quant))
    if f"{head_name}.weight" in reader:
        head_tensors = reader.read(name for name in (f"{head_name}.weight", f"{head_name}.bias") if name in reader)
        weight, bias = head_tensors[f"{head_name}.weight"], head_tensors.get(f"{head_name}.bias")
    else:  # tied: the LM head reads the embedding table
        weight, bias = embeddings.weight.detach(), None
    return WindowLogits(hidden, weight.to(device), None if bias is None else bias.to(device),
                        getattr(model.config, "final_logit_softcapping", None))


@contextlib.contextmanager
def _kv_cache_simulated(model, meta: dict | None) -> Iterator[None]:
    """An FP8 KV cache rounded as the deployed graph rounds it, for the duration."""
    scales = meta.kv_cache_scales() if meta else None
    if not scales:
        yield
        return
    kv_cache.attach_kv_cache_quant(model, scales)
    try:
        yield
    finally:
        kv_cache.restore_attention(model)
