"""The quantize stage's options: one typed config per method, behind one discriminated union.

``method`` picks the class, so an option of another method is an error naming the key and the
method rather than a silently ignored setting: ``alpha`` is SmoothQuant's (W8A8 methods),
``group_size`` INT4's, ``activations`` NVFP4's. Every class answers the same questions
(:meth:`precision`, :meth:`scheme`, :meth:`weight_grid`, ...), which is all the quantizer asks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypedDict

from pydantic import Discriminator, Field, NonNegativeInt, PositiveFloat, PositiveInt, Tag, TypeAdapter, model_validator

from compress.algorithms.formats import (
    ACTIVATION_FORMATS,
    NVFP4_BLOCK,
    PRECISIONS,
    ActivationFormat,
    Fp8Grid,
    IntGrid,
    Nvfp4Grid,
    Precision,
    WeightGrid,
)
from compress.algorithms.rounding import TuneSettings
from compress.core.config import StrictModel

# A block linear by its short name; Phi-3's are fused (qkv_proj, gate_up_proj).
LinearName = Literal[
    "q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj"
]
DEFAULT_METHOD = "int8"


class CalibrationOptions(TypedDict):
    """The calibration options every candidate format's method of a mixed plan takes from the plan's config."""

    calib_windows: int
    calib_window: int
    min_calib_tokens: int
    sample_tokens: int


class QuantizeConfig(StrictModel):
    """Options every method has (calibration budget, linears left float, the KV cache), and the questions every method's
    config answers, so that no caller tests a method's name.

    Build one with :func:`quantize_config` (``quantize_config(method="int4", group_size=128)``) or a method's own class;
    each method's class takes only its own options.
    """

    @model_validator(mode="before")
    @classmethod
    def _no_options_of_other_methods(cls, data: Any) -> Any:
        """An option another method takes is named with the methods it belongs to (a typo stays "unknown key")."""
        if not isinstance(data, dict) or cls is QuantizeConfig:
            return data
        method = cls.model_fields["method"].default
        for key, value in data.items():
            if key in cls.model_fields:
                continue
            owners = [name for name, config in METHODS.items() if key in config.model_fields]
            if key == "activations" and value == "float" and cls.model_construct().smooths_activations():
                raise ValueError(f"method {method} quantizes activations; weight-only is method int4 or nvfp4")
            if owners:
                option = f"{key}={value}" if key == "activations" else key
                raise ValueError(f"{option} applies to method {' or '.join(owners)} only, not {method}")
        return data

    calib_windows: PositiveInt = 32
    calib_window: PositiveInt = 512
    min_calib_tokens: PositiveInt = 2048
    sample_tokens: PositiveInt = 1024
    # Linears left unquantized (float weights and inputs; FP16 in a deployment checkpoint).
    float_linears: list[LinearName] = []
    # "fp8" stores the KV cache as FP8 E4M3 under a calibrated scale per layer for keys and for values.
    kv_cache: Literal["fp16", "fp8"] = "fp16"
    # Learned rounding and clipping after the format's own solution: signed-gradient iterations per block (0: off),
    # calibration windows per iteration, and the learning rate in grid steps (None: 1 / tune_iters).
    tune_iters: NonNegativeInt = 0
    tune_windows: PositiveInt = 4
    tune_lr: PositiveFloat | None = None
    # "hadamard": the residual stream and each value head rotated, the rotation folded into the weights before the
    # format's own solution (compress.transforms.rotate); the deployed model is a plain model of the same family.
    rotate: Literal["none", "hadamard"] = "none"

    def tuning(self) -> TuneSettings | None:
        """How each block's rounding is tuned after it is quantized, or None when it is not."""
        if not self.tune_iters:
            return None
        return TuneSettings(self.tune_iters, self.tune_windows, self.tune_lr)

    def is_float(self, linear: str) -> bool:
        """Whether the linear at block path ``linear`` stays unquantized."""
        return linear.rsplit(".", 1)[-1] in self.float_linears

    def is_w8a8(self) -> bool:
        """Whether weights and activations are both 8-bit (INT8 or FP8), the SmoothQuant methods."""
        return False

    def rotation_limit(self) -> int:
        """The largest Hadamard block the down_proj input may be rotated by (0: never rotated)."""
        return 0

    def keeps_float_input(self, linear: str) -> bool:
        """Whether the linear at block path ``linear`` keeps its input float while its weights are quantized."""
        return False

    def uses_awq(self) -> bool:
        return False

    def uses_gptq(self) -> bool:
        return False

    def scheme(self) -> tuple[int, bool, int | None]:
        """(weight bits, activations quantized?, group size or None for per-channel / per-tensor)."""
        precision = self.precision()
        return precision.weight_bits, precision.activations is not None, None

    def weight_grid(self) -> WeightGrid:
        """The grid weights are rounded to (an NVFP4 grid is bound to each weight's global scale later)."""
        bits, _, group = self.scheme()
        return IntGrid(bits, group)

    def activation_format(self) -> ActivationFormat | None:
        """How inputs of quantized linears are quantized, or None for weight-only."""
        activations = self.precision().activations
        return ACTIVATION_FORMATS[activations] if activations else None

    def weight_format(self) -> str:
        """``int``, ``fp8`` or ``nvfp4``: how the weights are stored."""
        return self.precision().weight_format

    def precision(self) -> Precision:
        """The deployment precision these options produce (see :data:`compress.algorithms.formats.PRECISIONS`)."""
        return PRECISIONS[self.method]  # type: ignore[attr-defined]

    def is_mixed(self) -> bool:
        """Whether the quantization ends in a plan of a format per group of linears rather than one format."""
        return False

    def candidate_precisions(self) -> list[str] | None:
        """The precision names the quantized model may hold (``None``: whichever the target deploys, for a plan)."""
        return [self.precision().name]

    def uniform_configs(self) -> list[QuantizeConfig]:
        """The one-format configs this quantization may apply: itself, or a plan's candidate formats' configs."""
        return [self]

    def smooths_activations(self) -> bool:
        """Whether a SmoothQuant migration (a scale per input channel folded into the producer) precedes rounding."""
        return False

    def binds_global_scale(self) -> bool:
        """Whether the weight grid holds a per-tensor scale bound to the weights it rounds (NVFP4)."""
        return False

    def searches_global_scale(self) -> bool:
        """Whether that per-tensor scale is searched for the least output error on calibration samples."""
        return False

    def clip_on_all_tokens(self) -> bool:
        """Whether AWQ's clip search scores every calibration token (reads the input's Hessian) rather than samples."""
        return False

    def describe(self) -> str:
        """The number formats of weights, activations and KV cache, in words a report can show."""
        bits, _, group = self.scheme()
        return _with_inputs(
            self, f"INT{bits} weights ({f'group {group}' if group else 'one scale per output channel'})"
        )

    def algorithm_name(self) -> str:
        """How the weights were chosen, in words a report can show."""
        return "rtn"


