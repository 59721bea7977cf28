"""Symmetric integer quantizers, SmoothQuant, AWQ and GPTQ on plain tensors.

Weights are ``(out_features, in_features)`` as in ``torch.nn.Linear``. Every quantizer is
symmetric (zero point 0), the form TensorRT takes in Q/DQ networks, so exact zeros (from
sparsity) stay zero. AWQ and GPTQ round through a :class:`~compress.algorithms.formats.WeightGrid`
(integers, FP8 or NVFP4), so the same search runs on every grid.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from compress.algorithms.formats import ActivationFormat, IntGrid, WeightGrid, expand_scales, quantize_dequantize


def qmax(bits: int) -> int:
    """Largest positive level of a signed ``bits``-bit integer."""
    return 2 ** (bits - 1) - 1


def quantize_dequantize_weight(
    weight: torch.Tensor, bits: int, group_size: int | None, clip_ratio: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest on the ``bits``-bit integer grid: the dequantized weight and its scales."""
    return quantize_dequantize(weight, IntGrid(bits, group_size), clip_ratio)


def quantize_dequantize_activation(x: torch.Tensor, scale: float, bits: int = 8) -> torch.Tensor:
    """Static per-tensor symmetric activation quantization."""
    return torch.clamp(torch.round(x / scale), -qmax(bits) - 1, qmax(bits)) * scale


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (higher is better)."""
    return sqnr_of_energies(
        reference.double().pow(2).sum().item(), (reference - approximation).double().pow(2).sum().item()
    )


def sqnr_of_energies(signal: float, noise: float) -> float:
    """:func:`sqnr_db` from the summed squares of the reference and of the error (summed over slices, say)."""
    if noise == 0:
        return math.inf
    return 10 * math.log10(max(signal, 1e-30) / noise)


def smoothquant_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """SmoothQuant migration scales ``s_j = max|X_j|^a / max|W_j|^(1-a)`` over input channels."""
    weight_absmax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
    scales = act_absmax.clamp(min=1e-5).pow(alpha) / weight_absmax.clamp(min=1e-5).pow(1 - alpha)
    return scales.clamp(min=1e-5)


def awq_search_scales(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    grid: WeightGrid,
    steps: int = 20,
    reduce: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, float]:
    """AWQ: the per-input-channel scale ``mean|x|^r`` (r on a grid) that minimises the quantized output error.

    Each candidate's weights are rounded to ``grid`` (bound to each scaled weight, so NVFP4 takes
    that weight's global scale); ``activation`` fake-quantizes the scaled input (W4A4). ``reduce``
    (optional ``(in,)`` group ids) forces equal scales inside each group, for scales that must be
    folded into a shared producer (GQA value heads). Returns the scales and the best ratio.
    """
    x_mean = x.abs().mean(dim=0)
    reference = [x @ w.T for w in weights]
    best = (math.inf, torch.ones_like(x_mean), 0.0)
    for step in range(steps):
        ratio = step / steps
        scales = x_mean.clamp(min=1e-4).pow(ratio)
        if reduce is not None:
            scales = _group_mean(scales, reduce)
        scales = scales / (scales.max() * scales.min()).sqrt()
        x_scaled = x / scales if activation is None else activation(x / scales)
        error = 0.0
        for w, ref in zip(weights, reference, strict=True):
            scaled = w * scales
            wq, _ = quantize_dequantize(scaled, grid.bind([scaled]))
            error += (ref - x_scaled @ wq.T).pow(2).mean().item()
        if error < best[0]:
            best = (error, scales, ratio)
    return best[1], best[2]


def _group_mean(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    sums = values.new_zeros(int(groups.max()) + 1).index_add_(0, groups, values)
    counts = torch.zeros_like(sums).index_add_(0, groups, torch.ones_like(values))
    return (sums / counts)[groups]


CLIP_SEARCH_ELEMENTS = 1 << 23  # the largest temporary of the clip search, in elements (32 MB in float32)


def awq_search_clip(x: torch.Tensor, weight: torch.Tensor, grid: WeightGrid, steps: int = 10, max_shrink: float = 0.5,
                    hessian: torch.Tensor | None = None) -> torch.Tensor:
    """AWQ clipping: per ``(out, group)`` shrink of the absolute maximum that minimises that group's output error.

    ``grid`` is bound (NVFP4's global scale fixed), and grouped; for NVFP4 every block of 16 is searched.
    The error is measured on the sample rows ``x``, or with ``hessian`` (``X^T X`` over every
    calibration token, up to a factor) as each group's ``dW_g H_gg dW_g^T``: the same output error
    over all tokens, the attention sink included.
    """
    groups = weight.shape[1] // grid.group_size
    # each row's ratios are its own: rows at a time, so the sampled outputs (tokens x groups x rows) stay small
    rows = max(1, CLIP_SEARCH_ELEMENTS // (groups * (x.shape[0] if hessian is None else grid.group_size)))
    return torch.cat([_search_clip_rows(x, part, grid, steps, max_shrink, hessian) for part in weight.split(rows)])


def _search_clip_rows(x: torch.Tensor, weight: torch.Tensor, grid: WeightGrid, steps: int, max_shrink: float,
                      hessian: torch.Tensor | None) -> torch.Tensor:
    group_size = grid.group_size
    out_features, in_features = weight.shape
    groups = in_features // group_size
    w = weight.reshape(out_features, groups, group_size)
    if hessian is not None:
        index = torch.arange(groups, device=weight.device)
        blocks = hessian.reshape(groups, group_size, groups, group_size)[index, :, index, :]  # (groups, g, g)

        def group_error(wq: torch.Tensor) -> torch.Tensor:
            delta = w - wq.reshape(out_features, groups, group_size)
            return torch.einsum("ong,ngh,onh->no", delta, blocks, delta)
    else:
        xg = x.reshape(x.shape[0], groups, group_size)
        reference = torch.einsum("tng,ong->tno", xg, w)

        def group_error(wq: torch.Tensor) -> torch.Tensor:
            return (
                (torch.einsum("tng,ong->tno", xg, wq.reshape(out_features, groups, group_size)) - reference)
                .pow(2)
                .mean(dim=0)
            )

    best_error = weight.new_full((groups, out_features), math.inf, dtype=torch.float32)
    best_ratio = weight.new_ones(out_features, groups, dtype=torch.float32)
    for step in range(steps):
        ratio = 1 - max_shrink * step / steps
        wq, _ = quantize_dequantize(weight, grid, ratio)
        error = group_error(wq)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_ratio = torch.where(better.T, torch.full_like(best_ratio, ratio), best_ratio)
    return best_ratio


def prepare_obs(weight: torch.Tensor, hessian: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A working copy of ``weight`` and the upper Cholesky factor of the damped inverse Hessian.

    Shared by GPTQ and SparseGPT (optimal brain surgeon updates); inputs never seen (zero Hessian
    diagonal) get their weights zeroed.
    """
    w = weight.clone().float()
    h = hessian.clone().double()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += torch.eye(h.shape[0], dtype=h.dtype, device=h.device) * damp * torch.diag(h).mean()
    return w, torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, grid: WeightGrid, damp: float = 0.01,
                  block_size: int = 128, clip_ratio: torch.Tensor | float = 1.0, act_order: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ: quantize columns in order, feeding each column's error back through the inverse Hessian.

    ``grid`` is bound (NVFP4's global scale fixed). Per-tensor and per-channel scales come from
    the original weight; group scales (integer groups, NVFP4 blocks) from the updated weight when
    the group's first column is reached. Exact zeros of ``weight`` (a sparsity mask) stay zero.
    ``act_order`` (ungrouped scales only) visits columns by decreasing Hessian diagonal, so the
    inputs with the most energy are quantized first, while most columns are left to absorb
    their error. Returns the dequantized weight and its scales.
    """
    group_size = grid.group_size
    if act_order:
        if group_size is not None:
            raise ValueError("act_order needs per-channel or per-tensor scales (no groups)")
        order = torch.argsort(torch.diag(hessian), descending=True, stable=True)
        restore = torch.argsort(order)
        dequantized, scales = gptq_quantize(
            weight[:, order], hessian[order][:, order], grid, damp, block_size, clip_ratio
        )
        return dequantized[:, restore], scales
    w, h_inv = prepare_obs(weight, hessian, damp)
    out_features, in_features = w.shape
    zero_mask = weight == 0
    group = group_size or in_features
    if group_size is None:
        scales = grid.scales(w, clip_ratio)
        column_scale = scales[:, None] if scales.dim() else scales
    else:
        scales = w.new_zeros(out_features, in_features // group)
        block_size = max(group, block_size - block_size % group)
    levels = torch.zeros_like(w)
    for start in range(0, in_features, block_size):
        end = min(start + block_size, in_features)
        w_block = w[:, start:end].clone()
        errors = torch.zeros_like(w_block)
        h_block = h_inv[start:end, start:end]
        for i in range(end - start):
            column = start + i
            if group_size is not None:
                if column % group == 0:
                    ratio = clip_ratio[:, column // group] if isinstance(clip_ratio, torch.Tensor) else clip_ratio
                    scales[:, column // group] = grid.group_scale(w_block[:, i:i + group], ratio)
                column_scale = scales[:, column // group, None]
            q = grid.levels(w_block[:, i, None], column_scale)[:, 0]
            q[zero_mask[:, column]] = 0
            levels[:, column] = q
            error = (w_block[:, i] - grid.dequantize(q[:, None], column_scale)[:, 0]) / h_block[i, i]
            w_block[:, i:] -= error[:, None] * h_block[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ h_inv[start:end, end:]
    return grid.dequantize(levels, expand_scales(scales, in_features)), scales


def activation_scale(
    samples: torch.Tensor, absmax: float, rule: str, activation: ActivationFormat, steps: int = 20
) -> float:
    """Static per-tensor activation scale: from the absolute maximum, or the clipped maximum with least MSE."""
    if rule == "absmax":
        return activation.scale_for(absmax)
    best = (float("inf"), activation.scale_for(absmax))
    for step in range(steps):
        candidate = activation.scale_for(absmax * (1.0 - 0.8 * step / steps))
        error = (activation.fake_quantize(samples, candidate) - samples).pow(2).mean().item()
        if error < best[0]:
            best = (error, candidate)
    return best[1]
