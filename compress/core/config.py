"""Typed configuration: targets, recipes, run options and ``key=value`` overrides.

Every model here rejects unknown keys, so a typo in a YAML file or on the command line is
an error naming the key rather than a silently ignored setting.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    StringConstraints,
    ValidationError,
    model_validator,
)

from compress.catalog import RECIPES, TARGETS, catalog_dir
from compress.core.errors import UsageError


class StrictModel(BaseModel):
    """A pydantic model that rejects unknown keys, takes values only of their own type (no ``true`` for a number, no
    ``"5"`` for an integer), refuses infinite and NaN numbers, and re-validates on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, strict=True, allow_inf_nan=False)


# A name that becomes part of a file name or a shell word (targets, recipes, power modes): letters, digits, '.', '_',
# '-'.
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=100)]


class PowerMode(StrictModel):
    """One nvpmodel power mode (or a desktop power limit) and the clock caps it sets."""

    name: Name
    watts: PositiveFloat
    gpu_max_mhz: PositiveFloat
    emc_max_mhz: PositiveFloat = Field(description="memory (EMC) clock cap; bandwidth scales with it")


class Gpu(StrictModel):
    """The GPU of a target."""

    arch: Literal["ampere", "ada", "hopper", "blackwell"]
    sm: PositiveInt
    cuda_cores: PositiveInt
    tensor_cores: PositiveInt
    max_mhz: PositiveFloat
    precisions: list[Literal["fp32", "fp16", "bf16", "int8", "int4", "fp8", "fp4"]]


class Budgets(StrictModel):
    """What the validator enforces on this target."""

    max_ppl_increase_pct: PositiveFloat = Field(description="perplexity increase on the worst evaluation domain")
    min_top1_agreement: float = Field(
        0.85, gt=0.0, le=1.0, description="share of next-token argmax predictions equal to the reference model's"
    )
    max_mean_kl: PositiveFloat = Field(
        0.1, description="mean KL(reference || model) per token, nats, on the mixed evaluation text"
    )
    max_decode_latency_ms: PositiveFloat
    max_ttft_ms: PositiveFloat
    max_memory_gb: PositiveFloat
    context_length: PositiveInt = 2048
    prompt_length: PositiveInt = 128
    # The app's prompts (prompts=, the shipped set for chat models): greedy answers against the teacher's.
    min_answer_prefix_agreement: float = Field(
        0.35, ge=0.0, le=1.0, description="mean share of the teacher's answer matched before the first difference"
    )
    min_first_token_agreement: float = Field(
        0.8, ge=0.0, le=1.0, description="share of answers whose first token is the teacher's"
    )
    min_identical_answers: float = Field(
        0.05, ge=0.0, le=1.0, description="share of answers identical to the teacher's"
    )
    max_expect_pass_drop_pct: float = Field(
        10.0, ge=0.0, description="points lost on prompts whose answer must match 'expect'"
    )
    # Encoders (sentence embeddings, classifiers) against their fp32 model on the evaluation sentences.
    min_embedding_cosine: float = Field(
        0.99, gt=0.0, le=1.0, description="mean cosine similarity of embeddings to the fp32 model's"
    )
    min_embedding_cosine_worst: float = Field(
        0.95, gt=0.0, le=1.0, description="lowest cosine similarity over the sentences"
    )
    min_neighbour_agreement: float = Field(
        0.85, gt=0.0, le=1.0, description="mean overlap of each sentence's 5 nearest neighbours with the fp32 model's"
    )
    min_label_agreement: float = Field(
        0.98, gt=0.0, le=1.0, description="share of classifier labels equal to the fp32 model's"
    )
    max_accuracy_drop_pct: PositiveFloat = Field(
        1.0, description="accuracy lost on a labelled set (eval_labels=), points"
    )
    max_encoder_batch_ms: PositiveFloat = Field(20.0, description="one batch of encoder_batch sentences on the target")
    encoder_batch: PositiveInt = 8


class EdgeLLMStack(StrictModel):
    """The software a TensorRT Edge-LLM bundle for this target is built and run with."""

    version: str = Field(description="TensorRT Edge-LLM release the bundle is exported with")
    support: Literal["official", "compatible", "developer"] = Field(
        description="Edge-LLM's support level for the platform"
    )
    jetpack: str | None = None
    cuda: str
    tensorrt: str = Field(description="TensorRT version, or the package it comes from")
    embedded_target: str | None = Field(
        None, description="Edge-LLM's CMake EMBEDDED_TARGET for the C++ build on the device"
    )
    precisions: list[Literal["fp16", "int8", "int4", "fp8", "nvfp4"]]


