"""Planning a run: resolve the target, recipe, model, data and overrides, and check the whole plan before any work.

:func:`build_plan` turns ``compress run``'s options into a :class:`Plan`: every stage exists and
connects to the one before, works on this kind of model and has valid options; what the target or
the deployment runtime cannot run is refused naming the rule; the run directory may be written;
and every stage gets a fingerprint (its config, its data, everything upstream), so a rerun reuses
exactly the stages whose inputs did not change. Every problem is a one-line :class:`UsageError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compress.backends.edgellm.env import EDGELLM_VERSION
from compress.core.artifact import EDGELLM_BUNDLE, SOURCE
from compress.core.config import (
    Recipe,
    Target,
    apply_budget_overrides,
    load_recipe,
    load_target,
    parse_override_value,
    select_power_mode,
)
from compress.core.devices import resolve_device
from compress.core.errors import UsageError
from compress.core.files import sha256_path
from compress.core.rundir import ARTIFACT_LAYOUT, check_run_dir, plan_identity, stage_dirname
from compress.core.text import (
    DEFAULT_CALIBRATION,
    DEFAULT_EVALUATION,
    TextSource,
    TrainingData,
    check_disjoint,
    load_calibration,
    load_evaluation,
    split_paths,
    unseen_domains,
)
from compress.core.versions import __version__
from compress.eval.prompts import PROMPTS_OFF, load_prompts
from compress.models.config_file import ModelConfig
from compress.models.families import check_model_dimensions, family_of, model_kind, supported_model_types
from compress.models.sources import (
    DEFAULT_MODEL,
    ModelSource,
    check_tokenizer_files,
    model_config,
    model_files,
    model_sha256,
    resolve_model,
    tokenizer_size,
)
from compress.pipeline.auto_precision import candidate_formats
from compress.pipeline.resources import Machine, StageEstimate, estimate_stages, fit_problem, parameter_count
from compress.pipeline.stage import DECODER, RunContext, StageDef, StageVariant, all_stages, get_stage
from compress.transforms.quantize.config import AutoConfig

log = logging.getLogger("compress")

OFF = "off"
RUN_KEYS = (
    "target",
    "recipe",
    "model",
    "out",
    "calib",
    "eval",
    "train_data",
    "prompts",
    "eval_labels",
    "power",
    "seed",
    "trust_remote_code",
    "device",
)
# What recipe=default means for each kind of model.
DEFAULT_RECIPES = {"decoder": "default", "encoder": "encoder-int8"}


def config_json(config: Any) -> dict[str, Any]:
    """A stage config as plain JSON (what fingerprints, manifests and ``--dry-run`` show)."""
    return config.model_dump(mode="json")


@dataclass(frozen=True)
class RunOptions:
    """Everything ``compress run`` accepts: the run keys and ``stage.option`` / ``budgets.key`` overrides."""

    target: str
    recipe: str = "default"
    model: str = DEFAULT_MODEL
    out: Path | None = None
    calib: str | None = None
    eval: str | None = None
    train_data: str | None = None
    prompts: str | None = None
    eval_labels: str | None = None
    power: str | None = None
    seed: int = 0
    trust_remote_code: bool = False
    device: str = "auto"
    overrides: dict[str, str] = field(default_factory=dict)
    off: tuple[str, ...] = ()  # ``STAGE=off``: optional stages of the recipe left out
    require_measured: bool = False
    progress: bool = True
    dry_run: bool = False
    force: bool = False

    @classmethod
    def from_pairs(cls, pairs: dict[str, str], **flags: Any) -> RunOptions:
        """Split ``key=value`` pairs into run keys and stage/budget overrides."""
        run_values: dict[str, Any] = {}
        overrides: dict[str, str] = {}
        off: list[str] = []
        for key, value in pairs.items():
            if key in RUN_KEYS:
                run_values[key] = value
            elif "." in key:
                overrides[key] = value
            elif key in all_stages():
                if value != OFF:
                    raise UsageError(
                        f"{key}={value}: a stage takes only {key}={OFF} (its options are {key}.OPTION=VALUE)"
                    )
                off.append(key)
            else:
                raise UsageError(
                    f"unknown override key {key!r} (run keys: {', '.join(RUN_KEYS)}; or stage.option, budgets.key, "
                    "STAGE=off)"
                )
        if "target" not in run_values:
            raise UsageError("missing target=NAME (see `compress ls targets`)")
        if "out" in run_values:
            run_values["out"] = Path(run_values["out"])
        for key, kind in (("seed", int), ("trust_remote_code", bool)):
            if key in run_values:
                value = parse_override_value(run_values[key])
                if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                    raise UsageError(f"{key}={run_values[key]!r}: expected {kind.__name__}")
                run_values[key] = value
        return cls(**run_values, overrides=overrides, off=tuple(off), **flags)


@dataclass
class PlannedStage:
    """A stage of the plan with its validated config and fingerprint."""

    index: int
    stage: StageDef
    config: Any
    model_kind: str
    fingerprint: str = ""

    @property
    def dirname(self) -> str:
        return stage_dirname(self.index, self.stage.name)

    @property
    def variant(self) -> StageVariant:
        """The stage's variant for the plan's model kind (checked when the plan was built)."""
        return self.stage.variants[self.model_kind]


@dataclass
class Plan:
    """A fully resolved, checked run."""

    options: RunOptions
    target: Target
    power_mode: str
    recipe: Recipe
    model: ModelSource
    calibration: list[TextSource]
    evaluation: list[TextSource]
    stages: list[PlannedStage]
    out_dir: Path
    train_data: TrainingData | None = None
    model_sha256: str = ""  # the content of the model files (what every fingerprint starts from)
    device: str = "cpu"  # the torch device the heavy work runs on (``device=`` resolved)
    estimates: list[StageEstimate] = field(default_factory=list)  # each stage's expected memory, disk and time
    fit_problem: str | None = None  # why the run cannot fit this machine (a dry run reports it, a run is refused)

    @property
    def unseen_domains(self) -> list[str]:
        """Evaluation domains no calibration or training text came from."""
        seen = self.calibration + (self.train_data.sample if self.train_data else [])
        return unseen_domains(seen, self.evaluation)

    @property
    def model_kind(self) -> str:
        return self.stages[0].model_kind if self.stages else DECODER

    def context(self, run_dir: Path) -> RunContext:
        """What the stages of this plan may read, for a run in ``run_dir``."""
        options = self.options
        return RunContext(run_dir=run_dir, stage_dir=run_dir, target=self.target, power_mode=self.power_mode,
                          model_spec=self.model.spec, model_source=self.model, calibration=self.calibration,
                          evaluation=self.evaluation, unseen_domains=self.unseen_domains,
                          trust_remote_code=options.trust_remote_code,
                          eval_labels=Path(options.eval_labels) if options.eval_labels else None,
                          require_measured=options.require_measured, progress=options.progress, device=self.device,
                          prompts=options.prompts, train_data=self.train_data.specs if self.train_data else [])

    @property
    def identity(self) -> dict[str, Any]:
        """Recipe, model and stage list: a run directory holding another identity is another plan's."""
        return plan_identity(self.recipe.model_dump(mode="json"), self.model.spec)

    def describe(self) -> dict[str, Any]:
        """The resolved configuration and stage plan, as printed by ``--dry-run``."""
        description = {
            "target": self.target.name,
            "power_mode": self.power_mode,
            "budgets": self.target.budgets.model_dump(),
            "device": self.device,
            "recipe": self.recipe.name,
            "model": {
                "spec": self.model.spec,
                "kind": self.model.kind,
                "path": str(self.model.path),
                "sha256": self.model_sha256,
            },
            "out": str(self.out_dir),
            "calibration": [{"domain": s.domain, "path": str(s.path)} for s in self.calibration],
            "evaluation": [
                {"domain": s.domain, "path": str(s.path), "seen": s.domain not in self.unseen_domains}
                for s in self.evaluation
            ],
            "train_data": [str(spec) for spec in self.train_data.specs] if self.train_data else None,
            "prompts": self.options.prompts
            or "default (the shipped assistant prompts, for a model with a chat template)",
            "stages": [
                {
                    "dir": p.dirname,
                    "name": p.stage.name,
                    "input": p.stage.input_kind,
                    "output": p.stage.output_kind,
                    "config": config_json(p.config),
                }
                for p in self.stages
            ],
            "estimates": [e.to_json() for e in self.estimates],
            "fits_this_machine": self.fit_problem is None,
        }
        if self.fit_problem:
            description["fit_problem"] = self.fit_problem
        described = [
            (p, e) for p, e in zip(self.stages, description["stages"], strict=True) if p.variant.describe is not None
        ]
        config = model_config(self.model) if described else None
        for planned, entry in described if config is not None else ():
            entry["plan"] = planned.variant.describe(planned.config, config, self.target)
        return description


