"""The number grids quantized weights and activations lie on: signed integers, FP8 (E4M3) and NVFP4.

A weight grid chooses a weight's scales and rounds values under them; every quantizer in
:mod:`compress.algorithms.quant` (round-to-nearest, AWQ, GPTQ) works through one, so the same
algorithm runs on any grid. Scales are symmetric (zero point 0), the form TensorRT takes.

* :class:`IntGrid`: ``bits``-bit integers, one scale per output channel or per group of inputs.
* :class:`Fp8Grid`: FP8 E4M3 values (saturating at 448), one scale per tensor or per output channel.
  Scales are FP16 numbers, because TensorRT Edge-LLM stores FP8 scales in FP16.
* :class:`Nvfp4Grid`: FP4 E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6) in blocks of 16 inputs, each
  block with an FP8 E4M3 scale, all multiplied by one FP32 per-tensor scale (``weight_scale_2``):
  ``w = (e2m1 * block_scale) * global_scale``, the order Edge-LLM's decoder multiplies in.

Activation formats (:class:`Int8Activation`, :class:`Fp8Activation`, :class:`Nvfp4Activation`)
fake-quantize an activation under its calibrated per-tensor scale. NVFP4 activations are
quantized dynamically per block of 16, their block scales in FP8 relative to the calibrated global
scale, exactly as TensorRT Edge-LLM's ``TRT_FP4DynamicQuantize`` pattern does.

A deployment :class:`Precision` (``int8``, ``int4``, ``fp8``, ``nvfp4``, ``nvfp4_a16``, the float
ones) ties those together: how its weights are stored, how its inputs are quantized, which GPU
number format and tensor-core rate it needs, and what its TensorRT Edge-LLM checkpoint calls it.
:data:`PRECISIONS` is the one table every stage, backend and the latency model read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
NVFP4_BLOCK = 16
E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_SMALLEST_FP16 = 2.0 ** -24


def fp16_number(value: float) -> float:
    """The FP16 number nearest to a positive ``value`` (at least the smallest FP16 subnormal)."""
    return max(float(torch.tensor(value, dtype=torch.float16)), _SMALLEST_FP16)


def round_fp8(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest FP8 E4M3 value (ties to even), saturating at +-448; returned as float32."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest FP4 E2M1 value, saturating at +-6.

    Ties go to the even code, which is what rounding half to even gives in each of the three
    spacings of the grid (0.5 below 2, 1 below 4, 2 above).
    """
    magnitude = x.float().abs()
    halves = torch.round(magnitude * 2) / 2
    units = torch.round(magnitude)
    twos = (torch.round(magnitude / 2) * 2).clamp(max=FP4_MAX)
    rounded = torch.where(magnitude < 2, halves, torch.where(magnitude < 4, units, twos))
    return torch.copysign(rounded, x.float()) * (rounded != 0)


