"""Executing a checked plan: stage by stage into the run directory, reusing what a killed or earlier run finished.

Every stage writes into a staging folder renamed to ``NN_stage/`` only once its ``stage.json``
(config, input and output hashes, duration, peak memory, metrics, summary, figures) is written, so a
killed run leaves nothing half-written and a rerun reuses finished stages whose fingerprint
matches. The manifest is rewritten after every stage; the reports are built from the run directory
at the end.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from compress.core.artifact import SOURCE, Artifact
from compress.core.errors import (
    CompressError,
    Interrupted,
    StageError,
    UsageError,
    first_interruption,
    raise_pending_interrupt,
    signals_held,
)
from compress.core.files import (
    atomic_write_json,
    disk_write_error,
    is_disk_write_error,
    open_no_follow,
    rewrite_in_place,
    sha256_file,
    sha256_path,
    staging_dir,
    written_path,
)
from compress.core.memory import device_peak_mb, peak_mb, reset_peak
from compress.core.records import FileRecords, record_file, record_folder
from compress.core.rundir import (
    MANIFEST_FILE,
    RUN_LOG,
    STAGE_RECORD,
    RunDirLock,
    check_run_dir,
    clean_for_run,
    read_in_place_problem,
    require_only_recorded,
    stage_check,
)
from compress.core.stage_record import StageFile, StageInput, StageOutput
from compress.core.versions import library_versions
from compress.models.sources import DEFAULT_MODEL
from compress.pipeline.plan import (
    Plan,
    PlannedStage,
    RunOptions,
    build_plan,
    config_json,
    data_record,
    deployment_versions,
)
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
    record: StageFile


@dataclass
class RunResult:
    """The outcome of a run."""

    run_dir: Path
    stages: list[StageRecord]
    report: dict[str, Any]
    exit_code: int


def _childrenpeak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def _stage_children_peak(before: float) -> float | None:
    """The largest resident size of a program the stage ran (NVIDIA's exporter, the custody check), where one of them
    grew past every earlier one's (the kernel keeps only the maximum over all children)."""
    after = _childrenpeak_mb()
    return round(after, 1) if after > before else None


def _reuse(run_dir: Path, planned: PlannedStage, previous: Artifact,
           earlier: dict[str, Any] | None) -> tuple[Artifact, StageFile] | None:
    """The finished output of ``planned`` if it may stand: same fingerprint, made from this very input, and its folder
    still holding what its record (and the earlier manifest's entry, ``earlier``) say was written."""
    if not (run_dir / planned.dirname / STAGE_RECORD).is_file():
        return None
    record, problems = stage_check(run_dir, planned.dirname, earlier)
    if record is None or record.fingerprint != planned.fingerprint:
        return None
    if record.input.sha256 != previous.sha256:
        log.info("%s: its input changed since it ran; redoing the stage", planned.dirname)
        return None
    in_place = read_in_place_problem(record)
    problems = [*problems, in_place] if in_place else problems
    if problems:
        log.warning("%s: %s; redoing the stage", planned.dirname, problems[0])
        return None
    return record.output.artifact(run_dir / planned.dirname), record


def _run_stage(
    planned: PlannedStage, previous: Artifact, ctx: RunContext, final_dir: Path
) -> tuple[Artifact, StageFile]:
    if final_dir.is_dir():
        require_only_recorded(final_dir)
    with staging_dir(final_dir) as tmp:
        ctx.stage_dir = tmp
        ctx.stage_name = planned.dirname
        ctx.fingerprint = planned.fingerprint
        reset_peak(ctx.device)
        children_before = _childrenpeak_mb()
        started = time.perf_counter()
        result = planned.variant.run(previous, planned.config, ctx)
        artifact = result.artifact
        raise_pending_interrupt()  # a signal whose exception was dropped mid-stage still stops the run here
        duration = time.perf_counter() - started
        files = record_folder(tmp, skip=frozenset({STAGE_RECORD}))
        relative, output_sha = _output_location(planned, artifact, tmp, files)
        status = "deferred" if getattr(artifact.meta, "deferred", False) else "done"
        device_mb = device_peak_mb(ctx.device)
        record = StageFile(
            stage=planned.stage.name,
            status=status,
            fingerprint=planned.fingerprint,
            config=config_json(planned.config),
            input=StageInput(kind=previous.kind, path=str(previous.path), sha256=previous.sha256),
            output=StageOutput(kind=artifact.kind, path=str(relative), meta=artifact.meta.to_json(), sha256=output_sha,
                               read_in_place=relative.is_absolute()),
            files=files,
            device_files=list(result.device_files),
            device=ctx.device,
            duration_s=round(duration, 3),
            peak_rss_mb=round(peak_mb(), 1),
            peak_subprocess_rss_mb=_stage_children_peak(children_before),
            peak_device_memory_mb=None if device_mb is None else round(device_mb, 1),
            metrics=artifact.metrics,
            summary=result.summary,
            figures=result.figures,
            versions=library_versions(),
            finished_at=datetime.now(timezone.utc).isoformat(),
        )
        record.write(tmp / STAGE_RECORD)
    final = Artifact(artifact.kind, final_dir / relative, artifact.meta, output_sha)
    return final, record


def _inside(path: Path, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def _output_location(planned: PlannedStage, artifact: Artifact, tmp: Path, files: FileRecords) -> tuple[Path, str]:
    """Where the record says the output is (relative to the stage folder, or absolute for a model read in place) and its
    content hash (of the files the stage wrote, or the one the stage computed for what it reads in place)."""
    if _inside(artifact.path, tmp):
        relative = Path(artifact.path).resolve().relative_to(tmp.resolve())
        return relative, sha256_path(
            artifact.path, lambda path: files[path.resolve().relative_to(tmp.resolve()).as_posix()]["sha256"]
        )
    if not artifact.sha256:
        raise StageError(
            f"{planned.stage.name}: its output {artifact.path} is outside its folder and has no content hash"
        )
    return Path(artifact.path).resolve(), artifact.sha256


def _require_read_in_place_unchanged(records: list[StageRecord]) -> None:
    """Stop the run when a model read in place (not copied into the run directory) changed since its stage hashed it."""
    for stage in records:
        problem = read_in_place_problem(stage.record)
        if problem:
            raise UsageError(
                f"{problem}; it changed while the run was going: rerun to start again from the model as it is now"
            )


def _manifest(plan: Plan, status: str, records: list[StageRecord], error: str | None = None,
              files: FileRecords | None = None) -> dict[str, Any]:
    return {
        "schema_version": MANIFEST_SCHEMA,
        "status": status,
        "updated_at": datetime.now(timezone.utc).isoformat(),
        "command": " ".join(sys.argv),
        "target": plan.target.name,
        "target_config": plan.target.model_dump(mode="json"),
        "power_mode": plan.power_mode,
        "budgets": plan.target.budgets.model_dump(),
        "device": plan.device,
        "recipe": plan.recipe.model_dump(mode="json"),
        "model": {"spec": plan.model.spec, "path": str(plan.model.path), "license": plan.model.license,
                  "sha256": plan.model_sha256},
        "data": data_record(plan),
        "versions": {**library_versions(), **deployment_versions(plan)},
        "stages": [
            {"name": r.name, "dir": r.dirname, "status": r.status, "fingerprint": r.record.fingerprint,
             "output_sha256": r.artifact.sha256, "record_sha256": sha256_file(plan.out_dir / r.dirname / STAGE_RECORD)}
            for r in records
        ],
        "files": files or {},
        "error": error,
    }


class _RunLog(logging.StreamHandler):
    """A log handler that owns its file: closing the handler closes the file. A line the file cannot take (a full disk)
    is dropped from it quietly: the console still shows it, and the run's own error says what could not be written."""

    def handleError(self, record: logging.LogRecord) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a formatting mistake is still reported
            super().handleError(record)

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            super().close()


def _attach_log_file(run_dir: Path) -> logging.Handler:
    """The run's log, appended to ``RUN_DIR/run.log`` (never through a link)."""
    fd = open_no_follow(run_dir / RUN_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    handler = _RunLog(os.fdopen(fd, "a", encoding="utf-8"))
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def _open_run_dir(plan: Plan) -> tuple[RunDirLock, logging.Handler, dict[str, dict[str, Any]]]:
    """Create or reclaim the run directory under its lock; mark it running before anything else is written. Returns the
    lock, the log handler and the earlier manifest's stage entries by folder name."""
    out = plan.out_dir
    lock = RunDirLock(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as exc:
        raise disk_write_error(exc, out) from exc
    handler = None
    try:
        # Checked again under the lock: another process may have written here since planning.
        earlier = check_run_dir(out, plan.identity, plan.options.force)
        clean_for_run(out, earlier, plan.identity)
        handler = _attach_log_file(out)
        atomic_write_json(out / MANIFEST_FILE, _manifest(plan, "running", []))
        entries = {entry["dir"]: entry for entry in (earlier or {}).get("stages", [])}
    except BaseException as exc:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()
        lock.release()
        if is_disk_write_error(exc):
            raise disk_write_error(exc, written_path(exc) or out) from exc
        raise
    return lock, handler, entries


def execute(plan: Plan) -> RunResult:
    """Run a checked plan; finished stages whose fingerprint matches are reused."""
    lock, handler, earlier_entries = _open_run_dir(plan)
    out = plan.out_dir = plan.out_dir.resolve()
    records: list[StageRecord] = []
    previous = Artifact(SOURCE, plan.model.path, {"spec": plan.model.spec}, plan.model_sha256)
    ctx = plan.context(out)
    total = len(plan.stages)
    current = out
    if plan.estimates:
        largest = max(plan.estimates, key=lambda e: e.host_bytes)
        log.info("expected on %s: peak memory about %.1f GB (%s), run directory about %.1f GB, about %.0f min",
                 plan.device, largest.host_bytes / 1e9, largest.stage, sum(e.disk_bytes for e in plan.estimates) / 1e9,
                 sum(e.seconds for e in plan.estimates) / 60)
    try:
        for planned in plan.stages:
            _require_read_in_place_unchanged(records)
            current = final_dir = out / planned.dirname
            reused = _reuse(out, planned, previous, earlier_entries.get(planned.dirname))
            if reused is not None:
                artifact, record = reused
                status = "reused"
                log.info(
                    "[%d/%d] %s: reused (finished earlier, fingerprint matches)",
                    planned.index,
                    total,
                    planned.stage.name,
                )
            else:
                log.info("[%d/%d] %s: running", planned.index, total, planned.stage.name)
                artifact, record = _run_stage(planned, previous, ctx, final_dir)
                status = record.status
                log.info(
                    "[%d/%d] %s: %s in %.1fs", planned.index, total, planned.stage.name, status, record.duration_s
                )
            records.append(StageRecord(planned.stage.name, planned.dirname, status, artifact, record))
            ctx.artifacts[planned.stage.name] = artifact
            previous = artifact
            atomic_write_json(out / MANIFEST_FILE, _manifest(plan, "running", records))
            if record.summary:
                log.info("[%d/%d] %s: %s", planned.index, total, planned.stage.name, record.summary)
        current = out
        raise_pending_interrupt()
        _require_read_in_place_unchanged(records)
        report = build_report(out)
        written = write_reports(out, report)
        files = {path.relative_to(out).as_posix(): record_file(path) for path in written}
        atomic_write_json(out / MANIFEST_FILE, _manifest(plan, "finished", records, files=files))
        return RunResult(out, records, report, report["exit_code"])
    except BaseException as exc:
        with signals_held():
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
    first = first_interruption()
    if first is not None and isinstance(exc, (Interrupted, KeyboardInterrupt)):
        return str(first)
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (SIGINT)"
    return str(exc) or type(exc).__name__


def _mark_failed(plan: Plan, records: list[StageRecord], exc: BaseException) -> None:
    """Record the failure in the manifest; on a full disk, where no new file can be made, by rewriting the manifest in
    place over its own blocks, so a run never stays "running" after it stopped."""
    manifest = _manifest(plan, "failed", records, error=_failure_reason(exc))
    try:
        atomic_write_json(plan.out_dir / MANIFEST_FILE, manifest)
    except OSError:
        try:
            compact = json.dumps(manifest, separators=(",", ":"), default=str) + "\n"  # shorter than the indented file
            rewrite_in_place(plan.out_dir / MANIFEST_FILE, compact.encode())
        except OSError:
            log.debug("could not write the failed manifest", exc_info=True)


def run(options: RunOptions) -> RunResult:
    """Plan and execute a run."""
    return execute(build_plan(options))


RUN_FLAGS = {"progress": True, "require_measured": False, "force": False}  # the CLI's flags, with their defaults


def run_python(target: str, recipe: str = "default", model: str = DEFAULT_MODEL, out: str | Path | None = None,
               **options: Any) -> RunResult:
    """Drive a run from Python with the CLI's options: ``stage__option=value`` for ``stage.option=value``, and the
    CLI's flags as booleans (``progress=False``, ``require_measured=True``, ``force=True``)."""
    flags = {name: bool(options.pop(name, default)) for name, default in RUN_FLAGS.items()}
    pairs = {"target": target, "recipe": recipe, "model": model}
    if out is not None:
        pairs["out"] = str(out)
    for key, value in options.items():
        pairs[key.replace("__", ".")] = value if isinstance(value, str) else json.dumps(value)
    return run(RunOptions.from_pairs(pairs, **flags))
