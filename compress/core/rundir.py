"""The run directory: every file name in it, finding a stage's folder, ownership and locking.

A run directory holds ``manifest.json`` (plan, status, stage list with their output hashes), one
``NN_<stage>/`` folder per stage (its output and ``stage.json``), ``run.log``, the reports and the
lock. Everything outside a stage that reads a run directory finds a stage by the kind of artifact
it produced (:meth:`RunDir.stage_producing`), never by its name.

Ownership: compress deletes only what it created.

``out=`` may be a new folder, an empty folder, or a folder whose ``manifest.json`` says it is a
compress run. A run of the same plan (recipe, model, stage list) resumes there; a different plan
is refused unless ``--force``, and even then only the stage folders the earlier manifest records
are removed. Anything else is refused before any file is touched.

Every command that writes into a run directory holds an exclusive OS file lock on
``.compress.lock`` inside it. The lock dies with the process, so a ``SIGKILL`` never leaves a
stale lock behind; a second process is refused at once, naming the PID that holds it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from compress.core.artifact import ENGINE
from compress.core.errors import UsageError
from compress.core.files import disk_write_error, is_disk_write_error, read_json

log = logging.getLogger(__name__)

LOCK_FILE = ".compress.lock"
MANIFEST_FILE = "manifest.json"
RUN_LOG = "run.log"
STAGE_RECORD = "stage.json"
CHECKPOINTS_DIR = "checkpoints"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
REPORT_HTML = "report.html"
MODEL_CARD = "MODEL_CARD.md"
PLOTS_DIR = "plots"
REPORT_FILES = (REPORT_JSON, REPORT_MD, REPORT_HTML, MODEL_CARD)
REPORT_DIRS = (PLOTS_DIR,)
# Files inside stage folders that commands other than the stage read.
VALIDATION = "validation.json"  # the validate stage's measurements, predictions and gate
DEVICE_REFERENCE = "device_reference.json"  # host greedy tokens the on-device check compares with
BUILD_PLAN = "build_plan.json"  # a generic TensorRT build, replayed by `compress build-engine`
EDGELLM_BUILD_PLAN = "edgellm_build.json"  # an Edge-LLM llm_build, replayed likewise
DEVICE_SCRIPT = "build_on_device.sh"
ENGINE_MANIFEST = "engine_manifest.json"  # who built the engine, for what, from which graph
_VALIDATE_OUTPUT = re.compile(r"validate-.+\.(json|md)")


def validate_output_stem(target: str, power_mode: str) -> str:
    """``validate-<target>-<mode>``: the files ``compress validate RUN_DIR`` writes beside the report."""
    return f"validate-{target}-{power_mode}"


def stage_dirname(index: int, name: str) -> str:
    """``NN_<stage>``: the folder of the ``index``-th stage of a plan."""
    return f"{index:02d}_{name}"


class RunDir:
    """Read access to a run directory: its manifest, its stages' records, the folder of the stage that made an artifact."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def require_manifest(self) -> None:
        if not (self.path / MANIFEST_FILE).is_file():
            raise UsageError(f"{self.path} is not a run directory (no {MANIFEST_FILE})")

    def manifest(self) -> dict[str, Any]:
        """The manifest; a usage error when there is none."""
        self.require_manifest()
        return read_json(self.path / MANIFEST_FILE)

    def stages(self) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
        """Each manifest stage entry with its ``stage.json`` record (None where the stage has not finished)."""
        found = []
        for entry in self.manifest()["stages"]:
            record_path = self.path / entry["dir"] / STAGE_RECORD
            found.append((entry, read_json(record_path) if record_path.is_file() else None))
        return found

    def stage_producing(self, kind: str | tuple[str, ...]) -> tuple[Path, dict[str, Any]] | None:
        """The folder and record of the last finished stage whose output is of ``kind`` (one kind, or any of several)."""
        kinds = (kind,) if isinstance(kind, str) else kind
        for entry, record in reversed(self.stages()):
            if record is not None and record["output"]["kind"] in kinds:
                return self.path / entry["dir"], record
        return None

    def require_stage_producing(self, kind: str | tuple[str, ...], what: str) -> tuple[Path, dict[str, Any]]:
        """:meth:`stage_producing`, or a usage error saying the run has no ``what``."""
        found = self.stage_producing(kind)
        if found is None:
            raise UsageError(f"{self.path} has no finished stage producing {what}")
        return found

    def output_path(self, kind: str | tuple[str, ...], what: str) -> Path:
        """Where the last finished stage of ``kind`` keeps its output."""
        folder, record = self.require_stage_producing(kind, what)
        return folder / record["output"]["path"]

    def edgellm_engine_folder(self) -> Path | None:
        """The engine folder of a run whose engine is built from an Edge-LLM bundle (it holds an Edge-LLM build plan)."""
        found = self.stage_producing(ENGINE)
        if found is None:
            return None
        folder = found[0] / found[1]["output"]["path"]
        return folder if (folder / EDGELLM_BUILD_PLAN).is_file() else None


