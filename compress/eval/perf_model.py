"""A roofline model of decoder LLM latency, memory and energy on a target, per power mode.

* Decode (one token for one stream) is bound by memory bandwidth plus a fixed cost per layer:
  ``ms/token = bytes read per token / (efficiency * bandwidth(mode)) + layers * per_layer_ms(mode)``,
  where the bytes are every decoder weight at its stored precision, the LM head, and the KV cache
  read at the context length. The per-layer term (kernel launches, norms, RoPE, attention set-up)
  is what keeps a 0.6B model further from the bandwidth roofline than an 8B one; it scales with
  the inverse of the mode's GPU clock.
* Prefill reads every weight once and runs the prompt's FLOPs:
  ``weight bytes / (efficiency * bandwidth) + FLOPs / (peak ops(mode) * utilisation) + layers * per_layer_ms``,
  the linears' FLOPs at the precision that runs them (INT8 tensor cores for W8A8, FP8 for FP8, FP4
  for NVFP4 W4A4, FP16 otherwise: INT4 and NVFP4 weight-only dequantize to FP16), attention's at
  FP16. A short prompt is bound by the weight reads and the fixed cost, a long one by compute.
* A power mode caps the GPU clock (compute scales with it) and the memory clock (bandwidth scales
  with it). Energy per token is the mode's power budget times the per-token latency, an upper bound.

``efficiency`` and ``per_layer_ms`` are fitted together on published measurements (the anchors of
:mod:`compress.eval.published_rates`: TensorRT Edge-LLM's own Jetson results, the runtime the
bundles are built for, and two earlier 7-8B figures), minimising the relative error, per GPU
architecture and precision where at least :data:`MIN_FIT_ANCHORS` anchors exist, else per
architecture, else on all of them. Prefill's ``utilisation`` and fixed cost are fitted the same way,
per architecture and compute precision, else per architecture; where an architecture has none, the
utilisation is the assumed :data:`PREFILL_UTILISATION` with no fixed cost. :func:`anchor_errors`
reports every published point: the anchors, the points held out of the fit, and earlier releases.

NVFP4 weight-only (``nvfp4_a16``) on a Llama-style model runs through Edge-LLM's
``--no-quantize-activations`` export, where "TensorRT dequantizes the weights on every step"
(Edge-LLM's own help text): the FP4 weights are read and an FP16 copy is written and read back,
which is what the decode bytes count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

import numpy as np

from compress.algorithms.formats import PRECISIONS, Precision
from compress.core.config import PowerMode, Target, load_target
from compress.core.errors import UsageError
from compress.eval.model_shape import (  # noqa: F401  (the published shapes are re-exported)
    LLAMA2_7B,
    LLAMA3_8B,
    QWEN3_0_6B,
    QWEN3_1_7B,
    QWEN3_4B,
    QWEN3_8B,
    ModelShape,
)
from compress.eval.published_rates import ANCHOR, ANCHORS, PREFILL_ANCHORS, Anchor, PrefillAnchor

# Bytes of scales per weight: INT4 one FP16 scale per group; NVFP4 one FP8 (E4M3) scale per 16 weights.
NVFP4_BLOCK = 16
KV_CACHE_ELEMENT_BYTES = {"fp16": 2, "fp8": 1}
RUNTIME_OVERHEAD_GB = 0.35  # CUDA context + TensorRT runtime, typical on Jetson
# share of peak tensor-core rate a prefill GEMM reaches, where no prefill anchor says otherwise
PREFILL_UTILISATION = 0.5
MIN_FIT_ANCHORS = 3  # anchors a group needs for its own (efficiency, per-layer) fit


def precision_named(name: str) -> Precision:
    """The deployment precision called ``name``; a usage error naming the known ones otherwise."""
    if name not in PRECISIONS:
        raise UsageError(f"unknown precision {name!r} (known: {', '.join(PRECISIONS)})")
    return PRECISIONS[name]


@dataclass(frozen=True)
class DecodeFit:
    """The fitted decode constants: bandwidth efficiency and fixed milliseconds per layer at full GPU clock."""

    efficiency: float
    per_layer_ms: float


@dataclass(frozen=True)
class PrefillFit:
    """The prefill constants: share of the peak tensor-core rate reached and fixed milliseconds per layer at full
    clock."""

    utilisation: float
    per_layer_ms: float
    fitted: bool


def device_bits(precision: str) -> int:
    """Bits per weight on the device: fp32 checkpoints are built as FP16 engines."""
    return precision_named(precision).device_bits


def _linear_bytes(shape: ModelShape, precision: str, group_size: int, float_fraction: float = 0.0) -> float:
    """Decoder linear bytes: ``float_fraction`` of the parameters in FP16, the rest at ``precision``."""
    params = shape.decoder_linear_params() * (1.0 - float_fraction)
    scales = {"int4": params / group_size * 2, "nvfp4": params / NVFP4_BLOCK, "nvfp4_a16": params / NVFP4_BLOCK}.get(
        precision, 0.0
    )
    return params * device_bits(precision) / 8 + scales + shape.decoder_linear_params() * float_fraction * 2


def weight_bytes(shape: ModelShape, precision: str, group_size: int = 128, float_fraction: float = 0.0) -> float:
    """Bytes of weights moved per decoded token: decoder linears at their precision (NVFP4 weight-only also writes and
    reads back its FP16 copy), the LM head in FP16."""
    dequantized_copy = (
        2 * 2 * shape.decoder_linear_params() * (1.0 - float_fraction) if precision == "nvfp4_a16" else 0.0
    )
    return _linear_bytes(shape, precision, group_size, float_fraction) + dequantized_copy + shape.lm_head_params() * 2


def stored_weight_bytes(shape: ModelShape, precision: str, group_size: int = 128, float_fraction: float = 0.0) -> float:
    """Bytes of all weights held in device memory (FP16 embedding and LM head)."""
    head = 0 if shape.tie_word_embeddings else shape.lm_head_params() * 2
    return shape.vocab_size * shape.hidden_size * 2 + head + _linear_bytes(shape, precision, group_size, float_fraction)


def mode_bandwidth_gbps(target: Target, mode: PowerMode) -> float:
    return target.memory_bandwidth_gbps * min(1.0, mode.emc_max_mhz / target.emc_max_mhz)


def mode_tops(target: Target, mode: PowerMode, precision: str, sparse: bool = False) -> float:
    """Peak tera-ops/s of the GPU tensor cores at ``precision`` (``int8``, ``fp8``, ``fp4``, else FP16) under the mode's
    clock cap."""
    scale = min(1.0, mode.gpu_max_mhz / target.gpu.max_mhz)
    if precision == "int8":
        peak = target.int8_tops_sparse if sparse else target.int8_tops_dense
    elif precision in ("fp8", "fp4"):
        dense = target.fp8_tflops_dense if precision == "fp8" else target.fp4_tflops_dense
        if dense is None:
            raise UsageError(f"{target.name} (sm_{target.gpu.sm}) has no {precision.upper()} tensor cores; "
                             f"its precisions: {', '.join(target.gpu.precisions)}")
        peak = dense * (2 if sparse else 1)
    else:
        peak = target.fp16_tflops_dense * (2 if sparse else 1)
    return peak * scale


def _bandwidth_ms(target: Target, mode: PowerMode, shape: ModelShape, precision: str, group_size: int, context: int,
                  float_fraction: float = 0.0) -> float:
    """Milliseconds per token at the full bandwidth of the mode (the roofline, efficiency 1)."""
    read = weight_bytes(shape, precision, group_size, float_fraction) + shape.kv_bytes_read(context)
    return read / (mode_bandwidth_gbps(target, mode) * 1e9) * 1000


def _layer_units(target: Target, mode: PowerMode, shape: ModelShape) -> float:
    """Layers weighted by the mode's GPU clock cap (fixed per-layer costs take longer at a lower clock)."""
    return shape.num_layers * target.gpu.max_mhz / min(mode.gpu_max_mhz, target.gpu.max_mhz)


