"""Know before you start: each stage's peak host memory, disk and time for this model on this machine.

The figures come from the model's parameter count and rates measured on the stages as they are
written today (the scaling section of ``docs/benchmarks.md`` gives the runs they were measured on): the stages that hold
the model in its own dtype (load, sparsify, quantize: one block in float32 at a time) need a multiple of
the checkpoint's bytes, the others that load a model in full a multiple of its fp32 bytes; time is
linear in the parameters and in the tokens a stage reads. They are estimates, good to about a
factor of two; the plan refuses only a run whose largest stage would need more than this machine's
memory and swap by a clear margin, or more disk than the run directory's file system has free (a dry
run, which may plan for another machine, reports it instead).
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.eval.perf_model import ModelShape
from compress.models.config_file import ModelConfig
from compress.models.families import linear_shapes, model_kind

GB = 1e9
PROCESS_BASE_BYTES = 0.45 * GB  # torch, transformers, ONNX Runtime imported: the floor of every stage
REFUSE_MARGIN = 1.25  # refuse when the estimate exceeds memory + swap by this factor (the estimate's error)

# Peak host memory of a stage beyond the process floor: fp32 copies of the model (what a stage computing on a float32
# copy holds) plus copies of the checkpoint's bytes (what a stage holding the model in its own dtype, one part in
# float32
# at a time, holds) plus a fixed part; measured on the embedded SmolLM2 (float32) and on Qwen3-0.6B- and
# Qwen3-1.7B-shape
# bf16 checkpoints (default recipe, 2 cores; `bench/scale_table.py --measure`), fitted to the larger of each.
# A stage in none of the tables: two fp32 copies.
HOST_FP32_COPIES = {"distill": 6.0, "prune_heads": 3.0, "build_engine": 0.5}
# validate holds one thing at a time: its torch phases (the block-by-block passes, the teacher held for the app prompts:
# 2.35 and 2.80 GB for the 1.19 GB checkpoint, 5.08 and 4.95 GB for the 3.44 GB one, fitted before a mapped checkpoint's
# pages were handed back after each part; the 3.44 GB one now peaks at 3.9 GB, the deployed model's prompt answers) are
# the checkpoint once, copies of the embedding table (below) and the prompts' batch and KV cache (fixed); then ONNX
# Runtime's session (_onnx_session). Kept as fitted until the smaller shapes are measured again: it over-estimates.
# export_edgellm: NVIDIA's exporter in its own process (2.8 and 8.4 GB).
HOST_CHECKPOINT_COPIES = {"load": 0.5, "sparsify": 2.0, "export_edgellm": 2.4, "validate": 1.0}
# quantize holds more than its streamed block and one embedding table (2.0 and 3.5 GB measured on the two Qwen3 shapes,
# flat in depth at Llama-3.1-8B's width: 6.2 and 6.3 GB at 4 and 8 layers); fitted as a fixed part and copies of the
# embedding table in the checkpoint's dtype, which over-estimates the Llama-3.1-8B-width stage by about 1.4 GB.
HOST_FIXED_BYTES = {"quantize": 0.35 * GB, "validate": 0.5 * GB}
EMBEDDING_COPIES = {"quantize": 2.5, "validate": 1.5}
# export_onnx's ONNX Runtime session of the portable graph, as copies of the checkpoint: the levels, and the 16-bit
# tensors (float linears, the tied LM head) folded to float32 for its MatMuls; the stage's largest phase on the
# Qwen3-0.6B shape, whose embedding is a quarter of its parameters (2.56 GB for the 1.19 GB checkpoint; tracing the
# skeleton 1.44 GB, torch's block-by-block reference 1.12 GB).
ORT_SESSION_CHECKPOINT_COPIES = 1.8
# export_onnx writing the graph (the trace, then one tensor at a time) and, for a sliced graph, holding the model for
# torch's greedy continuation: 4.00 and 4.43 GiB for the 3.44 GB bf16 Qwen3-1.7B shape (`recipe=baseline`).
EXPORT_GRAPH_CHECKPOINT_COPIES = 1.25
# The graph weights (as stored) above which ONNX Runtime runs a graph in slices of whole blocks, each at most this much
# (``export_onnx.session_mb``, ``validate.onnx_session_mb``): a session then holds its slice's share of the above.
DEFAULT_SESSION_BYTES = 1024 * 2**20
# The stages that stream a model block by block (models/weights.py) hold one block in float32 and its work (statistics,
# Hessians, the copies a search makes) on the compute device: this many float32 copies of one block.
STREAMED_BLOCK_COPIES = {"quantize": 4.0, "validate": 2.0}

# Bytes written per parameter (None: computed from the checkpoint, see _disk_bytes). export_edgellm: the bundle (its
# ONNX
# and the embedding table beside it; 1.13 GB for the 0.6B-parameter Qwen3 shape in INT8), the unified checkpoint
# it is exported from being removed once the bundle is checked (``export_edgellm.keep_checkpoint``).
DISK_BYTES_PER_PARAM = {
    "load": None,
    "distill": 4.0,
    "prune_heads": 4.0,
    "sparsify": None,
    "quantize": None,
    "export_onnx": None,
    "export_edgellm": 1.9,
    "build_engine": 0.0,
    "validate": 0.0,
}
# Seconds per parameter and token read (stages that run the model over text), per parameter, and fixed, on two cores
# of this class of machine (quantize: W8A8 SmoothQuant + GPTQ on the Qwen3-1.7B shape, 1,721 s for 16,384 tokens).
SECONDS_PER_PARAM_TOKEN = {"quantize": 6.2e-11, "sparsify": 6.2e-11, "validate": 6.5e-11, "distill": 6.0e-10}
# The same on a CUDA device (the block-by-block work there, the rest of the stage on the host), measured on one H200
# with
# `bench/gpu_checks.sh`: W8A8 SmoothQuant + GPTQ on a Qwen3-1.7B shape (160 s; INT4 AWQ + GPTQ on Llama-3.1-8B's width
# took a quarter of that per parameter) and its validation (99 s). A smaller GPU is slower by about its arithmetic rate.
CUDA_SECONDS_PER_PARAM_TOKEN = {"quantize": 5.7e-12, "sparsify": 5.7e-12, "validate": 4.7e-12}
# recipe=auto's search before the chosen plan (measured on the Qwen3-0.6B shape, `bench/auto_table.py --shape
# qwen3-0.6b`,
# the Orin Nano's INT8 and INT4): the output Fisher pass holds the model in its own dtype, one block recomputed in
# float32
# and one window's logits, their log-probabilities and gradients (3.62 GiB; the sensitivities 2.24 GiB, the teacher's
# answers 3.06 GiB; measuring three plans 5.75 GiB, fitted as copies of the checkpoint, quantizing and measuring not
# told apart); its time is per token of its windows, the sensitivities'
# per token of calibration and candidate format (16.8 min for two), each plan's a quantization (INT4 AWQ + GPTQ is
# slower than W8A8) and a measurement on the held-out windows and the chat prompts' answers, of fixed size.
FISHER_LOGITS_COPIES = 7.0
PLANS_CHECKPOINT_COPIES = 4.8
FISHER_SECONDS_PER_PARAM_TOKEN = 7e-11
SENSITIVITY_SECONDS_PER_PARAM_TOKEN = 4.1e-10  # per candidate format
PLAN_SECONDS_PER_PARAM_TOKEN = 3.2e-10
PLAN_MEASURE_SECONDS_PER_PARAM = 4.0e-7
TEACHER_SECONDS_PER_PARAM = 2.6e-7
# learned rounding, per parameter-token of the steps' windows and of three passes over the calibration windows, as a
# multiple of the quantize rate: fitted to SmolLM2's INT4 at 100 steps of 4 windows (about 1,600 s of tuning)
TUNE_FACTOR = 1.0
SEARCH_PLANS = 3  # what a search usually measures: the first plan, a back-off, a refinement
SECONDS_PER_PARAM = {"load": 8e-9, "prune_heads": 1e-7, "export_onnx": 5e-8, "export_edgellm": 3e-8}
FIXED_SECONDS = {"export_onnx": 15.0, "export_edgellm": 30.0}


@dataclass(frozen=True)
class StageEstimate:
    """What one stage is expected to need (``device_bytes``: on a CUDA device, for the stages that compute there)."""

    stage: str
    host_bytes: float
    disk_bytes: float
    seconds: float
    device_bytes: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "peak_host_gb": round(self.host_bytes / GB, 2),
            "disk_gb": round(self.disk_bytes / GB, 2),
            "minutes": round(self.seconds / 60, 1),
            "seconds": round(self.seconds, 1),
            "peak_device_gb": round(self.device_bytes / GB, 2),
        }


def readable_bytes(size: float) -> str:
    """``size`` in the largest unit (GB, MB, kB, bytes) that shows it as at least 1, to one decimal."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(size) >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} bytes"


