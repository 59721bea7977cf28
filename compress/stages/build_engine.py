"""``build_engine``: a TensorRT engine for the target, or a build plan to run on the device.

From a TensorRT Edge-LLM bundle the engine is built by Edge-LLM's own ``llm_build`` with the
batch, input length and KV capacity of the target's budgets (:mod:`compress.deploy.edgellm_device`).
From our Q/DQ ONNX (the generic path) the graph is first checked against the target (operators,
data types, opset, shapes) and built with TensorRT's Python API. Either way, when the tools and a
CUDA device are present the engine is built here; otherwise the stage is ``deferred``: the exact
commands go to ``build_on_device.sh``, to run on the device or through ``compress build-engine
RUN_DIR``. No engine is written without a real build.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
from pydantic import Field, PositiveInt

from compress.algorithms.qdq import FP4_OPSET
from compress.artifact import EDGELLM_BUNDLE, ENGINE, ONNX, Artifact
from compress.config import StrictModel, Target
from compress.deploy import edgellm_device
from compress.engine.builder import build_engine, local_build_support
from compress.engine.engine_graph import engine_graph_parity, write_engine_graph
from compress.engine.plan import BuildPlan, make_encoder_plan, make_plan
from compress.engine.static_check import MAX_OPSET, GraphFacts, check_onnx_file
from compress.errors import MissingBackendError, StageError, UsageError
from compress.fsutil import atomic_write_json, atomic_write_text, read_json
from compress.models import cache_root
from compress.runtime.encoder import ENCODER_FILE
from compress.runtime.onnx_decoder import ONNX_FILE, DecoderLayout, past_names
from compress.stages import StageDef, register

log = logging.getLogger(__name__)

PLAN_FILE = "build_plan.json"
EDGELLM_PLAN_FILE = "edgellm_build.json"
SCRIPT_FILE = "build_on_device.sh"
ENGINE_MANIFEST_FILE = "engine_manifest.json"
ENCODER_MAX_TOKENS = 512
ENCODER_MAX_BATCH = 32


class BuildEngineConfig(StrictModel):
    """Options of the engine build."""

    max_batch: PositiveInt = 1
    # The settings below apply to the generic TensorRT path; Edge-LLM's builder chooses its own.
    workspace_fraction: float = Field(0.25, gt=0.0, le=1.0)
    optimization_level: int = Field(3, ge=0, le=5)
    version_compatible: bool = False
    build: Literal["auto", "defer"] = "auto"
    min_engine_graph_cosine: float = Field(0.99, gt=0.0, le=1.0)  # FP16 engine graph vs exported graph, per position


def timing_cache_path(target: str, tensorrt: str) -> Path:
    """The timing cache kept per target and TensorRT version, shared by runs."""
    return cache_root() / "timing" / f"{target}-trt{tensorrt}.cache"


def device_script(plan: BuildPlan) -> str:
    """Shell script that builds the engine on the device with ``trtexec`` alone and writes its manifest.

    ``compress build-engine RUN_DIR`` does the same through TensorRT's Python API, with separate
    prefill and decode profiles; ``trtexec`` builds the one profile covering both.
    """
    trtexec = " ".join(shlex.quote(a) for a in plan.trtexec_args()[1:])
    manifest = (
        '{"target": "%s", "gpu": "%s", "sm": %d, "tensorrt_version": "%s", "builder": "trtexec", '
        f'"version_compatible": {str(plan.version_compatible).lower()}, "model_kind": "{plan.model_kind}", '
        '"engine_sha256": "%s", "engine_graph_sha256": "%s"}\\n'
    )
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Build the TensorRT engine for {plan.target} (sm_{plan.gpu_sm}, TensorRT {plan.tensorrt_version}) on the device.",
        '# With compress installed: compress build-engine "$RUN_DIR"',
        "# With trtexec alone:      bash build_on_device.sh (it works in its own folder)",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        'TRTEXEC="${TRTEXEC:-$(command -v trtexec || echo /usr/src/tensorrt/bin/trtexec)}"',
        f'"$TRTEXEC" {trtexec} 2>&1 | tee trtexec.log',
        "VERSION=$(sed -n 's/.*TensorRT version: *\\([0-9.]*\\).*/\\1/p' trtexec.log | head -n 1)",
        "GPU=$({ tr -d '\\000' < /proc/device-tree/model || nvidia-smi --query-gpu=name --format=csv,noheader; } 2>/dev/null "
        "| head -n 1 || true)",
        f"ENGINE_SHA=$(sha256sum {shlex.quote(plan.engine_file)} | cut -d' ' -f1)",
        f"GRAPH_SHA=$(sha256sum {shlex.quote(plan.engine_onnx_file)} | cut -d' ' -f1)",
        f"printf '{manifest}' {plan.target} \"${{GPU:-unknown}}\" {plan.gpu_sm} \"${{VERSION:-unknown}}\" \"$ENGINE_SHA\" \"$GRAPH_SHA\" "
        f"> {ENGINE_MANIFEST_FILE}.tmp",
        f"mv {ENGINE_MANIFEST_FILE}.tmp {ENGINE_MANIFEST_FILE}",
        "",
    ])


def write_plan(folder: Path, plan: BuildPlan) -> None:
    atomic_write_json(folder / PLAN_FILE, plan.to_json())
    atomic_write_text(folder / SCRIPT_FILE, device_script(plan))
    (folder / SCRIPT_FILE).chmod(0o755)


def edgellm_plan(target: Target, bundle: Path, folder: Path, max_batch: int) -> dict:
    """What ``llm_build`` is run with for this bundle and target, paths relative to the engine folder."""
    profile = edgellm_device.engine_profile(target, max_batch)
    return {"runtime": "edgellm", "edgellm_version": target.edgellm.version, "target": target.name,
            "stack": target.edgellm.model_dump(), "profile": profile.to_json(),
            "onnx_dir": os.path.relpath(bundle / "llm", folder), "engine_dir": edgellm_device.ENGINE_SUBDIR}


def build_edgellm_engine(folder: Path, plan: dict) -> dict:
    """Run ``llm_build`` for a written plan (raises "not run: ..." without a CUDA device or the tool)."""
    tool = edgellm_device.require_device_tool(edgellm_device.BUILD_TOOL)
    profile = edgellm_device.EngineProfile(**plan["profile"])
    command = edgellm_device.build_command(tool, folder / plan["onnx_dir"], folder / plan["engine_dir"], profile)
    log.info("building the Edge-LLM engine: %s", " ".join(command))
    log_file = folder / "llm_build.log"
    with log_file.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise StageError(f"llm_build failed (exit {code}); see {log_file}")
    engines = sorted((folder / plan["engine_dir"]).rglob("*.engine"))
    if not engines:
        raise StageError(f"llm_build exited 0 but wrote no .engine file under {folder / plan['engine_dir']}")
    return {"engine_files": [str(p.relative_to(folder)) for p in engines], "engine_bytes": sum(p.stat().st_size for p in engines),
            "llm_build": str(tool)}


def run_edgellm_build(source: Artifact, config: BuildEngineConfig, ctx) -> Artifact:
    out = ctx.stage_dir / "engine"
    out.mkdir()
    plan = edgellm_plan(ctx.target, Path(source.path), out, config.max_batch)
    atomic_write_json(out / EDGELLM_PLAN_FILE, plan)
    atomic_write_text(out / SCRIPT_FILE, edgellm_device.device_script(ctx.target, edgellm_device.EngineProfile(**plan["profile"]),
                                                                      plan["onnx_dir"], plan["engine_dir"]))
    (out / SCRIPT_FILE).chmod(0o755)
    meta = {"runtime": "edgellm", "bundle": str(source.path), "profile": plan["profile"], "precision": source.meta.get("precision")}
    try:
        if config.build == "defer":
            raise MissingBackendError("deferred by configuration")
        built = build_edgellm_engine(out, plan)
    except MissingBackendError as exc:
        log.info("Edge-LLM engine build deferred: %s; commands written to %s", exc, SCRIPT_FILE)
        meta.update(deferred=True, metrics={"status": "deferred", "reason": str(exc), "runtime": "edgellm", **plan["profile"]})
        return Artifact(ENGINE, out, meta)
    meta.update(engine_file=plan["engine_dir"], metrics={"status": "built", "runtime": "edgellm", **plan["profile"], **built})
    return Artifact(ENGINE, out, meta)


def _encoder_max_tokens(folder: Path) -> int:
    """The longest sentence the encoder takes: its tokenizer's limit, bounded by its position table."""
    config = read_json(folder / "config.json")
    positions = int(config.get("max_position_embeddings", ENCODER_MAX_TOKENS))
    if config.get("model_type") in ("roberta", "xlm-roberta"):
        positions -= 2  # RoBERTa's positions start after the padding index
    tokenizer_config = folder / "tokenizer_config.json"
    limit = int(read_json(tokenizer_config).get("model_max_length", positions)) if tokenizer_config.is_file() else positions
    return max(1, min(positions, limit, ENCODER_MAX_TOKENS))