class _ActivationOptions(StrictModel):
    """Options of the methods that quantize activations under a static per-tensor scale."""

    act_scale: Literal["absmax", "mse"] = "absmax"
    float_activations: list[LinearName] = []
    float_activations_below_db: float | None = None

    def keeps_float_input(self, linear: str) -> bool:
        return linear.rsplit(".", 1)[-1] in self.float_activations


class _GptqOptions(StrictModel):
    """GPTQ's options, for the methods that can round weights with it."""

    gptq_damp: float = Field(0.01, gt=0.0, lt=1.0)
    gptq_act_order: bool = True


class _W8A8(_ActivationOptions, _GptqOptions, QuantizeConfig):
    """SmoothQuant W8A8: a migration strength per input (searched with ``alpha: auto``), weights by RTN or GPTQ."""

    alpha: float | Literal["auto"] = "auto"
    weight_algorithm: Literal["rtn", "gptq"] = "gptq"
    # Largest Hadamard block for the down_proj input rotation (the largest power of two up to this
    # that divides the layer's width is used); 0 turns the rotation off.
    hadamard_block: Literal[0, 32, 64, 128, 256] = 0

    @model_validator(mode="after")
    def _rotation_or_float(self) -> _W8A8:
        if self.hadamard_block and "down_proj" in self.float_linears:
            raise ValueError(
                "hadamard_block rotates the down_proj input, which float_linears leaves unquantized; use one of them"
            )
        return self

    def is_w8a8(self) -> bool:
        return True

    def rotation_limit(self) -> int:
        return self.hadamard_block

    def uses_gptq(self) -> bool:
        return self.weight_algorithm == "gptq"

    def smooths_activations(self) -> bool:
        return True

    def algorithm_name(self) -> str:
        return "smoothquant+" + self.weight_algorithm


class Int8Config(_W8A8):
    """``method: int8``: INT8 weights per output channel, static per-tensor INT8 activations."""

    method: Literal["int8"] = "int8"


class Fp8Config(_W8A8):
    """``method: fp8``: FP8 E4M3 weights and static per-tensor FP8 activations (Thor's FP8 tensor cores)."""

    method: Literal["fp8"] = "fp8"
    # One weight scale per tensor (what TensorRT Edge-LLM's FP8 linears take) or per output channel.
    fp8_weight_scale: Literal["tensor", "channel"] = "tensor"

    def weight_grid(self) -> WeightGrid:
        return Fp8Grid(per_channel=self.fp8_weight_scale == "channel")

    def describe(self) -> str:
        scale = "output channel" if self.fp8_weight_scale == "channel" else "tensor"
        return _with_inputs(self, f"FP8 E4M3 weights (one scale per {scale})")