@cache
def _anchor_target(name: str) -> Target:
    return load_target(name)


def _anchor_terms(anchor: Anchor) -> tuple[float, float]:
    target = _anchor_target(anchor.target)
    mode = target.power_mode(anchor.power_mode)
    return (_bandwidth_ms(target, mode, anchor.shape, anchor.precision, anchor.group_size, anchor.context),
            _layer_units(target, mode, anchor.shape))


def _fit_two_terms(terms: np.ndarray, measured: np.ndarray, known: np.ndarray | None = None) -> tuple[float, float]:
    """Least squares on relative error of ``measured ~ known + terms[:, 0] * a + terms[:, 1] * b`` (``known``: a part of
    each measurement already accounted for, none by default); b is dropped when negative."""
    rows = terms / measured[:, None]
    rest = 1.0 - (np.zeros(len(measured)) if known is None else known / measured)
    (a, b), *_ = np.linalg.lstsq(rows, rest, rcond=None)
    if b < 0:  # no fixed cost visible in the anchors: the first term alone
        a, b = float(rows[:, 0] @ rest / (rows[:, 0] @ rows[:, 0])), 0.0
    return float(a), float(b)


def _matching(anchors: tuple, arch: str | None, precision: str | None, compute: bool = False) -> list:
    """The fitted anchors (held-out and earlier-release points excluded) of ``arch`` and ``precision`` (None: any)."""
    def key(anchor) -> str:
        return precision_named(anchor.precision).compute if compute else anchor.precision

    return [a for a in anchors if a.role == ANCHOR and arch in (None, _anchor_target(a.target).gpu.arch)
            and precision in (None, key(a))]


