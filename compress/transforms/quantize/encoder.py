"""Static W8A8 for encoders (BERT, RoBERTa, XLM-R, DistilBERT, MPNet): SmoothQuant placed where it is exact.

Statistics of every linear's input (per-channel absolute maximum over real tokens, and a sample of
rows) come from one pass of the float model over calibration sentences. Per layer, as
:class:`compress.families.EncoderFamily` describes it:

* attention output: its SmoothQuant scale is folded into the value rows (and bias), exact and free;
* q/k/v input and FFN input: these are LayerNorm outputs that also feed a residual add (post-LN), so
  no weight can absorb a scale; it is applied online, as a per-channel multiply in front of the
  input's quantizer, and the weights carry its inverse;
* FFN output: its input is GELU's output; no smoothing, and GELU itself stays float.

The migration strength is searched per input on the output error of the W8A8 linears. Weights are
INT8 per output channel (round to nearest); activations INT8 per tensor with a static scale. A
linear whose INT8 input loses more than ``float_activations_below_db`` keeps a float input (INT8
weights only). The quantized folder stays an exact float model of what is exported: weights on
their grid, the online scales and activation scales stored beside them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypedDict

import torch
from pydantic import PositiveInt
from safetensors.torch import load_file, save_file

from compress.algorithms.formats import Int8Activation
from compress.algorithms.quant import (
    activation_scale,
    quantize_dequantize_activation,
    quantize_dequantize_weight,
    smoothquant_scales,
    sqnr_db,
)
from compress.core.config import StrictModel
from compress.core.files import atomic_write_json, read_json
from compress.models.families import encoder_family_of, encoder_layers
from compress.transforms.walk import run_encoder_batches

ENCODER_QUANT_FILE = "encoder_quantization.json"
ENCODER_QUANT_TENSORS = "encoder_quant_scales.safetensors"
ALPHAS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


class EncoderQuantizeConfig(StrictModel):
    """Options of the quantize_encoder stage."""

    method: Literal["int8"] = "int8"
    alpha: float | Literal["auto"] = "auto"
    calib_sentences: PositiveInt = 256
    max_length: PositiveInt = 128
    batch_size: PositiveInt = 32
    sample_tokens: PositiveInt = 2048
    act_scale: Literal["absmax", "mse"] = "mse"
    float_activations_below_db: float | None = 15.0


@dataclass
class EncoderLinearQuant:
    """One quantized encoder linear: INT8 weight scales, a static input scale (None: float input), an online
    smoothing."""

    weight_scales: torch.Tensor
    input_scale: float | None
    sqnr_db: float
    smoothing: torch.Tensor | None = None  # the input is divided by this per channel before it is quantized


class _InputStats:
    """Per-channel absolute maximum and a bounded sample of rows of one linear's input over real tokens."""

    def __init__(self, limit: int) -> None:
        self.absmax: torch.Tensor | None = None
        self.rows: list[torch.Tensor] = []
        self.limit = limit

    def add(self, x: torch.Tensor) -> None:
        absmax = x.abs().amax(dim=0)
        self.absmax = absmax if self.absmax is None else torch.maximum(self.absmax, absmax)
        taken = sum(r.shape[0] for r in self.rows)
        if taken < self.limit:
            step = max(1, x.shape[0] // max(1, (self.limit - taken)))
            self.rows.append(x[::step][: self.limit - taken].clone())

    def samples(self) -> torch.Tensor:
        return torch.cat(self.rows)


def collect_stats(model, batches: list[dict[str, torch.Tensor]], limit: int) -> dict[str, _InputStats]:
    """Input statistics of every linear the family lists, by full module name, over the unpadded tokens of
    ``batches``."""
    family = encoder_family_of(model.config)
    stats: dict[str, _InputStats] = {}
    mask: list[torch.Tensor] = []
    handles = []
    for index, layer in enumerate(encoder_layers(model)):
        for path in family.linears():
            name = _name(family, index, path)
            stats[name] = _InputStats(limit)

            def hook(_module, args, name=name):
                stats[name].add(args[0][mask[0].bool()].detach().float())
            handles.append(layer.get_submodule(path).register_forward_pre_hook(hook))
    run_encoder_batches(model, batches, mask, handles)
    return stats


def _name(family, index: int, path: str) -> str:
    return f"{family.layers}.{index}.{path}"


def _w8a8_error(samples: torch.Tensor, weights: list[torch.Tensor], scales: torch.Tensor) -> float:
    x = samples / scales
    x_q = quantize_dequantize_activation(x, float(x.abs().max()) / 127)
    error = 0.0
    for w in weights:
        w_q, _ = quantize_dequantize_weight(w * scales, 8, None)
        error += (samples @ w.T - x_q @ w_q.T).pow(2).mean().item()
    return error


def _smoothing(stats: _InputStats, weights: list[torch.Tensor], alpha: float | str) -> torch.Tensor:
    """SmoothQuant scales for one input, with the migration strength searched on the W8A8 output error."""
    samples = stats.samples()
    candidates = ALPHAS if alpha == "auto" else (float(alpha),)
    best = min(candidates, key=lambda a: _w8a8_error(samples, weights, smoothquant_scales(stats.absmax, weights, a)))
    return smoothquant_scales(stats.absmax, weights, best)


def quantize_encoder(
    model, batches: list[dict[str, torch.Tensor]], config: EncoderQuantizeConfig
) -> dict[str, EncoderLinearQuant]:
    """Quantize ``model`` in place (weights onto their INT8 grid, value rows smoothed); returns each linear's scales."""
    family = encoder_family_of(model.config)
    stats = collect_stats(model, batches, config.sample_tokens)
    result: dict[str, EncoderLinearQuant] = {}
    with torch.no_grad():
        for index, layer in enumerate(encoder_layers(model)):
            # The attention output first: its scale goes into the value rows before those are quantized with q and k.
            for paths, smoothing in (
                ((family.attn_out,), "value"),
                (family.attn_in, "online"),
                ((family.ffn_in,), "online"),
                ((family.ffn_out,), None),
            ):
                point = stats[_name(family, index, paths[0])]
                linears = [layer.get_submodule(p) for p in paths]
                scales = (
                    _smoothing(point, [lin.weight.detach().float() for lin in linears], config.alpha)
                    if smoothing
                    else None
                )
                if smoothing == "value":
                    _divide_rows(layer.get_submodule(family.value), scales)
                samples = point.samples() / scales if scales is not None else point.samples()
                input_scale = activation_scale(samples, float(samples.abs().max()), config.act_scale, Int8Activation())
                online = scales if smoothing == "online" else None
                for path, linear in zip(paths, linears, strict=True):
                    result[_name(family, index, path)] = _quantize_linear(
                        linear, samples, scales, input_scale, online, config
                    )
    return result


def _divide_rows(linear: torch.nn.Linear, scales: torch.Tensor) -> None:
    linear.weight.div_(scales[:, None])
    if linear.bias is not None:
        linear.bias.div_(scales)


def _quantize_linear(linear: torch.nn.Linear, samples: torch.Tensor, scales: torch.Tensor | None, input_scale: float,
                     online: torch.Tensor | None, config: EncoderQuantizeConfig) -> EncoderLinearQuant:
    weight = linear.weight.detach().float() * (scales[None, :] if scales is not None else 1.0)
    dequantized, weight_scales = quantize_dequantize_weight(weight, 8, None)
    reference = samples @ weight.T
    error = sqnr_db(reference, quantize_dequantize_activation(samples, input_scale) @ dequantized.T)
    scale: float | None = input_scale
    if config.float_activations_below_db is not None and error < config.float_activations_below_db:
        scale, error = None, sqnr_db(reference, samples @ dequantized.T)
    linear.weight.copy_(dequantized)
    return EncoderLinearQuant(weight_scales, scale, round(error, 2), online)


def attach_encoder_quant(model, linears: dict[str, EncoderLinearQuant]) -> list:
    """The torch reference of the exported graph: divide inputs by their online smoothing, then round them to the INT8
    grid of their static scale (quantize and dequantize, as the graph's Q/DQ pair does)."""
    handles = []
    for name, quant in linears.items():
        if quant.smoothing is None and quant.input_scale is None:
            continue

        def hook(_module, args, quant=quant):
            x = args[0] / quant.smoothing if quant.smoothing is not None else args[0]
            return (quantize_dequantize_activation(x, quant.input_scale) if quant.input_scale is not None else x,)
        handles.append(model.base_model.get_submodule(name).register_forward_pre_hook(hook))
    return handles


def save_encoder_quantization(
    linears: dict[str, EncoderLinearQuant], config: EncoderQuantizeConfig, folder: Path
) -> None:
    tensors = {f"{name}.weight_scale": q.weight_scales.float().clone() for name, q in linears.items()}
    tensors.update(
        {f"{name}.smoothing": q.smoothing.float().clone() for name, q in linears.items() if q.smoothing is not None}
    )
    save_file(tensors, str(Path(folder) / ENCODER_QUANT_TENSORS))
    atomic_write_json(Path(folder) / ENCODER_QUANT_FILE, {
        "method": config.method, "config": config.model_dump(mode="json"), "weight_bits": 8,
        "activations": "int8-static-per-tensor",
        "linears": {name: {"input_scale": q.input_scale, "sqnr_db": q.sqnr_db} for name, q in linears.items()}})


def load_encoder_quantization(folder: Path) -> dict[str, EncoderLinearQuant] | None:
    """What :func:`save_encoder_quantization` wrote, or None for a float encoder."""
    folder = Path(folder)
    if not (folder / ENCODER_QUANT_FILE).is_file():
        return None
    meta = read_json(folder / ENCODER_QUANT_FILE)
    tensors = load_file(str(folder / ENCODER_QUANT_TENSORS))
    return {name: EncoderLinearQuant(tensors[f"{name}.weight_scale"], info["input_scale"], info["sqnr_db"],
                                     tensors.get(f"{name}.smoothing"))
            for name, info in meta["linears"].items()}


class EncoderQuantSummary(TypedDict):
    """What the encoder quantize stage records."""

    quantized_linears: int
    median_sqnr_db: float
    min_sqnr_db: float
    float_input_linears: list[str]
    online_smoothed_linears: int


def summary(linears: dict[str, EncoderLinearQuant]) -> EncoderQuantSummary:
    """Metrics the stage records."""
    values = [q.sqnr_db for q in linears.values()]
    return {
        "quantized_linears": len(linears),
        "median_sqnr_db": round(statistics.median(values), 2),
        "min_sqnr_db": min(values),
        "float_input_linears": sorted(n for n, q in linears.items() if q.input_scale is None),
        "online_smoothed_linears": sum(q.smoothing is not None for q in linears.values()),
    }
