"""Published decode and prefill measurements the latency model is fitted on and checked against.

Each point has a role:

* ``anchor``: the fit uses it;
* ``held out``: the fit does not see it; it is checked (decode within 10%, prefill within 20%);
* ``earlier release``: a figure an earlier runtime release published for a target that a later
  release re-measured; reported beside the others, neither fitted nor checked (the runtime moved:
  Edge-LLM 0.4.0 decoded Qwen3-1.7B NVFP4 on Thor at 170 tokens/s, 0.9.0 and 0.10.0 at 154).

Thor's points and every prefill point come from TensorRT Edge-LLM 0.10.0, the newest release with
runtime rows (its ``llm_inference`` dashboard: MTBench prompts of 57-61 tokens, batch 1, JetPack 7.2)
and component rows (``llm_bench``: a 2048-token prefill, decode after 2048 cached tokens). Orin's
decode fit stays on Edge-LLM 0.9.0's rows it was made on; 0.10.0's Orin, Orin NX and Orin Nano
decode rows are held out. Ampere's prefill is fitted on all three Orin devices (their tensor cores
reach different shares of peak: one device's fit misses the Nano's 2048-token prefill by 22%). In
every group one model size, Qwen3-4B, is held out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from compress.eval.model_shape import LLAMA2_7B, LLAMA3_8B, QWEN3_0_6B, QWEN3_1_7B, QWEN3_4B, QWEN3_8B, ModelShape

Role = Literal["anchor", "held out", "earlier release"]
ANCHOR: Role = "anchor"
HELD_OUT: Role = "held out"
EARLIER: Role = "earlier release"

PERFORMANCE_PAGE = "https://nvidia.github.io/TensorRT-Edge-LLM/0.10.0/user_guide/performance/performance-benchmarks.html"
RUNTIME_010 = (f"TensorRT Edge-LLM 0.10.0 runtime dashboard (llm_inference, MTBench, batch 1, JetPack 7.2), "
               f"{PERFORMANCE_PAGE}")
BENCH_010 = (f"TensorRT Edge-LLM 0.10.0 llm_bench (2048-token prefill, decode at 2048 cached tokens, batch 1), "
             f"{PERFORMANCE_PAGE}")
RUNTIME_090 = ("TensorRT Edge-LLM 0.9.0 runtime dashboard (llm_inference, MTBench, ~61-token prompts, batch 1, "
               f"JetPack 7.2; engines built with max input 2048, KV capacity 2200), {PERFORMANCE_PAGE}")
THOR_040 = ("TensorRT Edge-LLM 0.4.0 performance benchmarks, Jetson AGX Thor Developer Kit (SM110), batch 1, "
            "vanilla decoding, 364-383-token prompts")
THOR_070 = "TensorRT Edge-LLM 0.7.0 performance benchmarks (TensorRT 10.13), Jetson AGX Thor, batch 1, 370-token prompt"

THOR, AGX_ORIN = "jetson-agx-thor", "jetson-agx-orin-64gb"
ORIN_NX, ORIN_NANO = "jetson-orin-nx-16gb", "jetson-orin-nano-8gb"
# The power mode each device's published rows fit: Thor and the AGX Orin at MAXN, the NX at MAXN SUPER; the Orin
# Nano's rows match its 15W mode (68 GB/s: its decode rate is 0.62x the NX's at the same 102 GB/s peak otherwise).
MODE = {THOR: "MAXN", AGX_ORIN: "MAXN", ORIN_NX: "MAXN_SUPER", ORIN_NANO: "15W"}
DEVICE = {THOR: "AGX Thor", AGX_ORIN: "AGX Orin", ORIN_NX: "Orin NX", ORIN_NANO: "Orin Nano"}
QWEN3 = {"Qwen3-0.6B": QWEN3_0_6B, "Qwen3-1.7B": QWEN3_1_7B, "Qwen3-4B-2507": QWEN3_4B, "Qwen3-8B": QWEN3_8B}
HELD_OUT_MODEL = "Qwen3-4B-2507"
WEIGHT_GROUP = {"int4": 128, "nvfp4": 16}  # AWQ's group of 128; NVFP4's block of 16
LABEL = {"int4": "INT4 AWQ", "nvfp4": "NVFP4"}
# Decode reads the KV cache at the prompt plus half the generated span: 128 for ~61-token prompts.
RUNTIME_CONTEXT, BENCH_TOKENS = 128, 2048


@dataclass(frozen=True)
class Anchor:
    """A published decode rate: one stream, ``tokens_per_s`` with ``context`` tokens cached on average."""

    name: str
    target: str
    power_mode: str
    shape: ModelShape
    precision: str
    group_size: int
    context: int
    tokens_per_s: float
    source: str
    role: Role = ANCHOR


@dataclass(frozen=True)
class PrefillAnchor:
    """A published prefill (time to process the prompt) measurement."""

    name: str
    target: str
    power_mode: str
    shape: ModelShape
    precision: str
    prompt_tokens: int
    prefill_ms: float
    source: str
    role: Role = ANCHOR


def _role(model: str, fitted: Role) -> Role:
    return HELD_OUT if fitted == ANCHOR and model == HELD_OUT_MODEL else fitted


def _edgellm_decode(release: str, target: str, rates: dict[tuple[str, str], float], context: int, source: str,
                    fitted: Role) -> tuple[Anchor, ...]:
    """Decode points of one Edge-LLM table: ``rates`` maps (Qwen3 model, precision) to tokens/s."""
    bench = " llm_bench" if context == BENCH_TOKENS else ""
    return tuple(
        Anchor(f"{model} {LABEL[precision]} (Edge-LLM {release}{bench}, {DEVICE[target]})", target, MODE[target],
               QWEN3[model], precision, WEIGHT_GROUP[precision], context, rate, source, _role(model, fitted))
        for (model, precision), rate in rates.items()
    )


def _edgellm_prefill(release: str, target: str, times: dict[tuple[str, str, int], float], source: str,
                     fitted: Role) -> tuple[PrefillAnchor, ...]:
    """Prefill points of one Edge-LLM table: ``times`` maps (Qwen3 model, precision, prompt tokens) to ms."""
    return tuple(
        PrefillAnchor(f"{model} {LABEL[precision]}, {tokens} tokens (Edge-LLM {release}, {DEVICE[target]})", target,
                      MODE[target], QWEN3[model], precision, tokens, ms, source, _role(model, fitted))
        for (model, precision, tokens), ms in times.items()
    )


def _qwen3(precision: str, values: tuple[float, ...]) -> dict[tuple[str, str], float]:
    """Values for Qwen3 0.6B, 1.7B, 4B-2507 and 8B, as many as given, at ``precision``."""
    return {(model, precision): value for model, value in zip(QWEN3, values, strict=False)}


def _prompts(precision: str, tokens: tuple[int, ...], values: tuple[float, ...]) -> dict[tuple[str, str, int], float]:
    return {(model, precision, n): value for model, n, value in zip(QWEN3, tokens, values, strict=False)}


RUNTIME_PROMPTS = (61, 61, 57, 61)  # MTBench's first prompt in each model's chat template
BENCH_PROMPTS = (BENCH_TOKENS,) * 4

_ORIN_090 = (
    Anchor("Qwen3-0.6B INT4 AWQ (Edge-LLM 0.9.0)", AGX_ORIN, "MAXN", QWEN3_0_6B, "int4", 128, 128, 186.4, RUNTIME_090),
    Anchor("Qwen3-1.7B INT4 AWQ (Edge-LLM 0.9.0)", AGX_ORIN, "MAXN", QWEN3_1_7B, "int4", 128, 128, 98.6, RUNTIME_090),
    Anchor("Qwen3-4B-2507 INT4 AWQ (Edge-LLM 0.9.0)", AGX_ORIN, "MAXN", QWEN3_4B, "int4", 128, 128, 53.1, RUNTIME_090),
    Anchor("Qwen3-8B INT4 AWQ (Edge-LLM 0.9.0)", AGX_ORIN, "MAXN", QWEN3_8B, "int4", 128, 128, 32.5, RUNTIME_090),
    Anchor("Llama-3-8B INT4 (TensorRT-LLM 0.12, AWQ)", AGX_ORIN, "MAXN", LLAMA3_8B, "int4", 128, 192, 35.9,
           "NVIDIA Jetson AI Lab benchmarks, AGX Orin 64GB MAXN, 128 in / 128 out"),
    Anchor("Llama-2-7B INT4 (MLC q4f16_ft)", AGX_ORIN, "MAXN", LLAMA2_7B, "int4", 128, 192, 46.9,
           "NVIDIA Jetson AI Lab benchmarks, AGX Orin 64GB MAXN, MLC/TVM"),
)

# Earlier Thor releases: 364-383-token prompts, the KV cache read at the prompt plus 64 generated tokens.
_THOR_EARLIER = (
    Anchor("Llama-3.1-8B INT4 AWQ (Edge-LLM 0.4.0, AGX Thor)", THOR, "MAXN", LLAMA3_8B, "int4", 128, 447, 50.8,
           THOR_040, EARLIER),
    Anchor("Llama-3.1-8B NVFP4 (Edge-LLM 0.4.0, AGX Thor)", THOR, "MAXN", LLAMA3_8B, "nvfp4", 16, 447, 54.9,
           THOR_040, EARLIER),
    Anchor("Qwen3-0.6B INT4 AWQ (Edge-LLM 0.4.0, AGX Thor)", THOR, "MAXN", QWEN3_0_6B, "int4", 128, 430, 270.2,
           THOR_040, EARLIER),
    Anchor("Qwen3-0.6B NVFP4 (Edge-LLM 0.4.0, AGX Thor)", THOR, "MAXN", QWEN3_0_6B, "nvfp4", 16, 430, 318.6,
           THOR_040, EARLIER),
    Anchor("Qwen3-4B-2507 INT4 AWQ (Edge-LLM 0.4.0, AGX Thor)", THOR, "MAXN", QWEN3_4B, "int4", 128, 428, 76.4,
           THOR_040, EARLIER),
    Anchor("Qwen3-1.7B NVFP4 (Edge-LLM 0.7.0, AGX Thor)", THOR, "MAXN", QWEN3_1_7B, "nvfp4", 16, 434, 170.4,
           THOR_070, EARLIER),
)

ANCHORS: tuple[Anchor, ...] = (
    _ORIN_090
    + _edgellm_decode("0.10.0", THOR, _qwen3("nvfp4", (306.4, 153.6, 79.8, 47.3))
                      | _qwen3("int4", (319.7, 154.1, 83.3, 49.0)), RUNTIME_CONTEXT, RUNTIME_010, ANCHOR)
    + _edgellm_decode("0.10.0", THOR, _qwen3("nvfp4", (244.3, 135.5, 73.4, 44.6))
                      | _qwen3("int4", (253.1, 135.1, 76.5, 46.4)), BENCH_TOKENS, BENCH_010, HELD_OUT)
    + _edgellm_decode("0.10.0", AGX_ORIN, _qwen3("int4", (200.5, 99.8, 55.3, 32.2)), RUNTIME_CONTEXT, RUNTIME_010,
                      HELD_OUT)
    + _edgellm_decode("0.10.0", ORIN_NX, _qwen3("int4", (124.9, 59.0, 32.2, 18.4)), RUNTIME_CONTEXT, RUNTIME_010,
                      HELD_OUT)
    + _edgellm_decode("0.10.0", ORIN_NANO, _qwen3("int4", (77.0, 36.5)), RUNTIME_CONTEXT, RUNTIME_010, HELD_OUT)
    + _edgellm_decode("0.10.0", AGX_ORIN, _qwen3("int4", (162.5, 89.5, 50.7, 30.6)), BENCH_TOKENS, BENCH_010,
                      HELD_OUT)
    + _edgellm_decode("0.10.0", ORIN_NX, _qwen3("int4", (98.9, 52.2, 29.2, 17.5)), BENCH_TOKENS, BENCH_010,
                      HELD_OUT)
    + _edgellm_decode("0.10.0", ORIN_NANO, _qwen3("int4", (61.0, 32.3)), BENCH_TOKENS, BENCH_010, HELD_OUT)
    + _edgellm_decode("0.9.0", THOR, _qwen3("nvfp4", (303.1, 154.2, 80.5, 46.8))
                      | {("Qwen3-4B-2507", "int4"): 79.6, ("Qwen3-8B", "int4"): 49.3}, RUNTIME_CONTEXT, RUNTIME_090,
                      EARLIER)
    + _THOR_EARLIER
)

PREFILL_ANCHORS: tuple[PrefillAnchor, ...] = (
    _edgellm_prefill("0.10.0", THOR, _prompts("nvfp4", RUNTIME_PROMPTS, (6.6, 10.3, 18.6, 27.7))
                     | _prompts("int4", RUNTIME_PROMPTS, (8.2, 14.6, 30.8, 52.2)), RUNTIME_010, ANCHOR)
    + _edgellm_prefill("0.10.0", THOR, _prompts("nvfp4", BENCH_PROMPTS, (17.9, 27.7, 62.0, 104.9))
                       | _prompts("int4", BENCH_PROMPTS, (54.8, 145.4, 364.6, 663.4)), BENCH_010, ANCHOR)
    + _edgellm_prefill("0.10.0", AGX_ORIN, _prompts("int4", RUNTIME_PROMPTS, (12.8, 24.3, 49.9, 74.7)), RUNTIME_010,
                       ANCHOR)
    + _edgellm_prefill("0.10.0", AGX_ORIN, _prompts("int4", BENCH_PROMPTS, (118.5, 308.3, 761.9, 1384.1)), BENCH_010,
                       ANCHOR)
    + _edgellm_prefill("0.10.0", ORIN_NX, _prompts("int4", RUNTIME_PROMPTS, (17.6, 39.5, 78.4, 134.5)), RUNTIME_010,
                       ANCHOR)
    + _edgellm_prefill("0.10.0", ORIN_NX, _prompts("int4", BENCH_PROMPTS, (268.8, 674.0, 1880.5, 2944.1)), BENCH_010,
                       ANCHOR)
    + _edgellm_prefill("0.10.0", ORIN_NANO, _prompts("int4", RUNTIME_PROMPTS, (30.7, 69.8)), RUNTIME_010, ANCHOR)
    + _edgellm_prefill("0.10.0", ORIN_NANO, _prompts("int4", BENCH_PROMPTS, (445.2, 1021.0)), BENCH_010, ANCHOR)
    + _edgellm_prefill("0.9.0", THOR, _prompts("nvfp4", RUNTIME_PROMPTS, (8.0, 12.0, 20.5, 30.4))
                       | {("Qwen3-4B-2507", "int4", 57): 33.5, ("Qwen3-8B", "int4", 61): 56.0}, RUNTIME_090, EARLIER)
    + (
        PrefillAnchor("Llama-3.1-8B INT4 AWQ, 383 tokens (Edge-LLM 0.4.0, AGX Thor)", THOR, "MAXN", LLAMA3_8B, "int4",
                      383, 215.5, THOR_040, EARLIER),
        PrefillAnchor("Llama-3.1-8B NVFP4, 383 tokens (Edge-LLM 0.4.0, AGX Thor)", THOR, "MAXN", LLAMA3_8B, "nvfp4",
                      383, 31.0, THOR_040, EARLIER),
        PrefillAnchor("Qwen3-1.7B NVFP4, 370 tokens (Edge-LLM 0.7.0, AGX Thor)", THOR, "MAXN", QWEN3_1_7B, "nvfp4",
                      370, 13.9, THOR_070, EARLIER),
    )
)