def _stage_options(recipe: Recipe, overrides: dict[str, str]
                   ) -> tuple[dict[str, dict[str, Any]], dict[str, set[str]], dict[str, str]]:
    """Each stage's options (the recipe's, then the command line's), the keys the command line gave, and the budget
    overrides."""
    options = {spec.name: dict(spec.options) for spec in recipe.stages}
    explicit: dict[str, set[str]] = {name: set() for name in options}
    budget_overrides: dict[str, str] = {}
    for key, raw in overrides.items():
        scope, _, option = key.partition(".")
        if scope == "budgets":
            budget_overrides[option] = raw
        elif scope not in options:
            raise UsageError(
                f"override {key!r}: stage {scope!r} is not in recipe {recipe.name!r} (stages: {', '.join(options)})"
            )
        else:
            options[scope][option] = parse_override_value(raw)
            explicit[scope].add(option)
    return options, explicit, budget_overrides


def without_stages(recipe: Recipe, off: tuple[str, ...]) -> Recipe:
    """``recipe`` with the optional stages ``off`` names left out (``export_onnx=off``: the bundle ships, not the
    ONNX)."""
    names = [spec.name for spec in recipe.stages]
    for name in off:
        if name not in names:
            raise UsageError(
                f"{name}={OFF}: stage {name} is not in recipe {recipe.name!r} (stages: {', '.join(names)})"
            )
        if not get_stage(name).optional:
            optional = [n for n in names if get_stage(n).optional]
            raise UsageError(f"{name}={OFF}: stage {name} cannot be left out of recipe {recipe.name!r}"
                             + (f" (optional: {', '.join(optional)})" if optional else " (it has no optional stage)"))
    if not off:
        return recipe
    return recipe.model_copy(update={"stages": [spec for spec in recipe.stages if spec.name not in off]})