def parameter_count(config: ModelConfig) -> int:
    """Parameters of a model from its config alone (decoders through the latency model's shape; encoders BERT-like)."""
    if model_kind(config) == "decoder":
        return ModelShape.from_config(config).total_params()
    hidden, layers = config.get("hidden_size", 0), config.get("num_hidden_layers", 0)
    intermediate = config.get("intermediate_size", 4 * hidden)
    return layers * (4 * hidden * hidden + 2 * hidden * intermediate) + config.get("vocab_size", 0) * hidden


def _tokens_read(stage: str, config: Any, domains: int) -> int:
    """Tokens a stage runs the model over, from its config (calibration windows, evaluation tokens per evaluation
    domain, training steps)."""
    if stage in ("quantize", "sparsify"):
        return int(getattr(config, "calib_windows", 32)) * int(getattr(config, "calib_window", 512))
    if stage == "validate":
        return domains * int(getattr(config, "eval_tokens", 2048))
    if stage == "distill":
        return (
            int(getattr(config, "steps", 0))
            * int(getattr(config, "batch_size", 1))
            * int(getattr(config, "seq_len", 512))
        )
    return 0


def estimate_stages(stages: list[tuple[str, Any]], model_config: dict[str, Any], checkpoint_bytes: float,
                    device: str = "cpu", search_formats: int = 0, evaluation_domains: int = 6) -> list[StageEstimate]:
    """One estimate per ``(stage name, stage config)`` for a model of ``model_config`` whose files take
    ``checkpoint_bytes``; ``device``: where the block-by-block stages compute (on CUDA their blocks and activations live
    there); ``search_formats``: the candidate formats of a ``method: auto`` quantize stage's search;
    ``evaluation_domains``: how many domains validation evaluates (the shipped text has six)."""
    model = _Sized(model_config, checkpoint_bytes)
    on_device = device.startswith("cuda")
    quantized = any(other == "quantize" for other, _ in stages)
    exported = any(other == "export_onnx" for other, _ in stages)
    estimates = []
    for name, config in stages:
        base = name.removesuffix("_encoder")
        tokens = _tokens_read(base, config, evaluation_domains)
        host, device_bytes = _stage_memory(base, config, tokens, model, (quantized, exported, on_device))
        disk_rate = DISK_BYTES_PER_PARAM.get(base, 4.0)
        disk = (_disk_bytes(base, model_config, model.params, checkpoint_bytes, quantized) if disk_rate is None
                else disk_rate * model.params)
        disk = _kept_copies(base, config, disk, model_config, model.params, checkpoint_bytes)
        seconds = _stage_seconds(base, config, tokens, model, on_device)
        if base == "quantize" and getattr(config, "method", None) == "auto" and model.shape is not None:
            search_host, search_seconds = _search(config, model.params, checkpoint_bytes, model.shape, search_formats)
            rate = CUDA_SECONDS_PER_PARAM_TOKEN["quantize"] / SECONDS_PER_PARAM_TOKEN["quantize"] if on_device else 1.0
            host = max(host, search_host)
            seconds = rate * search_seconds  # the chosen plan is one of those measured: it is not quantized again
        estimates.append(StageEstimate(name, host, disk, seconds, device_bytes))
    return estimates


