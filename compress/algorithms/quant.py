"""Symmetric integer quantizers, SmoothQuant, AWQ and GPTQ on plain tensors.

Weights are ``(out_features, in_features)`` as in ``torch.nn.Linear``. Every quantizer is
symmetric (zero point 0), the form TensorRT takes in Q/DQ networks, so exact zeros (from
sparsity) stay zero. ``group_size=None`` means one scale per output channel.
"""

from __future__ import annotations

import math

import torch


def qmax(bits: int) -> int:
    """Largest positive level of a signed ``bits``-bit integer."""
    return 2 ** (bits - 1) - 1


def weight_scales(weight: torch.Tensor, bits: int, group_size: int | None, clip_ratio: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Per-channel ``(out,)`` or per-group ``(out, in // group)`` scales from the absolute maximum."""
    out_features, in_features = weight.shape
    if group_size is None:
        absmax = weight.abs().amax(dim=1)
    else:
        absmax = weight.reshape(out_features, in_features // group_size, group_size).abs().amax(dim=2)
    return (absmax * clip_ratio).clamp(min=1e-8) / qmax(bits)


def _expand(scales: torch.Tensor, in_features: int) -> torch.Tensor:
    if scales.dim() == 1:
        return scales[:, None]
    return scales.repeat_interleave(in_features // scales.shape[1], dim=1)


def quantize_weight(weight: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer levels (as float) of ``weight`` under ``scales``."""
    return torch.clamp(torch.round(weight / _expand(scales, weight.shape[1])), -qmax(bits) - 1, qmax(bits))


def dequantize_weight(levels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return levels * _expand(scales, levels.shape[1])


def quantize_dequantize_weight(weight: torch.Tensor, bits: int, group_size: int | None, clip_ratio: torch.Tensor | float = 1.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest: the dequantized weight and its scales."""
    scales = weight_scales(weight, bits, group_size, clip_ratio)
    return dequantize_weight(quantize_weight(weight, scales, bits), scales), scales


def quantize_dequantize_activation(x: torch.Tensor, scale: float, bits: int = 8) -> torch.Tensor:
    """Static per-tensor symmetric activation quantization."""
    return torch.clamp(torch.round(x / scale), -qmax(bits) - 1, qmax(bits)) * scale


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (higher is better)."""
    noise = (reference - approximation).double().pow(2).sum().item()
    signal = reference.double().pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(max(signal, 1e-30) / noise)


def smoothquant_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """SmoothQuant migration scales ``s_j = max|X_j|^a / max|W_j|^(1-a)`` over input channels."""
    weight_absmax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
    scales = act_absmax.clamp(min=1e-5).pow(alpha) / weight_absmax.clamp(min=1e-5).pow(1 - alpha)
    return scales.clamp(min=1e-5)


def awq_search_scales(x: torch.Tensor, weights: list[torch.Tensor], bits: int, group_size: int | None, grid: int = 20,
                      reduce: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """AWQ: the per-input-channel scale ``mean|x|^r`` (r on a grid) that minimises the quantized output error.

    ``reduce`` (optional ``(in,)`` group ids) forces equal scales inside each group, for scales
    that must be folded into a shared producer (GQA value heads). Returns the scales and the best ratio.
    """
    x_mean = x.abs().mean(dim=0)
    reference = [x @ w.T for w in weights]
    best = (math.inf, torch.ones_like(x_mean), 0.0)
    for step in range(grid):
        ratio = step / grid
        scales = x_mean.clamp(min=1e-4).pow(ratio)
        if reduce is not None:
            scales = _group_mean(scales, reduce)
        scales = scales / (scales.max() * scales.min()).sqrt()
        error = 0.0
        for w, ref in zip(weights, reference, strict=True):
            wq, _ = quantize_dequantize_weight(w * scales, bits, group_size)
            error += (ref - (x / scales) @ wq.T).pow(2).mean().item()
        if error < best[0]:
            best = (error, scales, ratio)
    return best[1], best[2]


def _group_mean(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    sums = torch.zeros(int(groups.max()) + 1, dtype=values.dtype).index_add_(0, groups, values)
    counts = torch.zeros_like(sums).index_add_(0, groups, torch.ones_like(values))
    return (sums / counts)[groups]


def awq_search_clip(x: torch.Tensor, weight: torch.Tensor, bits: int, group_size: int, grid: int = 10,
                    max_shrink: float = 0.5) -> torch.Tensor:
    """AWQ clipping: per ``(out, group)`` shrink of the absolute maximum that minimises that group's output error."""
    out_features, in_features = weight.shape
    groups = in_features // group_size
    w = weight.reshape(out_features, groups, group_size)
    xg = x.reshape(x.shape[0], groups, group_size)
    reference = torch.einsum("tng,ong->tno", xg, w)
    best_error = torch.full((groups, out_features), math.inf)
    best_ratio = torch.ones(out_features, groups)
    for step in range(grid):
        ratio = 1 - max_shrink * step / grid
        wq, _ = quantize_dequantize_weight(weight, bits, group_size, ratio)
        error = (torch.einsum("tng,ong->tno", xg, wq.reshape(out_features, groups, group_size)) - reference).pow(2).mean(dim=0)
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
    h += torch.eye(h.shape[0], dtype=h.dtype) * damp * torch.diag(h).mean()
    return w, torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int | None, damp: float = 0.01,
                  block_size: int = 128, clip_ratio: torch.Tensor | float = 1.0, act_order: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ: quantize columns in order, feeding each column's error back through the inverse Hessian.

    Per-channel scales come from the original weight; group scales from the updated weight when
    the group's first column is reached. Exact zeros of ``weight`` (a sparsity mask) stay zero.
    ``act_order`` (per-channel scales only) visits columns by decreasing Hessian diagonal, so the
    inputs with the most energy are quantized first, while most columns are left to absorb
    their error. Returns the dequantized weight and its scales.
    """
    if act_order:
        if group_size is not None:
            raise ValueError("act_order needs per-channel scales (group_size=None)")
        order = torch.argsort(torch.diag(hessian), descending=True, stable=True)
        restore = torch.argsort(order)
        dequantized, scales = gptq_quantize(weight[:, order], hessian[order][:, order], bits, None, damp, block_size, clip_ratio)
        return dequantized[:, restore], scales
    w, h_inv = prepare_obs(weight, hessian, damp)
    out_features, in_features = w.shape
    zero_mask = weight == 0
    group = group_size or in_features
    if group_size is None:
        scales = weight_scales(w, bits, None, clip_ratio)[:, None]
    else:
        scales = torch.zeros(out_features, in_features // group)
        block_size = max(group, block_size - block_size % group)
    levels = torch.zeros_like(w)
    for start in range(0, in_features, block_size):
        end = min(start + block_size, in_features)
        w_block = w[:, start:end].clone()
        errors = torch.zeros_like(w_block)
        h_block = h_inv[start:end, start:end]
        for i in range(end - start):
            column = start + i
            if group_size is not None and column % group == 0:
                ratio = clip_ratio[:, column // group] if isinstance(clip_ratio, torch.Tensor) else clip_ratio
                absmax = w_block[:, i:i + group].abs().amax(dim=1)
                scales[:, column // group] = (absmax * ratio).clamp(min=1e-8) / qmax(bits)
            scale = scales[:, column // group]
            q = torch.clamp(torch.round(w_block[:, i] / scale), -qmax(bits) - 1, qmax(bits))
            q[zero_mask[:, column]] = 0
            levels[:, column] = q
            error = (w_block[:, i] - q * scale) / h_block[i, i]
            w_block[:, i:] -= error[:, None] * h_block[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ h_inv[start:end, end:]
    if group_size is None:
        scales = scales[:, 0]
    return dequantize_weight(levels, scales), scales