def default_out_dir(options: RunOptions, target: Target, recipe: Recipe) -> Path:
    """``runs/<target>-<recipe>-<model>``: the same command always means the same folder, so reruns resume."""
    model_name = Path(options.model).stem if options.model not in ("", DEFAULT_MODEL) else DEFAULT_MODEL
    return Path("runs") / f"{target.name}-{recipe.name}-{model_name}"


def build_plan(options: RunOptions) -> Plan:
    """Resolve and check everything before any work; every problem is a :class:`UsageError`."""
    target = load_target(options.target)
    model = resolve_model(
        options.model, weights_required=not options.dry_run, trust_remote_code=options.trust_remote_code
    )
    recipe = without_stages(
        load_recipe(_default_recipe(target, model) if options.recipe == "default" else options.recipe), options.off
    )
    stage_options, explicit, budget_overrides = _stage_options(recipe, options.overrides)
    if budget_overrides:
        target = apply_budget_overrides(target, budget_overrides)
    power_mode = (select_power_mode(target, options.power) if options.power else target.power_mode()).name
    config = model_config(model)
    if config is not None:
        _check_model_config(config, model)
    planned = _check_stage_chain(
        recipe, (stage_options, explicit), target, _Model(model_kind(config or {}), model.spec, config), options.off
    )
    out_dir = options.out or default_out_dir(options, target, recipe)
    if options.eval_labels is not None and not Path(options.eval_labels).is_file():
        raise UsageError(f"eval_labels={options.eval_labels}: no such file")
    calibration = load_calibration(split_paths(options.calib, DEFAULT_CALIBRATION))
    evaluation = load_evaluation(split_paths(options.eval, DEFAULT_EVALUATION))
    evaluated_tokens = max((getattr(p.config, "eval_tokens", 0) for p in planned), default=0) or 2048
    check_disjoint(calibration, evaluation, evaluated_tokens)
    train_data = _training_data(options, planned)
    if train_data is not None:
        check_disjoint(train_data.sample, evaluation, evaluated_tokens)
    if options.prompts and options.prompts != PROMPTS_OFF:
        load_prompts(Path(options.prompts))
    device = resolve_device(options.device)
    estimates = _estimates(planned, model, config, device, target, len(evaluation))
    problem = fit_problem(estimates, Machine.here(out_dir, device), model.spec)
    if problem and not options.dry_run:
        raise UsageError(problem)  # before the model's files are hashed: a model too large to run is not read
    plan = Plan(options, target, power_mode, recipe, model, calibration, evaluation, planned, out_dir, train_data,
                model_sha256(model), device, estimates, problem)
    check_run_dir(out_dir, plan.identity, options.force)
    _check_plan_rules(planned, target, model, config)
    _assign_fingerprints(plan)
    return plan


