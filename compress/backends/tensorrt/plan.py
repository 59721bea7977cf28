"""Build plans: the exact TensorRT settings a target yields, as data and as a ``trtexec`` command.

A Jetson engine must be built on the Jetson (engines are tied to the GPU and TensorRT version that
built them, and hardware-compatible engines are not supported on JetPack), so the plan is written
into the run directory and replayed there with ``compress build-engine RUN_DIR``.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TypedDict

import numpy as np
import onnx

from compress.backends.onnx.encoder import ENCODER_FILE
from compress.backends.onnx.runtime import ONNX_FILE, DecoderLayout, past_names
from compress.backends.tensorrt.static_check import GraphFacts, check_onnx_file
from compress.core import shell
from compress.core.config import Target
from compress.core.errors import UsageError
from compress.core.files import atomic_write_json, atomic_write_text, read_json
from compress.core.rundir import BUILD_PLAN, DEVICE_SCRIPT, ENGINE_MANIFEST, TRTEXEC_LOG


class BuildResult(TypedDict, total=False):
    """What an engine build reports: its size, the TensorRT that built it and how (``builder``: ``trtexec`` or
    ``tensorrt-python``; the Python builder also says its typing and optimisation profiles)."""

    engine_bytes: int
    tensorrt_version: str
    builder: str
    typing: str
    profiles: list[str]

GB = 1 << 30
ENCODER_MAX_TOKENS = 512
ENCODER_MAX_BATCH = 32
PLAN_VERSION = 2
ENGINE_ONNX_FILE = "engine_input.onnx"
ENCODER_OPT_TOKENS = 64  # a typical command or retrieval query


@dataclass(frozen=True)
class ShapeRange:
    """One input's optimization-profile shapes."""

    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


class ShapeRangeJson(TypedDict):
    name: str
    min: list[int]
    opt: list[int]
    max: list[int]


class ProfileJson(TypedDict):
    name: str
    shapes: list[ShapeRangeJson]


@dataclass(frozen=True)
class Profile:
    """One optimization profile: a shape range for every dynamic input."""

    name: str
    shapes: list[ShapeRange]

    def to_json(self) -> ProfileJson:
        return ProfileJson(**asdict(self))

    @classmethod
    def from_json(cls, data: ProfileJson) -> Profile:
        shapes = [ShapeRange(s["name"], tuple(s["min"]), tuple(s["opt"]), tuple(s["max"])) for s in data["shapes"]]
        return cls(data["name"], shapes)

    def shape_flags(self) -> list[str]:
        """``trtexec``'s --minShapes/--optShapes/--maxShapes for this profile."""
        def shapes(kind: str) -> str:
            return ",".join(f"{s.name}:{'x'.join(str(d) for d in getattr(s, kind))}" for s in self.shapes)

        return [f"--minShapes={shapes('min')}", f"--optShapes={shapes('opt')}", f"--maxShapes={shapes('max')}"]


