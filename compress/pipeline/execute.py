"""Executing a checked plan: stage by stage into the run directory, reusing what a killed or earlier run finished.

Every stage writes into a staging folder renamed to ``NN_stage/`` only once its ``stage.json``
(config, input and output hashes, duration, peak memory, metrics, summary, figures) is written, so a
killed run leaves nothing half-written and a rerun reuses finished stages whose fingerprint
matches. The manifest is rewritten after every stage; the reports are built from the run directory
at the end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from compress.core.artifact import SOURCE, Artifact
from compress.core.errors import CompressError, StageError, raise_pending_interrupt
from compress.core.files import atomic_write_json, disk_write_error, is_disk_write_error, read_json, sha256_path, staging_dir, written_path
from compress.core.rundir import MANIFEST_FILE, RUN_LOG, STAGE_RECORD, RunDirLock, check_run_dir, clean_for_run
from compress.core.versions import library_versions
from compress.models.sources import DEFAULT_MODEL
from compress.pipeline.plan import Plan, PlannedStage, RunOptions, build_plan, config_json, data_record, deployment_versions
from compress.pipeline.stage import RunContext
from compress.report.build import build_report, write_reports

log = logging.getLogger("compress")

MANIFEST_SCHEMA = "1.0"


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
    record_path = stage_dir / STAGE_RECORD
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
        result = planned.variant.run(previous, planned.config, ctx)
        artifact = result.artifact
        raise_pending_interrupt()  # a signal whose exception was dropped mid-stage still stops the run here
        duration = time.perf_counter() - started
        relative = Path(artifact.path).resolve().relative_to(tmp.resolve())
        output_sha = sha256_path(artifact.path)
        status = "deferred" if artifact.meta.get("deferred") else "done"
        record = {
            "stage": planned.stage.name,
            "status": status,
            "fingerprint": planned.fingerprint,
            "config": config_json(planned.config),
            "input": {"kind": previous.kind, "path": str(previous.path), "sha256": previous.sha256},
            "output": {"kind": artifact.kind, "path": str(relative), "meta": artifact.meta, "sha256": output_sha},
            "duration_s": round(duration, 3),
            "peak_rss_mb": round(_peak_rss_mb(), 1),
            "metrics": artifact.meta.get("metrics", {}),
            "summary": result.summary,
            "figures": result.figures,
            "versions": library_versions(),
            "finished_at": datetime.now(timezone.utc).isoformat(),
        }
        atomic_write_json(tmp / STAGE_RECORD, record)
    final = Artifact(artifact.kind, final_dir / relative, artifact.meta, output_sha)
    return final, record


def _manifest(plan: Plan, status: str, records: list[StageRecord], error: str | None = None) -> dict[str, Any]:
    return {
        "schema_version": MANIFEST_SCHEMA,
        "status": status,
        "updated_at": datetime.now(timezone.utc).isoformat(),
        "command": " ".join(sys.argv),
        "target": plan.target.name,
        "power_mode": plan.power_mode,
        "budgets": plan.target.budgets.model_dump(),
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
    handler = logging.FileHandler(run_dir / RUN_LOG, encoding="utf-8")
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
        atomic_write_json(out / MANIFEST_FILE, _manifest(plan, "running", []))
        handler = _attach_log_file(out)
    except BaseException as exc:
        lock.release()
        if is_disk_write_error(exc):
            raise disk_write_error(exc, written_path(exc) or out) from exc
        raise
    return lock, handler


def execute(plan: Plan) -> RunResult:
    """Run a checked plan; finished stages whose fingerprint matches are reused."""
    lock, handler = _open_run_dir(plan)
    out = plan.out_dir = plan.out_dir.resolve()
    records: list[StageRecord] = []
    previous = Artifact(SOURCE, plan.model.path, {"spec": plan.model.spec})
    ctx = plan.context(out)
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
            atomic_write_json(out / MANIFEST_FILE, _manifest(plan, "running", records))
            if record.get("summary"):
                log.info("[%d/%d] %s: %s", planned.index, total, planned.stage.name, record["summary"])
        current = out
        raise_pending_interrupt()
        report = build_report(out)
        write_reports(out, report)
        atomic_write_json(out / MANIFEST_FILE, _manifest(plan, "finished", records))
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
        return StageError(f"{type(exc).__name__}: {first_line} (full traceback in {out / RUN_LOG})")
    return None


def _failure_reason(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (SIGINT)"
    return str(exc) or type(exc).__name__


def _mark_failed(plan: Plan, records: list[StageRecord], exc: BaseException) -> None:
    try:
        atomic_write_json(plan.out_dir / MANIFEST_FILE, _manifest(plan, "failed", records, error=_failure_reason(exc)))
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