class _FourBit(_GptqOptions, QuantizeConfig):
    """4-bit weights rounded by AWQ (scales and clipping), GPTQ, or AWQ then GPTQ."""

    algorithm: Literal["awq", "gptq", "awq+gptq"] = "awq+gptq"
    # AWQ clipping scored on the sampled rows (the attention sink left out) or on every calibration token.
    clip_tokens: Literal["sampled", "all"] = "sampled"

    def uses_awq(self) -> bool:
        return "awq" in self.algorithm

    def uses_gptq(self) -> bool:
        return "gptq" in self.algorithm

    def clip_on_all_tokens(self) -> bool:
        return self.uses_awq() and self.clip_tokens == "all"

    def algorithm_name(self) -> str:
        return self.algorithm


class Int4Config(_FourBit):
    """``method: int4``: INT4 weight-only, one scale per group of inputs."""

    method: Literal["int4"] = "int4"
    group_size: Literal[32, 64, 128] = 64

    def scheme(self) -> tuple[int, bool, int | None]:
        return 4, False, self.group_size


class Nvfp4Config(_ActivationOptions, _FourBit):
    """``method: nvfp4``: FP4 E2M1 weights in blocks of 16 with FP8 block scales; weight-only or, with
    ``activations: nvfp4``, W4A4."""

    method: Literal["nvfp4"] = "nvfp4"
    # "float" keeps activations FP16 (W4A16), "nvfp4" quantizes them per block of 16 (W4A4).
    activations: Literal["auto", "float", "nvfp4"] = "auto"
    # Search the per-tensor scale (weight_scale_2) for the least output error on calibration samples.
    nvfp4_scale_search: bool = True

    def scheme(self) -> tuple[int, bool, int | None]:
        return 4, self.activations == "nvfp4", NVFP4_BLOCK

    def weight_grid(self) -> WeightGrid:
        return Nvfp4Grid()

    def precision(self) -> Precision:
        return PRECISIONS["nvfp4" if self.activations == "nvfp4" else "nvfp4_a16"]

    def binds_global_scale(self) -> bool:
        return True

    def searches_global_scale(self) -> bool:
        return self.nvfp4_scale_search

    def describe(self) -> str:
        return _with_inputs(self, "NVFP4 weights (E2M1 in blocks of 16, FP8 block scales, FP32 per-tensor scale)")

    def algorithm_name(self) -> str:
        return self.algorithm + ("+global-scale-search" if self.nvfp4_scale_search else "")


class RtnConfig(_ActivationOptions, QuantizeConfig):
    """``method: rtn``: round to nearest, no migration: W8A8 (``bits: 8``) or INT4 weight-only (``bits: 4``)."""

    method: Literal["rtn"] = "rtn"
    bits: Literal[4, 8] = 8
    group_size: Literal[32, 64, 128] = 64
    hadamard_block: Literal[0, 32, 64, 128, 256] = 0

    @model_validator(mode="after")
    def _rotation_needs_w8a8(self) -> RtnConfig:
        if self.hadamard_block and self.bits != 8:
            raise ValueError("hadamard_block applies to W8A8 (method int8 or fp8, or rtn with bits 8) only")
        if self.hadamard_block and "down_proj" in self.float_linears:
            raise ValueError(
                "hadamard_block rotates the down_proj input, which float_linears leaves unquantized; use one of them"
            )
        return self

    def is_w8a8(self) -> bool:
        return self.bits == 8

    def rotation_limit(self) -> int:
        return self.hadamard_block

    def scheme(self) -> tuple[int, bool, int | None]:
        return (8, True, None) if self.bits == 8 else (4, False, self.group_size)

    def precision(self) -> Precision:
        return PRECISIONS["int8" if self.bits == 8 else "int4"]


CandidateFormat = Literal["int8", "int4", "fp8", "nvfp4", "nvfp4_a16"]


