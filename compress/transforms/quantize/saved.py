"""A quantization on disk: the quantized checkpoint the quantize stage writes, and reading it back.

The quantize stage writes a Hugging Face folder whose quantized linears are stored as their grid
values and scales, never as a float copy:

* ``quantized_weights.safetensors``: per quantized linear ``<name>.weight_levels`` (int8 for the
  integer grids, FP8 E4M3 for the FP8 and E2M1 values, which E4M3 holds exactly; in the basis the
  input is quantized in) and ``<name>.weight_scale``;
* ``quantization.json``: method, precision, per-linear input scales, rotations, NVFP4 global
  scales, FP8 KV-cache scales;
* ``model.safetensors``: every other tensor (embeddings, norms, linears left float) in the
  checkpoint's own dtype, without the quantized linears' weights.

Every later reader (ONNX export, the Edge-LLM checkpoint and its custody check, validation's torch
reference) goes through this module: :func:`load_quantized_causal_lm` rebuilds the float model
with each quantized weight computed from its levels exactly as the quantizer computed it.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from compress.algorithms import kv_cache
from compress.algorithms.formats import ACTIVATION_FORMATS, Fp8Grid, IntGrid, Nvfp4Grid, WeightGrid, expand_scales, levels_on_grid
from compress.algorithms.rotation import rotate
from compress.core.errors import UsageError
from compress.core.files import atomic_write_json, read_json
from compress.models.loading import load_causal_lm
from compress.transforms.quantize.config import QuantizeConfig

QUANT_CONFIG_FILE = "quantization.json"
QUANT_WEIGHTS_FILE = "quantized_weights.safetensors"
# The compact dtype each weight format's grid values are stored in (exact: int8 holds INT8/INT4, E4M3 holds E4M3 and E2M1).
LEVEL_DTYPES = {"int": torch.int8, "fp8": torch.float8_e4m3fn, "nvfp4": torch.float8_e4m3fn}
ACTIVATION_DESCRIPTIONS = {"int8": "int8-static-per-tensor", "fp8": "fp8-static-per-tensor",
                           "nvfp4": "nvfp4-dynamic-block16-static-global"}
OUTLIER_MARGIN_DB = 10.0


@dataclass
class LinearQuant:
    """What the exporter needs for one quantized linear."""

    weight_scales: torch.Tensor
    input_scale: float | None
    sqnr_db: float
    migration_ratio: float | None = None
    rotation: int = 0  # Hadamard block size applied to the input before quantization; 0 = none
    global_scale: float | None = None  # NVFP4's per-tensor scale (weight_scale_2); weights = (e2m1 * block scale) * this
    input_format: str = "int8"  # how input_scale quantizes the input (a key of ACTIVATION_FORMATS)
    levels: torch.Tensor | None = None  # the weight's grid values (in the input's basis), as LEVEL_DTYPES stores them


@dataclass
class QuantResult:
    """The outcome of quantizing a model."""

    config: QuantizeConfig
    linears: dict[str, LinearQuant] = field(default_factory=dict)
    calibration_tokens: int = 0
    seconds: float = 0.0
    kv_scales: dict[int, tuple[float, float]] = field(default_factory=dict)  # per layer (k_scale, v_scale) of an FP8 KV cache

    def layer_errors(self) -> list[dict[str, Any]]:
        return [{"name": name, "sqnr_db": round(q.sqnr_db, 2), "migration_ratio": q.migration_ratio, "rotation": q.rotation}
                for name, q in self.linears.items()]

    def rotated_linears(self) -> list[str]:
        """Linears whose input is Hadamard-rotated."""
        return [name for name, q in self.linears.items() if q.rotation]

    def float_input_linears(self) -> list[str]:
        """Linears of a W8A8 result that keep float inputs (by ``float_activations`` or the SQNR fallback)."""
        if not self.config.scheme()[1]:
            return []
        return [name for name, q in self.linears.items() if q.input_scale is None]

    def outliers(self) -> list[dict[str, Any]]:
        """Linears whose SQNR is more than 10 dB below the median."""
        values = [q.sqnr_db for q in self.linears.values()]
        if not values:
            return []
        floor = statistics.median(values) - OUTLIER_MARGIN_DB
        return [row for row in self.layer_errors() if row["sqnr_db"] < floor]


def attach_activation_quant(model, linears: dict[str, LinearQuant]) -> list:
    """Fake-quantize the inputs of W8A8 / W4A4 linears with their static scales (torch reference of the Q/DQ graph)."""
    handles = []
    for name, quant in linears.items():
        if quant.input_scale is None:
            continue
        scale, block, fake_quantize = quant.input_scale, quant.rotation, ACTIVATION_FORMATS[quant.input_format].fake_quantize

        def hook(_module, args, scale=scale, block=block, fake_quantize=fake_quantize):
            if block:
                # Quantized in the rotated basis, rotated back for the stored (rotated-back) weight.
                return (rotate(fake_quantize(rotate(args[0], block), scale), block),) + tuple(args[1:])
            return (fake_quantize(args[0], scale),) + tuple(args[1:])

        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    return handles


def save_quantization(result: QuantResult, folder: Path) -> None:
    """Write ``quantization.json`` and each quantized linear's levels and scales beside a saved model."""
    bits, _, group = result.config.scheme()
    tensors = {f"{name}.weight_scale": q.weight_scales.contiguous().float() for name, q in result.linears.items()}
    tensors.update({f"{name}.weight_levels": q.levels.contiguous() for name, q in result.linears.items() if q.levels is not None})
    save_file(tensors, str(folder / QUANT_WEIGHTS_FILE))
    activation = result.config.activation_format()
    atomic_write_json(folder / QUANT_CONFIG_FILE, {
        "method": result.config.method,
        "precision": result.config.precision().name,
        "config": result.config.model_dump(mode="json"),
        "format": result.config.weight_format(),
        "weight_bits": bits,
        "group_size": group,
        "activations": ACTIVATION_DESCRIPTIONS[activation.name] if activation else "float",
        "kv_cache": {"format": "fp8", "scales": {str(i): list(s) for i, s in result.kv_scales.items()}} if result.kv_scales else None,
        "linears": {name: {"input_scale": q.input_scale, "input_format": q.input_format, "sqnr_db": q.sqnr_db,
                           "migration_ratio": q.migration_ratio, "rotation": q.rotation, "global_scale": q.global_scale}
                    for name, q in result.linears.items()},
    })


