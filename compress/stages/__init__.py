"""The stage registry.

A stage is a pure step ``(input artifact, stage config, run context) -> output artifact``. Each
module in this package registers one :class:`StageDef`; the runner looks stages up by name and
checks a recipe's order against their input and output kinds before doing any work.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

from compress.config import StrictModel, Target, format_validation_error
from compress.errors import UsageError

if TYPE_CHECKING:
    from compress.artifact import Artifact
    from compress.runner import RunContext

StageFn = Callable[["Artifact", StrictModel, "RunContext"], "Artifact"]
TargetCheck = Callable[[StrictModel, Target], None]
# (this stage's config, the configs of the stages before it by name, target, model config or None) -> None; raises UsageError
PlanCheck = Callable[[StrictModel, dict[str, StrictModel], Target, "dict | None"], None]

_STAGE_MODULES = ("load", "distill", "prune_heads", "sparsify", "quantize", "export_onnx", "export_edgellm", "build_engine",
                  "validate", "prune_encoder_heads", "quantize_encoder", "export_encoder", "validate_encoder")


@dataclass(frozen=True)
class StageDef:
    """How to run one stage and what it connects to."""

    name: str
    summary: str
    input_kind: str | tuple[str, ...]
    output_kind: str
    config_cls: type[StrictModel]
    run: StageFn
    check_target: TargetCheck | None = None
    check_plan: PlanCheck | None = None
    uses_target: bool = False
    model_kinds: tuple[str, ...] = ("decoder",)  # the kinds of model the stage works on ("decoder", "encoder")

    def accepts(self, kind: str) -> bool:
        """Whether the stage takes an artifact of ``kind``."""
        return kind in self.input_kind if isinstance(self.input_kind, tuple) else kind == self.input_kind

    def make_config(self, options: dict) -> StrictModel:
        """Validate options; an unknown key or wrong type is a usage error naming it."""
        try:
            return self.config_cls.model_validate(options)
        except ValidationError as exc:
            raise UsageError(format_validation_error(exc, f"stage {self.name}")) from exc


_REGISTRY: dict[str, StageDef] = {}


def register(stage: StageDef) -> StageDef:
    """Add a stage to the registry (called once by each stage module)."""
    _REGISTRY[stage.name] = stage
    return stage


def all_stages() -> dict[str, StageDef]:
    """Every registered stage, by name, in pipeline order."""
    for module in _STAGE_MODULES:
        importlib.import_module(f"compress.stages.{module}")
    return dict(_REGISTRY)


def get_stage(name: str) -> StageDef:
    """Look up a stage by name."""
    stages = all_stages()
    if name not in stages:
        raise UsageError(f"unknown stage {name!r} (known: {', '.join(stages)})")
    return stages[name]