@cache
def fit_decode(arch: str | None = None, precision: str | None = None) -> DecodeFit:
    """Least squares on relative error: ``1000 / tokens_per_s = bandwidth_ms / efficiency + layers * per_layer_ms``, on
    the anchors of GPU architecture ``arch`` and ``precision`` (None: any)."""
    anchors = _matching(ANCHORS, arch, precision)
    terms = np.array([_anchor_terms(a) for a in anchors])
    inverse_efficiency, per_layer = _fit_two_terms(terms, np.array([1000.0 / a.tokens_per_s for a in anchors]))
    return DecodeFit(efficiency=1.0 / inverse_efficiency, per_layer_ms=per_layer)


def decode_fit_for(target: Target, precision: str) -> DecodeFit:
    """The decode fit of the anchors nearest to the target: its architecture and precision, else its architecture, else
    all."""
    for arch, group in ((target.gpu.arch, precision), (target.gpu.arch, None), (None, None)):
        if len(_matching(ANCHORS, arch, group)) >= MIN_FIT_ANCHORS:
            return fit_decode(arch, group)
    return fit_decode()


@dataclass(frozen=True)
class PrefillTerms:
    """One prefill's parts: milliseconds at the full tensor-core rate, clock-weighted layers, and the milliseconds its
    weight reads take (at the decode fit's bandwidth efficiency)."""

    at_peak_ms: float
    layers: float
    weights_ms: float


def _prefill_terms(target: Target, mode: PowerMode, shape: ModelShape, precision: str, prompt_len: int,
                   sparse: bool = False) -> PrefillTerms:
    """The parts of one prefill of ``prompt_len`` tokens: the linears' FLOPs at the rate of the precision that runs
    them, attention's at FP16, every weight read once."""
    linear_flops = 2 * shape.decoder_linear_params() * prompt_len + 2 * shape.lm_head_params()
    attention_flops = 4 * shape.num_layers * shape.num_heads * shape.head_dim * prompt_len * prompt_len / 2
    linear_peak = mode_tops(target, mode, precision_named(precision).compute, sparse)
    at_peak_s = linear_flops / (linear_peak * 1e12) + attention_flops / (mode_tops(target, mode, "fp16") * 1e12)
    bandwidth = mode_bandwidth_gbps(target, mode) * 1e9 * decode_fit_for(target, precision).efficiency
    weights_ms = weight_bytes(shape, precision) / bandwidth * 1000
    return PrefillTerms(at_peak_s * 1000, _layer_units(target, mode, shape), weights_ms)


def _prefill_anchor_terms(anchor: PrefillAnchor) -> PrefillTerms:
    target = _anchor_target(anchor.target)
    return _prefill_terms(target, target.power_mode(anchor.power_mode), anchor.shape, anchor.precision,
                          anchor.prompt_tokens)


@cache
def fit_prefill(arch: str, compute: str | None) -> PrefillFit:
    """The prefill fit on the anchors of GPU architecture ``arch`` whose GEMMs run at ``compute`` precision (None: any),
    or the assumed utilisation where fewer than :data:`MIN_FIT_ANCHORS` exist."""
    anchors = _matching(PREFILL_ANCHORS, arch, compute, compute=True)
    if len(anchors) < MIN_FIT_ANCHORS:
        return PrefillFit(PREFILL_UTILISATION, 0.0, fitted=False)
    parts = [_prefill_anchor_terms(anchor) for anchor in anchors]
    inverse_utilisation, per_layer = _fit_two_terms(
        np.array([(part.at_peak_ms, part.layers) for part in parts]), np.array([a.prefill_ms for a in anchors]),
        known=np.array([part.weights_ms for part in parts]))
    return PrefillFit(1.0 / inverse_utilisation, per_layer, fitted=True)