def _plan(source: Artifact, onnx_path: Path, config: BuildEngineConfig, target: Target) -> tuple[BuildPlan, GraphFacts]:
    facts = check_onnx_file(onnx_path, target, config.max_batch)
    options = {"workspace_fraction": config.workspace_fraction, "optimization_level": config.optimization_level,
               "version_compatible": config.version_compatible}
    if source.meta.get("model_kind") == "encoder":
        names = [i.name for i in onnx.load(str(onnx_path), load_external_data=False).graph.input]
        plan = make_encoder_plan(target, names, _encoder_max_tokens(Path(source.path)), has_qdq=facts.has_qdq,
                                 max_batch=max(config.max_batch, ENCODER_MAX_BATCH), **options)
    else:
        plan = make_plan(target, DecoderLayout.load(source.path), has_qdq=facts.has_qdq, has_int4=facts.has_int4,
                         sparse_24=bool(source.meta.get("sparse_24", False)), max_batch=config.max_batch, **options)
    return plan, facts


def _parity_feeds(source: Artifact) -> dict[str, np.ndarray]:
    """A short fixed input for the exported graph: eight tokens, an empty cache for a decoder."""
    vocab = int(read_json(Path(source.path) / "config.json").get("vocab_size", 1000))
    ids = np.random.default_rng(0).integers(min(100, vocab // 2), min(1000, vocab), (1, 8))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids),
             "position_ids": np.arange(8)[None]}
    if source.meta.get("model_kind") != "encoder":
        layout = DecoderLayout.load(source.path)
        for index, name in enumerate(past_names(layout.num_layers)):
            feeds[name] = np.zeros((1, layout.num_kv_heads[index // 2], 0, layout.head_dim), dtype=np.float32)
    return feeds


def write_engine_input(source: Artifact, onnx_path: Path, out: Path, plan: BuildPlan, min_cosine: float) -> dict:
    """The FP16 engine graph beside the plan, checked against the exported graph in ONNX Runtime."""
    written = write_engine_graph(onnx_path, out / plan.engine_onnx_file)
    parity = engine_graph_parity(onnx_path, out / plan.engine_onnx_file, _parity_feeds(source))
    log.info("engine graph (FP16) vs exported graph in ONNX Runtime: cosine %.5f, relative max difference %.4f",
             parity["cosine_min"], parity["relative_max_diff"])
    if parity["cosine_min"] < min_cosine:
        raise StageError(f"the FP16 engine graph departs from the exported graph: cosine {parity['cosine_min']:.5f} < {min_cosine}")
    return {**written, "engine_graph_parity": parity}


def run_build_engine(source: Artifact, config: BuildEngineConfig, ctx) -> Artifact:
    if source.kind == EDGELLM_BUNDLE:
        return run_edgellm_build(source, config, ctx)
    encoder = source.meta.get("model_kind") == "encoder"
    onnx_path = Path(source.path) / (ENCODER_FILE if encoder else ONNX_FILE)
    target = ctx.target
    plan, facts = _plan(source, onnx_path, config, target)
    out = ctx.stage_dir / "engine"
    out.mkdir()
    engine_input = write_engine_input(source, onnx_path, out, plan, config.min_engine_graph_cosine)
    write_plan(out, plan)
    support = local_build_support(target.gpu.sm)
    meta = {**{k: v for k, v in source.meta.items() if k != "metrics"}, "onnx": str(source.path),
            "trtexec": plan.trtexec_command(), "static_check": "passed", **engine_input}
    if config.build == "defer" or not support.can_build:
        reason = "deferred by configuration" if config.build == "defer" else support.reason
        log.info("engine build deferred: %s; plan written to %s", reason, PLAN_FILE)
        meta.update(deferred=True, metrics={"status": "deferred", "reason": reason, "trtexec": plan.trtexec_command(),
                                            "graph_nodes": facts.num_nodes, "qdq": facts.has_qdq, "int4": facts.has_int4,
                                            "profiles": [p.name for p in plan.profiles], **engine_input})
        return Artifact(ENGINE, out, meta)
    cache = timing_cache_path(target.name, support.tensorrt_version or "unknown")
    cache.parent.mkdir(parents=True, exist_ok=True)
    built = build_engine(plan, out / plan.engine_onnx_file, out / plan.engine_file, cache)
    meta.update(engine_file=plan.engine_file, device=support.device, tensorrt_version=built["tensorrt_version"],
                metrics={"status": "built", "device": support.device, **built, **engine_input})
    return Artifact(ENGINE, out, meta)


def check_plan(config: BuildEngineConfig, earlier: dict[str, StrictModel], target: Target, model_config: dict | None) -> None:
    """Refuse, before any work, a generic TensorRT build of a graph the target's ONNX parser cannot read."""
    quantize = earlier.get("quantize")
    if quantize is not None and quantize.method == "nvfp4" and "export_edgellm" not in earlier:
        major = target.tensorrt_version.split(".")[0]
        if MAX_OPSET.get(major, 21) < FP4_OPSET:
            raise UsageError(f"build_engine: an NVFP4 graph stores FP4 weights (FLOAT4E2M1, ONNX opset {FP4_OPSET}), and the ONNX parser "
                             f"of TensorRT {target.tensorrt_version} on {target.name} reads opset {MAX_OPSET.get(major, 21)} at most; "
                             "deploy NVFP4 through export_edgellm (recipe=thor-nvfp4), or end the recipe at export_onnx")


STAGE = register(StageDef(
    name="build_engine",
    summary="build the TensorRT engine (Edge-LLM's llm_build for a bundle, TensorRT for our ONNX), or defer with the commands",
    input_kind=(EDGELLM_BUNDLE, ONNX),
    output_kind=ENGINE,
    config_cls=BuildEngineConfig,
    run=run_build_engine,
    check_plan=check_plan,
    uses_target=True,
    model_kinds=("decoder", "encoder"),
))