def _training_data(options: RunOptions, planned: list[PlannedStage]) -> TrainingData | None:
    """``train_data=``, checked and sampled for the overlap check, for a recipe that trains (refused for one that does
    not)."""
    if not options.train_data:
        return None
    if not any(p.stage.name == "distill" for p in planned):
        raise UsageError(f"train_data={options.train_data}: the recipe has no distill stage to train with it")
    return TrainingData.read(split_paths(options.train_data, ()))


def _estimates(planned: list[PlannedStage], model: ModelSource, config: ModelConfig | None, device: str,
               target: Target, domains: int) -> list[StageEstimate]:
    """Each stage's expected memory, disk and time (none for a model without a config, a GGUF read later, nor for a
    decoder family compress does not describe, which the plan's rules refuse naming it)."""
    if config is None or (model_kind(config) == DECODER and config.get("model_type") not in supported_model_types()):
        return []
    searches = [p.config for p in planned if isinstance(p.config, AutoConfig)]
    formats = len(candidate_formats(searches[0], target)) if searches else 0
    return estimate_stages(
        [(p.stage.name, p.config) for p in planned],
        config,
        _checkpoint_bytes(model, config),
        device,
        search_formats=formats,
        evaluation_domains=domains,
    )


def _checkpoint_bytes(model: ModelSource, config: dict[str, Any]) -> float:
    """Bytes of the model's weights on disk (two per parameter where a dry run was given a config alone)."""
    if model.kind == "gguf":
        return 4.0 * parameter_count(config)  # the run copies the float32 conversion
    files = [p for p in model_files(model.path) if p.suffix in (".safetensors", ".bin")]
    return float(sum(p.stat().st_size for p in files)) or 2.0 * parameter_count(config)


def _check_model_config(config: ModelConfig, model: ModelSource) -> None:
    """Sane dimensions, and an embedding with a row for every id the tokenizer makes (else evaluation indexes past
    it)."""
    check_model_dimensions(config, f"model={model.spec}")
    if model.kind == "hf-folder":
        check_tokenizer_files(model.path, model.spec)
    tokens = tokenizer_size(model.path) if model.kind == "hf-folder" else None
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if tokens is not None and vocab is not None and tokens > vocab:
        raise UsageError(
            f"model={model.spec}: the tokenizer makes {tokens:,} token ids but the embedding has {vocab:,} rows "
            "(vocab_size in config.json); the model cannot read its own tokens"
        )


def _default_recipe(target: Target, model: ModelSource) -> str:
    """What ``recipe=default`` means: the target's own default for a decoder where it names one, else the model
    kind's."""
    kind = model_kind(model_config(model) or {})
    if kind == "decoder" and target.default_recipe is not None:
        log.info(
            "recipe=default on %s: %s, because %s", target.name, target.default_recipe.name, target.default_recipe.why
        )
        return target.default_recipe.name
    if DEFAULT_RECIPES[kind] != "default":
        log.info("recipe=default for %s %s: %s", _article(kind), kind, DEFAULT_RECIPES[kind])
    return DEFAULT_RECIPES[kind]


@dataclass(frozen=True)
class _Model:
    """The model a plan is checked for: its kind (decoder or encoder), how the user named it, its config."""

    kind: str
    spec: str
    config: ModelConfig | None


def _check_stage_chain(recipe: Recipe, options: tuple[dict[str, dict[str, Any]], dict[str, set[str]]], target: Target,
                       model: _Model, off: tuple[str, ...] = ()) -> list[PlannedStage]:
    """Every stage exists, appears once, takes what the step before gives, works on this kind of model, and has valid
    options the target can run (``options``: each stage's options and the keys the user gave explicitly; ``off``: the
    stages the command line left out, named when the chain breaks)."""
    stage_options, explicit = options
    kind = model.kind
    label = f"recipe {recipe.name}" + (f" with {', '.join(f'{name}={OFF}' for name in off)}" if off else "")
    planned: list[PlannedStage] = []
    previous_kind = SOURCE
    seen: set[str] = set()
    for index, spec in enumerate(recipe.stages, start=1):
        stage = get_stage(spec.name)
        if spec.name in seen:
            raise UsageError(f"recipe {recipe.name}: stage {spec.name} appears twice")
        seen.add(spec.name)
        if not stage.accepts(previous_kind, kind):
            raise UsageError(
                f"{label}: stage {spec.name} takes {' or '.join(stage.takes(kind))} but the step before it gives "
                f"{previous_kind}"
            )
        variant = stage.variant(kind)
        if variant is None:
            raise _wrong_kind(stage, stage.model_kinds, model)
        try:
            stage_config = variant.make_config(f"stage {spec.name}", stage_options[spec.name], explicit[spec.name])
        except UsageError:
            fits = [
                other
                for other, v in stage.variants.items()
                if other != kind and _validates(v, stage_options[spec.name])
            ]
            if fits:  # the recipe's options are those of another kind of model's stage
                raise _wrong_kind(stage, tuple(fits), model) from None
            raise
        if variant.check_target is not None:
            variant.check_target(stage_config, target)
        planned.append(PlannedStage(index, stage, stage_config, kind))
        previous_kind = stage.output_kind
    return planned


