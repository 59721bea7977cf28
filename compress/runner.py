"""Plan checking, execution, fingerprints, resume and the manifest.

A run is a plan of stages. :func:`build_plan` resolves the target, recipe, model, data and
overrides and checks the whole plan before any work. :func:`execute` runs it stage by stage;
every stage writes into a staging folder renamed to ``NN_stage/`` only once its ``stage.json``
is written, so a killed run leaves nothing half-written and a rerun reuses finished stages.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import platform
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from compress import __version__
from compress.artifact import SOURCE, Artifact
from compress.config import Budgets, Recipe, StrictModel, Target, format_validation_error, load_recipe, load_target, parse_override_value
from compress.data import (
    DEFAULT_CALIBRATION,
    DEFAULT_EVALUATION,
    TextSource,
    check_disjoint,
    load_calibration,
    load_evaluation,
    split_paths,
    unseen_domains,
)
from compress.errors import CompressError, StageError, UsageError, raise_pending_interrupt
from compress.families import check_attention_window, family_of, model_kind
from compress.fsutil import atomic_write_json, disk_write_error, is_disk_write_error, read_json, sha256_path, staging_dir, written_path
from compress.models import DEFAULT_MODEL, ModelSource, model_config, resolve_model
from compress.predict_cli import select_power_mode
from compress.rundir import RunDirLock, check_run_dir, clean_for_run, plan_identity
from compress.stages import StageDef, get_stage

log = logging.getLogger("compress")

MANIFEST_SCHEMA = "1.0"
RUN_KEYS = ("target", "recipe", "model", "out", "calib", "eval", "eval_labels", "power", "seed", "trust_remote_code")
# What recipe=default means for each kind of model.
DEFAULT_RECIPES = {"decoder": "default", "encoder": "encoder-int8"}
_TRACKED_LIBRARIES = ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "numpy", "safetensors", "tensorrt")


@dataclass(frozen=True)
class RunOptions:
    """Everything ``compress run`` accepts: the run keys and ``stage.option`` / ``budgets.key`` overrides."""

    target: str
    recipe: str = "default"
    model: str = DEFAULT_MODEL
    out: Path | None = None
    calib: str | None = None
    eval: str | None = None
    eval_labels: str | None = None
    power: str | None = None
    seed: int = 0
    trust_remote_code: bool = False
    overrides: dict[str, str] = field(default_factory=dict)
    require_measured: bool = False
    progress: bool = True
    dry_run: bool = False
    force: bool = False

    @classmethod
    def from_pairs(cls, pairs: dict[str, str], **flags: Any) -> RunOptions:
        """Split ``key=value`` pairs into run keys and stage/budget overrides."""
        run_values: dict[str, Any] = {}
        overrides: dict[str, str] = {}
        for key, value in pairs.items():
            if key in RUN_KEYS:
                run_values[key] = value
            elif "." in key:
                overrides[key] = value
            else:
                raise UsageError(f"unknown override key {key!r} (run keys: {', '.join(RUN_KEYS)}; or stage.option, budgets.key)")
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
        return cls(**run_values, overrides=overrides, **flags)


@dataclass
class PlannedStage:
    """A stage of the plan with its validated config and fingerprint."""

    index: int
    stage: StageDef
    config: StrictModel
    fingerprint: str = ""

    @property
    def dirname(self) -> str:
        return f"{self.index:02d}_{self.stage.name}"


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

    @property
    def unseen_domains(self) -> list[str]:
        """Evaluation domains no calibration or training text came from."""
        return unseen_domains(self.calibration, self.evaluation)

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
            "recipe": self.recipe.name,
            "model": {"spec": self.model.spec, "kind": self.model.kind, "path": str(self.model.path)},
            "out": str(self.out_dir),
            "calibration": [{"domain": s.domain, "path": str(s.path)} for s in self.calibration],
            "evaluation": [{"domain": s.domain, "path": str(s.path), "seen": s.domain not in self.unseen_domains}
                           for s in self.evaluation],
            "stages": [
                {"dir": p.dirname, "name": p.stage.name, "input": p.stage.input_kind, "output": p.stage.output_kind,
                 "config": p.config.model_dump(mode="json")}
                for p in self.stages
            ],
        }
        distill = [(p, e) for p, e in zip(self.stages, description["stages"], strict=True) if p.stage.name == "distill"]
        config = model_config(self.model) if distill else None
        if config is not None:
            from compress.distillation import plan_from_config

            for planned, entry in distill:
                entry["plan"] = plan_from_config(config, planned.config, gpu_memory_gb=self.target.memory_gb)
        return description


@dataclass
class RunContext:
    """What a stage may read besides its input artifact."""

    plan: Plan
    run_dir: Path
    stage_dir: Path
    artifacts: dict[str, Artifact]
    progress: bool = True
    stage_name: str = ""
    fingerprint: str = ""

    @property
    def target(self) -> Target:
        return self.plan.target

    def first_artifact(self, kind: str) -> Artifact | None:
        """The earliest artifact of a kind (e.g. the teacher ``hf-model``)."""
        return next((a for a in self.artifacts.values() if a.kind == kind), None)

    def last_artifact(self, kind: str) -> Artifact | None:
        """The latest artifact of a kind (e.g. the model an export was made from)."""
        return next((a for a in reversed(self.artifacts.values()) if a.kind == kind), None)


@dataclass
class StageRecord:
    """What the runner learned running (or reusing) one stage."""

    name: str
    dirname: str
    status: str
    artifact: Artifact
    record: dict[str, Any]


@dataclass
class RunResult:
    """The outcome of a run."""

    run_dir: Path
    stages: list[StageRecord]
    report: dict[str, Any]
    exit_code: int


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


def _stage_options(recipe: Recipe, overrides: dict[str, str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    options = {spec.name: dict(spec.options) for spec in recipe.stages}
    budget_overrides: dict[str, str] = {}
    for key, raw in overrides.items():
        scope, _, option = key.partition(".")
        if scope == "budgets":
            budget_overrides[option] = raw
        elif scope not in options:
            raise UsageError(f"override {key!r}: stage {scope!r} is not in recipe {recipe.name!r} (stages: {', '.join(options)})")
        else:
            options[scope][option] = parse_override_value(raw)
    return options, budget_overrides


def default_out_dir(options: RunOptions, target: Target, recipe: Recipe) -> Path:
    """``runs/<target>-<recipe>-<model>``: the same command always means the same folder, so reruns resume."""
    model_name = Path(options.model).stem if options.model not in ("", DEFAULT_MODEL) else DEFAULT_MODEL
    return Path("runs") / f"{target.name}-{recipe.name}-{model_name}"


def build_plan(options: RunOptions) -> Plan:
    """Resolve and check everything before any work; every problem is a :class:`UsageError`."""
    target = load_target(options.target)
    model = resolve_model(options.model, weights_required=not options.dry_run, trust_remote_code=options.trust_remote_code)
    recipe = load_recipe(_default_recipe(target, model) if options.recipe == "default" else options.recipe)
    stage_options, budget_overrides = _stage_options(recipe, options.overrides)
    if budget_overrides:
        target = apply_budget_overrides(target, budget_overrides)
    power_mode = (select_power_mode(target, options.power) if options.power else target.power_mode()).name
    planned = _check_stage_chain(recipe, stage_options, target)
    out_dir = options.out or default_out_dir(options, target, recipe)
    if options.eval_labels is not None and not Path(options.eval_labels).is_file():
        raise UsageError(f"eval_labels={options.eval_labels}: no such file")
    calibration = load_calibration(split_paths(options.calib, DEFAULT_CALIBRATION))
    evaluation = load_evaluation(split_paths(options.eval, DEFAULT_EVALUATION))
    check_disjoint(calibration, evaluation)
    plan = Plan(options, target, power_mode, recipe, model, calibration, evaluation, planned, out_dir)
    check_run_dir(out_dir, plan.identity, options.force)
    _check_plan_rules(planned, target, model)
    _assign_fingerprints(plan)
    return plan


def _default_recipe(target: Target, model: ModelSource) -> str:
    """What ``recipe=default`` means: the target's own default for a decoder where it names one, else the model kind's."""
    kind = model_kind(model_config(model) or {})
    if kind == "decoder" and target.default_recipe is not None:
        log.info("recipe=default on %s: %s, because %s", target.name, target.default_recipe.name, target.default_recipe.why)
        return target.default_recipe.name
    if DEFAULT_RECIPES[kind] != "default":
        log.info("recipe=default for %s %s: %s", _article(kind), kind, DEFAULT_RECIPES[kind])
    return DEFAULT_RECIPES[kind]


def _check_stage_chain(recipe: Recipe, stage_options: dict[str, dict[str, Any]], target: Target) -> list[PlannedStage]:
    planned: list[PlannedStage] = []
    previous_kind = SOURCE
    seen: set[str] = set()
    for index, spec in enumerate(recipe.stages, start=1):
        stage = get_stage(spec.name)
        if spec.name in seen:
            raise UsageError(f"recipe {recipe.name}: stage {spec.name} appears twice")
        seen.add(spec.name)
        if not stage.accepts(previous_kind):
            raise UsageError(
                f"recipe {recipe.name}: stage {spec.name} takes {_kinds(stage.input_kind)} but the step before it gives {previous_kind}"
            )
        config = stage.make_config(stage_options[spec.name])
        if stage.check_target is not None:
            stage.check_target(config, target)
        planned.append(PlannedStage(index, stage, config))
        previous_kind = stage.output_kind
    return planned


def _check_plan_rules(planned: list[PlannedStage], target: Target, model: ModelSource) -> None:
    """Stage rules that depend on the stages before them or on the model's shape (e.g. what a deployment format takes)."""
    config = model_config(model)
    kind = model_kind(config or {})
    if config is not None and kind == "decoder":
        try:
            family_of(config)
            check_attention_window(config, target.budgets.context_length)
        except UsageError as exc:
            raise UsageError(f"model={model.spec}: {exc}") from exc
    earlier: dict[str, StrictModel] = {}
    for stage in planned:
        if kind not in stage.stage.model_kinds:
            kinds = " and ".join(f"{k}s" for k in stage.stage.model_kinds)
            raise UsageError(f"stage {stage.stage.name} works on {kinds}; model={model.spec} is {_article(kind)} {kind} "
                             f"({(config or {}).get('model_type')}): use {_article(kind)} {kind} recipe (recipe=default picks "
                             f"{DEFAULT_RECIPES[kind]})")
        if stage.stage.check_plan is not None:
            stage.stage.check_plan(stage.config, earlier, target, config)
        earlier[stage.stage.name] = stage.config


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _kinds(kind: str | tuple[str, ...]) -> str:
    return " or ".join(kind) if isinstance(kind, tuple) else kind