@dataclass(frozen=True)
class _Sized:
    """What the estimates read of a model: its config, parameters, checkpoint bytes and decoder shape."""

    config: dict[str, Any]
    checkpoint_bytes: float

    @functools.cached_property
    def params(self) -> int:
        return parameter_count(self.config)

    @functools.cached_property
    def shape(self) -> ModelShape | None:
        return ModelShape.from_config(self.config) if model_kind(self.config) == "decoder" else None

    @functools.cached_property
    def hidden(self) -> int:
        text = self.config.get("text_config") or {}
        return int(self.config.get("hidden_size") or text.get("hidden_size") or 0)

    @property
    def per_param(self) -> float:
        return self.checkpoint_bytes / max(self.params, 1)


def _stage_memory(base: str, config: Any, tokens: int, model: _Sized,
                  run: tuple[bool, bool, bool]) -> tuple[float, float]:
    """A stage's peak host memory and device memory; ``run``: whether the run quantizes, exports ONNX, and computes
    its block-by-block work on a CUDA device (which then holds that work)."""
    quantized, exported, on_device = run
    shape, hidden, checkpoint_bytes = model.shape, model.hidden, model.checkpoint_bytes
    phased = base == "export_onnx" and shape is not None
    known = base in HOST_FP32_COPIES or base in HOST_CHECKPOINT_COPIES or base in STREAMED_BLOCK_COPIES or phased
    host = (PROCESS_BASE_BYTES + HOST_FP32_COPIES.get(base, 0.0 if known else 2.0) * 4.0 * model.params
            + HOST_CHECKPOINT_COPIES.get(base, 0.0) * checkpoint_bytes + HOST_FIXED_BYTES.get(base, 0.0))
    work = 0.0  # what the block-by-block work holds: blocks, hidden states, heads
    if base in ("quantize", "sparsify"):
        work += 3 * 4 * tokens * hidden  # the hidden states entering a block, its outputs and the hooks' copies
    if base in STREAMED_BLOCK_COPIES and shape is not None:
        work += STREAMED_BLOCK_COPIES[base] * 4.0 * (shape.decoder_linear_params() / shape.num_layers + 2 * hidden)
        # the embedding, read in the checkpoint's dtype for the first block's inputs
        host += EMBEDDING_COPIES.get(base, 1.0) * model.per_param * shape.vocab_size * hidden
        if base == "validate":  # both models' hidden states over every window (on the device where there is one)
            work += 2 * 4 * tokens * hidden
    device_bytes = work if on_device else 0.0
    host += 0.0 if on_device else work
    if shape is None or not (phased or (base == "validate" and exported)):
        return host, device_bytes
    graph_bytes = _disk_bytes("export_onnx", model.config, model.params, checkpoint_bytes, quantized)
    key = "session_mb" if phased else "onnx_session_mb"
    session = _onnx_session(checkpoint_bytes, graph_bytes, _session_limit(config, key), shape, model.per_param)
    if phased:  # one after the other: the largest of what each phase holds
        trace = max(2 * 4.0 * shape.vocab_size * shape.hidden_size, EXPORT_GRAPH_CHECKPOINT_COPIES * checkpoint_bytes)
        session = max(session, trace)
    return max(host, PROCESS_BASE_BYTES + session), device_bytes


