"""Work that needs the target device: ``compress build-engine RUN_DIR`` and ``compress validate RUN_DIR --on-device``.

A run whose engine comes from a TensorRT Edge-LLM bundle is built with Edge-LLM's ``llm_build``
and measured with its ``llm_inference`` (:mod:`compress.deploy.edgellm_device`); a run on the
generic path uses TensorRT's Python API. On a machine without the tools or a CUDA device both
say "not run: ..." and change nothing.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path
from typing import Any

from compress.config import load_target
from compress.deploy import edgellm_device
from compress.engine.builder import build_engine, cuda_device, local_build_support
from compress.engine.plan import BuildPlan
from compress.errors import MissingBackendError, UsageError
from compress.fsutil import atomic_write_json, read_json, sha256_file
from compress.perf_model import ModelShape, mode_tops
from compress.rundir import locked
from compress.runtime.onnx_decoder import ONNX_FILE, DecoderLayout
from compress.stages.build_engine import EDGELLM_PLAN_FILE, PLAN_FILE, build_edgellm_engine, timing_cache_path
from compress.stages.export_onnx import onnx_files_sha256
from compress.stages.validate import DEVICE_REFERENCE_FILE

ENGINE_MANIFEST = "engine_manifest.json"
MIN_ITERATIONS = 1024
MAX_SECONDS = 60.0


def _stage_dir(run_dir: Path, name: str) -> Path:
    manifest = read_json(run_dir / "manifest.json")
    for stage in manifest["stages"]:
        if stage["name"] == name:
            return run_dir / stage["dir"]
    raise UsageError(f"{run_dir} has no {name} stage")


def _engine_folder(run_dir: Path) -> tuple[Path, BuildPlan, Path]:
    if not (run_dir / "manifest.json").is_file():
        raise UsageError(f"{run_dir} is not a run directory (no manifest.json)")
    engine_dir = _stage_dir(run_dir, "build_engine") / "engine"
    plan = BuildPlan.from_json(read_json(engine_dir / PLAN_FILE))
    onnx_dir = _stage_dir(run_dir, "export_onnx") / "onnx"
    return engine_dir, plan, onnx_dir


def build_on_device(run_dir: Path) -> dict[str, Any]:
    """Build the run's engine here, from its plan; refuses when this host cannot build for the target."""
    if not (Path(run_dir) / "manifest.json").is_file():
        raise UsageError(f"{run_dir} is not a run directory (no manifest.json)")
    with locked(Path(run_dir)):
        return _build_on_device(Path(run_dir))


def edgellm_engine_folder(run_dir: Path) -> Path | None:
    """The run's Edge-LLM engine folder, when its engine is built from an Edge-LLM bundle."""
    if not (run_dir / "manifest.json").is_file():
        raise UsageError(f"{run_dir} is not a run directory (no manifest.json)")
    manifest = read_json(run_dir / "manifest.json")
    stage = next((s for s in manifest["stages"] if s["name"] == "build_engine"), None)
    folder = run_dir / stage["dir"] / "engine" if stage else None
    return folder if folder is not None and (folder / EDGELLM_PLAN_FILE).is_file() else None


def _files_sha256(folder: Path, names: list[str]) -> dict[str, str]:
    return {name: sha256_file(folder / name) for name in names}


def _build_edgellm_on_device(run_dir: Path, folder: Path) -> dict[str, Any]:
    plan = read_json(folder / EDGELLM_PLAN_FILE)
    built = build_edgellm_engine(folder, plan)
    manifest = {"runtime": "edgellm", "target": plan["target"], "edgellm_version": plan["edgellm_version"],
                "profile": plan["profile"], "power_mode": edgellm_device.read_power_mode(),
                "engine_sha256": _files_sha256(folder, built["engine_files"]), "llm_build": built["llm_build"]}
    atomic_write_json(folder / ENGINE_MANIFEST, manifest)
    _record_built_engine(run_dir, str((folder / plan["engine_dir"]).relative_to(run_dir)), manifest)
    return manifest