_CODE_OF_LEVEL = {level: code for code, level in enumerate(E2M1_LEVELS)}


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """4-bit codes (sign bit 8, magnitude index 0-7) of E2M1 values; zero is +0."""
    magnitude = values.abs()
    codes = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    for level, code in _CODE_OF_LEVEL.items():
        codes[magnitude == level] = code
    if not torch.isin(magnitude, torch.tensor(E2M1_LEVELS, device=values.device)).all():
        raise ValueError("values are not on the E2M1 grid")
    return codes | ((values < 0).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`e2m1_codes`."""
    levels = torch.tensor(E2M1_LEVELS, device=codes.device)[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -levels, levels)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` 4-bit codes -> ``[out, in / 2]`` uint8, even inputs in the low nibble (ModelOpt's NVFP4 layout)."""
    return (codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`."""
    codes = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8, device=packed.device)
    codes[:, 0::2] = packed & 0xF
    codes[:, 1::2] = packed >> 4
    return codes


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    return torch.where(scales == 0, torch.ones_like(scales), scales)


# rows of a weight taken to float32 at a time where a whole copy would be large (a 150k-word LM head)
ROWS_AT_A_TIME = 8192


def tensor_absmax(weights: list[torch.Tensor]) -> float:
    """The largest absolute value over ``weights``, read a slice of rows at a time (no whole-size temporary)."""
    return max(float(part.abs().max()) for w in weights for part in w.split(ROWS_AT_A_TIME))


def expand_scales(scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """Scales broadcast against an ``(out, in)`` weight: per tensor ``()``, per channel ``(out,)``, per group ``(out,
    groups)``."""
    if scales.dim() == 0:
        return scales
    if scales.dim() == 1:
        return scales[:, None]
    return scales.repeat_interleave(in_features // scales.shape[1], dim=1)


class WeightGrid(Protocol):
    """How a weight's scales are chosen and its values rounded (see the module docstring)."""

    group_size: int | None

    def bind(self, weights: list[torch.Tensor]) -> WeightGrid:
        """This grid with whatever it derives from the whole tensor (NVFP4's global scale) fixed from ``weights``."""

    def scales(self, weight: torch.Tensor, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
        """Round-to-nearest scales of ``weight`` (its absolute maximum times ``clip``, per tensor, channel or group)."""

    def group_scale(self, columns: torch.Tensor, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
        """``(out,)`` scales of one group's ``(out, group)`` columns."""

    def snap_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """``scales`` as this grid stores them (FP16 numbers for FP8, FP8 numbers for NVFP4 blocks)."""

    def levels(self, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Grid values of ``weight`` under broadcast ``scales``."""

    def dequantize(self, levels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Float values of grid ``levels`` under broadcast ``scales``."""


@dataclass(frozen=True)
class IntGrid:
    """Signed ``bits``-bit integers; a scale per output channel (``group_size=None``) or per group of inputs."""

    bits: int
    group_size: int | None = None

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def bind(self, weights: list[torch.Tensor]) -> IntGrid:
        return self

    def scales(self, weight: torch.Tensor, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
        out_features, in_features = weight.shape
        if self.group_size is None:
            absmax = weight.abs().amax(dim=1)
        else:
            absmax = weight.reshape(out_features, in_features // self.group_size, self.group_size).abs().amax(dim=2)
        return (absmax * clip).clamp(min=1e-8) / self.qmax

    def group_scale(self, columns: torch.Tensor, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
        return (columns.abs().amax(dim=1) * clip).clamp(min=1e-8) / self.qmax

    def snap_scales(self, scales: torch.Tensor) -> torch.Tensor:
        return scales.clamp(min=1e-8 / self.qmax)

    def levels(self, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.round(weight / scales), -self.qmax - 1, self.qmax)

    def dequantize(self, levels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return levels * scales


@dataclass(frozen=True)
class Fp8Grid:
    """FP8 E4M3 values; one FP16 scale per tensor, or per output channel with ``per_channel``.

    A per-tensor grid bound to its weight keeps the weight's absolute maximum, so slices of rows share the whole
    tensor's scale."""

    per_channel: bool = False
    group_size: int | None = None
    absmax: float | None = None

    def bind(self, weights: list[torch.Tensor]) -> Fp8Grid:
        if self.per_channel or self.absmax is not None:
            return self
        return replace(self, absmax=tensor_absmax(weights))

    def scales(self, weight: torch.Tensor, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
        if self.per_channel:
            absmax = weight.abs().amax(dim=1)
        else:
            absmax = weight.abs().amax() if self.absmax is None else weight.new_tensor(self.absmax)
        return self.snap_scales((absmax * clip).clamp(min=1e-8) / FP8_MAX)

    def snap_scales(self, scales: torch.Tensor) -> torch.Tensor:
        return scales.half().float().clamp(min=_SMALLEST_FP16)

    def group_scale(self, columns: torch.Tensor, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
        raise ValueError("FP8 weights have no groups")

    def levels(self, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return round_fp8(weight / scales)

    def dequantize(self, levels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return levels * scales


@dataclass(frozen=True)
class Nvfp4Grid:
    """E2M1 values in blocks of 16 inputs; FP8 block scales relative to the per-tensor ``global_scale``.

    ``scales`` are the FP8 block scales (as float32). An unbound grid takes its global scale from
    the weights it is bound to: their absolute maximum over ``6 * 448`` (the largest block scale
    then lands on FP8's maximum), times ``global_shrink`` (below 1, the largest blocks saturate).
    """

    global_scale: float | None = None
    global_shrink: float = 1.0
    group_size: int = NVFP4_BLOCK

    def bind(self, weights: list[torch.Tensor]) -> Nvfp4Grid:
        if self.global_scale is not None:
            return self
        return replace(self, global_scale=max(tensor_absmax(weights) * self.global_shrink, 1e-12) / (FP4_MAX * FP8_MAX))

    def _global(self) -> float:
        if self.global_scale is None:
            raise ValueError("an NVFP4 grid needs its global scale: bind it to the weights first")
        return self.global_scale

    def scales(self, weight: torch.Tensor, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
        out_features, in_features = weight.shape
        absmax = weight.reshape(out_features, in_features // self.group_size, self.group_size).abs().amax(dim=2)
        return round_fp8(absmax * clip / FP4_MAX / self._global())

    def group_scale(self, columns: torch.Tensor, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
        return round_fp8(columns.abs().amax(dim=1) * clip / FP4_MAX / self._global())

    def snap_scales(self, scales: torch.Tensor) -> torch.Tensor:
        return round_fp8(scales)

    def levels(self, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return round_e2m1(weight / (_nonzero(scales) * self._global()))

    def dequantize(self, levels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return (levels * scales) * self._global()


def quantize_dequantize(weight: torch.Tensor, grid: WeightGrid, clip: torch.Tensor | float = 1.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest on a bound grid: the dequantized weight and its scales."""
    scales = grid.scales(weight, clip)
    expanded = expand_scales(scales, weight.shape[1])
    return grid.dequantize(grid.levels(weight, expanded), expanded), scales


class ActivationFormat(Protocol):
    """Static per-tensor activation quantization from a calibrated absolute maximum."""

    name: str

    def scale_for(self, absmax: float) -> float:
        """The per-tensor scale calibration gives an input of absolute maximum ``absmax``."""

    def fake_quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """``x`` quantized and dequantized under ``scale``."""


@dataclass(frozen=True)
class Int8Activation:
    """Static per-tensor INT8."""

    name: str = "int8"

    def scale_for(self, absmax: float) -> float:
        return absmax / 127

    def fake_quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.clamp(torch.round(x / scale), -128, 127) * scale


@dataclass(frozen=True)
class Fp8Activation:
    """Static per-tensor FP8 E4M3 with an FP16 scale."""

    name: str = "fp8"

    def scale_for(self, absmax: float) -> float:
        return fp16_number(max(absmax, 1e-8) / FP8_MAX)

    def fake_quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return round_fp8(x / scale) * scale


@dataclass(frozen=True)
class Nvfp4Activation:
    """Dynamic NVFP4 blocks of 16 along the last axis, FP8 block scales relative to a calibrated power-of-two global
    scale.

    TensorRT's FP4 dynamic quantization divides by the FP32 product of block and global scale but
    multiplies back by their FP16 product; with a power-of-two global scale both products are exact,
    so the two are one number (the global scale still places the largest block's scale in FP8's top octave).
    """

    name: str = "nvfp4"

    def scale_for(self, absmax: float) -> float:
        return 2.0 ** math.ceil(math.log2(max(absmax, 1e-8) / (FP4_MAX * FP8_MAX)))

    def fake_quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        *lead, width = x.shape
        blocks = x.float().reshape(*lead, width // NVFP4_BLOCK, NVFP4_BLOCK)
        per_block = blocks.abs().amax(dim=-1, keepdim=True) / FP4_MAX
        block_scale = round_fp8(per_block / scale)
        block_scale = torch.where(per_block == 0, torch.ones_like(block_scale), block_scale)
        quantize_scale = (block_scale * scale).clamp(min=1e-20)
        return (round_e2m1(blocks / quantize_scale) * quantize_scale).reshape(x.shape).to(x.dtype)


ACTIVATION_FORMATS: dict[str, ActivationFormat] = {
    f.name: f for f in (Int8Activation(), Fp8Activation(), Nvfp4Activation())
}


def levels_on_grid(
    weight: torch.Tensor, grid: WeightGrid, scales: torch.Tensor, tolerance: float = 1e-5
) -> torch.Tensor:
    """The grid values of a weight that lies on ``grid`` under ``scales``; raises ValueError for one that does not.

    ``tolerance`` is relative to the weight's largest magnitude (integer grids recovered from a
    float32 product are exact only to rounding).
    """
    expanded = expand_scales(scales.float(), weight.shape[1])
    levels = grid.levels(weight.float(), expanded)
    off = float((grid.dequantize(levels, expanded) - weight.float()).abs().max())
    if off > tolerance * max(1.0, float(weight.abs().max())):
        raise ValueError(f"weight is not on its grid under the saved scales (off by up to {off:.3g})")
    return levels


@dataclass(frozen=True, eq=False)
class Precision:
    """One deployment precision: how the quantized linears of a model ship, every fact of it in one place.

    ``name`` is how runs, reports and ``compress predict precision=`` spell it. ``gpu_format`` is
    the number format the target's GPU must run (a name of ``Target.gpu.precisions``), ``compute``
    the tensor-core rate its matrix multiplies run at (weight-only precisions dequantize to FP16),
    ``weight_format`` how the weights are stored (``int``, ``fp8``, ``nvfp4``, ``float``),
    ``activations`` the activation format of quantized inputs (None: weight-only), ``edgellm`` the
    TensorRT Edge-LLM precision its bundle is, and ``quant_algo`` the Model Optimizer unified
    checkpoint's algorithm name for it.
    """

    name: str
    weight_bits: int
    gpu_format: str
    compute: str
    weight_format: str
    activations: str | None
    edgellm: str
    quant_algo: str | None
    summary: str

    def __eq__(self, other: object) -> bool:
        """A precision equals itself and its name (``config.precision() == "int4"``)."""
        if isinstance(other, Precision):
            return self.name == other.name
        return isinstance(other, str) and self.name == other

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    @property
    def device_bits(self) -> int:
        """Bits of one weight as the device stores it (float precisions run in FP16)."""
        return min(self.weight_bits, 16)


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", 32, "fp32", "fp16", "float", None, "fp16", None, "float (FP16 on the device)"),
        Precision("fp16", 16, "fp16", "fp16", "float", None, "fp16", None, "FP16"),
        Precision("bf16", 16, "bf16", "fp16", "float", None, "fp16", None, "float (FP16 on the device)"),
        Precision(
            "int8",
            8,
            "int8",
            "int8",
            "int",
            "int8",
            "int8",
            "W8A8_SQ_PER_CHANNEL",
            "INT8 weights and activations (W8A8)",
        ),
        Precision(
            "int4", 4, "int4", "fp16", "int", None, "int4", "W4A16_AWQ", "INT4 weight-only (W4A16), grouped scales"
        ),
        Precision("fp8", 8, "fp8", "fp8", "fp8", "fp8", "fp8", "FP8", "FP8 E4M3 weights and activations"),
        Precision("nvfp4", 4, "fp4", "fp4", "nvfp4", "nvfp4", "nvfp4", "NVFP4", "NVFP4 weights and activations (W4A4)"),
        Precision("nvfp4_a16", 4, "fp4", "fp16", "nvfp4", None, "nvfp4", "W4A16_NVFP4", "NVFP4 weight-only (W4A16)"),
    )
}