def _wrong_kind(stage: StageDef, kinds: tuple[str, ...], model: _Model) -> UsageError:
    works_on = " and ".join(f"{k}s" for k in kinds)
    kind = model.kind
    return UsageError(
        f"stage {stage.name} works on {works_on}; model={model.spec} is {_article(kind)} {kind} "
        f"({(model.config or {}).get('model_type')}): use {_article(kind)} {kind} recipe (recipe=default picks "
        f"{DEFAULT_RECIPES[kind]})"
    )


def _validates(variant: StageVariant, options: dict[str, Any]) -> bool:
    try:
        variant.make_config("", options)
    except UsageError:
        return False
    return True


def _check_plan_rules(planned: list[PlannedStage], target: Target, model: ModelSource, config: ModelConfig | None
                      ) -> None:
    """Stage rules that depend on the stages before them or on the model's shape (e.g. what a deployment format
    takes)."""
    if config is not None and model_kind(config) == DECODER:
        try:
            family_of(config)
        except UsageError as exc:
            raise UsageError(f"model={model.spec}: {exc}") from exc
    # The last stages' rules first: what the deployment takes is the most specific reason to refuse a plan.
    for index in reversed(range(len(planned))):
        stage = planned[index]
        if stage.variant.check_plan is not None:
            earlier = {p.stage.name: p.config for p in planned[:index]}
            stage.variant.check_plan(stage.config, earlier, target, config)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _assign_fingerprints(plan: Plan) -> None:
    upstream = hashlib.sha256(
        json.dumps({"model_sha256": plan.model_sha256, "model_spec": plan.model.spec, "version": __version__,
                    "layout": ARTIFACT_LAYOUT}).encode()
    ).hexdigest()
    data_hashes = [s.sha256 for s in plan.calibration] + [s.sha256 for s in plan.evaluation]
    data_hashes += plan.train_data.sha256 if plan.train_data else []
    prompts = plan.options.prompts
    prompts_hash = sha256_path(Path(prompts)) if prompts and prompts != PROMPTS_OFF else prompts
    for planned in plan.stages:
        material = {
            "upstream": upstream,
            "stage": planned.stage.name,
            "config": config_json(planned.config),
            "data": data_hashes,
            "seed": plan.options.seed,
        }
        if planned.stage.uses_target:
            material["target"] = plan.target.model_dump(mode="json")
            material["power_mode"] = plan.power_mode
            material["require_measured"] = plan.options.require_measured
            material["prompts"] = prompts_hash
            if plan.options.eval_labels:
                material["eval_labels"] = sha256_path(Path(plan.options.eval_labels))
        upstream = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
        planned.fingerprint = upstream


def deployment_versions(plan: Plan) -> dict[str, str]:
    """The pinned TensorRT Edge-LLM release and the device stack a run's bundle is for (only when the run exports
    one)."""
    if not any(p.stage.output_kind == EDGELLM_BUNDLE for p in plan.stages):
        return {}
    stack = plan.target.edgellm
    device = (
        f"JetPack {stack.jetpack}, CUDA {stack.cuda}"
        if stack.jetpack
        else f"CUDA {stack.cuda}, TensorRT {stack.tensorrt}"
    )
    return {"tensorrt-edgellm": EDGELLM_VERSION, "edgellm-device-stack": device}


def data_record(plan: Plan) -> dict[str, Any]:
    """The calibration and evaluation text of a run: domain, path and hash of each file, and the unseen domains."""
    def entries(sources: list[TextSource]) -> list[dict[str, str]]:
        return [{"domain": s.domain, "path": str(s.path), "sha256": s.sha256} for s in sources]

    record = {
        "calibration": entries(plan.calibration),
        "evaluation": entries(plan.evaluation),
        "unseen_domains": plan.unseen_domains,
    }
    if plan.train_data:
        record["train_data"] = [
            {"path": str(spec), "sha256": digest}
            for spec, digest in zip(plan.train_data.specs, plan.train_data.sha256, strict=True)
        ]
    if plan.options.prompts:
        record["prompts"] = plan.options.prompts
    return record
