"""A quantization on disk: the quantized checkpoint the quantize stage writes, and reading it back.

The quantize stage writes a Hugging Face folder whose quantized linears are stored as their grid
values and scales, never as a float copy, one shard per decoder block as the quantizer finishes it
(:class:`QuantizedCheckpointWriter`), so no more than one block's worth is ever held:

* ``quantized_weights-NNNNN-of-NNNNN.safetensors`` (named by ``quantized_weights.safetensors.index.json``):
  per quantized linear ``<name>.weight_levels`` (int8 for the integer grids, FP8 E4M3 for the FP8
  and E2M1 values, which E4M3 holds exactly; in the basis the input is quantized in) and
  ``<name>.weight_scale``;
* ``quantization.json``: method, precision, per-linear input scales, rotations, NVFP4 global
  scales, FP8 KV-cache scales;
* ``model-NNNNN-of-NNNNN.safetensors`` (named by the standard ``model.safetensors.index.json``):
  every other tensor (embeddings, norms, linears left float) in the checkpoint's own dtype,
  without the quantized linears' weights.

Every later reader (ONNX export, the Edge-LLM checkpoint and its custody check, validation's torch
reference) goes through this module: :func:`load_quantized_causal_lm` rebuilds the float model
with each quantized weight computed from its levels exactly as the quantizer computed it, and
:func:`load_quantization` reads the levels of all linears or of one block's.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors.torch import save_file

from compress.algorithms import kv_cache
from compress.algorithms.formats import (
    ACTIVATION_FORMATS,
    PRECISIONS,
    Fp8Grid,
    IntGrid,
    Nvfp4Grid,
    Precision,
    WeightGrid,
    expand_scales,
    levels_on_grid,
)
from compress.algorithms.rotation import rotate
from compress.algorithms.rounding import TuneOutcome
from compress.core.errors import UsageError, first_line
from compress.core.files import atomic_write_json, read_json
from compress.models.compute import holding_device, largest_part_float32_bytes, tensor_bytes
from compress.models.loading import load_causal_lm
from compress.models.weights import SAFETENSORS_INDEX, CheckpointReader, empty_causal_lm, set_parameter
from compress.transforms.quantize.config import QuantizeConfig

QUANT_CONFIG_FILE = "quantization.json"
QUANT_WEIGHTS_FILE = "quantized_weights.safetensors"
QUANT_WEIGHTS_INDEX = "quantized_weights.safetensors.index.json"
# The compact dtype each weight format's grid values are stored in (exact: int8 holds INT8/INT4, E4M3 holds E4M3 and
# E2M1).
LEVEL_DTYPES = {"int": torch.int8, "fp8": torch.float8_e4m3fn, "nvfp4": torch.float8_e4m3fn}
ACTIVATION_DESCRIPTIONS = {"int8": "int8-static-per-tensor", "fp8": "fp8-static-per-tensor",
                           "nvfp4": "nvfp4-dynamic-block16-static-global"}
OUTLIER_MARGIN_DB = 10.0
MIXED = "mixed"  # the precision of a quantization whose linears each have their own


QUANTIZATION_SCHEMA = 2


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SavedLinear(_Record):
    """One quantized linear's settings in ``quantization.json`` (its levels and scales are in the safetensors)."""

    input_scale: float | None
    sqnr_db: float
    migration_ratio: float | None = None
    rotation: int = 0
    global_scale: float | None = None
    input_format: str = "int8"
    # None in a file written before each linear named its own (the file's precision and group then hold)
    precision: str | None = None
    group_size: int | None = None


class SavedKvCache(_Record):
    """An FP8 KV cache: per layer (by index) its key and value scales."""

    format: Literal["fp8"] = "fp8"
    scales: dict[str, tuple[float, float]]