def _record_built_engine(run_dir: Path, engine_path: str, manifest: dict[str, Any]) -> None:
    report_path = run_dir / "report.json"
    if not report_path.is_file():
        return
    report = read_json(report_path)
    report["artifacts"]["engine"] = engine_path
    for stage in report["stages"]:
        if stage["name"] == "build_engine":
            stage["status"] = "done"
            stage["metrics"] = {**stage.get("metrics", {}), "status": "built", **manifest}
    atomic_write_json(report_path, report)


def _build_on_device(run_dir: Path) -> dict[str, Any]:
    folder = edgellm_engine_folder(run_dir)
    if folder is not None:
        return _build_edgellm_on_device(run_dir, folder)
    engine_dir, plan, onnx_dir = _engine_folder(run_dir)
    support = local_build_support(plan.gpu_sm)
    if not support.can_build:
        raise MissingBackendError(support.reason)
    cache = timing_cache_path(plan.target, support.tensorrt_version or "unknown")
    cache.parent.mkdir(parents=True, exist_ok=True)
    built = build_engine(plan, onnx_dir / ONNX_FILE, engine_dir / plan.engine_file, cache)
    manifest = {"target": plan.target, "gpu": support.device, "sm": plan.gpu_sm, "tensorrt_version": built["tensorrt_version"],
                "engine_sha256": sha256_file(engine_dir / plan.engine_file), "onnx_sha256": onnx_files_sha256(onnx_dir / ONNX_FILE)}
    atomic_write_json(engine_dir / ENGINE_MANIFEST, manifest)
    _record_built_engine(run_dir, str((engine_dir / plan.engine_file).relative_to(run_dir)), manifest)
    return manifest


def check_engine_provenance(engine_dir: Path) -> dict[str, Any]:
    """The engine was built by this TensorRT on this GPU, or a clear error telling to rebuild."""
    device = cuda_device()
    if device is None:
        raise MissingBackendError("not run: no CUDA device")
    manifest_path = engine_dir / ENGINE_MANIFEST
    if not manifest_path.is_file():
        raise UsageError(f"{engine_dir} has no built engine; run `compress build-engine RUN_DIR` on the device")
    manifest = read_json(manifest_path)
    from compress.engine.builder import tensorrt_version

    here = tensorrt_version()
    if here != manifest["tensorrt_version"] or device[1] != manifest["sm"]:
        raise UsageError(f"engine built with TensorRT {manifest['tensorrt_version']} for sm_{manifest['sm']} "
                         f"({manifest['gpu']}); this machine has TensorRT {here} on sm_{device[1]} ({device[0]}): "
                         "rebuild it here with `compress build-engine RUN_DIR`")
    return manifest


def measure_edgellm_on_device(run_dir: Path, folder: Path) -> dict[str, Any]:
    """Run the Edge-LLM engine with ``llm_inference`` on the validate stage's prompts.

    Returns decode tokens/s and ms/token, time to first token (prefill per request) and peak GPU
    memory from Edge-LLM's own profile, greedy agreement with the host model, and the nvpmodel
    power mode read from the device.
    """
    tool = edgellm_device.require_device_tool(edgellm_device.INFERENCE_TOOL)
    manifest_path = folder / ENGINE_MANIFEST
    if not manifest_path.is_file():
        raise UsageError(f"{folder} has no built engine; run `compress build-engine {run_dir}` on the device first")
    plan = read_json(folder / EDGELLM_PLAN_FILE)
    reference = read_json(_stage_dir(run_dir, "validate") / DEVICE_REFERENCE_FILE)
    prompts = [p["text"] for p in reference["prompts"]]
    power_mode = edgellm_device.read_power_mode()
    with tempfile.TemporaryDirectory(prefix="edgellm-", dir=folder) as work:
        responses, profile = edgellm_device.run_inference(
            tool, folder / plan["engine_dir"], edgellm_device.greedy_requests(prompts, reference["max_new_tokens"]), Path(work))
    device_ids = edgellm_device.output_ids(responses, len(prompts))
    figures = edgellm_device.profile_figures(profile)
    agreement = edgellm_device.greedy_agreement(reference["host_output_ids"], device_ids)
    return {"runtime": "edgellm", **figures, **agreement, "prompts": len(prompts), "new_tokens": reference["max_new_tokens"],
            "power_mode_read": power_mode, "engine_sha256": read_json(manifest_path)["engine_sha256"],
            "device_output_ids": device_ids}


