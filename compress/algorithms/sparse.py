"""Pruning masks: 2:4 semi-structured and unstructured, by magnitude, Wanda, or SparseGPT.

Weights are ``(out_features, in_features)``. A 2:4 pattern keeps at most 2 non-zeros in every
group of 4 consecutive weights along the input dimension (the layout Ampere sparse tensor cores
run). Unstructured pruning removes ``ratio`` of each output row.
"""

from __future__ import annotations

import torch

from compress.algorithms.quant import prepare_obs


def _mask_from_scores(scores: torch.Tensor, pattern: str, ratio: float) -> torch.Tensor:
    """True where a weight is kept."""
    out_features, in_features = scores.shape
    if pattern == "2:4":
        groups = scores.reshape(out_features, in_features // 4, 4)
        keep = torch.zeros_like(groups, dtype=torch.bool)
        keep.scatter_(2, groups.topk(2, dim=2).indices, True)
        return keep.reshape(out_features, in_features)
    prune = int(in_features * ratio)
    keep = torch.ones_like(scores, dtype=torch.bool)
    if prune:
        keep.scatter_(1, scores.topk(prune, dim=1, largest=False).indices, False)
    return keep


def magnitude_mask(weight: torch.Tensor, pattern: str, ratio: float = 0.5) -> torch.Tensor:
    """Keep the largest ``|W|``."""
    return _mask_from_scores(weight.abs(), pattern, ratio)


def wanda_mask(weight: torch.Tensor, input_norms: torch.Tensor, pattern: str, ratio: float = 0.5) -> torch.Tensor:
    """Wanda: keep the largest ``|W_ij| * ||X_j||`` within each output row."""
    return _mask_from_scores(weight.abs() * input_norms[None, :], pattern, ratio)


def sparsegpt_prune(weight: torch.Tensor, hessian: torch.Tensor, pattern: str, ratio: float = 0.5, damp: float = 0.01,
                    block_size: int = 128) -> torch.Tensor:
    """SparseGPT: choose the mask block by block from ``w^2 / [H^-1]_jj^2`` and update the kept weights."""
    w, h_inv = prepare_obs(weight, hessian, damp)
    in_features = w.shape[1]
    for start in range(0, in_features, block_size):
        end = min(start + block_size, in_features)
        w_block = w[:, start:end].clone()
        errors = torch.zeros_like(w_block)
        h_block = h_inv[start:end, start:end]
        diag = torch.diag(h_block)
        if pattern != "2:4":
            scores = w_block.pow(2) / diag[None, :].pow(2)
            prune_block = ~_mask_from_scores(scores, "unstructured", ratio)
        else:
            prune_block = torch.zeros_like(w_block, dtype=torch.bool)
        for i in range(end - start):
            if pattern == "2:4" and i % 4 == 0:
                scores = w_block[:, i:i + 4].pow(2) / diag[i:i + 4][None, :].pow(2)
                prune_block[:, i:i + 4] = ~_mask_from_scores(scores, "2:4", 0.5)
            column = w_block[:, i]
            kept = torch.where(prune_block[:, i], torch.zeros_like(column), column)
            error = (column - kept) / h_block[i, i]
            w_block[:, i:] -= error[:, None] * h_block[i, i:][None, :]
            w_block[:, i] = kept
            errors[:, i] = error
        w[:, start:end] = w_block
        w[:, end:] -= errors @ h_inv[start:end, end:]
    return w


def fraction_in_24_pattern(weight: torch.Tensor, axis: int = 1) -> float:
    """Share of 4-groups along ``axis`` (the input dimension) with at least 2 zeros."""
    w = weight if axis == 1 else weight.T
    if w.shape[1] % 4:
        return 0.0
    zeros = (w.reshape(w.shape[0], -1, 4) == 0).sum(dim=2)
    return float((zeros >= 2).float().mean())


def onnx_24_fraction(model_path, skip_output_dim: int | None = None) -> float:
    """2:4 coverage of the MatMul weight initializers of an ONNX file (float32 or 16-bit, INT8 or INT4, Q/DQ or not).

    Initializers are ``(in, out)``, so groups run along axis 0. ``skip_output_dim`` leaves out the
    dense LM head (its output width is the vocabulary).
    """
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path))
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    # A weight reaches its MatMul from an initializer directly, through a DequantizeLinear (levels) or a Cast (16-bit)
    dequantized_from = {n.output[0]: n.input[0] for n in graph.node
                        if n.op_type in ("DequantizeLinear", "Cast") and n.input[0] in initializers}
    covered = total = 0.0
    for node in graph.node:
        if node.op_type != "MatMul":
            continue
        name = dequantized_from.get(node.input[1], node.input[1])
        init = initializers.get(name)
        if init is None or len(init.dims) != 2 or init.dims[0] % 4 or init.dims[1] == skip_output_dim:
            continue
        values = np.asarray(numpy_helper.to_array(init)).astype(np.float32)
        groups = values.reshape(values.shape[0] // 4, 4, values.shape[1])
        ok = ((groups == 0).sum(axis=1) >= 2).mean()
        covered += ok * groups.shape[0] * groups.shape[2]
        total += groups.shape[0] * groups.shape[2]
    return covered / total if total else 0.0
