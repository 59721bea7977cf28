"""What validation measures and predicts, as types: the records the validate stage writes, the gate reads, revalidation
recomputes from and the report shows.

They are ``TypedDict``\\ s: each is written to and read back from JSON (``validation.json``, ``report.json``) as it is,
and each names its keys. ``total=False`` marks a record whose keys depend on what was measured (a teacher, an ONNX
graph, the app prompts, a labelled set).
"""

from __future__ import annotations

from typing import TypedDict

Row = dict[str, str | int | float | bool | list[int] | None]  # one table row (a domain, a prompt, a batch)


class OnnxParity(TypedDict):
    """ONNX Runtime against torch on the deployed numbers, on a sample of windows."""

    windows: int
    tokens: int
    perplexity_onnx: float
    perplexity_torch: float
    difference_pct: float
    top1_agreement: float


class HostLatency(TypedDict, total=False):
    """The portable ONNX's latency on this host in ONNX Runtime (a sanity figure, not the target's)."""

    prompt_tokens: int
    new_tokens: int
    ttft_ms: float
    decode: dict[str, float]
    tokens_per_s: float


class PromptComparison(TypedDict, total=False):
    """The app prompts answered by the teacher and by the deployed numbers: per-prompt rows and the shares gated."""

    source: str
    new_tokens: int
    rows: list[Row]
    prompts: int
    identical_answers: float
    answer_prefix_agreement: float
    first_token_agreement: float
    prompts_with_expect: int
    expect_pass_teacher: float | None
    expect_pass_model: float | None


class DecoderFigures(TypedDict, total=False):
    """A decoder's measurements as deployed (:func:`compress.eval.decoder.measure`, then the validate stage's size and
    2:4 figures)."""

    eval_tokens: int
    eval_windows: int
    window_prefix: int
    measured_with: str
    perplexity_model: float
    perplexity_teacher: float | None
    perplexity_increase_pct: float | None
    perplexity_increase_pct_mixed: float
    worst_domain: str
    unseen_domains: list[str]
    top1_agreement: float
    mean_kl: float
    domains: dict[str, dict[str, float]]
    mixed: dict[str, float]
    prompts: PromptComparison | None
    prompts_source: str | None
    onnx_parity: OnnxParity | None
    perplexity_onnx: float | None
    perplexity_torch_quantized: float | None
    onnx_vs_torch_quantized_pct: float | None
    host_latency: HostLatency | None
    phase_peak_rss_mb: dict[str, float]
    model_size_bytes: int
    onnx_pattern_24_fraction: float


class LabelledAccuracy(TypedDict):
    file: str
    sentences: int
    accuracy: float
    accuracy_fp32: float


class EncoderFigures(TypedDict, total=False):
    """An encoder's measurements: embedding fidelity (or label agreement for a classifier), host latency per batch."""

    output: str
    sentences: int
    cosine_mean: float
    cosine_min: float
    embedding_cosine_mean: float
    embedding_cosine_min: float
    neighbour_agreement: float
    label_agreement: float
    worst_domain: str
    domains: dict[str, Row]
    labelled: LabelledAccuracy
    host_latency: list[Row]
    median_tokens: int
    model_size_bytes: int


class DecoderPredictions(TypedDict):
    """The latency model's figures for every power mode, the chosen one, and the same model in FP16."""

    target: str
    modes: list[Row]
    chosen: Row
    lowest_power_mode_meeting_latency_budget: str | None
    reference_fp16: Row


class EncoderPredictions(TypedDict):
    target: str
    kind: str
    modes: list[Row]
    chosen: Row


class PromptJson(TypedDict):
    domain: str
    text: str
    prompt_ids: list[int]


class DeviceReference(TypedDict):
    """``device_reference.json``: the prompts a built engine answers on the device and the host's greedy answers."""

    max_new_tokens: int
    prompts: list[PromptJson]
    host_output_ids: list[list[int]]
    host: str


class AnswerPair(TypedDict):
    """One forced answer compared token by token with the teacher's."""

    identical: bool
    first_divergence: int | None
    prefix_fraction: float
    first_token_match: bool


class EdgeLLMEngineFigures(TypedDict):
    """An Edge-LLM engine measured on the device with ``llm_inference``."""

    runtime: str
    decode_tokens_per_s: float | None
    decode_latency_ms: float | None
    ttft_ms: float | None
    peak_device_memory_gb: float | None
    greedy_prefix_agreement: float
    greedy_sequences_identical: float
    prompts: int
    new_tokens: int
    power_mode_read: str | None
    engine_sha256: str
    device_output_ids: list[list[int]]


class DecoderEngineFigures(TypedDict):
    """A generic TensorRT decoder engine measured on its GPU."""

    runtime: str
    ttft_ms: float
    decode: dict[str, float]
    iterations: int
    tokens_per_s: float
    achieved_bandwidth_gbps: float
    bandwidth_utilisation: float
    prefill_tflops: float
    prefill_compute_utilisation: float
    peak_device_memory_gb: float
    joules_per_token: float | None
    energy_source: str
    engine_sha256: str


class EncoderEngineFigures(TypedDict):
    runtime: str
    model_kind: str
    batches: list[Row]
    engine_sha256: str
