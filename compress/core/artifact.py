"""Artifacts: what a stage takes and gives, stored in the run directory, and their metadata, one type per kind.

An artifact's ``meta`` is what later stages, the gate and the report read of it. Each kind has its own type
(:data:`META_TYPES`) that refuses keys it does not know, so a key renamed on one side of a seam fails where it is
written or read rather than reading as a default. A model's facts (architecture, precision, how its linears ship)
are carried from stage to stage with :meth:`ModelMeta.carried`; each stage's own figures (``metrics``) are not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

HF_MODEL = "hf-model"
ONNX = "onnx"
ENGINE = "engine"
EDGELLM_BUNDLE = "edgellm-bundle"
REPORT = "report"
SOURCE = "source"


class _Meta(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> dict[str, Any]:
        """The metadata as stored in a stage record (fields that are not set are left out)."""
        return self.model_dump(mode="json", exclude_none=True)


class DeployedQuantization(_Meta):
    """How a quantized model's linears ship: what the latency model and the report read (``quantization.json`` in
    the model folder holds every linear's own settings)."""

    method: str
    format: str
    weight_bits: int | None = None
    group_size: int | None = None
    activations: str = "float"
    kv_cache: Literal["fp16", "fp8"] = "fp16"
    mix: dict[str, float] | None = None  # a mixed plan: each precision's share of the linear parameters
    lm_head: str | None = None  # a mixed plan's LM head format


class Deployment(_Meta):
    """What the latency model reads of a model beyond its shape: how its linears ship."""

    quantization: DeployedQuantization | None = None
    float_linear_fraction: float | None = None  # the share of linear parameters left FP16


class SourceMeta(_Meta):
    """The model a run starts from."""

    spec: str


_Carried = TypeVar("_Carried", bound="ModelMeta")


class ModelMeta(_Meta):
    """A model folder or its exported graph: what it is (load), how it ships (sparsify, quantize, export) and the
    producing stage's figures."""

    architecture: str
    model_type: str
    model_kind: Literal["decoder", "encoder"]
    license: str | None = None
    source: str
    precision: str = "fp32"
    sparse_24: bool = False
    float_linear_fraction: float | None = None
    quantization: DeployedQuantization | None = None
    layout: dict[str, Any] | None = None  # an exported decoder graph's cache layout
    opset: int | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)

    def carried(self, **updates: Any) -> ModelMeta:
        """This model's facts with ``updates``, without the figures of the stage that made it."""
        return self.carried_as(ModelMeta, **updates)

    def carried_as(self, kind: type[_Carried], **updates: Any) -> _Carried:
        """:meth:`carried`, as the metadata of another artifact kind that carries a model's facts."""
        return kind.model_validate({**self.model_dump(exclude={"metrics"}, exclude_none=True), **updates})

    def deployment(self) -> Deployment:
        """How this model's linears ship, for the latency model."""
        return Deployment(quantization=self.quantization, float_linear_fraction=self.float_linear_fraction)


class EngineMeta(ModelMeta):
    """A TensorRT engine folder (built here, or deferred to the device): the model's facts and the build's."""

    architecture: str | None = None  # an Edge-LLM engine is built from a bundle, which names none of these
    model_type: str | None = None
    model_kind: Literal["decoder", "encoder"] = "decoder"
    source: str | None = None
    precision: str | None = None
    runtime: str | None = None  # "edgellm" for an Edge-LLM engine
    bundle: str | None = None
    profile: dict[str, Any] | None = None
    onnx: str | None = None
    trtexec: str | None = None
    static_check: str | None = None
    engine_graph: str | None = None
    engine_graph_casts: Any = None
    engine_graph_parity: dict[str, Any] | None = None
    engine_file: str | None = None
    device: str | None = None
    tensorrt_version: str | None = None
    deferred: bool = False


class BundleMeta(_Meta):
    """A TensorRT Edge-LLM bundle."""

    precision: str
    quant_algo: str
    metrics: dict[str, Any] = Field(default_factory=dict)


class ReportMeta(_Meta):
    """A validation: its measurements, the latency model's predictions and the gate."""

    metrics: dict[str, Any] = Field(default_factory=dict)
    predictions: dict[str, Any] | None = None
    gate: dict[str, Any]


ArtifactMeta = SourceMeta | ModelMeta | EngineMeta | BundleMeta | ReportMeta
META_TYPES: dict[str, type[_Meta]] = {
    SOURCE: SourceMeta, HF_MODEL: ModelMeta, ONNX: ModelMeta, ENGINE: EngineMeta, EDGELLM_BUNDLE: BundleMeta,
    REPORT: ReportMeta,
}


def read_meta(kind: str, data: dict[str, Any] | _Meta) -> ArtifactMeta:
    """``data`` as the metadata type of ``kind`` (ValueError, naming the key, when it does not fit)."""
    meta_type = META_TYPES.get(kind)
    if meta_type is None:
        raise ValueError(f"unknown artifact kind {kind!r}")
    if isinstance(data, meta_type):
        return data
    return meta_type.model_validate(data.model_dump() if isinstance(data, _Meta) else data)


@dataclass(frozen=True)
class Artifact:
    """A stage output: its kind, where it lives, its metadata (the type :data:`META_TYPES` gives its kind; a mapping
    is read into it) and its content hash."""

    kind: str
    path: Path
    meta: ArtifactMeta = field(default_factory=dict)  # type: ignore[assignment]
    sha256: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "meta", read_meta(self.kind, self.meta))

    @property
    def metrics(self) -> dict[str, Any]:
        """The producing stage's figures (none for the source model)."""
        return getattr(self.meta, "metrics", {})