def measure_on_device(run_dir: Path, prompt_len: int | None = None) -> dict[str, Any]:
    """CUDA-synchronised TTFT and decode latency of the run's engine (>= 1024 steps or 60 s), p50/p90/p99."""
    from compress.eval.latency import percentiles
    from compress.runtime.trt_decoder import TrtDecoder

    run_dir = Path(run_dir)
    folder = edgellm_engine_folder(run_dir)
    if folder is not None:
        return measure_edgellm_on_device(run_dir, folder)
    engine_dir, plan, onnx_dir = _engine_folder(run_dir)
    check_engine_provenance(engine_dir)
    target = load_target(plan.target)
    layout = DecoderLayout.load(onnx_dir)
    import torch

    baseline_used = _device_memory_used_bytes()
    decoder = TrtDecoder(engine_dir / plan.engine_file, layout)
    peak_used = _device_memory_used_bytes()
    prompt_len = prompt_len or target.budgets.prompt_length
    prompt = torch.randint(0, 1000, (1, prompt_len), device="cuda")
    mask = torch.ones_like(prompt)
    for _ in range(3):
        decoder.forward(prompt, mask, decoder.empty_past(1))
    ttft = []
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits, past = decoder.forward(prompt, mask, decoder.empty_past(1))
        torch.cuda.synchronize()
        ttft.append((time.perf_counter() - start) * 1000)
    steps: list[float] = []
    energy_start = _energy_mj()
    started = time.perf_counter()
    step_mask = mask
    while len(steps) < MIN_ITERATIONS and time.perf_counter() - started < MAX_SECONDS:
        if step_mask.shape[1] >= target.budgets.context_length - 1:
            logits, past = decoder.forward(prompt, mask, decoder.empty_past(1))
            step_mask = mask
        token = logits[:, -1:].argmax(-1)
        step_mask = torch.cat([step_mask, torch.ones((1, 1), dtype=step_mask.dtype, device="cuda")], dim=1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits, past = decoder.forward(token, step_mask, past)
        torch.cuda.synchronize()
        steps.append((time.perf_counter() - start) * 1000)
        if len(steps) % 64 == 0:
            peak_used = max(peak_used, _device_memory_used_bytes())
    energy_end = _energy_mj()
    decode = percentiles(steps)
    ttft_ms = percentiles(ttft)["p50_ms"]
    engine_bytes = (engine_dir / plan.engine_file).stat().st_size
    bandwidth = engine_bytes / (decode["p50_ms"] / 1000) / 1e9
    shape = ModelShape.from_config(read_json(onnx_dir / "config.json"))
    prefill_flops = 2 * shape.decoder_linear_params() * prompt_len + 2 * shape.lm_head_params()
    precision = "int8" if plan.int8 else "fp16"
    peak_tops = mode_tops(target, target.power_mode(), precision)
    joules = None if energy_start is None or energy_end is None else (energy_end - energy_start) / 1000 / len(steps)
    return {"ttft_ms": ttft_ms, "decode": decode, "iterations": len(steps),
            "tokens_per_s": 1000 / decode["mean_ms"], "achieved_bandwidth_gbps": bandwidth,
            "bandwidth_utilisation": bandwidth / target.memory_bandwidth_gbps,
            "prefill_tflops": prefill_flops / (ttft_ms / 1000) / 1e12,
            "prefill_compute_utilisation": prefill_flops / (ttft_ms / 1000) / 1e12 / peak_tops,
            "peak_device_memory_gb": (max(peak_used, _device_memory_used_bytes()) - baseline_used) / 1e9,
            "joules_per_token": joules, "energy_source": "nvml" if joules is not None else "not measured (no NVML)",
            "engine_sha256": hashlib.sha256((engine_dir / plan.engine_file).read_bytes()).hexdigest()}


def _device_memory_used_bytes() -> int:
    """Bytes in use on the current CUDA device (all processes; the caller subtracts a baseline taken before loading)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def _energy_mj() -> float | None:
    """Total energy counter of GPU 0 in millijoules (NVML, desktop GPUs), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(0)))
    except Exception:  # NVML absent (Jetson, CPU hosts) or the counter unsupported
        return None