def _stage_seconds(base: str, config: Any, tokens: int, model: _Sized, on_device: bool) -> float:
    """A stage's time from the rates measured on this class of machine (or a CUDA device)."""
    rates = CUDA_SECONDS_PER_PARAM_TOKEN if on_device else SECONDS_PER_PARAM_TOKEN
    rate = rates.get(base, SECONDS_PER_PARAM_TOKEN.get(base, 0.0))
    seconds = rate * model.params * tokens + SECONDS_PER_PARAM.get(base, 0.0) * model.params
    seconds += FIXED_SECONDS.get(base, 0.0)
    tuning = getattr(config, "tuning", None)
    settings = tuning() if callable(tuning) else None
    if base == "quantize" and settings is not None and model.shape is not None:
        # each iteration a forward and backward pass of every block over its windows; before and after, one forward
        # pass over all calibration windows
        tuned_tokens = settings.iters * settings.windows * config.calib_window + 3 * tokens
        seconds += TUNE_FACTOR * rate * model.shape.decoder_linear_params() * tuned_tokens
    return seconds


def _search(config: Any, params: int, checkpoint_bytes: float, shape: ModelShape, formats: int) -> tuple[float, float]:
    """recipe=auto's search on the CPU: the peak host memory of its largest phase (the output Fisher pass, or quantizing
    and measuring the plans), and the seconds of the Fisher pass, the sensitivities, the teacher's answers and the
    plans."""
    window = int(config.calib_window)
    largest_block = 4.0 * shape.decoder_linear_params() / shape.num_layers
    fisher_host = (PROCESS_BASE_BYTES + checkpoint_bytes + FISHER_LOGITS_COPIES * 4 * window * shape.vocab_size
                   + 2 * largest_block + 4 * window * shape.hidden_size * shape.num_layers)
    calibration_tokens = int(config.calib_windows) * window
    seconds = (
        FISHER_SECONDS_PER_PARAM_TOKEN * params * int(config.fisher_windows) * window
        + SENSITIVITY_SECONDS_PER_PARAM_TOKEN * params * calibration_tokens * max(formats, 1)
        + TEACHER_SECONDS_PER_PARAM * params
        + SEARCH_PLANS
        * (PLAN_SECONDS_PER_PARAM_TOKEN * params * calibration_tokens + PLAN_MEASURE_SECONDS_PER_PARAM * params)
    )
    return max(fisher_host, PROCESS_BASE_BYTES + PLANS_CHECKPOINT_COPIES * checkpoint_bytes), seconds