class QuantizationFile(_Record):
    """``quantization.json``: how a quantized folder was quantized, written and read through this one type.

    ``schema_version`` is 2 since the file became this type; one without it reads as version 1 (same layout)."""

    schema_version: Literal[1, 2] = 1
    method: str
    config: dict[str, Any]
    precision: str
    format: str
    weight_bits: int | None
    group_size: int | None
    activations: str
    plan: dict[str, Any] | None = None  # a mixed plan (MixedPlan.to_json)
    lm_head: str | None = None  # a mixed plan's LM head format
    kv_cache: SavedKvCache | None = None
    linears: dict[str, SavedLinear]

    def is_mixed(self) -> bool:
        return self.precision == MIXED

    def linear_precision(self, name: str) -> str:
        """How the linear ``name`` ships (its own precision; in an older file, the file's)."""
        return self.linears[name].precision or self.precision

    def kv_cache_scales(self) -> dict[int, tuple[float, float]] | None:
        """The per-layer ``(k_scale, v_scale)`` of an FP8 KV cache, or None."""
        if self.kv_cache is None:
            return None
        return {int(i): (float(k), float(v)) for i, (k, v) in self.kv_cache.scales.items()}

    def write(self, folder: Path) -> None:
        data = self.model_copy(update={"schema_version": QUANTIZATION_SCHEMA}).model_dump(mode="json")
        atomic_write_json(Path(folder) / QUANT_CONFIG_FILE, data)

    @classmethod
    def read(cls, folder: Path) -> QuantizationFile | None:
        """``quantization.json`` of a quantized folder, or None for a float model; a usage error naming the file when
        it is not one this compress reads."""
        path = Path(folder) / QUANT_CONFIG_FILE
        if not path.is_file():
            return None
        try:
            return cls.model_validate(read_json(path))
        except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            reason = _validation_reason(exc) if isinstance(exc, ValidationError) else first_line(exc)
            raise UsageError(
                f"{path} is not a quantization this compress reads ({reason}); rerun the quantize stage"
            ) from None


def _validation_reason(exc: ValidationError) -> str:
    problem = exc.errors()[0]
    return f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg'].lower()}"


@dataclass
class LinearQuant:
    """What the exporter needs for one quantized linear."""

    weight_scales: torch.Tensor
    input_scale: float | None
    sqnr_db: float
    migration_ratio: float | None = None
    rotation: int = 0  # Hadamard block size applied to the input before quantization; 0 = none
    # NVFP4's per-tensor scale (weight_scale_2); weights = (e2m1 * block scale) * this
    global_scale: float | None = None
    input_format: str = "int8"  # how input_scale quantizes the input (a key of ACTIVATION_FORMATS)
    levels: torch.Tensor | None = None  # the weight's grid values (in the input's basis), as LEVEL_DTYPES stores them
    precision: str = "int8"  # how this linear ships (a name of PRECISIONS): in a mixed-precision model, each its own
    group_size: int | None = None  # inputs per weight scale (INT4, NVFP4); None: per output channel or per tensor
    output_mse: torch.Tensor | None = None  # per output channel, on the calibration samples (what a sensitivity reads)

    @property
    def format(self) -> Precision:
        """This linear's deployment precision."""
        return PRECISIONS[self.precision]


class TuningSummary(TypedDict):
    """What learned rounding did over the blocks."""

    iterations: int
    windows_per_iteration: int
    blocks: int
    blocks_improved: int
    median_error_reduction: float
    seconds: float


class LayerError(TypedDict):
    name: str
    sqnr_db: float
    migration_ratio: float | None
    rotation: int