def prefill_fit_for(target: Target, precision: str) -> PrefillFit:
    """The prefill fit nearest to the target: its architecture and compute precision, else its architecture, else
    assumed."""
    compute = precision_named(precision).compute
    fit = fit_prefill(target.gpu.arch, compute)
    return fit if fit.fitted else fit_prefill(target.gpu.arch, None)


def prefill_ms(
    target: Target, mode: PowerMode, shape: ModelShape, precision: str, prompt_len: int, sparse: bool = False
) -> float:
    """Predicted milliseconds to process a ``prompt_len``-token prompt."""
    parts = _prefill_terms(target, mode, shape, precision, prompt_len, sparse)
    fit = prefill_fit_for(target, precision)
    return parts.weights_ms + parts.at_peak_ms / fit.utilisation + parts.layers * fit.per_layer_ms


def decode_ms(target: Target, mode: PowerMode, shape: ModelShape, precision: str, group_size: int, context: int,
              float_fraction: float = 0.0) -> float:
    """Predicted milliseconds per decoded token (one stream)."""
    fit = decode_fit_for(target, precision)
    return (_bandwidth_ms(target, mode, shape, precision, group_size, context, float_fraction) / fit.efficiency
            + _layer_units(target, mode, shape) * fit.per_layer_ms)


@dataclass(frozen=True)
class AnchorError:
    """The fitted model's prediction for one published point, and its error."""

    anchor: str
    measure: str
    measured: float
    predicted: float
    error_pct: float
    role: str
    source: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _anchor_error(anchor: Anchor | PrefillAnchor, measure: str, measured: float, predicted: float) -> AnchorError:
    return AnchorError(anchor.name, measure, measured, round(predicted, 2), round(100 * (predicted / measured - 1), 2),
                       anchor.role, anchor.source)


def anchor_errors() -> list[AnchorError]:
    """Prediction error of the fitted model on every published point (anchors, held-out points, earlier releases):
    decode tokens/s, then prefill milliseconds."""
    rows = []
    for anchor in ANCHORS:
        target = _anchor_target(anchor.target)
        mode = target.power_mode(anchor.power_mode)
        predicted = 1000.0 / decode_ms(target, mode, anchor.shape, anchor.precision, anchor.group_size, anchor.context)
        rows.append(_anchor_error(anchor, "decode tokens/s", anchor.tokens_per_s, predicted))
    for anchor in PREFILL_ANCHORS:
        target = _anchor_target(anchor.target)
        predicted = prefill_ms(
            target, target.power_mode(anchor.power_mode), anchor.shape, anchor.precision, anchor.prompt_tokens
        )
        rows.append(_anchor_error(anchor, "prefill ms", anchor.prefill_ms, predicted))
    return rows


@dataclass(frozen=True)
class Prediction:
    """Predicted figures for one power mode."""

    power_mode: str
    watts: float
    precision: str
    decode_tokens_per_s: float
    decode_latency_ms: float
    ttft_ms: float
    memory_gb: float
    joules_per_token: float
    bandwidth_gbps: float
    efficiency: float
    per_layer_ms: float

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Lengths:
    """The prompt and context a prediction is for (None: the target's budgets)."""

    prompt_len: int | None = None
    context: int | None = None

    def of(self, target: Target) -> tuple[int, int]:
        """(prompt length, context) for ``target``."""
        return self.prompt_len or target.budgets.prompt_length, self.context or target.budgets.context_length


@dataclass(frozen=True)
class Storage:
    """How the decoder linears are stored beyond their precision: the weight group size (INT4), 2:4 sparsity, and the
    share of linear parameters left FP16."""

    group_size: int = 128
    sparse: bool = False
    float_fraction: float = 0.0


BUDGET_LENGTHS, DENSE = Lengths(), Storage()