def _session_limit(config: Any, option: str) -> float:
    """The stage's ``option`` (MiB) in bytes, or the default where the stage has none."""
    value = getattr(config, option, None)
    return value * 2**20 if value else DEFAULT_SESSION_BYTES


def _onnx_session(
    checkpoint_bytes: float, graph_bytes: float, limit_bytes: float, shape: ModelShape, per_param: float
) -> float:
    """ONNX Runtime's largest session beyond the process floor: the whole graph's, or, for a graph over ``limit_bytes``,
    its largest slice's share (whole blocks up to the limit; the last also holds the LM head)."""
    if graph_bytes <= limit_bytes:
        return ORT_SESSION_CHECKPOINT_COPIES * checkpoint_bytes
    head = shape.vocab_size * shape.hidden_size
    largest = max(limit_bytes, graph_bytes / shape.num_layers + per_param * head)
    # the LM head's slice as it runs: the stored head, its transpose and the float32 copy the MatMul reads (2.87 GiB
    # for the Qwen3-1.7B shape's 0.62 GB bf16 head, bench/sliced_parity.py)
    head_at_run = (2 * per_param + 4.0) * head
    return max(ORT_SESSION_CHECKPOINT_COPIES * checkpoint_bytes * min(1.0, largest / graph_bytes), head_at_run)


def _kept_copies(
    stage: str, config: Any, disk: float, model_config: dict[str, Any], params: int, checkpoint_bytes: float
) -> float:
    """``disk`` with what a stage's options keep or leave out: the load stage writes nothing unless it copies the model,
    the Edge-LLM export keeps its unified checkpoint (the quantized linears again) only when asked."""
    if stage == "load" and not getattr(config, "copy_model", False):
        return 0.0
    if stage == "export_edgellm" and getattr(config, "keep_checkpoint", False):
        return disk + _disk_bytes("quantize", model_config, params, checkpoint_bytes, True)
    return disk


def _disk_bytes(
    stage: str, model_config: dict[str, Any], params: int, checkpoint_bytes: float, quantized: bool
) -> float:
    """What the stages that write the model in its own dtype write: the checkpoint again (load, sparsify, the ONNX of a
    float model), or its quantized linears as one byte per weight and the rest as in the checkpoint (quantize, the ONNX
    of a quantized model)."""
    writes_levels = stage == "quantize" or (stage == "export_onnx" and quantized)
    if not writes_levels or model_kind(model_config) != "decoder":
        return checkpoint_bytes
    per_param = checkpoint_bytes / max(params, 1)
    linear = sum(out * inp for out, inp in linear_shapes(model_config).values()) * int(
        model_config.get("num_hidden_layers", 0)
    )
    return linear + per_param * max(params - linear, 0)