@dataclass
class QuantResult:
    """The outcome of quantizing a model."""

    config: QuantizeConfig
    linears: dict[str, LinearQuant] = field(default_factory=dict)
    calibration_tokens: int = 0
    seconds: float = 0.0
    # per layer (k_scale, v_scale) of an FP8 KV cache
    kv_scales: dict[int, tuple[float, float]] = field(default_factory=dict)
    plan: Any = None  # a MixedPlan: each point's own format (its linears say theirs)
    tuned: list[TuneOutcome] = field(default_factory=list)  # per block, where rounding was tuned
    untied_head: bool = False  # a tied LM head became a linear of its own (a rotation folded into it)

    def tuning_summary(self) -> TuningSummary | None:
        """What learned rounding did over the blocks (None when it did not run)."""
        if not self.tuned:
            return None
        kept = [t for t in self.tuned if t.kept]
        reduction = [1 - t.error_after / t.error_before for t in kept if t.error_before > 0]
        return {"iterations": self.config.tune_iters, "windows_per_iteration": self.config.tune_windows,
                "blocks": len(self.tuned), "blocks_improved": len(kept),
                "median_error_reduction": round(statistics.median(reduction), 4) if reduction else 0.0,
                "seconds": round(sum(t.seconds for t in self.tuned), 1)}

    def layer_errors(self) -> list[LayerError]:
        return [
            {"name": name, "sqnr_db": round(q.sqnr_db, 2), "migration_ratio": q.migration_ratio, "rotation": q.rotation}
            for name, q in self.linears.items()
        ]

    def rotated_linears(self) -> list[str]:
        """Linears whose input is Hadamard-rotated."""
        return [name for name, q in self.linears.items() if q.rotation]

    def float_input_linears(self) -> list[str]:
        """Linears of a format that quantizes activations that keep float inputs (``float_activations``, the SQNR
        fallback)."""
        return [name for name, q in self.linears.items() if q.input_scale is None and q.format.activations]

    def outliers(self) -> list[LayerError]:
        """Linears whose SQNR is more than 10 dB below the median."""
        values = [q.sqnr_db for q in self.linears.values()]
        if not values:
            return []
        floor = statistics.median(values) - OUTLIER_MARGIN_DB
        return [row for row in self.layer_errors() if row["sqnr_db"] < floor]