def predict(target: Target, shape: ModelShape, precision: str, mode_name: str | None = None,
            lengths: Lengths = BUDGET_LENGTHS, storage: Storage = DENSE) -> Prediction:
    """Predict decode speed, TTFT, memory and energy for one power mode."""
    mode = target.power_mode(mode_name)
    prompt_len, context = lengths.of(target)
    group_size, float_fraction = storage.group_size, storage.float_fraction
    fit = decode_fit_for(target, precision)
    # Decode reads the cache at the end of the prompt plus half the generated span on average; the
    # budget's context length is the pessimistic bound used here.
    tokens_per_s = 1000.0 / decode_ms(target, mode, shape, precision, group_size, context, float_fraction)
    ttft_s = prefill_ms(target, mode, shape, precision, prompt_len, storage.sparse) / 1000
    memory = stored_weight_bytes(shape, precision, group_size, float_fraction) + shape.kv_bytes_read(context)
    latency_s = 1.0 / tokens_per_s
    return Prediction(
        power_mode=mode.name, watts=mode.watts, precision=precision, decode_tokens_per_s=tokens_per_s,
        decode_latency_ms=latency_s * 1000, ttft_ms=ttft_s * 1000 + latency_s * 1000,
        memory_gb=memory / 1e9 + RUNTIME_OVERHEAD_GB, joules_per_token=mode.watts * latency_s,
        bandwidth_gbps=mode_bandwidth_gbps(target, mode), efficiency=fit.efficiency,
        per_layer_ms=fit.per_layer_ms,
    )


MIXED = "mixed"


def linear_ms_per_param(target: Target, mode_name: str | None, precision: str, group_size: int = 128) -> float:
    """Decode milliseconds one decoder-linear parameter at ``precision`` costs per token (its bytes, scales included, at
    the mode's bandwidth and the precision's fitted efficiency; NVFP4 weight-only also writes and reads back its FP16
    copy): what a mixed-precision search weighs each group of linears by."""
    mode = target.power_mode(mode_name)
    copy = 4.0 if precision == "nvfp4_a16" else 0.0
    per_param = stored_bytes_per_param(precision, group_size) + copy
    return per_param / (mode_bandwidth_gbps(target, mode) * 1e9 * decode_fit_for(target, precision).efficiency) * 1000


def stored_bytes_per_param(precision: str, group_size: int = 128) -> float:
    """Bytes one linear parameter at ``precision`` holds in device memory, its share of the scales included."""
    bits = 16 if precision == "fp16" else device_bits(precision)
    return bits / 8 + {"int4": 2 / group_size, "nvfp4": 1 / NVFP4_BLOCK, "nvfp4_a16": 1 / NVFP4_BLOCK}.get(
        precision, 0.0
    )


def _mix_precisions(mix: dict[str, float]) -> list[tuple[str, float]]:
    return [(precision, fraction) for precision, fraction in sorted(mix.items()) if fraction > 0]


def predict_mixed(target: Target, shape: ModelShape, mix: dict[str, float], mode_name: str | None = None,
                  lengths: Lengths = BUDGET_LENGTHS, group_size: int = 128, head: str = "fp16") -> Prediction:
    """:func:`predict` for decoder linears in several precisions: ``mix`` maps each precision (``fp16`` included) to the
    share of the decoder-linear parameters it holds. Each share's bytes move at its precision's fitted efficiency; the
    fixed per-layer cost and the KV cache's reads are those of the precision holding most parameters; prefill runs each
    share's FLOPs at its precision's tensor-core rate. ``head``: the LM head's precision; a quantized head is a linear
    of its own beside the FP16 embedding table, read at its precision's efficiency."""
    mode = target.power_mode(mode_name)
    prompt_len, context = lengths.of(target)
    parts = _mix_precisions(mix)
    dominant = max(parts, key=lambda part: part[1])[0]
    fit = decode_fit_for(target, dominant)
    bandwidth = mode_bandwidth_gbps(target, mode) * 1e9
    linears = sum(linear_ms_per_param(target, mode.name, p, group_size) * fraction * shape.decoder_linear_params()
                  for p, fraction in parts)
    if head == "fp16":
        head_ms = shape.lm_head_params() * 2 / (bandwidth * fit.efficiency) * 1000
        head_stored = 0 if shape.tie_word_embeddings else shape.lm_head_params() * 2
    else:
        head_ms = linear_ms_per_param(target, mode.name, head, group_size) * shape.lm_head_params()
        head_stored = stored_bytes_per_param(head, group_size) * shape.lm_head_params()
    kv = shape.kv_bytes_read(context) / (bandwidth * fit.efficiency) * 1000
    latency_ms = linears + head_ms + kv + _layer_units(target, mode, shape) * fit.per_layer_ms
    ttft_ms = sum(fraction * prefill_ms(target, mode, shape, p, prompt_len) for p, fraction in parts)
    stored = (shape.vocab_size * shape.hidden_size * 2 + head_stored
              + sum(fraction * _linear_bytes(shape, p, group_size) for p, fraction in parts))
    return Prediction(
        power_mode=mode.name,
        watts=mode.watts,
        precision=MIXED,
        decode_tokens_per_s=1000.0 / latency_ms,
        decode_latency_ms=latency_ms,
        ttft_ms=ttft_ms + latency_ms,
        memory_gb=(stored + shape.kv_bytes_read(context)) / 1e9 + RUNTIME_OVERHEAD_GB,
        joules_per_token=mode.watts * latency_ms / 1000,
        bandwidth_gbps=mode_bandwidth_gbps(target, mode),
        efficiency=fit.efficiency,
        per_layer_ms=fit.per_layer_ms,
    )


