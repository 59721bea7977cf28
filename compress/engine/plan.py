"""Build plans: the exact TensorRT settings a target yields, as data and as a ``trtexec`` command.

A Jetson engine must be built on the Jetson (engines are tied to the GPU and TensorRT version that
built them, and hardware-compatible engines are not supported on JetPack), so the plan is written
into the run directory and replayed there with ``compress build-engine RUN_DIR``.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from compress.config import Target
from compress.runtime.onnx_decoder import DecoderLayout, past_names

GB = 1 << 30


@dataclass(frozen=True)
class ShapeRange:
    """One input's optimization-profile shapes."""

    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


@dataclass(frozen=True)
class BuildPlan:
    """Everything needed to build the engine for a target."""

    target: str
    gpu_sm: int
    tensorrt_version: str
    onnx_file: str
    engine_file: str
    fp16: bool
    int8: bool
    sparse_weights: bool
    strongly_typed: bool
    workspace_bytes: int
    builder_optimization_level: int
    version_compatible: bool
    timing_cache_file: str
    profiles: list[ShapeRange] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BuildPlan:
        profiles = [ShapeRange(p["name"], tuple(p["min"]), tuple(p["opt"]), tuple(p["max"])) for p in data["profiles"]]
        return cls(**{**data, "profiles": profiles})

    def trtexec_command(self) -> str:
        """The equivalent ``trtexec`` command line."""
        def shapes(kind: str) -> str:
            return ",".join(f"{p.name}:{'x'.join(str(d) for d in getattr(p, kind))}" for p in self.profiles)

        args = ["trtexec", f"--onnx={self.onnx_file}", f"--saveEngine={self.engine_file}",
                f"--memPoolSize=workspace:{self.workspace_bytes // (1 << 20)}M",
                f"--builderOptimizationLevel={self.builder_optimization_level}",
                f"--timingCacheFile={self.timing_cache_file}",
                f"--minShapes={shapes('min')}", f"--optShapes={shapes('opt')}", f"--maxShapes={shapes('max')}"]
        if self.strongly_typed:
            args.append("--stronglyTyped")
        else:
            if self.fp16:
                args.append("--fp16")
            if self.int8:
                args.append("--int8")
        if self.sparse_weights:
            args.append("--sparsity=enable")
        if self.version_compatible:
            args.append("--versionCompatible")
        return " ".join(shlex.quote(a) for a in args)


def decoder_profiles(layout: DecoderLayout, target: Target, max_batch: int) -> list[ShapeRange]:
    """Profiles for batch, sequence and past length within the target's context budget."""
    context = target.budgets.context_length
    prompt = min(target.budgets.prompt_length, context)
    ranges = [
        ShapeRange("input_ids", (1, 1), (1, prompt), (max_batch, context)),
        ShapeRange("attention_mask", (1, 1), (1, prompt), (max_batch, context)),
        ShapeRange("position_ids", (1, 1), (1, prompt), (max_batch, context)),
    ]
    for index, name in enumerate(past_names(layout.num_layers)):
        kv = layout.num_kv_heads[index // 2]
        ranges.append(ShapeRange(name, (1, kv, 0, layout.head_dim), (1, kv, prompt, layout.head_dim),
                                 (max_batch, kv, context - 1, layout.head_dim)))
    return ranges


def make_plan(target: Target, layout: DecoderLayout, *, has_qdq: bool, sparse_24: bool, max_batch: int = 1,
              workspace_fraction: float = 0.25, optimization_level: int = 3, version_compatible: bool = False) -> BuildPlan:
    """The build settings for ``target``: workspace limited to a share of the target's memory."""
    workspace = int(min(target.memory_gb * workspace_fraction, target.budgets.max_memory_gb) * GB)
    return BuildPlan(
        target=target.name,
        gpu_sm=target.gpu.sm,
        tensorrt_version=target.tensorrt_version,
        onnx_file="model.onnx",
        engine_file="model.engine",
        fp16=True,
        int8=has_qdq and "int8" in target.gpu.precisions,
        sparse_weights=sparse_24,
        strongly_typed=False,
        workspace_bytes=workspace,
        builder_optimization_level=optimization_level,
        version_compatible=version_compatible,
        timing_cache_file=f"timing-{target.name}.cache",
        profiles=decoder_profiles(layout, target, max_batch),
    )