def _assign_fingerprints(plan: Plan) -> None:
    upstream = hashlib.sha256(
        json.dumps({"model": str(plan.model.path), "model_spec": plan.model.spec, "version": __version__}).encode()
    ).hexdigest()
    data_hashes = [s.sha256 for s in plan.calibration] + [s.sha256 for s in plan.evaluation]
    for planned in plan.stages:
        material = {
            "upstream": upstream,
            "stage": planned.stage.name,
            "config": planned.config.model_dump(mode="json"),
            "data": data_hashes,
            "seed": plan.options.seed,
        }
        if planned.stage.uses_target:
            material["target"] = plan.target.model_dump(mode="json")
            material["power_mode"] = plan.power_mode
            material["require_measured"] = plan.options.require_measured
            if plan.options.eval_labels:
                material["eval_labels"] = sha256_path(Path(plan.options.eval_labels))
        upstream = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
        planned.fingerprint = upstream


def library_versions() -> dict[str, str]:
    """Versions of the libraries a result depends on."""
    versions = {"compress": __version__, "python": platform.python_version()}
    for name in _TRACKED_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def deployment_versions(plan: Plan) -> dict[str, str]:
    """The pinned TensorRT Edge-LLM release and the device stack a run's bundle is for (only when the run exports one)."""
    if not any(p.stage.name == "export_edgellm" for p in plan.stages):
        return {}
    from compress.deploy.edgellm import EDGELLM_VERSION

    stack = plan.target.edgellm
    device = f"JetPack {stack.jetpack}, CUDA {stack.cuda}" if stack.jetpack else f"CUDA {stack.cuda}, TensorRT {stack.tensorrt}"
    return {"tensorrt-edgellm": EDGELLM_VERSION, "edgellm-device-stack": device}