class DefaultRecipe(StrictModel):
    """The recipe ``recipe=default`` runs for a decoder on a target, and why."""

    name: Name
    why: str


class Target(StrictModel):
    """A deployment target: hardware facts, power modes, TensorRT version and budgets."""

    name: Name
    description: str
    aliases: list[Name] = []
    kind: Literal["jetson", "desktop"]
    gpu: Gpu
    memory_gb: PositiveFloat
    memory_bandwidth_gbps: PositiveFloat
    emc_max_mhz: PositiveFloat
    int8_tops_dense: PositiveFloat
    int8_tops_sparse: PositiveFloat
    fp16_tflops_dense: PositiveFloat
    fp8_tflops_dense: PositiveFloat | None = Field(
        None, description="dense FP8 tensor-core rate, where the GPU has FP8"
    )
    fp4_tflops_dense: PositiveFloat | None = Field(
        None, description="dense FP4 (NVFP4) tensor-core rate, where the GPU has FP4"
    )
    dla_count: int = Field(ge=0)
    tensorrt_version: str
    jetpack: str | None = None
    edgellm: EdgeLLMStack
    power_modes: list[PowerMode] = Field(min_length=1)
    default_power_mode: str
    budgets: Budgets
    default_recipe: DefaultRecipe | None = Field(
        None, description="what recipe=default runs for a decoder here (else `default`)"
    )

    @model_validator(mode="after")
    def _check_modes(self) -> Target:
        names = [mode.name for mode in self.power_modes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate power mode names: {names}")
        if self.default_power_mode not in names:
            raise ValueError(f"default_power_mode {self.default_power_mode!r} is not one of {names}")
        if self.int8_tops_sparse < self.int8_tops_dense:
            raise ValueError("int8_tops_sparse must be at least int8_tops_dense")
        for rate, precision in ((self.fp8_tflops_dense, "fp8"), (self.fp4_tflops_dense, "fp4")):
            if (rate is not None) != (precision in self.gpu.precisions):
                raise ValueError(f"{precision}_tflops_dense is given exactly when gpu.precisions lists {precision}")
        return self

    def power_mode(self, name: str | None = None) -> PowerMode:
        """The named power mode, or the default one."""
        wanted = name or self.default_power_mode
        for mode in self.power_modes:
            if mode.name.lower() == wanted.lower():
                return mode
        raise UsageError(
            f"target {self.name} has no power mode {wanted!r} (modes: {', '.join(m.name for m in self.power_modes)})"
        )


class StageSpec(StrictModel):
    """One step of a recipe: a stage name and its options (validated by the stage)."""

    name: str
    options: dict[str, Any] = {}


class Recipe(StrictModel):
    """A named, ordered list of stages."""

    name: Name
    description: str = ""
    stages: list[StageSpec] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _expand_short_stages(cls, data: Any) -> Any:
        """Accept ``- load`` and ``- quantize: {method: int8}`` as stage entries."""
        if isinstance(data, dict) and isinstance(data.get("stages"), list):
            expanded = []
            for entry in data["stages"]:
                if isinstance(entry, str):
                    expanded.append({"name": entry})
                elif isinstance(entry, dict) and len(entry) == 1 and "name" not in entry:
                    (name, options), = entry.items()
                    expanded.append({"name": name, "options": options or {}})
                else:
                    expanded.append(entry)
            data = {**data, "stages": expanded}
        return data


def format_validation_error(exc: ValidationError, where: str) -> str:
    """One line naming the first offending key and the problem."""
    first = exc.errors()[0]
    loc = ".".join(str(part) for part in first["loc"]) or "(top level)"
    problem = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{where}: {loc}: {problem}{more}"


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, also reading ``1e-4`` and ``3.0e9`` as numbers (YAML 1.1 wants ``1.0e-4``, ``3.0e+9``)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                              list("-+0123456789."))


def load_yaml(path: Path) -> Any:
    """Parse a YAML file, turning syntax errors into a usage error."""
    try:
        return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_Loader)  # a SafeLoader: no Python objects
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from exc