class AutoConfig(QuantizeConfig):
    """``method: auto``: a format for each group of linears (q/k/v, o, gate/up, down of each block), chosen for the
    fastest decode the target's latency model predicts while the accuracy predicted from measured sensitivities stays
    inside the gate's budgets with a margin; then measured on held-out calibration windows and backed off until it holds
    (see
    :mod:`compress.transforms.quantize.mixed`). Each format is quantized by its own method with its defaults."""

    method: Literal["auto"] = "auto"
    formats: list[CandidateFormat] | None = None  # None: every format the target's deployment runs
    margin: float = Field(0.5, gt=0.0, le=1.0)  # the share of the gate's perplexity budget a plan may use
    fisher_windows: PositiveInt = 4  # windows of the Fisher pass (the sensitivity's weights)
    selection_windows: PositiveInt = 8  # held-out calibration windows each candidate plan is measured on
    selection_prompts: NonNegativeInt = 60  # chat calibration prompts whose answers each plan is measured on (0: none)
    # Held-out prompts with an expected answer (neither the gate's nor calibration's) each plan's answers must keep
    # passing.
    expect_prompts: NonNegativeInt = 32
    answer_tokens: PositiveInt = 32  # the teacher's greedy answer length to each of them
    max_rounds: PositiveInt = 5  # plans measured before the search gives up on quantizing anything
    # Plans measured after a back-off, between the accepted budget and the last failed one, for a faster plan that
    # holds.
    refine_rounds: NonNegativeInt = 2
    # the LM head is a group too, in the formats the runtime quantizes it in (False: it stays FP16)
    lm_head: bool = True

    def precision(self) -> Precision:
        raise ValueError("method auto has no single precision: each linear has its own (see the quantization's plan)")

    def scheme(self) -> tuple[int, bool, int | None]:
        return 16, True, None  # at most: a plan may quantize some inputs

    def shared_options(self) -> CalibrationOptions:
        """The calibration options every candidate format's method takes from this config."""
        return {
            key: getattr(self, key) for key in ("calib_windows", "calib_window", "min_calib_tokens", "sample_tokens")
        }

    def is_mixed(self) -> bool:
        return True

    def candidate_precisions(self) -> list[str] | None:
        return list(self.formats) if self.formats else None

    def uniform_configs(self) -> list[QuantizeConfig]:
        return list(candidate_configs(self.formats or [], {}).values())

    def describe(self) -> str:
        return "a format per group of linears, chosen against the target (see the plan)"

    def algorithm_name(self) -> str:
        return "sensitivity search; smoothquant+gptq (8-bit), awq+gptq (4-bit)"


METHODS: dict[str, type[QuantizeConfig]] = {
    cls.model_fields["method"].default: cls
    for cls in (Int8Config, Fp8Config, Int4Config, Nvfp4Config, RtnConfig, AutoConfig)
}


def method_class(method: str) -> type[QuantizeConfig]:
    """The config class of ``method``; a ValueError naming the methods otherwise."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")
    return METHODS[method]


def _method_of(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("method", DEFAULT_METHOD)
    return getattr(value, "method", DEFAULT_METHOD)


# One config class per method; ``method`` (int8 when absent) says which.
AnyQuantizeConfig = Annotated[
    Annotated[Int8Config, Tag("int8")] | Annotated[Fp8Config, Tag("fp8")] | Annotated[Int4Config, Tag("int4")]
    | Annotated[Nvfp4Config, Tag("nvfp4")] | Annotated[RtnConfig, Tag("rtn")] | Annotated[AutoConfig, Tag("auto")],
    Discriminator(_method_of),
]
QUANTIZE_CONFIG = TypeAdapter(AnyQuantizeConfig)


def quantize_config(**options: Any) -> QuantizeConfig:
    """The config of ``options["method"]`` (``int8`` when absent) with ``options``; a pydantic ValidationError names any
    option the method does not take."""
    return QUANTIZE_CONFIG.validate_python(options)


def options_of(method: str) -> set[str]:
    """The option names ``method`` takes."""
    return set(METHODS[method].model_fields)


def _with_inputs(config: QuantizeConfig, weights: str) -> str:
    """``weights`` followed by the activations' and KV cache's formats."""
    activation = config.activation_format()
    names = {"int8": "static INT8 activations", "fp8": "static FP8 activations",
             "nvfp4": "NVFP4 activations (dynamic blocks of 16, calibrated global scale)"}
    inputs = names[activation.name] if activation else "FP16 activations"
    return f"{weights}, {inputs}" + (", FP8 KV cache" if config.kv_cache == "fp8" else "")


# Each candidate format of a mixed plan: its method and options (the shared calibration options are added by the
# caller).
CANDIDATE_METHODS: dict[str, dict[str, Any]] = {
    "int8": {"method": "int8", "alpha": "auto", "weight_algorithm": "gptq", "hadamard_block": 0},
    "int4": {"method": "int4", "group_size": 128, "algorithm": "awq+gptq"},
    "fp8": {"method": "fp8", "alpha": "auto", "weight_algorithm": "gptq", "fp8_weight_scale": "tensor"},
    "nvfp4": {"method": "nvfp4", "activations": "nvfp4"},
    "nvfp4_a16": {"method": "nvfp4", "activations": "float"},
}


def candidate_configs(formats: Iterable[str], shared: CalibrationOptions) -> dict[str, QuantizeConfig]:
    """The quantize config of each candidate format, with the ``shared`` calibration options."""
    return {name: quantize_config(**CANDIDATE_METHODS[name], **shared) for name in formats}
