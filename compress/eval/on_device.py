"""Measuring a built engine on the GPU it runs on: a generic TensorRT decoder or encoder engine, or an Edge-LLM engine.

Every figure is measured with the engine on this device, CUDA-synchronised; what a tool does not
report (energy without NVML, a profile field Edge-LLM leaves out) is returned as not measured.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from compress.backends.edgellm import tools as edgellm_tools
from compress.backends.onnx.encoder import HIDDEN_OUTPUT, PARITY_SENTENCES
from compress.backends.onnx.runtime import DecoderLayout
from compress.backends.tensorrt.cuda import memory_in_use_bytes
from compress.backends.tensorrt.decoder import TrtDecoder
from compress.backends.tensorrt.encoder import TrtEncoder
from compress.backends.tensorrt.plan import BuildPlan
from compress.backends.tensorrt.provenance import EngineManifest
from compress.core.config import load_target
from compress.core.files import read_json
from compress.core.rundir import EDGELLM_BUILD_PLAN, ENGINE_MANIFEST
from compress.eval.embeddings import batch_latency
from compress.eval.encoder import LATENCY_BATCHES
from compress.eval.figures import DecoderEngineFigures, DeviceReference, EdgeLLMEngineFigures, EncoderEngineFigures
from compress.eval.latency import percentiles
from compress.eval.perf_model import ModelShape, mode_tops
from compress.models.config_file import ModelConfig

MIN_ITERATIONS = 1024
MAX_SECONDS = 60.0


def measure_edgellm_engine(folder: Path, reference: DeviceReference, tool: Path) -> EdgeLLMEngineFigures:
    """Run the Edge-LLM engine in ``folder`` with ``llm_inference`` on the validate stage's prompts (``reference``, its
    ``device_reference.json``).

    Returns decode tokens/s and ms/token, time to first token (prefill per request) and peak GPU
    memory from Edge-LLM's own profile, greedy agreement with the host model, and the nvpmodel
    power mode read from the device.
    """
    manifest_path = folder / ENGINE_MANIFEST
    plan = read_json(folder / EDGELLM_BUILD_PLAN)
    prompts = [p["text"] for p in reference["prompts"]]
    power_mode = edgellm_tools.read_power_mode()
    with tempfile.TemporaryDirectory(prefix="edgellm-", dir=folder) as work:
        responses, profile = edgellm_tools.run_inference(
            tool,
            folder / plan["engine_dir"],
            edgellm_tools.greedy_requests(prompts, reference["max_new_tokens"]),
            Path(work),
        )
    device_ids = edgellm_tools.output_ids(responses, len(prompts))
    figures = edgellm_tools.profile_figures(profile)
    agreement = edgellm_tools.greedy_agreement(reference["host_output_ids"], device_ids)
    return {
        "runtime": "edgellm",
        **figures,
        **agreement,
        "prompts": len(prompts),
        "new_tokens": reference["max_new_tokens"],
        "power_mode_read": power_mode,
        "engine_sha256": read_json(manifest_path)["engine_sha256"],
        "device_output_ids": device_ids,
    }


def _timed(step) -> tuple[float, Any]:
    """Milliseconds of one synchronous engine step (the session synchronizes its stream before returning)."""
    start = time.perf_counter()
    result = step()
    return (time.perf_counter() - start) * 1000, result


def measure_decoder_engine(engine_dir: Path, plan: BuildPlan, onnx_dir: Path, manifest: EngineManifest,
                           prompt_len: int | None = None) -> DecoderEngineFigures:
    """CUDA-synchronised TTFT and decode latency of a generic decoder engine, with bandwidth and compute utilisation."""
    target = load_target(plan.target)
    layout = DecoderLayout.load(onnx_dir)
    baseline_used = memory_in_use_bytes()
    decoder = TrtDecoder(engine_dir / plan.engine_file, layout, bool(manifest.get("version_compatible")))
    peak_used = memory_in_use_bytes()
    context = decoder.context_length  # the engine's budgets, overridden or not
    prompt_len = min(prompt_len or target.budgets.prompt_length, context - 1)
    vocab = int(read_json(onnx_dir / "config.json").get("vocab_size", 1000))
    prompt = np.random.default_rng(0).integers(0, min(vocab, 1000), (1, prompt_len))
    mask = np.ones_like(prompt)
    for _ in range(3):
        decoder.forward(prompt, mask, decoder.empty_past(1))
    ttft = [_timed(lambda: decoder.forward(prompt, mask, decoder.empty_past(1)))[0] for _ in range(10)]
    logits, past = decoder.forward(prompt, mask, decoder.empty_past(1))
    steps: list[float] = []
    energy_start = _energy_mj()
    started = time.perf_counter()
    step_mask = mask
    while len(steps) < MIN_ITERATIONS and time.perf_counter() - started < MAX_SECONDS:
        if step_mask.shape[1] >= context - 1:
            logits, past = decoder.forward(prompt, mask, decoder.empty_past(1))
            step_mask = mask
        token = logits[:, -1:].argmax(-1)
        step_mask = np.concatenate([step_mask, np.ones((1, 1), dtype=step_mask.dtype)], axis=1)
        elapsed, (logits, past) = _timed(lambda: decoder.forward(token, step_mask, past))  # noqa: B023
        steps.append(elapsed)
        if len(steps) % 64 == 0:
            peak_used = max(peak_used, memory_in_use_bytes())
    energy_end = _energy_mj()
    decode = percentiles(steps)
    ttft_ms = percentiles(ttft)["p50_ms"]
    engine_bytes = (engine_dir / plan.engine_file).stat().st_size
    bandwidth = engine_bytes / (decode["p50_ms"] / 1000) / 1e9
    shape = ModelShape.from_config(ModelConfig.read(onnx_dir))
    prefill_flops = 2 * shape.decoder_linear_params() * prompt_len + 2 * shape.lm_head_params()
    precision = "int8" if plan.int8 else "fp16"
    peak_tops = mode_tops(target, target.power_mode(), precision)
    joules = None if energy_start is None or energy_end is None else (energy_end - energy_start) / 1000 / len(steps)
    return {"runtime": "tensorrt", "ttft_ms": ttft_ms, "decode": decode, "iterations": len(steps),
            "tokens_per_s": 1000 / decode["mean_ms"], "achieved_bandwidth_gbps": bandwidth,
            "bandwidth_utilisation": bandwidth / target.memory_bandwidth_gbps,
            "prefill_tflops": prefill_flops / (ttft_ms / 1000) / 1e12,
            "prefill_compute_utilisation": prefill_flops / (ttft_ms / 1000) / 1e12 / peak_tops,
            "peak_device_memory_gb": (max(peak_used, memory_in_use_bytes()) - baseline_used) / 1e9,
            "joules_per_token": joules, "energy_source": "nvml" if joules is not None else "not measured (no NVML)",
            "engine_sha256": hashlib.sha256((engine_dir / plan.engine_file).read_bytes()).hexdigest()}


def measure_encoder_engine(engine_dir: Path, plan: BuildPlan, onnx_dir: Path, manifest: EngineManifest,
                           encoder_batch: int | None = None) -> EncoderEngineFigures:
    """Per-batch latency (p50/p90) and sentences/s of an encoder engine at batch 1, 8, 32 and the target's batch."""
    encoder = TrtEncoder(onnx_dir, engine_dir / plan.engine_file, bool(manifest.get("version_compatible")))
    run = encoder.embed if encoder.output == HIDDEN_OUTPUT else encoder.logits
    batches = sorted({*LATENCY_BATCHES, *([encoder_batch] if encoder_batch else [])})
    sentences = list(PARITY_SENTENCES) * (4 * max(batches) // len(PARITY_SENTENCES) + 1)
    rows = [
        batch_latency(lambda chunk: run(list(chunk), batch_size=len(chunk)), sentences, batch, repeats=10)
        for batch in batches
    ]
    return {"runtime": "tensorrt", "model_kind": "encoder", "batches": rows, "engine_sha256": manifest["engine_sha256"]}


def _energy_mj() -> float | None:
    """Total energy counter of GPU 0 in millijoules (NVML, desktop GPUs), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(0)))
    except Exception:  # NVML absent (Jetson, CPU hosts) or the counter unsupported
        return None
