"""Work that needs the target device: ``compress build-engine RUN_DIR`` and ``compress validate RUN_DIR --on-device``.

A run whose engine comes from a TensorRT Edge-LLM bundle is built with Edge-LLM's ``llm_build``
and measured with its ``llm_inference`` (:mod:`compress.deploy.edgellm_device`); a run on the
generic path uses TensorRT's Python API. On a machine without the tools or a CUDA device both
say "not run: ..." and change nothing.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from compress.config import load_target
from compress.deploy import edgellm_device
from compress.engine.builder import build_engine, cuda_device, local_build_support, missing_tensorrt_reason, tensorrt_version
from compress.engine.cuda import memory_in_use_bytes
from compress.engine.plan import BuildPlan
from compress.errors import MissingBackendError, StageError, UsageError
from compress.fsutil import atomic_write_json, read_json, sha256_file
from compress.perf_model import ModelShape, mode_tops
from compress.rundir import locked
from compress.runtime.onnx_decoder import DecoderLayout
from compress.stages.build_engine import EDGELLM_PLAN_FILE, PLAN_FILE, build_edgellm_engine, timing_cache_path
from compress.stages.export_onnx import onnx_files_sha256
from compress.stages.validate import DEVICE_REFERENCE_FILE

ENGINE_MANIFEST = "engine_manifest.json"
JETPACK_TRTEXEC = Path("/usr/src/tensorrt/bin/trtexec")
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
    onnx_dir = _stage_dir(run_dir, "export_encoder" if plan.model_kind == "encoder" else "export_onnx") / "onnx"
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
    device = cuda_device()
    if device is None:
        raise MissingBackendError("not run: no CUDA device")
    if device[1] != plan.gpu_sm:
        raise MissingBackendError(f"not run: local GPU {device[0]} is sm_{device[1]}, the plan is for sm_{plan.gpu_sm}; "
                                  "build on the device")
    source = engine_dir / plan.engine_onnx_file
    trtexec = find_trtexec() if tensorrt_version() is None else None
    if trtexec is not None:
        built = build_with_trtexec(plan, engine_dir, trtexec)
    else:
        support = local_build_support(plan.gpu_sm)
        if not support.can_build:
            raise MissingBackendError(support.reason)
        cache = timing_cache_path(plan.target, support.tensorrt_version or "unknown")
        cache.parent.mkdir(parents=True, exist_ok=True)
        built = {**build_engine(plan, source, engine_dir / plan.engine_file, cache), "builder": "tensorrt-python"}
    manifest = engine_manifest(plan, engine_dir, onnx_dir, device[0], built)
    atomic_write_json(engine_dir / ENGINE_MANIFEST, manifest)
    _record_built_engine(run_dir, str((engine_dir / plan.engine_file).relative_to(run_dir)), manifest)
    return manifest


def engine_manifest(plan: BuildPlan, engine_dir: Path, onnx_dir: Path, gpu: str, built: dict[str, Any]) -> dict[str, Any]:
    """What :func:`check_engine_provenance` and the runtime read: who built the engine, for what, from which graph."""
    return {"target": plan.target, "gpu": gpu, "sm": plan.gpu_sm, "tensorrt_version": built["tensorrt_version"],
            "builder": built["builder"], "version_compatible": plan.version_compatible, "model_kind": plan.model_kind,
            "engine_sha256": sha256_file(engine_dir / plan.engine_file),
            "engine_graph_sha256": onnx_files_sha256(engine_dir / plan.engine_onnx_file),
            "onnx_sha256": onnx_files_sha256(onnx_dir / plan.onnx_file)}


def find_trtexec() -> Path | None:
    """``trtexec`` on PATH, or where JetPack installs it."""
    found = shutil.which("trtexec")
    if found:
        return Path(found)
    return JETPACK_TRTEXEC if JETPACK_TRTEXEC.is_file() else None


def build_with_trtexec(plan: BuildPlan, engine_dir: Path, trtexec: Path) -> dict[str, Any]:
    """Build with ``trtexec`` (one profile, see :attr:`BuildPlan.trtexec_profile`) where TensorRT's Python API is absent."""
    command = [str(trtexec), *plan.trtexec_args()[1:]]
    log_path = engine_dir / "trtexec.log"
    with log_path.open("w") as out:
        code = subprocess.run(command, cwd=engine_dir, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    text = log_path.read_text(errors="replace")
    if code != 0 or not (engine_dir / plan.engine_file).is_file():
        raise StageError(f"trtexec failed (exit {code}); see {log_path}")
    version = re.search(r"TensorRT version: (\S+)", text)
    return {"tensorrt_version": version.group(1) if version else "unknown", "builder": "trtexec",
            "engine_bytes": (engine_dir / plan.engine_file).stat().st_size}


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def check_engine_provenance(engine_dir: Path) -> dict[str, Any]:
    """The engine can run here: same GPU architecture, and the TensorRT that built it, or a later one for a
    version-compatible engine; otherwise a clear error telling to rebuild."""
    device = cuda_device()
    if device is None:
        raise MissingBackendError("not run: no CUDA device")
    manifest_path = engine_dir / ENGINE_MANIFEST
    if not manifest_path.is_file():
        raise UsageError(f"{engine_dir} has no built engine; run `compress build-engine RUN_DIR` on the device")
    manifest = read_json(manifest_path)
    here = tensorrt_version()
    if here is None:
        raise MissingBackendError(missing_tensorrt_reason())
    built = manifest["tensorrt_version"]
    if manifest.get("version_compatible"):
        runs_here = _version_tuple(here) >= _version_tuple(built)
        needed = f"TensorRT {built} or later"
    else:  # trtexec prints major.minor.patch, the Python module may add the build number
        runs_here = _version_tuple(here) == _version_tuple(built)
        needed = f"TensorRT {built}"
    if not runs_here or device[1] != manifest["sm"]:
        raise UsageError(f"engine built with TensorRT {built} for sm_{manifest['sm']} ({manifest['gpu']}) needs {needed} on "
                         f"sm_{manifest['sm']}; this machine has TensorRT {here} on sm_{device[1]} ({device[0]}): "
                         "rebuild it here with `compress build-engine RUN_DIR`")
    if sha256_file(engine_dir / read_json(engine_dir / PLAN_FILE)["engine_file"]) != manifest["engine_sha256"]:
        raise UsageError(f"the engine in {engine_dir} does not match its manifest's hash; rebuild it with `compress build-engine RUN_DIR`")
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


def measure_on_device(run_dir: Path, prompt_len: int | None = None, encoder_batch: int | None = None) -> dict[str, Any]:
    """Measure the run's engine on this GPU: an Edge-LLM engine with ``llm_inference``; a generic decoder engine for
    TTFT and decode latency (>= 1024 steps or 60 s, p50/p90/p99); an encoder engine per batch size."""
    run_dir = Path(run_dir)
    folder = edgellm_engine_folder(run_dir)
    if folder is not None:
        return measure_edgellm_on_device(run_dir, folder)
    engine_dir, plan, onnx_dir = _engine_folder(run_dir)
    manifest = check_engine_provenance(engine_dir)
    if plan.model_kind == "encoder":
        return measure_encoder_on_device(engine_dir, plan, onnx_dir, manifest, encoder_batch)
    return measure_decoder_on_device(engine_dir, plan, onnx_dir, manifest, prompt_len)


def _timed(step) -> tuple[float, Any]:
    """Milliseconds of one synchronous engine step (the session synchronizes its stream before returning)."""
    start = time.perf_counter()
    result = step()
    return (time.perf_counter() - start) * 1000, result


def measure_decoder_on_device(engine_dir: Path, plan: BuildPlan, onnx_dir: Path, manifest: dict[str, Any],
                              prompt_len: int | None = None) -> dict[str, Any]:
    """CUDA-synchronised TTFT and decode latency of a generic decoder engine, with bandwidth and compute utilisation."""
    from compress.eval.latency import percentiles
    from compress.runtime.trt_decoder import TrtDecoder

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
    shape = ModelShape.from_config(read_json(onnx_dir / "config.json"))
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


def measure_encoder_on_device(engine_dir: Path, plan: BuildPlan, onnx_dir: Path, manifest: dict[str, Any],
                              encoder_batch: int | None = None) -> dict[str, Any]:
    """Per-batch latency (p50/p90) and sentences/s of an encoder engine at batch 1, 8, 32 and the target's batch."""
    from compress.eval.embeddings import batch_latency
    from compress.runtime.encoder import HIDDEN_OUTPUT, TrtEncoder
    from compress.stages.export_encoder import PARITY_SENTENCES
    from compress.stages.validate_encoder import LATENCY_BATCHES

    encoder = TrtEncoder(onnx_dir, engine_dir / plan.engine_file, bool(manifest.get("version_compatible")))
    run = encoder.embed if encoder.output == HIDDEN_OUTPUT else encoder.logits
    batches = sorted({*LATENCY_BATCHES, *([encoder_batch] if encoder_batch else [])})
    sentences = list(PARITY_SENTENCES) * (4 * max(batches) // len(PARITY_SENTENCES) + 1)
    rows = [batch_latency(lambda chunk: run(list(chunk), batch_size=len(chunk)), sentences, batch, repeats=10) for batch in batches]
    return {"runtime": "tensorrt", "model_kind": "encoder", "batches": rows, "engine_sha256": manifest["engine_sha256"]}


def _energy_mj() -> float | None:
    """Total energy counter of GPU 0 in millijoules (NVML, desktop GPUs), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(0)))
    except Exception:  # NVML absent (Jetson, CPU hosts) or the counter unsupported
        return None
