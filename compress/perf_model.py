"""A roofline model of decoder LLM latency, memory and energy on a target, per power mode.

* Decode (one token for one stream) is bound by memory bandwidth:
  ``tokens/s = efficiency * bandwidth(mode) / bytes read per token``, where the bytes are every
  decoder weight at its stored precision, the LM head, and the KV cache read at the context length.
* Prefill is bound by compute: ``FLOPs / (peak ops(mode) * utilisation)`` at the precision that
  runs the matrix multiplies (INT8 tensor cores for W8A8, FP16 otherwise; INT4 is weight-only).
* A power mode caps the GPU clock (compute scales with it) and the memory clock (bandwidth scales
  with it). Energy per token is the mode's power budget times the per-token latency, an upper bound.

``efficiency`` is fitted on published measurements (:data:`ANCHORS`); :func:`anchor_errors` reports
how far the fitted model is from each of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from compress.config import PowerMode, Target
from compress.errors import UsageError

PRECISION_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "int4": 4}
KV_CACHE_BYTES = 2  # fp16 KV cache on the device
RUNTIME_OVERHEAD_GB = 0.35  # CUDA context + TensorRT runtime, typical on Jetson
PREFILL_UTILISATION = 0.5  # share of peak tensor-core rate a prefill GEMM reaches


@dataclass(frozen=True)
class ModelShape:
    """What the latency model needs to know of a decoder: shapes only, no weights."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelShape:
        """From a Hugging Face decoder ``config.json`` mapping."""
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            return cls(
                num_layers=int(cfg["num_hidden_layers"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                vocab_size=int(cfg["vocab_size"]),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"model config is not a decoder LLM config: missing or bad {exc}") from exc

    def layer_linear_params(self) -> int:
        """Parameters of the linear layers of one decoder block (attention + gated MLP)."""
        q_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q_o + k_v + mlp

    def decoder_linear_params(self) -> int:
        return self.num_layers * self.layer_linear_params()

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.lm_head_params()
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.decoder_linear_params() + embed + head + norms

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * KV_CACHE_BYTES


@dataclass(frozen=True)
class Anchor:
    """A published decode measurement the efficiency factor is fitted on."""

    name: str
    target: str
    power_mode: str
    shape: ModelShape
    precision: str
    group_size: int
    context: int
    tokens_per_s: float
    source: str


LLAMA3_8B = ModelShape(32, 4096, 14336, 32, 8, 128, 128256, False)
LLAMA2_7B = ModelShape(32, 4096, 11008, 32, 32, 128, 32000, False)

ANCHORS = (
    Anchor("Llama-3-8B INT4 (TensorRT-LLM 0.12, AWQ)", "jetson-agx-orin-64gb", "MAXN", LLAMA3_8B, "int4", 128, 192, 35.9,
           "NVIDIA Jetson AI Lab benchmarks, AGX Orin 64GB MAXN, 128 in / 128 out"),
    Anchor("Llama-2-7B INT4 (MLC q4f16_ft)", "jetson-agx-orin-64gb", "MAXN", LLAMA2_7B, "int4", 128, 192, 46.9,
           "NVIDIA Jetson AI Lab benchmarks, AGX Orin 64GB MAXN, MLC/TVM"),
)


def device_bits(precision: str) -> int:
    """Bits per weight on the device: fp32 checkpoints are built as FP16 engines."""
    if precision not in PRECISION_BITS:
        raise UsageError(f"unknown precision {precision!r} (known: {', '.join(PRECISION_BITS)})")
    return min(PRECISION_BITS[precision], 16)


def _linear_bytes(shape: ModelShape, precision: str, group_size: int) -> float:
    params = shape.decoder_linear_params()
    scales = params / group_size * 2 if precision == "int4" else 0  # one fp16 scale per group
    return params * device_bits(precision) / 8 + scales


def weight_bytes(shape: ModelShape, precision: str, group_size: int = 128) -> float:
    """Bytes of weights read per decoded token: decoder linears at their precision, the LM head in FP16."""
    return _linear_bytes(shape, precision, group_size) + shape.lm_head_params() * 2


def stored_weight_bytes(shape: ModelShape, precision: str, group_size: int = 128) -> float:
    """Bytes of all weights held in device memory (FP16 embedding and LM head)."""
    head = 0 if shape.tie_word_embeddings else shape.lm_head_params() * 2
    return shape.vocab_size * shape.hidden_size * 2 + head + _linear_bytes(shape, precision, group_size)


def mode_bandwidth_gbps(target: Target, mode: PowerMode) -> float:
    return target.memory_bandwidth_gbps * min(1.0, mode.emc_max_mhz / target.emc_max_mhz)


def mode_tops(target: Target, mode: PowerMode, precision: str, sparse: bool = False) -> float:
    """Peak tera-ops/s of the GPU tensor cores under the mode's clock cap."""
    scale = min(1.0, mode.gpu_max_mhz / target.gpu.max_mhz)
    if precision == "int8":
        peak = target.int8_tops_sparse if sparse else target.int8_tops_dense
    else:
        peak = target.fp16_tflops_dense * (2 if sparse else 1)
    return peak * scale


def _raw_decode_tokens_per_s(target: Target, mode: PowerMode, shape: ModelShape, precision: str, group_size: int,
                             context: int) -> float:
    read = weight_bytes(shape, precision, group_size) + shape.kv_bytes_per_token() * context
    return mode_bandwidth_gbps(target, mode) * 1e9 / read


def fit_efficiency() -> float:
    """Least-squares factor between the bandwidth bound and the anchors' measured tokens/s."""
    from compress.config import load_target

    raw, measured = [], []
    for anchor in ANCHORS:
        target = load_target(anchor.target)
        mode = target.power_mode(anchor.power_mode)
        raw.append(_raw_decode_tokens_per_s(target, mode, anchor.shape, anchor.precision, anchor.group_size, anchor.context))
        measured.append(anchor.tokens_per_s)
    return sum(r * m for r, m in zip(raw, measured, strict=False)) / sum(r * r for r in raw)


def anchor_errors() -> list[dict[str, Any]]:
    """Prediction error of the fitted model on each published anchor."""
    from compress.config import load_target

    eff = fit_efficiency()
    rows = []
    for anchor in ANCHORS:
        target = load_target(anchor.target)
        mode = target.power_mode(anchor.power_mode)
        predicted = eff * _raw_decode_tokens_per_s(target, mode, anchor.shape, anchor.precision, anchor.group_size, anchor.context)
        rows.append({"anchor": anchor.name, "measured_tokens_per_s": anchor.tokens_per_s,
                     "predicted_tokens_per_s": round(predicted, 2),
                     "error_pct": round(100 * (predicted / anchor.tokens_per_s - 1), 2), "source": anchor.source})
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

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def predict(target: Target, shape: ModelShape, precision: str, mode_name: str | None = None, prompt_len: int | None = None,
            context: int | None = None, group_size: int = 128, sparse: bool = False) -> Prediction:
    """Predict decode speed, TTFT, memory and energy for one power mode."""
    mode = target.power_mode(mode_name)
    prompt_len = prompt_len or target.budgets.prompt_length
    context = context or target.budgets.context_length
    efficiency = fit_efficiency()
    # Decode reads the cache at the end of the prompt plus half the generated span on average; the
    # budget's context length is the pessimistic bound used here.
    tokens_per_s = efficiency * _raw_decode_tokens_per_s(target, mode, shape, precision, group_size, context)
    compute_precision = "int8" if precision == "int8" else "fp16"
    flops = 2 * shape.decoder_linear_params() * prompt_len + 2 * shape.lm_head_params()
    flops += 4 * shape.num_layers * shape.num_heads * shape.head_dim * prompt_len * prompt_len / 2
    ttft_s = flops / (mode_tops(target, mode, compute_precision, sparse) * 1e12 * PREFILL_UTILISATION)
    memory = stored_weight_bytes(shape, precision, group_size) + shape.kv_bytes_per_token() * context
    latency_s = 1.0 / tokens_per_s
    return Prediction(
        power_mode=mode.name, watts=mode.watts, precision=precision, decode_tokens_per_s=tokens_per_s,
        decode_latency_ms=latency_s * 1000, ttft_ms=ttft_s * 1000 + latency_s * 1000,
        memory_gb=memory / 1e9 + RUNTIME_OVERHEAD_GB, joules_per_token=mode.watts * latency_s,
        bandwidth_gbps=mode_bandwidth_gbps(target, mode), efficiency=efficiency,
    )


def predict_all_modes(target: Target, shape: ModelShape, precision: str, **kwargs: Any) -> list[Prediction]:
    """One prediction per power mode, in the order the target lists them."""
    return [predict(target, shape, precision, mode.name, **kwargs) for mode in target.power_modes]


def lowest_power_mode_meeting_budget(predictions: list[Prediction], max_latency_ms: float) -> Prediction | None:
    """The lowest-wattage mode whose decode latency is within budget, or None."""
    meeting = [p for p in predictions if p.decode_latency_ms <= max_latency_ms]
    return min(meeting, key=lambda p: p.watts) if meeting else None

