"""TensorRT Edge-LLM on the device: ``llm_build`` and ``llm_inference``, driven through their documented interfaces.

Jetson teams build Edge-LLM's C++ examples on the device (``cmake -DEMBEDDED_TARGET=jetson-orin``)
and run two programs (Edge-LLM 0.11 quick start and ``llm_inference --help``):

* ``llm_build --onnxDir BUNDLE/llm --engineDir ENGINE --maxBatchSize B --maxInputLen N --maxKVCacheCapacity K``
* ``llm_inference --engineDir ENGINE --inputFile IN.json --outputFile OUT.json --profileOutputFile PROFILE.json
  [--warmup W]``

The input file is Edge-LLM's request format (``batch_size``, sampling settings,
``max_generate_length``, ``apply_chat_template``, ``requests[].messages``); the output file holds
``responses[]`` with ``output_ids`` per ``request_idx``/``batch_idx``; the profile holds
``prefill`` and ``generation`` summaries and the peak GPU memory. This module builds those
commands and files and reads the results; it never invents a figure: what is not in the profile
is reported as not measured.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypedDict

from compress.backends.tensorrt.cuda import driver_device_count as cuda_device_count
from compress.core import shell
from compress.core.config import Target
from compress.core.errors import MissingBackendError, StageError, UsageError
from compress.core.files import atomic_write_json, read_json

log = logging.getLogger(__name__)

TOOLS_ENV = "COMPRESS_EDGELLM_TOOLS"
BUILD_TOOL = "llm_build"
INFERENCE_TOOL = "llm_inference"
ENGINE_SUBDIR = "engines"


class Message(TypedDict):
    role: str
    content: str


class Request(TypedDict):
    messages: list[Message]


class InferenceRequest(TypedDict):
    """Edge-LLM's ``llm_inference`` input file."""

    batch_size: int
    temperature: float
    top_p: float
    top_k: int
    max_generate_length: int
    apply_chat_template: bool
    add_generation_prompt: bool
    requests: list[Request]


class Response(TypedDict, total=False):
    request_idx: int
    batch_idx: int
    output_ids: list[int]
    output_text: str


class InferenceResponses(TypedDict, total=False):
    """Edge-LLM's ``llm_inference`` output file (the fields compress reads)."""

    responses: list[Response]


class PhaseProfile(TypedDict, total=False):
    tokens_per_second: float
    average_time_per_run_ms: float


class InferenceProfile(TypedDict, total=False):
    """Edge-LLM's ``--profileOutputFile`` (the fields compress reads; the peak GPU memory may sit in any section)."""

    prefill: PhaseProfile
    generation: PhaseProfile
    peak_gpu_memory_bytes: int


class ProfileFigures(TypedDict):
    decode_tokens_per_s: float | None
    decode_latency_ms: float | None
    ttft_ms: float | None
    peak_device_memory_gb: float | None


class EdgeLLMPlan(TypedDict):
    """What ``llm_build`` is run with (``build_plan.json`` of an Edge-LLM engine folder)."""

    runtime: str
    edgellm_version: str
    target: str
    stack: dict[str, str | list[str]]
    profile: dict[str, int]
    onnx_dir: str
    engine_dir: str


class BuiltEngine(TypedDict):
    engine_files: list[str]
    engine_bytes: int
    llm_build: str


@dataclass(frozen=True)
class EngineProfile:
    """The shapes an Edge-LLM engine is built for, from the target's budgets."""

    max_batch_size: int
    max_input_len: int
    max_kv_cache_capacity: int

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def engine_profile(target: Target, max_batch_size: int = 1) -> EngineProfile:
    """Batch, input length and KV capacity for the target: the budget's prompt length and context length."""
    budgets = target.budgets
    if budgets.context_length <= budgets.prompt_length:
        raise UsageError(f"target {target.name}: budgets.context_length ({budgets.context_length}) must exceed "
                         f"budgets.prompt_length ({budgets.prompt_length}) to leave room for generated tokens")
    return EngineProfile(max_batch_size, budgets.prompt_length, budgets.context_length)


def find_tool(name: str) -> Path | None:
    """``llm_build`` / ``llm_inference`` from ``$COMPRESS_EDGELLM_TOOLS`` (Edge-LLM's ``build/examples/llm``) or
    ``PATH``."""
    folder = os.environ.get(TOOLS_ENV)
    if folder:
        candidate = Path(folder) / name
        return candidate if candidate.is_file() and os.access(candidate, os.X_OK) else None
    found = shutil.which(name)
    return Path(found) if found else None