def input_quantizer(quant: LinearQuant) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the deployed graph does to a linear's input: fake quantization with its static scale (in the rotated basis,
    rotated back, for a rotated input), or None for a float input."""
    if quant.input_scale is None:
        return None
    scale, block, fake_quantize = (
        quant.input_scale,
        quant.rotation,
        ACTIVATION_FORMATS[quant.input_format].fake_quantize,
    )
    if block:
        # Quantized in the rotated basis, rotated back for the stored (rotated-back) weight.
        return lambda x: rotate(fake_quantize(rotate(x, block), scale), block)
    return lambda x: fake_quantize(x, scale)


def attach_activation_quant(model, linears: dict[str, LinearQuant]) -> list:
    """Fake-quantize the inputs of W8A8 / W4A4 linears with their static scales (torch reference of the Q/DQ graph)."""
    handles = []
    for name, quant in linears.items():
        quantizer = input_quantizer(quant)
        if quantizer is None:
            continue

        def hook(_module, args, quantizer=quantizer):
            return (quantizer(args[0]),) + tuple(args[1:])

        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    return handles


def _shard(stem: str, number: int, total: int) -> str:
    return f"{stem}-{number:05d}-of-{total:05d}.safetensors"


class QuantizedCheckpointWriter:
    """Writes the quantized checkpoint into ``folder`` one decoder block at a time (see the module docstring).

    :meth:`add_block` takes a block as the quantizer leaves it (its quantized linears computing with their
    dequantized levels, its norms holding the folded migration scales) and writes its float tensors in the
    checkpoint's own ``dtype`` and its quantized linears' levels and scales, then lets the levels go;
    :meth:`finish` writes the tensors outside the blocks, the two indexes and ``quantization.json``.
    """

    def __init__(self, folder: Path, blocks: int, dtype: torch.dtype) -> None:
        self.folder = Path(folder)
        self.blocks = blocks
        self.dtype = dtype
        self.model_map: dict[str, str] = {}
        self.level_map: dict[str, str] = {}
        self.sizes = {"model": 0, "levels": 0}
        self.folder.mkdir(parents=True, exist_ok=True)

    def add_block(self, index: int, prefix: str, block: torch.nn.Module, linears: dict[str, LinearQuant]) -> None:
        """Write block ``index`` (state-dict names under ``prefix``) and its quantized ``linears`` (full names)."""
        left_out = _weight_names(linears)
        state = {f"{prefix}.{key}": value for key, value in block.state_dict().items()}
        self._write("model", _shard("model", index + 1, self.blocks + 1), {
            key: _stored(value, self.dtype) for key, value in state.items() if key not in left_out}, self.model_map)
        levels: dict[str, torch.Tensor] = {}
        for name, quant in linears.items():
            levels[f"{name}.weight_scale"] = quant.weight_scales.detach().float().cpu().contiguous()
            levels[f"{name}.weight_levels"] = quant.levels.cpu().contiguous()
            quant.levels = None  # on disk now; nothing holds a second copy of the model's levels
        if levels:
            self._write("levels", _shard("quantized_weights", index + 1, self.blocks), levels, self.level_map)

    def add_head(self, name: str, quant: LinearQuant) -> None:
        """Write a quantized LM head's levels and scales (its float weight is never written)."""
        levels = {f"{name}.weight_scale": quant.weight_scales.detach().float().cpu().contiguous(),
                  f"{name}.weight_levels": quant.levels.cpu().contiguous()}
        quant.levels = None
        self._write("levels", f"quantized_weights-{name}.safetensors", levels, self.level_map)

    def finish(self, rest: dict[str, torch.Tensor], result: QuantResult) -> None:
        """Write ``rest`` (every tensor outside the blocks, as stored), the indexes and ``quantization.json``."""
        self._write("model", _shard("model", self.blocks + 1, self.blocks + 1), rest, self.model_map)
        atomic_write_json(self.folder / SAFETENSORS_INDEX, {"metadata": {"total_size": self.sizes["model"]},
                                                            "weight_map": self.model_map})
        atomic_write_json(self.folder / QUANT_WEIGHTS_INDEX, {"metadata": {"total_size": self.sizes["levels"]},
                                                              "weight_map": self.level_map})
        _quantization_file(result).write(self.folder)

    def _write(self, kind: str, file: str, tensors: dict[str, torch.Tensor], weight_map: dict[str, str]) -> None:
        save_file(tensors, str(self.folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        self.sizes[kind] += sum(t.numel() * t.element_size() for t in tensors.values())


def _stored(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor as the checkpoint stores it: on the CPU, floats in the checkpoint's dtype."""
    return value.detach().to("cpu", dtype=dtype if value.is_floating_point() else None).contiguous()


def _quantization_file(result: QuantResult) -> QuantizationFile:
    if result.plan is not None:
        uniform = {"precision": MIXED, "format": MIXED, "weight_bits": None, "group_size": None,
                   "activations": "per linear", "plan": result.plan.to_json(), "lm_head": result.plan.head}
    else:
        bits, _, group = result.config.scheme()
        activation = result.config.activation_format()
        uniform = {"precision": result.config.precision().name, "format": result.config.weight_format(),
                   "weight_bits": bits, "group_size": group,
                   "activations": ACTIVATION_DESCRIPTIONS[activation.name] if activation else "float"}
    kv_cache = SavedKvCache(scales={str(i): s for i, s in result.kv_scales.items()}) if result.kv_scales else None
    linears = {
        name: SavedLinear(input_scale=q.input_scale, input_format=q.input_format, sqnr_db=q.sqnr_db,
                          migration_ratio=q.migration_ratio, rotation=q.rotation, global_scale=q.global_scale,
                          precision=q.precision, group_size=q.group_size)
        for name, q in result.linears.items()
    }
    return QuantizationFile(method=result.config.method, config=result.config.model_dump(mode="json"), **uniform,
                            kv_cache=kv_cache, linears=linears)


def quantization_meta(folder: Path) -> QuantizationFile | None:
    """``quantization.json`` of a quantized folder (every linear's settings, no tensors), or None for a float model."""
    return QuantizationFile.read(folder)


def load_quantization(
    folder: Path, prefix: str | None = None
) -> tuple[QuantizationFile, dict[str, LinearQuant]] | None:
    """Read what :class:`QuantizedCheckpointWriter` wrote (``prefix``: only the linears under it, e.g. one block's), or
    None for a float model."""
    folder = Path(folder)
    meta = quantization_meta(folder)
    if meta is None:
        return None
    names = [name for name in meta.linears if prefix is None or name.startswith(prefix)]
    try:
        reader = CheckpointReader(folder, QUANT_WEIGHTS_FILE, QUANT_WEIGHTS_INDEX)
    except UsageError as exc:
        raise UsageError(f"{folder} holds quantization.json but no levels ({exc}); rerun the quantize stage") from exc
    missing = [name for name in names if f"{name}.weight_levels" not in reader]
    if missing:
        raise UsageError(
            f"{folder} holds no levels for {', '.join(missing[:3])}; it was written by another version of compress: "
            "rerun the quantize stage"
        )
    stored = reader.read(key for name in names for key in (f"{name}.weight_scale", f"{name}.weight_levels"))
    return meta, {name: _linear_quant(meta, name, stored) for name in names}


def _linear_quant(meta: QuantizationFile, name: str, stored: dict[str, torch.Tensor]) -> LinearQuant:
    info = meta.linears[name]
    # a file written before each linear named its own precision holds one group size for all
    group_size = info.group_size if info.precision is not None else meta.group_size
    return LinearQuant(stored[f"{name}.weight_scale"], info.input_scale, info.sqnr_db, info.migration_ratio,
                       info.rotation, info.global_scale, info.input_format, stored[f"{name}.weight_levels"],
                       meta.linear_precision(name), group_size)


def grid_levels(weight: torch.Tensor, grid: WeightGrid, scales: torch.Tensor, weight_format: str) -> torch.Tensor:
    """The stored form of an on-grid weight's levels (``weight`` in its input's basis); raises ValueError off the
    grid."""
    return levels_on_grid(weight, grid, scales, tolerance=1e-5).to(LEVEL_DTYPES[weight_format])


def level_values(quant: LinearQuant) -> torch.Tensor:
    """A saved linear's grid values as float32 (integers, E4M3 or E2M1 values), in its input's basis."""
    return quant.levels.float()


def dequantized_weight(quant: LinearQuant) -> torch.Tensor:
    """The float32 weight a saved linear computes with: its levels times its scales, rotated back when its input is
    rotated (the quantizer computes it this way, so the result is the same number for number)."""
    levels = level_values(quant)
    weight = stored_grid(quant).dequantize(levels, expand_scales(quant.weight_scales.float(), levels.shape[1]))
    return rotate(weight, quant.rotation) if quant.rotation else weight


def _weight_names(linears: dict[str, LinearQuant]) -> frozenset[str]:
    """The state-dict keys of quantized linears' weights (which ``model.safetensors`` leaves out: they are levels)."""
    return frozenset(f"{name}.weight" for name in linears)


def model_state_without_quantized(model, linears: dict[str, LinearQuant]) -> dict[str, torch.Tensor]:
    """``model``'s state dict without the weights its quantized linears store as levels (what ``model.safetensors``
    holds)."""
    left_out = _weight_names(linears)
    return {key: value for key, value in model.state_dict().items() if key not in left_out}


def held_quantized_causal_lm(folder: Path, trust_remote_code: bool = False,
                             loaded: tuple[dict[str, Any], dict[str, LinearQuant]] | None = None
                             ) -> tuple[Any, dict[str, Callable[[], torch.Tensor]]]:
    """A quantized folder's model held compactly, for computing with
    :func:`~compress.models.compute.computed_in_float32`: every float tensor as the checkpoint stores it, each quantized
    weight kept only as its levels and scales, with the function that rebuilds it in float32 (by parameter name) while
    its block computes.

    The model is built empty and given the checkpoint's tensors (no initialisation, no float copy of a quantized
    weight is ever made); its generation settings are the folder's. ``loaded``: what :func:`load_quantization` read, if
    the caller has it."""
    _, linears = loaded or load_quantization(folder)
    quantized = _weight_names(linears)
    model = empty_causal_lm(folder, trust_remote_code=trust_remote_code)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()  # one parameter, read once, before the tensors are named
    shapes = {name: p.shape for name, p in model.named_parameters()}
    reader = CheckpointReader(folder)
    stored = reader.read(name for name in shapes if name not in quantized)
    for name, shape in shapes.items():
        if name in quantized:
            set_parameter(model, name, torch.empty(0, dtype=model.get_parameter(name).dtype))
            continue
        value = stored.pop(name)
        if value.shape != shape:
            raise UsageError(f"{folder}: {name} is {tuple(value.shape)} where config.json gives {tuple(shape)}")
        set_parameter(model, name, value)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    if (Path(folder) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    rebuilt = {f"{name}.weight": functools.partial(dequantized_weight, quant) for name, quant in linears.items()}
    return model, rebuilt


def held_deployed_causal_lm(folder: Path, trust_remote_code: bool = False, device: str = "cpu"
                            ) -> tuple[Any, dict[str, Callable[[], torch.Tensor]] | None]:
    """What a folder deploys, held in its own dtype for :func:`~compress.models.compute.computed_in_float32`: a float
    model as it is, a quantized one as its levels with its input quantizers and FP8 KV cache attached; held on
    ``device`` where it fits there (:func:`~compress.models.compute.holding_device`), else on the CPU."""
    loaded = load_quantization(folder)
    if loaded is None:
        model = load_causal_lm(folder, trust_remote_code=trust_remote_code, own_dtype=True)
        return model.to(
            holding_device(device, tensor_bytes(model.parameters()), largest_part_float32_bytes(model))
        ), None
    model, rebuilt = held_quantized_causal_lm(folder, trust_remote_code, loaded)
    attach_quantization(model, *loaded)
    linears = loaded[1].values()
    held = tensor_bytes([*model.parameters(), *(q.levels for q in linears), *(q.weight_scales for q in linears)])
    where = holding_device(device, held, largest_part_float32_bytes(model))
    if where != "cpu":
        model.to(where)
        for quant in linears:  # each weight is rebuilt from these where its block computes
            quant.levels, quant.weight_scales = quant.levels.to(where), quant.weight_scales.to(where)
    return model, rebuilt


def load_quantized_causal_lm(folder: Path, trust_remote_code: bool = False):
    """A causal LM in float32 from a folder the quantize stage wrote (each quantized weight rebuilt from its levels), or
    from any float Hugging Face folder."""
    loaded = load_quantization(folder)
    left_out = _weight_names(loaded[1]) if loaded is not None else frozenset()
    model = load_causal_lm(folder, trust_remote_code=trust_remote_code, left_out=left_out)
    if loaded is not None:
        _, linears = loaded
        with torch.no_grad():
            for name, quant in linears.items():
                model.get_submodule(name).weight.copy_(dequantized_weight(quant))
    return model


def attach_quantization(model, meta: QuantizationFile, linears: dict[str, LinearQuant]) -> None:
    """Everything a saved quantization simulates at run time: quantized inputs and the FP8 KV cache."""
    attach_activation_quant(model, linears)
    scales = meta.kv_cache_scales()
    if scales:
        kv_cache.attach_kv_cache_quant(model, scales)


def stored_grid(quant: LinearQuant) -> WeightGrid:
    """The bound grid a saved linear's weight lies on (each linear its own precision)."""
    weight_format = quant.format.weight_format
    if weight_format == "nvfp4":
        return Nvfp4Grid(quant.global_scale)
    if weight_format == "fp8":
        return Fp8Grid(per_channel=quant.weight_scales.dim() == 1)
    return IntGrid(quant.format.weight_bits, quant.group_size)