def plan_identity(recipe: dict[str, Any], model_spec: str) -> dict[str, Any]:
    """What makes two runs "the same plan": recipe name, model and the ordered stage list."""
    stages = [f"{index:02d}_{stage['name']}" for index, stage in enumerate(recipe.get("stages", []), start=1)]
    return {"recipe": recipe.get("name"), "model": model_spec, "stages": stages}


def read_run_manifest(out: Path) -> dict[str, Any] | None:
    """The manifest of a compress run directory; None when ``out`` has none; a usage error when it is not ours."""
    path = Path(out) / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        manifest = read_json(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"out={out}: {MANIFEST_FILE} is unreadable ({exc}); not a compress run directory, nothing touched") from exc
    if not isinstance(manifest, dict) or not {"schema_version", "status", "recipe", "model", "stages"} <= manifest.keys():
        raise UsageError(f"out={out}: {MANIFEST_FILE} is not a compress manifest; give a new or empty folder (nothing touched)")
    return manifest


def check_run_dir(out: Path, identity: dict[str, Any], force: bool = False) -> dict[str, Any] | None:
    """Refuse ``out`` unless compress may write there; returns the earlier manifest, if any. Touches nothing."""
    out = Path(out)
    shown = f"out={out}" + ("" if out.is_absolute() else f" ({out.resolve()})")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{shown} is a file, not a folder")
    if not out.exists():
        parent = next((p for p in out.parents if p.exists()), Path("."))
        if not parent.is_dir():
            raise UsageError(f"{shown}: {parent} is not a folder")
        return None
    manifest = read_run_manifest(out)
    if manifest is None:
        foreign = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE)
        if foreign:
            listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise UsageError(f"{shown} is not empty and is not a compress run directory (holds {listed}); "
                             "give a new or empty folder (nothing touched)")
        return None
    earlier = plan_identity(manifest["recipe"], manifest["model"].get("spec", ""))
    if earlier != identity and not force:
        raise UsageError(f"{shown} holds a run of another plan (recipe {earlier['recipe']}, model {earlier['model']}, "
                         f"stages {' '.join(earlier['stages'])}); use another out= or pass --force to replace its stages")
    return manifest


def clean_for_run(out: Path, manifest: dict[str, Any] | None, identity: dict[str, Any]) -> None:
    """Before a run: remove what compress wrote earlier and must not stand beside a running run.

    That is the previous reports (a running or failed run has no report from an earlier attempt),
    staging folders of a killed run, and, when the plan changed (``--force``), the earlier plan's
    recorded stage folders. Nothing else is touched.
    """
    out = Path(out)
    ours = set(identity["stages"])
    if manifest is not None:
        earlier = plan_identity(manifest["recipe"], manifest["model"].get("spec", ""))
        ours |= set(earlier["stages"])
        if earlier != identity:
            for stage in manifest["stages"]:
                folder = out / stage["dir"]
                if stage["dir"] not in identity["stages"] and folder.is_dir():
                    log.info("removing %s: a stage of the replaced plan", folder.name)
                    shutil.rmtree(folder)
        remove_reports(out)
    remove_stale_staging(out, ours)


def remove_reports(out: Path) -> None:
    """Remove the reports a finished run wrote (``report.*``, ``MODEL_CARD.md``, ``plots/``, ``validate-*``)."""
    for name in REPORT_FILES:
        (out / name).unlink(missing_ok=True)
    for name in REPORT_DIRS:
        if (out / name).is_dir():
            shutil.rmtree(out / name)
    for item in out.iterdir():
        if item.is_file() and _VALIDATE_OUTPUT.fullmatch(item.name):
            item.unlink()


def remove_stale_staging(out: Path, stage_dirs: set[str]) -> None:
    """Remove ``.tmp-<stage>-*`` folders a killed run left for one of ``stage_dirs``, and our atomic-write leftovers."""
    atomic_leftover = re.compile(r"\.(manifest\.json|report\.(json|md|html)|MODEL_CARD\.md|validate-.+)\..+\.tmp")
    for item in Path(out).iterdir():
        staged = item.name.startswith(".tmp-") and any(item.name.startswith(f".tmp-{d}-") for d in stage_dirs)
        if staged and item.is_dir():
            shutil.rmtree(item, ignore_errors=True)
        elif item.is_file() and atomic_leftover.fullmatch(item.name):
            item.unlink(missing_ok=True)


class RunDirLock:
    """An exclusive, non-blocking ``flock`` on ``RUN_DIR/.compress.lock`` holding this process's PID."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if is_disk_write_error(exc):
                raise disk_write_error(exc, self.path) from exc
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UsageError(f"{self.path.parent} is in use by another compress process (PID {holder}); "
                                 "wait for it to finish or stop it") from exc
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@contextlib.contextmanager
def locked(run_dir: Path) -> Iterator[RunDirLock]:
    """Hold the run directory's lock for the duration of a ``with`` block."""
    lock = RunDirLock(run_dir)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()