def _reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _peak_rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reuse(stage_dir: Path, fingerprint: str) -> tuple[Artifact, dict[str, Any]] | None:
    record_path = stage_dir / "stage.json"
    if not record_path.is_file():
        return None
    try:
        record = read_json(record_path)
    except (OSError, ValueError):
        return None
    if record.get("fingerprint") != fingerprint or record.get("status") not in ("done", "deferred"):
        return None
    artifact = Artifact.from_json(record["output"], base=stage_dir)
    if not artifact.path.exists() or sha256_path(artifact.path) != record["output"]["sha256"]:
        log.warning("%s: stored output does not match its recorded hash; redoing the stage", stage_dir.name)
        return None
    return artifact, record


def _run_stage(planned: PlannedStage, previous: Artifact, ctx: RunContext, final_dir: Path) -> tuple[Artifact, dict[str, Any]]:
    with staging_dir(final_dir) as tmp:
        ctx.stage_dir = tmp
        ctx.stage_name = planned.dirname
        ctx.fingerprint = planned.fingerprint
        _reset_peak_rss()
        started = time.perf_counter()
        artifact = planned.stage.run(previous, planned.config, ctx)
        raise_pending_interrupt()  # a signal whose exception was dropped mid-stage still stops the run here
        duration = time.perf_counter() - started
        relative = Path(artifact.path).resolve().relative_to(tmp.resolve())
        output_sha = sha256_path(artifact.path)
        status = "deferred" if artifact.meta.get("deferred") else "done"
        record = {
            "stage": planned.stage.name,
            "status": status,
            "fingerprint": planned.fingerprint,
            "config": planned.config.model_dump(mode="json"),
            "input": {"kind": previous.kind, "path": str(previous.path), "sha256": previous.sha256},
            "output": {"kind": artifact.kind, "path": str(relative), "meta": artifact.meta, "sha256": output_sha},
            "duration_s": round(duration, 3),
            "peak_rss_mb": round(_peak_rss_mb(), 1),
            "metrics": artifact.meta.get("metrics", {}),
            "versions": library_versions(),
            "finished_at": datetime.now(timezone.utc).isoformat(),
        }
        atomic_write_json(tmp / "stage.json", record)
    final = Artifact(artifact.kind, final_dir / relative, artifact.meta, output_sha)
    return final, record