def load_quantization(folder: Path) -> tuple[dict[str, Any], dict[str, LinearQuant]] | None:
    """Read what :func:`save_quantization` wrote, or None for a float model."""
    folder = Path(folder)
    if not (folder / QUANT_CONFIG_FILE).is_file():
        return None
    meta = read_json(folder / QUANT_CONFIG_FILE)
    stored = load_file(str(folder / QUANT_WEIGHTS_FILE))
    linears = {name: LinearQuant(stored[f"{name}.weight_scale"], info["input_scale"], info["sqnr_db"], info.get("migration_ratio"),
                                 info.get("rotation", 0), info.get("global_scale"), info.get("input_format", "int8"),
                                 stored.get(f"{name}.weight_levels"))
               for name, info in meta["linears"].items()}
    missing = [name for name, quant in linears.items() if quant.levels is None]
    if missing:
        raise UsageError(f"{folder / QUANT_WEIGHTS_FILE} holds no levels for {', '.join(missing[:3])}; it was written by another "
                         "version of compress: rerun the quantize stage")
    return meta, linears


def grid_levels(weight: torch.Tensor, grid: WeightGrid, scales: torch.Tensor, weight_format: str) -> torch.Tensor:
    """The stored form of an on-grid weight's levels (``weight`` in its input's basis); raises ValueError off the grid."""
    return levels_on_grid(weight, grid, scales, tolerance=1e-5).to(LEVEL_DTYPES[weight_format])