@dataclass(frozen=True)
class BuildPlan:
    """Everything needed to build the engine for a target.

    ``engine_onnx_file`` is the graph TensorRT parses: the exported graph with its precision in its
    types (FP16 activations and weights, INT8/INT4 where Q/DQ nodes say so), so the build is
    strongly typed. ``profiles`` are what the Python API builds (prefill and decode for a decoder);
    ``trtexec_profile`` is the single profile ``trtexec`` takes, covering both.
    """

    model_kind: str
    target: str
    gpu_sm: int
    tensorrt_version: str
    onnx_file: str
    engine_onnx_file: str
    engine_file: str
    precision: str
    int8: bool
    int4: bool
    sparse_weights: bool
    strongly_typed: bool
    workspace_bytes: int
    builder_optimization_level: int
    version_compatible: bool
    timing_cache_file: str
    profiles: list[Profile] = field(default_factory=list)
    trtexec_profile: Profile | None = None

    def to_json(self) -> dict[str, object]:
        return {"plan_version": PLAN_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> BuildPlan:
        if data.get("plan_version") != PLAN_VERSION:
            raise UsageError("this build plan was written by an older compress (no prefill/decode profiles, no typed "
                             "engine graph); rerun `compress run` to write a new one")
        fields = {k: v for k, v in data.items() if k != "plan_version"}
        fields["profiles"] = [Profile.from_json(p) for p in data["profiles"]]
        fields["trtexec_profile"] = Profile.from_json(data["trtexec_profile"]) if data.get("trtexec_profile") else None
        return cls(**fields)

    def trtexec_args(self) -> list[str]:
        """The equivalent ``trtexec`` command, as arguments."""
        args = ["trtexec", f"--onnx={self.engine_onnx_file}", f"--saveEngine={self.engine_file}", "--skipInference",
                f"--memPoolSize=workspace:{self.workspace_bytes // (1 << 20)}M",
                f"--builderOptimizationLevel={self.builder_optimization_level}",
                f"--timingCacheFile={self.timing_cache_file}",
                *(self.trtexec_profile or self.profiles[0]).shape_flags()]
        if self.strongly_typed:
            args.append("--stronglyTyped")
        else:
            args += ["--fp16"] + ["--int8"] * self.int8 + ["--int4"] * self.int4
        if self.sparse_weights:
            args.append("--sparsity=enable")
        if self.version_compatible:
            args.append("--versionCompatible")
        return args

    def trtexec_command(self) -> str:
        """The equivalent ``trtexec`` command line."""
        return " ".join(shlex.quote(a) for a in self.trtexec_args())


def _decoder_point(layout: DecoderLayout, batch: int, seq: int, past: int) -> dict[str, tuple[int, ...]]:
    """Every input's shape for one step of ``seq`` new tokens after ``past`` cached ones: the mask spans both."""
    shapes = {"input_ids": (batch, seq), "attention_mask": (batch, past + seq), "position_ids": (batch, seq)}
    for index, name in enumerate(past_names(layout.num_layers)):
        shapes[name] = (batch, layout.num_kv_heads[index // 2], layout.cache_length(index // 2, past), layout.head_dim)
    return shapes


def _profile(name: str, low: dict, opt: dict, high: dict) -> Profile:
    return Profile(name, [ShapeRange(key, low[key], opt[key], high[key]) for key in low])


def decoder_profiles(layout: DecoderLayout, target: Target, max_batch: int) -> list[Profile]:
    """A prefill profile (the prompt, empty cache) and a decode profile (one token, cache up to the context).

    Each is built from whole steps, so at its min, opt and max the mask length is the cache length
    plus the new tokens, as the graph requires.
    """
    context = target.budgets.context_length
    prompt = min(target.budgets.prompt_length, context - 1)
    point = partial(_decoder_point, layout)
    prefill = _profile("prefill", point(1, 1, 0), point(1, prompt, 0), point(max_batch, context, 0))
    decode = _profile("decode", point(1, 1, 1), point(1, 1, prompt), point(max_batch, 1, context - 1))
    return [prefill, decode]


def decoder_single_profile(layout: DecoderLayout, target: Target, max_batch: int) -> Profile:
    """One profile covering prefill and decode (``trtexec`` builds one), tuned for decode.

    Its max step is a full-context prompt after a full cache, so its mask bound is twice the
    context: the engine reserves more activation memory than the two-profile build.
    """
    context = target.budgets.context_length
    prompt = min(target.budgets.prompt_length, context - 1)
    point = partial(_decoder_point, layout)
    return _profile("all", point(1, 1, 0), point(1, 1, prompt), point(max_batch, context, context - 1))


def encoder_profile(input_names: list[str], max_tokens: int, opt_batch: int, max_batch: int) -> Profile:
    """Batches of 1..max_batch sentences of 1..max_tokens tokens, tuned for the target's batch of typical sentences."""
    opt_tokens = min(ENCODER_OPT_TOKENS, max_tokens)
    return Profile(
        "encoder",
        [
            ShapeRange(name, (1, 1), (min(opt_batch, max_batch), opt_tokens), (max_batch, max_tokens))
            for name in input_names
        ],
    )


@dataclass(frozen=True)
class _Graph:
    """What a build builds: the model's kind, its ONNX and engine file names, its profiles (and the one ``trtexec``
    takes), and what its graph holds (Q/DQ nodes, INT4 weights, 2:4 sparse weights)."""

    model_kind: str
    onnx_file: str
    engine_file: str
    profiles: list[Profile]
    trtexec_profile: Profile
    has_qdq: bool
    int4: bool = False
    sparse_24: bool = False


def _target_plan(target: Target, graph: _Graph, workspace_fraction: float = 0.25, optimization_level: int = 3,
                 version_compatible: bool = False) -> BuildPlan:
    """Settings every build shares: strongly typed from the FP16 engine graph, workspace a share of the target's
    memory."""
    workspace = int(min(target.memory_gb * workspace_fraction, target.budgets.max_memory_gb) * GB)
    return BuildPlan(
        model_kind=graph.model_kind, target=target.name, gpu_sm=target.gpu.sm, tensorrt_version=target.tensorrt_version,
        onnx_file=graph.onnx_file, engine_onnx_file=ENGINE_ONNX_FILE, engine_file=graph.engine_file, precision="fp16",
        int8=graph.has_qdq and "int8" in target.gpu.precisions, int4=graph.int4, sparse_weights=graph.sparse_24,
        strongly_typed=True, workspace_bytes=workspace, builder_optimization_level=optimization_level,
        version_compatible=version_compatible, timing_cache_file=f"timing-{target.name}.cache", profiles=graph.profiles,
        trtexec_profile=graph.trtexec_profile,
    )


def make_plan(
    target: Target,
    layout: DecoderLayout,
    *,
    has_qdq: bool,
    sparse_24: bool,
    max_batch: int = 1,
    has_int4: bool = False,
    **settings,
) -> BuildPlan:
    """The decoder build for ``target``: prefill and decode profiles (one covering both for ``trtexec``)."""
    graph = _Graph("decoder", "model.onnx", "model.engine", decoder_profiles(layout, target, max_batch),
                   decoder_single_profile(layout, target, max_batch), has_qdq, has_int4, sparse_24)
    return _target_plan(target, graph, **settings)


def make_encoder_plan(target: Target, input_names: list[str], max_tokens: int, *, has_qdq: bool, max_batch: int,
                      **settings) -> BuildPlan:
    """The encoder build for ``target``: one profile over batch and sentence length."""
    profile = encoder_profile(input_names, max_tokens, target.budgets.encoder_batch, max_batch)
    return _target_plan(
        target, _Graph("encoder", "encoder.onnx", "encoder.engine", [profile], profile, has_qdq), **settings
    )


def device_script(plan: BuildPlan) -> str:
    """Shell script that builds the engine on the device with ``trtexec`` alone and writes its manifest.

    ``compress build-engine RUN_DIR`` does the same through TensorRT's Python API, with separate
    prefill and decode profiles; ``trtexec`` builds the one profile covering both.
    """
    trtexec = " ".join(shell.quote(a) for a in plan.trtexec_args()[1:])
    manifest = (
        '{"target": "%s", "gpu": "%s", "sm": %d, "tensorrt_version": "%s", "builder": "trtexec", '
        f'"version_compatible": {str(plan.version_compatible).lower()}, "model_kind": "{plan.model_kind}", '
        '"engine_sha256": "%s", "engine_graph_sha256": "%s"}\\n'
    )
    return "\n".join(
        [
            "#!/usr/bin/env bash",
            shell.comment(
                f"Build the TensorRT engine for {plan.target} (sm_{plan.gpu_sm}, TensorRT {plan.tensorrt_version}) on "
                "the device."
            ),
            '# With compress installed: compress build-engine "$RUN_DIR"',
            "# With trtexec alone:      bash build_on_device.sh (it works in its own folder)",
            "set -euo pipefail",
            'cd "$(dirname "$0")"',
            'TRTEXEC="${TRTEXEC:-$(command -v trtexec || echo /usr/src/tensorrt/bin/trtexec)}"',
            f'"$TRTEXEC" {trtexec} 2>&1 | tee {TRTEXEC_LOG}',
            f"VERSION=$(sed -n 's/.*TensorRT version: *\\([0-9.]*\\).*/\\1/p' {TRTEXEC_LOG} | head -n 1)",
            "GPU=$({ tr -d '\\000' < /proc/device-tree/model || nvidia-smi --query-gpu=name --format=csv,noheader; } "
            "2>/dev/null "
            "| head -n 1 || true)",
            f"ENGINE_SHA=$(sha256sum {shell.quote(plan.engine_file)} | cut -d' ' -f1)",
            f"GRAPH_SHA=$(sha256sum {shell.quote(plan.engine_onnx_file)} | cut -d' ' -f1)",
            f'printf \'{manifest}\' {shell.quote(plan.target)} "${{GPU:-unknown}}" {shell.quote(plan.gpu_sm)} '
            f'"${{VERSION:-unknown}}" '
            f'"$ENGINE_SHA" "$GRAPH_SHA" > {ENGINE_MANIFEST}.tmp',
            f"mv {ENGINE_MANIFEST}.tmp {ENGINE_MANIFEST}",
            "",
        ]
    )


def write_plan(folder: Path, plan: BuildPlan) -> None:
    """``build_plan.json`` and ``build_on_device.sh`` in the engine folder."""
    atomic_write_json(folder / BUILD_PLAN, plan.to_json())
    atomic_write_text(folder / DEVICE_SCRIPT, device_script(plan))
    (folder / DEVICE_SCRIPT).chmod(0o755)


def encoder_max_tokens(folder: Path) -> int:
    """The longest sentence the encoder takes: its tokenizer's limit, bounded by its position table."""
    config = read_json(folder / "config.json")
    positions = int(config.get("max_position_embeddings", ENCODER_MAX_TOKENS))
    if config.get("model_type") in ("roberta", "xlm-roberta"):
        positions -= 2  # RoBERTa's positions start after the padding index
    tokenizer_config = folder / "tokenizer_config.json"
    limit = (
        int(read_json(tokenizer_config).get("model_max_length", positions)) if tokenizer_config.is_file() else positions
    )
    return max(1, min(positions, limit, ENCODER_MAX_TOKENS))


def plan_for_export(onnx_dir: Path, model_kind: str, target: Target, max_batch: int, *, sparse_24: bool = False,
                    **settings) -> tuple[BuildPlan, GraphFacts]:
    """The build of an exported folder's graph for ``target``, after the static check of that graph against the
    target."""
    onnx_path = onnx_dir / (ENCODER_FILE if model_kind == "encoder" else ONNX_FILE)
    facts = check_onnx_file(onnx_path, target, max_batch)
    if model_kind == "encoder":
        names = [i.name for i in onnx.load(str(onnx_path), load_external_data=False).graph.input]
        plan = make_encoder_plan(target, names, encoder_max_tokens(onnx_dir), has_qdq=facts.has_qdq,
                                 max_batch=max(max_batch, ENCODER_MAX_BATCH), **settings)
    else:
        plan = make_plan(target, DecoderLayout.load(onnx_dir), has_qdq=facts.has_qdq, has_int4=facts.has_int4,
                         sparse_24=sparse_24, max_batch=max_batch, **settings)
    return plan, facts


def parity_feeds(onnx_dir: Path, model_kind: str) -> dict[str, np.ndarray]:
    """A short fixed input for the exported graph: eight tokens, an empty cache for a decoder."""
    vocab = int(read_json(onnx_dir / "config.json").get("vocab_size", 1000))
    ids = np.random.default_rng(0).integers(min(100, vocab // 2), min(1000, vocab), (1, 8))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids),
             "position_ids": np.arange(8)[None]}
    if model_kind != "encoder":
        layout = DecoderLayout.load(onnx_dir)
        for index, name in enumerate(past_names(layout.num_layers)):
            feeds[name] = np.zeros((1, layout.num_kv_heads[index // 2], 0, layout.head_dim), dtype=np.float32)
    return feeds