@dataclass(frozen=True)
class Machine:
    """What this machine offers a run: memory, swap and free disk where the run directory goes."""

    memory_bytes: float
    available_bytes: float
    swap_bytes: float
    free_disk_bytes: float
    device_memory_bytes: float = 0.0  # of the CUDA device the run computes on (0: none)
    device: str = "cpu"

    @classmethod
    def here(cls, out_dir: Path, device: str = "cpu") -> Machine:
        info = _meminfo()
        existing = next((p for p in [Path(out_dir), *Path(out_dir).absolute().parents] if p.exists()), Path("."))
        return cls(info.get("MemTotal", 0.0), info.get("MemAvailable", 0.0), info.get("SwapTotal", 0.0),
                   float(shutil.disk_usage(existing).free), _device_memory(device), device)


def _device_memory(device: str) -> float:
    """Total memory of a CUDA device (0 for the CPU)."""
    if not device.startswith("cuda"):
        return 0.0
    import torch

    return float(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def _meminfo() -> dict[str, float]:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return {"MemTotal": float(pages), "MemAvailable": float(pages)}
    values = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = float(parts[0]) * 1024
    return values


def _way_out(stage: str) -> str:
    """What a user can change when ``stage`` would not fit."""
    base = stage.removesuffix("_encoder")
    if base == "export_onnx":
        return (
            "let ONNX Runtime hold less at a time (export_onnx.session_mb=N, MiB of weights), leave the portable ONNX "
            "out with export_onnx=off (an Edge-LLM bundle ships without it), or use a larger machine"
        )
    if base == "validate":
        return (
            "let ONNX Runtime hold less at a time (validate.onnx_session_mb=N, MiB of weights), leave the portable "
            "ONNX out with export_onnx=off, or use a larger machine"
        )
    if base in ("quantize", "sparsify"):
        return (
            f"compute on a GPU with device=cuda, give a smaller calibration budget ({base}.calib_windows=N), "
            "or use a larger machine"
        )
    if base == "distill":
        return "distill on a GPU machine (device=cuda, distill.processes=N), or a smaller teacher"
    return "run it on a larger machine or a smaller model"


def fit_problem(estimates: list[StageEstimate], machine: Machine, model_spec: str) -> str | None:
    """Why a run cannot fit ``machine``: its largest stage needs clearly more memory than the machine has, or the run
    directory more disk than is free; None when it fits."""
    if not estimates:
        return None
    largest = max(estimates, key=lambda e: e.host_bytes)
    ceiling = (machine.memory_bytes + machine.swap_bytes) * REFUSE_MARGIN
    if machine.memory_bytes and largest.host_bytes > ceiling:
        return (
            f"model={model_spec}: {largest.stage} would need about {largest.host_bytes / GB:.1f} GB of memory "
            f"(estimated from the model's size), this machine has {machine.memory_bytes / GB:.1f} GB"
            f"{f' and {machine.swap_bytes / GB:.1f} GB of swap' if machine.swap_bytes else ''}; "
            f"{_way_out(largest.stage)} (`--dry-run` prints every stage's estimate)"
        )
    on_device = max(estimates, key=lambda e: e.device_bytes)
    if machine.device_memory_bytes and on_device.device_bytes > machine.device_memory_bytes:
        return (
            f"model={model_spec}: {on_device.stage} would need about {on_device.device_bytes / GB:.1f} GB on "
            f"{machine.device}, which has {machine.device_memory_bytes / GB:.1f} GB; use a smaller calibration budget "
            f"({on_device.stage}.calib_windows) or device=cpu"
        )
    disk = sum(e.disk_bytes for e in estimates)
    if disk > machine.free_disk_bytes * REFUSE_MARGIN:
        return (f"model={model_spec}: the run directory would take about {readable_bytes(disk)}, its file system has "
                f"{readable_bytes(machine.free_disk_bytes)} free; give out= on a larger disk")
    return None