def level_values(quant: LinearQuant) -> torch.Tensor:
    """A saved linear's grid values as float32 (integers, E4M3 or E2M1 values), in its input's basis."""
    return quant.levels.float()


def dequantized_weight(meta: dict[str, Any], quant: LinearQuant) -> torch.Tensor:
    """The float32 weight a saved linear computes with: its levels times its scales, rotated back when its input is
    rotated (the quantizer computes it this way, so the result is the same number for number)."""
    levels = level_values(quant)
    weight = stored_grid(meta, quant).dequantize(levels, expand_scales(quant.weight_scales.float(), levels.shape[1]))
    return rotate(weight, quant.rotation) if quant.rotation else weight


def _weight_names(linears: dict[str, LinearQuant]) -> frozenset[str]:
    """The state-dict keys of quantized linears' weights (which ``model.safetensors`` leaves out: they are levels)."""
    return frozenset(f"{name}.weight" for name in linears)


def model_state_without_quantized(model, linears: dict[str, LinearQuant]) -> dict[str, torch.Tensor]:
    """``model``'s state dict without the weights its quantized linears store as levels (what ``model.safetensors`` holds)."""
    left_out = _weight_names(linears)
    return {key: value for key, value in model.state_dict().items() if key not in left_out}


def held_quantized_causal_lm(folder: Path) -> tuple[Any, dict[str, Callable[[], torch.Tensor]]]:
    """A quantized folder's model held compactly, for computing with :func:`~compress.models.compute.computed_in_float32`:
    in the checkpoint's own dtype, each quantized weight kept only as its levels and scales, with the function that
    rebuilds it in float32 (by parameter name) while its block computes."""
    meta, linears = load_quantization(folder)
    model = load_causal_lm(folder, own_dtype=True, left_out=_weight_names(linears))
    rebuilt = {}
    for name, quant in linears.items():
        weight = model.get_submodule(name).weight
        weight.data = torch.empty(0, dtype=weight.dtype)  # transformers initialised it; the levels are the weight
        rebuilt[f"{name}.weight"] = functools.partial(dequantized_weight, meta, quant)
    return model, rebuilt


def load_quantized_causal_lm(folder: Path, trust_remote_code: bool = False):
    """A causal LM in float32 from a folder the quantize stage wrote (each quantized weight rebuilt from its levels), or
    from any float Hugging Face folder."""
    loaded = load_quantization(folder)
    left_out = _weight_names(loaded[1]) if loaded is not None else frozenset()
    model = load_causal_lm(folder, trust_remote_code=trust_remote_code, left_out=left_out)
    if loaded is not None:
        meta, linears = loaded
        with torch.no_grad():
            for name, quant in linears.items():
                model.get_submodule(name).weight.copy_(dequantized_weight(meta, quant))
    return model


def kv_cache_scales(meta: dict[str, Any]) -> dict[int, tuple[float, float]] | None:
    """The per-layer ``(k_scale, v_scale)`` of a saved quantization with an FP8 KV cache, or None."""
    cache = meta.get("kv_cache")
    return {int(i): (float(k), float(v)) for i, (k, v) in cache["scales"].items()} if cache else None


def attach_quantization(model, meta: dict[str, Any], linears: dict[str, LinearQuant]) -> None:
    """Everything a saved quantization simulates at run time: quantized inputs and the FP8 KV cache."""
    attach_activation_quant(model, linears)
    scales = kv_cache_scales(meta)
    if scales:
        kv_cache.attach_kv_cache_quant(model, scales)


def stored_grid(meta: dict[str, Any], quant: LinearQuant) -> WeightGrid:
    """The bound grid a saved linear's weight lies on (``meta`` as :func:`load_quantization` returns it)."""
    weight_format = meta.get("format", "int")
    if weight_format == "nvfp4":
        return Nvfp4Grid(quant.global_scale)
    if weight_format == "fp8":
        return Fp8Grid(per_channel=quant.weight_scales.dim() == 1)
    return IntGrid(meta["weight_bits"], meta.get("group_size"))