def require_device_tool(name: str) -> Path:
    """The tool, on a machine with a CUDA device; otherwise a "not run: ..." error naming what is missing."""
    if cuda_device_count() == 0:
        raise MissingBackendError("not run: no CUDA device")
    tool = find_tool(name)
    if tool is None:
        raise MissingBackendError(
            f"not run: {name} not found; build TensorRT Edge-LLM's C++ examples on the device and put "
            f"build/examples/llm on PATH or set {TOOLS_ENV}"
        )
    return tool


def build_command(tool: str | Path, onnx_dir: str | Path, engine_dir: str | Path, profile: EngineProfile) -> list[str]:
    """The ``llm_build`` command line for a bundle's ``llm`` folder."""
    return [str(tool), "--onnxDir", str(onnx_dir), "--engineDir", str(engine_dir),
            "--maxBatchSize", str(profile.max_batch_size), "--maxInputLen", str(profile.max_input_len),
            "--maxKVCacheCapacity", str(profile.max_kv_cache_capacity)]


def inference_command(tool: str | Path, engine_dir: str | Path, input_file: str | Path, output_file: str | Path,
                      profile_file: str | Path, warmup: int = 1) -> list[str]:
    """The ``llm_inference`` command line: requests in, responses and a profile out."""
    return [str(tool), "--engineDir", str(engine_dir), "--inputFile", str(input_file), "--outputFile", str(output_file),
            "--profileOutputFile", str(profile_file), "--warmup", str(warmup)]


def run_inference(
    tool: Path, engine_dir: Path, request: InferenceRequest, work_dir: Path, warmup: int = 1
) -> tuple[InferenceResponses, InferenceProfile]:
    """Write ``request`` as Edge-LLM's input file, run ``llm_inference`` in ``work_dir``; its responses and its
    profile."""
    atomic_write_json(work_dir / "input.json", request)
    command = inference_command(
        tool, engine_dir, work_dir / "input.json", work_dir / "output.json", work_dir / "profile.json", warmup
    )
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        last = (result.stderr or result.stdout).strip().splitlines()
        raise UsageError(f"llm_inference failed (exit {result.returncode}): {last[-1] if last else ''}")
    profile = read_json(work_dir / "profile.json") if (work_dir / "profile.json").is_file() else {}
    return read_json(work_dir / "output.json"), profile


def greedy_requests(prompts: list[str], max_new_tokens: int) -> InferenceRequest:
    """An Edge-LLM input file asking for greedy continuations of raw prompts (no chat template), one request each."""
    return {"batch_size": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 1, "max_generate_length": max_new_tokens,
            "apply_chat_template": False, "add_generation_prompt": False,
            "requests": [{"messages": [{"role": "user", "content": prompt}]} for prompt in prompts]}


def output_ids(responses: InferenceResponses, count: int) -> list[list[int]]:
    """Generated token ids per request, in request order; raises when a request failed or is missing."""
    ordered = sorted(responses.get("responses", []), key=lambda r: (int(r["request_idx"]), int(r.get("batch_idx", 0))))
    by_request = {index: [int(t) for t in response["output_ids"]] for index, response in enumerate(ordered)}
    missing = [i for i in range(count) if not by_request.get(i)]
    if missing:
        raise UsageError(f"llm_inference returned no tokens for request {missing[0]} of {count}")
    return [by_request[i] for i in range(count)]


def _find_number(data: Any, key: str) -> float | None:
    if isinstance(data, dict):
        if isinstance(data.get(key), (int, float)):
            return float(data[key])
        for value in data.values():
            found = _find_number(value, key)
            if found is not None:
                return found
    return None


def profile_figures(profile: InferenceProfile) -> ProfileFigures:
    """Decode tokens/s, time to first token (prefill time per request) and peak GPU memory from an Edge-LLM profile."""
    generation, prefill = profile.get("generation", {}), profile.get("prefill", {})
    tokens_per_s = generation.get("tokens_per_second")
    ttft = prefill.get("average_time_per_run_ms")
    peak = _find_number(profile, "peak_gpu_memory_bytes")
    return {"decode_tokens_per_s": float(tokens_per_s) if tokens_per_s else None,
            "decode_latency_ms": 1000.0 / float(tokens_per_s) if tokens_per_s else None,
            "ttft_ms": float(ttft) if ttft is not None else None,
            "peak_device_memory_gb": peak / 1e9 if peak is not None else None}