def predict_all_modes(target: Target, shape: ModelShape, precision: str, lengths: Lengths = BUDGET_LENGTHS,
                      storage: Storage = DENSE) -> list[Prediction]:
    """One prediction per power mode, in the order the target lists them."""
    return [predict(target, shape, precision, mode.name, lengths, storage) for mode in target.power_modes]


def lowest_power_mode_meeting_budget(predictions: list[Prediction], max_latency_ms: float) -> Prediction | None:
    """The lowest-wattage mode whose decode latency is within budget, or None."""
    meeting = [p for p in predictions if p.decode_latency_ms <= max_latency_ms]
    return min(meeting, key=lambda p: p.watts) if meeting else None



# Share of the tensor cores' peak an encoder's GEMMs reach. No published encoder measurement on these
# targets anchors it, so it is an assumption, stated in every encoder prediction.
ENCODER_COMPUTE_EFFICIENCY = 0.5


def predict_encoder_batch(target: Target, mode: PowerMode, config: dict[str, Any], precision: str, batch: int,
                          tokens: int) -> dict[str, Any]:
    """Predicted milliseconds for one encoder batch of ``batch`` sentences of ``tokens`` tokens, and sentences/s.

    ``config`` holds hidden_size, num_hidden_layers, intermediate_size, vocab_size and, for a pruned
    model, linear_params (the parameters of its layers' linears).

    A batch is the larger of its GEMM time (``2 x linear parameters x tokens`` plus attention, at the
    mode's tensor-core rate times :data:`ENCODER_COMPUTE_EFFICIENCY`) and its weight reads (at the
    fitted decode bandwidth efficiency), plus the fitted fixed cost per layer.
    """
    hidden, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    linear_params = config.get("linear_params") or layers * (4 * hidden * hidden + 2 * hidden * inter)
    flops = 2.0 * linear_params * batch * tokens + 4.0 * layers * batch * tokens * tokens * hidden
    compute_ms = (
        flops
        / (mode_tops(target, mode, "int8" if precision == "int8" else "fp16") * 1e12 * ENCODER_COMPUTE_EFFICIENCY)
        * 1e3
    )
    weights = linear_params * device_bits(precision) / 8 + config["vocab_size"] * hidden * 2
    fit = decode_fit_for(target, precision)
    memory_ms = weights / (mode_bandwidth_gbps(target, mode) * 1e9 * fit.efficiency) * 1e3
    fixed_ms = layers * target.gpu.max_mhz / min(mode.gpu_max_mhz, target.gpu.max_mhz) * fit.per_layer_ms
    batch_ms = max(compute_ms, memory_ms) + fixed_ms
    memory_gb = (weights + 2 * batch * tokens * max(hidden, inter) * 2) / 1e9 + RUNTIME_OVERHEAD_GB
    return {
        "power_mode": mode.name,
        "precision": precision,
        "batch": batch,
        "tokens": tokens,
        "batch_ms": round(batch_ms, 4),
        "sentences_per_s": round(1000.0 * batch / batch_ms, 2),
        "bound": "compute" if compute_ms > memory_ms else "memory",
        "memory_gb": round(memory_gb, 4),
        "compute_efficiency_assumed": ENCODER_COMPUTE_EFFICIENCY,
    }