def data_record(plan: Plan) -> dict[str, Any]:
    """The calibration and evaluation text of a run: domain, path and hash of each file, and the unseen domains."""
    def entries(sources: list[TextSource]) -> list[dict[str, str]]:
        return [{"domain": s.domain, "path": str(s.path), "sha256": s.sha256} for s in sources]

    return {"calibration": entries(plan.calibration), "evaluation": entries(plan.evaluation), "unseen_domains": plan.unseen_domains}


def _manifest(plan: Plan, status: str, records: list[StageRecord], error: str | None = None) -> dict[str, Any]:
    return {
        "schema_version": MANIFEST_SCHEMA,
        "status": status,
        "updated_at": datetime.now(timezone.utc).isoformat(),
        "command": " ".join(sys.argv),
        "target": plan.target.name,
        "power_mode": plan.power_mode,
        "recipe": plan.recipe.model_dump(mode="json"),
        "model": {"spec": plan.model.spec, "path": str(plan.model.path), "license": plan.model.license},
        "data": data_record(plan),
        "versions": {**library_versions(), **deployment_versions(plan)},
        "stages": [
            {"name": r.name, "dir": r.dirname, "status": r.status, "fingerprint": r.record.get("fingerprint"),
             "output_sha256": r.artifact.sha256}
            for r in records
        ],
        "error": error,
    }


