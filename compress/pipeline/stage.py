"""Stages: what one step of a run is, what it may read, and the registry recipes name them from.

A stage is thin glue ``(input artifact, stage config, run context) -> StageResult`` over library
code that knows nothing of runs. Where the same idea applies to decoders and encoders (quantize,
prune heads, export, validate) one stage holds a variant per model kind, and the plan picks the
variant for the model it loads. The encoder-only names recipes used before (``quantize_encoder``,
``prune_encoder_heads``, ``export_encoder``, ``validate_encoder``) stay registered as aliases
pinned to the encoder variant, so their run directories keep their names.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from compress.core.artifact import Artifact
from compress.core.config import StrictModel, Target, format_validation_error
from compress.core.data_files import DataSpec
from compress.core.errors import UsageError
from compress.core.text import TextSource
from compress.models.config_file import ModelConfig

log = logging.getLogger(__name__)

DECODER, ENCODER = "decoder", "encoder"
MODEL_KINDS = (DECODER, ENCODER)

# The stage modules, in pipeline order (``compress ls stages`` lists them so).
_STAGE_MODULES = (
    "load",
    "distill",
    "prune_heads",
    "sparsify",
    "quantize",
    "export_onnx",
    "export_edgellm",
    "build_engine",
    "validate",
)


@dataclass
class RunContext:
    """What a stage may read besides its input artifact: the run's settings and the artifacts of the stages before
    it."""

    run_dir: Path
    stage_dir: Path
    target: Target
    power_mode: str
    model_spec: str
    model_source: Any  # the resolved :class:`~compress.models.sources.ModelSource` (the load stage materialises it)
    calibration: list[TextSource]
    evaluation: list[TextSource]
    unseen_domains: list[str]
    trust_remote_code: bool = False
    eval_labels: Path | None = None
    require_measured: bool = False
    progress: bool = True
    device: str = "cpu"  # where block-by-block work (calibration, quantization, sparsification, scores) is computed
    # ``prompts=``: the app's prompt file, ``off``, or None for the shipped set (chat models)
    prompts: str | None = None
    # ``train_data=``: the distillation corpus (else calibration)
    train_data: list[DataSpec] = field(default_factory=list)
    artifacts: dict[str, Artifact] = field(default_factory=dict)  # by stage name, in run order
    stage_name: str = ""
    fingerprint: str = ""

    def first_artifact(self, kind: str) -> Artifact | None:
        """The earliest artifact of a kind (e.g. the teacher ``hf-model``)."""
        return next((a for a in self.artifacts.values() if a.kind == kind), None)

    def last_artifact(self, kind: str) -> Artifact | None:
        """The latest artifact of a kind (e.g. the model an export was made from)."""
        return next((a for a in reversed(self.artifacts.values()) if a.kind == kind), None)

    def stage_of(self, artifact: Artifact) -> str | None:
        """The name of the stage that produced ``artifact``."""
        return next((name for name, a in self.artifacts.items() if a is artifact), None)


@dataclass(frozen=True)
class StageResult:
    """What a stage produced: its artifact, the one line the log, report and ``compress show`` print, and the figures
    the report plots (names in :mod:`compress.report.figures`)."""

    artifact: Artifact
    summary: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    # Files a build on the device may add to the stage folder later (paths relative to it; a trailing "/" names a
    # folder): the folder still counts as what compress wrote, and the engine's own manifest proves the build.
    device_files: tuple[str, ...] = ()


StageFn = Callable[[Artifact, Any, RunContext], StageResult]
TargetCheck = Callable[[Any, Target], None]
# (this stage's config, the configs of the stages before it by name, target, model config or None) -> None; raises
# UsageError
PlanCheck = Callable[[Any, dict[str, Any], Target, "ModelConfig | None"], None]


@dataclass(frozen=True)
class StageVariant:
    """How a stage runs on one kind of model: its typed config and its glue."""

    config_cls: Any  # a StrictModel class, or a TypeAdapter of a discriminated union of them
    run: StageFn
    check_target: TargetCheck | None = None
    check_plan: PlanCheck | None = None
    # (config, model config or None, target) -> what --dry-run shows of this stage's plan beyond its config
    describe: Callable[[Any, ModelConfig | None, Target], dict[str, Any]] | None = None
    # For a union config: the key choosing the class, and each choice's class (to drop a recipe's options of another
    # choice).
    choice_key: str | None = None
    choices: dict[str, type[StrictModel]] | None = None
    input_kind: tuple[str, ...] | None = None  # what this variant takes, where it is narrower than the stage's

    def make_config(self, where: str, options: dict[str, Any], explicit: set[str] = frozenset()) -> Any:
        """Validate ``options`` (the recipe's, with ``explicit`` the keys given on the command line); an unknown key or
        wrong type is a usage error naming it."""
        options = self._drop_other_choices(where, options, explicit)
        try:
            if isinstance(self.config_cls, TypeAdapter):
                return self.config_cls.validate_python(options)
            return self.config_cls.model_validate(options)
        except ValidationError as exc:
            raise UsageError(self._message(exc, where, options)) from exc

    def _drop_other_choices(self, where: str, options: dict[str, Any], explicit: set[str]) -> dict[str, Any]:
        """A choice given on the command line starts from that choice's defaults: the recipe's options it lacks are
        dropped."""
        if (
            self.choice_key is None
            or self.choice_key not in explicit
            or options.get(self.choice_key) not in (self.choices or {})
        ):
            return options
        taken = self.choices[options[self.choice_key]].model_fields
        dropped = sorted(key for key in options if key not in taken and key not in explicit)
        if dropped:
            log.info("%s: %s=%s does not take the recipe's %s; they are left out", where, self.choice_key,
                                               options[self.choice_key], ", ".join(dropped))
        return {key: value for key, value in options.items() if key not in dropped}

    def _message(self, exc: ValidationError, where: str, options: dict[str, Any]) -> str:
        if self.choice_key is None:
            return format_validation_error(exc, where)
        errors = exc.errors()
        loc = errors[0]["loc"]
        choice = str(loc[0]) if loc and loc[0] in (self.choices or {}) else None
        key = ".".join(str(part) for part in (loc[1:] if choice else loc)) or "(top level)"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        if errors[0]["type"] == "union_tag_invalid":
            choices = ", ".join(self.choices or {})
            return f"{where}: {self.choice_key}: {options.get(self.choice_key)!r} is not one of {choices}"
        if errors[0]["type"] == "extra_forbidden":
            return f"{where}: {key}: not an option of {self.choice_key} {choice}{more}"
        message = errors[0]["msg"].removeprefix("Value error, ")
        return f"{where}: {message}{more}" if key == "(top level)" else f"{where}: {key}: {message}{more}"


@dataclass(frozen=True)
class StageDef:
    """One step recipes name: what it takes and gives, and how it runs on each kind of model."""

    name: str
    summary: str
    input_kind: str | tuple[str, ...]
    output_kind: str
    variants: dict[str, StageVariant]
    uses_target: bool = False  # its result depends on the target (its fingerprint includes it)
    optional: bool = False  # ``STAGE=off`` may leave it out of a recipe (nothing later needs what only it makes)

    @property
    def model_kinds(self) -> tuple[str, ...]:
        return tuple(kind for kind in MODEL_KINDS if kind in self.variants)

    def takes(self, model_kind: str | None = None) -> tuple[str, ...]:
        """The artifact kinds the stage takes (its variant's for ``model_kind``, where that one takes less)."""
        variant = self.variants.get(model_kind) if model_kind else None
        if variant is not None and variant.input_kind is not None:
            return variant.input_kind
        return self.input_kind if isinstance(self.input_kind, tuple) else (self.input_kind,)

    def accepts(self, kind: str, model_kind: str | None = None) -> bool:
        """Whether the stage (its variant for ``model_kind``, when given) takes an artifact of ``kind``."""
        return kind in self.takes(model_kind)

    def variant(self, model_kind: str) -> StageVariant | None:
        """The variant for ``model_kind``, or None when the stage does not work on that kind of model."""
        return self.variants.get(model_kind)


_REGISTRY: dict[str, StageDef] = {}


def register(stage: StageDef, aliases: dict[str, str] | None = None) -> StageDef:
    """Add a stage to the registry (once, by its module), with ``aliases``: other names pinned to one model kind's
    variant."""
    _REGISTRY[stage.name] = stage
    for alias, kind in (aliases or {}).items():
        _REGISTRY[alias] = replace(
            stage,
            name=alias,
            summary=f"{stage.name} for {kind}s, under the name {kind} recipes use",
            variants={kind: stage.variants[kind]},
        )
    return stage


def all_stages() -> dict[str, StageDef]:
    """Every registered stage and alias, by name, in pipeline order."""
    for module in _STAGE_MODULES:
        importlib.import_module(f"compress.pipeline.stages.{module}")
    return dict(_REGISTRY)


def get_stage(name: str) -> StageDef:
    """Look up a stage by name."""
    stages = all_stages()
    if name not in stages:
        raise UsageError(f"unknown stage {name!r} (known: {', '.join(stages)})")
    return stages[name]