def _yaml_files(kind: str) -> dict[str, Path]:
    return {path.stem: path for path in sorted(catalog_dir(kind).glob("*.yaml"))}


def available_targets() -> dict[str, Path]:
    """Target names (file stems) to their YAML files."""
    return _yaml_files(TARGETS)


def available_recipes() -> dict[str, Path]:
    """Recipe names (file stems) to their YAML files."""
    return _yaml_files(RECIPES)


def parse_target(data: Any, where: str) -> Target:
    """Validate a target mapping."""
    try:
        return Target.model_validate(data)
    except ValidationError as exc:
        raise UsageError(format_validation_error(exc, where)) from exc


def load_target(name_or_path: str) -> Target:
    """Load a target by name, alias, or YAML path."""
    path = Path(name_or_path)
    if path.suffix in {".yaml", ".yml"}:
        if not path.is_file():
            raise UsageError(f"target file not found: {path}")
        return parse_target(load_yaml(path), str(path))
    files = available_targets()
    if name_or_path in files:
        return parse_target(load_yaml(files[name_or_path]), str(files[name_or_path]))
    for file in files.values():
        target = parse_target(load_yaml(file), str(file))
        if name_or_path in target.aliases:
            return target
    raise UsageError(f"unknown target {name_or_path!r} (known: {', '.join(target_names())})")


def target_names() -> list[str]:
    """Every target name and alias."""
    names = []
    for file in available_targets().values():
        data = load_yaml(file) or {}
        names.append(str(data.get("name", file.stem)))
        names.extend(str(alias) for alias in data.get("aliases", []))
    return names


def load_recipe(name_or_path: str) -> Recipe:
    """Load a recipe by name or YAML path."""
    path = Path(name_or_path)
    if path.suffix in {".yaml", ".yml"}:
        if not path.is_file():
            raise UsageError(f"recipe file not found: {path}")
    else:
        files = available_recipes()
        if name_or_path not in files:
            raise UsageError(f"unknown recipe {name_or_path!r} (known: {', '.join(files)})")
        path = files[name_or_path]
    try:
        return Recipe.model_validate(load_yaml(path))
    except ValidationError as exc:
        raise UsageError(format_validation_error(exc, str(path))) from exc


def parse_override_value(raw: str) -> Any:
    """Turn the text after ``=`` into a YAML scalar (``5`` -> 5, ``true`` -> True, ``a`` -> "a")."""
    try:
        return yaml.load(raw, Loader=_Loader) if raw != "" else ""  # a SafeLoader: no Python objects
    except yaml.YAMLError:
        return raw


def split_overrides(items: list[str]) -> dict[str, str]:
    """Parse ``key=value`` words; a word without ``=``, or a key given twice, is a usage error."""
    result: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"expected key=value, got {item!r}")
        key = key.strip()
        if key in result:
            raise UsageError(f"{key}= is given twice ({key}={result[key]} and {key}={value}); give it once")
        result[key] = value
    return result


def select_power_mode(target: Target, power: str) -> PowerMode:
    """A mode by name, or the fastest mode within a watt budget such as ``15W``."""
    for mode in target.power_modes:
        if mode.name.lower() == power.lower():
            return mode
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*[wW]\s*", power)
    if not match:
        modes = ", ".join(m.name for m in target.power_modes)
        raise UsageError(f"power={power!r}: not a mode of {target.name} ({modes}) nor a budget like 15W")
    budget = float(match.group(1))
    within = [m for m in target.power_modes if m.watts <= budget]
    if not within:
        lowest = min(m.watts for m in target.power_modes)
        raise UsageError(f"power={power}: {target.name} has no mode within {budget:g} W (lowest is {lowest:g} W)")
    return max(within, key=lambda m: (m.watts, m.gpu_max_mhz))


def apply_budget_overrides(target: Target, overrides: dict[str, str]) -> Target:
    """The target with ``budgets.KEY=VALUE`` overrides applied and validated."""
    budgets = target.budgets.model_dump()
    for key, raw in overrides.items():
        budgets[key] = parse_override_value(raw)
    try:
        new_budgets = Budgets.model_validate(budgets)
    except ValidationError as exc:
        raise UsageError(format_validation_error(exc, "budgets")) from exc
    return target.model_copy(update={"budgets": new_budgets})