def greedy_agreement(host: list[list[int]], device: list[list[int]]) -> dict[str, float]:
    """How far the device's greedy tokens follow the host model's: matching prefix share, and whole sequences equal."""
    prefix = []
    for expected, got in zip(host, device, strict=True):
        same = 0
        for a, b in zip(expected, got, strict=False):
            if a != b:
                break
            same += 1
        prefix.append(same / len(expected) if expected else 1.0)
    exact = sum(e == g[: len(e)] for e, g in zip(host, device, strict=True))
    return {"greedy_prefix_agreement": sum(prefix) / len(prefix), "greedy_sequences_identical": exact / len(host)}


def read_power_mode() -> str | None:
    """The nvpmodel power mode the device is in now (``nvpmodel -q``), or None off a Jetson."""
    tool = shutil.which("nvpmodel")
    if tool is None:
        return None
    result = subprocess.run([tool, "-q"], capture_output=True, text=True, check=False, timeout=30)
    for line in result.stdout.splitlines():
        if "Power Mode" in line and ":" in line:
            return line.split(":", 1)[1].strip()
    return None


def device_script(target: Target, profile: EngineProfile, onnx_dir: str, engine_dir: str) -> str:
    """``build_on_device.sh``: the exact build (and a smoke run) with Edge-LLM's own tools, paths relative to the stage
    folder."""
    stack = target.edgellm
    requirement = (f"JetPack {stack.jetpack}, CUDA {stack.cuda}, TensorRT ({stack.tensorrt})" if stack.jetpack
                   else f"CUDA {stack.cuda}, TensorRT {stack.tensorrt}")
    cmake = f" -DEMBEDDED_TARGET={stack.embedded_target}" if stack.embedded_target else ""
    arguments = build_command(BUILD_TOOL, onnx_dir, engine_dir, profile)[1:]
    build = f'"${{EDGELLM_TOOLS}}/{BUILD_TOOL}" ' + " ".join(shell.quote(a) for a in arguments)
    return "\n".join(
        [
            "#!/usr/bin/env bash",
            shell.comment(
                f"Build the TensorRT Edge-LLM {stack.version} engine for {target.name} on the device ({requirement}; "
                f"Edge-LLM support: {stack.support})."
            ),
            shell.comment(f"Edge-LLM's C++ tools come from its source tree, built on the device (cmake ..{cmake})."),
            "# Either, with compress installed:   compress build-engine RUN_DIR",
            "# or with Edge-LLM alone, from this folder:",
            "set -euo pipefail",
            'cd "$(dirname "$0")"',
            'EDGELLM_TOOLS="${EDGELLM_TOOLS:-$HOME/TensorRT-Edge-LLM/build/examples/llm}"',
            build,
            "",
        ]
    )


def edgellm_plan(target: Target, bundle: Path, folder: Path, max_batch: int) -> EdgeLLMPlan:
    """What ``llm_build`` is run with for this bundle and target, paths relative to the engine folder."""
    profile = engine_profile(target, max_batch)
    return {"runtime": "edgellm", "edgellm_version": target.edgellm.version, "target": target.name,
            "stack": target.edgellm.model_dump(), "profile": profile.to_json(),
            "onnx_dir": os.path.relpath(bundle / "llm", folder), "engine_dir": ENGINE_SUBDIR}


def build_edgellm_engine(folder: Path, plan: EdgeLLMPlan) -> BuiltEngine:
    """Run ``llm_build`` for a written plan (raises "not run: ..." without a CUDA device or the tool)."""
    tool = require_device_tool(BUILD_TOOL)
    profile = EngineProfile(**plan["profile"])
    command = build_command(tool, folder / plan["onnx_dir"], folder / plan["engine_dir"], profile)
    log.info("building the Edge-LLM engine: %s", " ".join(command))
    log_file = folder / "llm_build.log"
    with log_file.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise StageError(f"llm_build failed (exit {code}); see {log_file}")
    engines = sorted((folder / plan["engine_dir"]).rglob("*.engine"))
    if not engines:
        raise StageError(f"llm_build exited 0 but wrote no .engine file under {folder / plan['engine_dir']}")
    return {
        "engine_files": [str(p.relative_to(folder)) for p in engines],
        "engine_bytes": sum(p.stat().st_size for p in engines),
        "llm_build": str(tool),
    }