def _attach_log_file(run_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(run_dir / "run.log", encoding="utf-8")
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def _open_run_dir(plan: Plan) -> tuple[RunDirLock, logging.Handler]:
    """Create or reclaim the run directory under its lock; mark it running before anything else is written."""
    out = plan.out_dir
    lock = RunDirLock(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as exc:
        raise disk_write_error(exc, out) from exc
    try:
        # Checked again under the lock: another process may have written here since planning.
        earlier = check_run_dir(out, plan.identity, plan.options.force)
        clean_for_run(out, earlier, plan.identity)
        atomic_write_json(out / "manifest.json", _manifest(plan, "running", []))
        handler = _attach_log_file(out)
    except BaseException as exc:
        lock.release()
        if is_disk_write_error(exc):
            raise disk_write_error(exc, written_path(exc) or out) from exc
        raise
    return lock, handler


def execute(plan: Plan) -> RunResult:
    """Run a checked plan; finished stages whose fingerprint matches are reused."""
    from compress.report import build_report, write_reports

    lock, handler = _open_run_dir(plan)
    out = plan.out_dir = plan.out_dir.resolve()
    records: list[StageRecord] = []
    previous = Artifact(SOURCE, plan.model.path, {"spec": plan.model.spec})
    ctx = RunContext(plan=plan, run_dir=out, stage_dir=out, artifacts={}, progress=plan.options.progress)
    total = len(plan.stages)
    current = out
    try:
        for planned in plan.stages:
            current = final_dir = out / planned.dirname
            reused = _reuse(final_dir, planned.fingerprint)
            if reused is not None:
                artifact, record = reused
                status = "reused"
                log.info("[%d/%d] %s: reused (finished earlier, fingerprint matches)", planned.index, total, planned.stage.name)
            else:
                log.info("[%d/%d] %s: running", planned.index, total, planned.stage.name)
                artifact, record = _run_stage(planned, previous, ctx, final_dir)
                status = record["status"]
                log.info("[%d/%d] %s: %s in %.1fs", planned.index, total, planned.stage.name, status, record["duration_s"])
            records.append(StageRecord(planned.stage.name, planned.dirname, status, artifact, record))
            ctx.artifacts[planned.stage.name] = artifact
            previous = artifact
            atomic_write_json(out / "manifest.json", _manifest(plan, "running", records))
        current = out
        raise_pending_interrupt()
        report = build_report(plan, records)
        write_reports(out, report)
        atomic_write_json(out / "manifest.json", _manifest(plan, "finished", records))
        return RunResult(out, records, report, report["exit_code"])
    except BaseException as exc:
        error = _as_compress_error(exc, current, out)
        _mark_failed(plan, records, error or exc)
        if error is not None and error is not exc:
            raise error from exc
        raise
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
        lock.release()


def _as_compress_error(exc: BaseException, writing: Path, out: Path) -> CompressError | None:
    """The one-line error for a failure while ``writing`` (a stage folder, or the run directory)."""
    if isinstance(exc, CompressError):
        return exc
    if is_disk_write_error(exc):
        return disk_write_error(exc, written_path(exc) or writing)
    if isinstance(exc, Exception):
        first_line = next((line for line in str(exc).splitlines() if line.strip()), "")
        log.debug("stage failure", exc_info=exc)
        return StageError(f"{type(exc).__name__}: {first_line} (full traceback in {out / 'run.log'})")
    return None


def _failure_reason(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (SIGINT)"
    return str(exc) or type(exc).__name__


def _mark_failed(plan: Plan, records: list[StageRecord], exc: BaseException) -> None:
    try:
        atomic_write_json(plan.out_dir / "manifest.json", _manifest(plan, "failed", records, error=_failure_reason(exc)))
    except OSError:
        log.debug("could not write the failed manifest", exc_info=True)


def run(options: RunOptions) -> RunResult:
    """Plan and execute a run."""
    return execute(build_plan(options))


def run_python(target: str, recipe: str = "default", model: str = DEFAULT_MODEL, out: str | Path | None = None,
               progress: bool = True, require_measured: bool = False, force: bool = False, **overrides: Any) -> RunResult:
    """Drive a run from Python with the CLI's options: ``stage__option=value`` for ``stage.option=value``."""
    pairs = {"target": target, "recipe": recipe, "model": model}
    if out is not None:
        pairs["out"] = str(out)
    for key, value in overrides.items():
        pairs[key.replace("__", ".")] = value if isinstance(value, str) else json.dumps(value)
    return run(RunOptions.from_pairs(pairs, require_measured=require_measured, progress=progress, force=force))
