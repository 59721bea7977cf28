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
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, StringConstraints, ValidationError, field_validator

from compress.core.artifact import ENGINE
from compress.core.errors import ProvenanceError, UsageError, first_line
from compress.core.files import (
    atomic_write_json,
    cached_sha256,
    open_no_follow,
    read_json,
    sha256_file,
    top_level_sha256,
)
from compress.core.records import (
    FileRecords,
    file_problem,
    folder_problems,
    is_plain_relative,
    record_file,
    record_folder,
)
from compress.core.stage_record import StageFile

log = logging.getLogger(__name__)

# Raised whenever a stage's files change shape, so a stage an older layout wrote is recomputed rather than reused.
ARTIFACT_LAYOUT = 4
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
TRTEXEC_LOG = "trtexec.log"  # what build_on_device.sh's trtexec printed
_VALIDATE_OUTPUT = re.compile(r"validate-.+\.(json|md)")
STAGE_DIR_PATTERN = r"^[0-9]{2}_[a-z][a-z0-9_]*$"  # what stage_dirname makes; nothing else is ever a stage folder


def validate_output_stem(target: str, power_mode: str) -> str:
    """``validate-<target>-<mode>``: the files ``compress validate RUN_DIR`` writes beside the report."""
    return f"validate-{target}-{power_mode}"


def stage_dirname(index: int, name: str) -> str:
    """``NN_<stage>``: the folder of the ``index``-th stage of a plan."""
    return f"{index:02d}_{name}"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _ManifestStage(_Open):
    name: str
    dir: Annotated[str, StringConstraints(pattern=STAGE_DIR_PATTERN)]
    status: str
    fingerprint: str | None = None
    output_sha256: str | None = None
    record_sha256: str | None = None


class _ManifestRecipe(_Open):
    name: str
    stages: list[Any]


class _ManifestModel(_Open):
    spec: str


class _Manifest(_Open):
    """What every reader of a manifest relies on; anything else in it is read where it is used."""

    schema_version: str
    status: str
    recipe: _ManifestRecipe
    model: _ManifestModel
    stages: list[_ManifestStage]
    files: dict[str, dict[str, Any]] = {}

    @field_validator("files")
    @classmethod
    def _plain_relative_paths(cls, files: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for path in files:
            if not is_plain_relative(path):
                raise ValueError(f"{path!r} is not a plain relative path inside the run directory")
        return files


def parse_manifest(data: Any, where: Path) -> dict[str, Any]:
    """``data`` if it is a compress manifest, else a usage error naming the first thing wrong with it."""
    try:
        _Manifest.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "the top level"
        raise UsageError(f"{where} is not a compress manifest ({field}: {error['msg']}); nothing touched") from exc
    return data


def read_manifest_file(path: Path) -> dict[str, Any]:
    """The manifest at ``path``, checked; a usage error for a file that is not JSON or not a manifest."""
    try:
        data = read_json(path)
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise UsageError(
            f"{path} is unreadable ({first_line(exc)}); not a compress run directory, nothing touched"
        ) from exc
    return parse_manifest(data, path)


def stage_folder(run_dir: Path, dirname: str) -> Path:
    """The folder of a recorded stage: ``NN_name`` directly inside the run directory, never a link."""
    if not re.fullmatch(STAGE_DIR_PATTERN, dirname):
        raise ProvenanceError(f"{run_dir / MANIFEST_FILE} names a stage folder {dirname!r}, which compress never makes")
    folder = Path(run_dir) / dirname
    if folder.is_symlink():
        raise ProvenanceError(f"{folder} is a symbolic link; compress never makes one, so it reads and removes none")
    return folder


class RunDir:
    """Read access to a run directory: its manifest, its stages' records, the folder of the stage that made an
    artifact."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def require_manifest(self) -> None:
        if not (self.path / MANIFEST_FILE).is_file():
            raise UsageError(f"{self.path} is not a run directory (no {MANIFEST_FILE})")

    def manifest(self) -> dict[str, Any]:
        """The manifest, checked; a usage error when there is none or it is not a compress manifest."""
        self.require_manifest()
        return read_manifest_file(self.path / MANIFEST_FILE)

    def stages(self) -> list[tuple[dict[str, Any], StageFile | None]]:
        """Each manifest stage entry with its ``stage.json`` record (None where the stage has not finished)."""
        found = []
        for entry in self.manifest()["stages"]:
            record_path = stage_folder(self.path, entry["dir"]) / STAGE_RECORD
            found.append((entry, StageFile.read(record_path) if record_path.is_file() else None))
        return found

    def report(self) -> dict[str, Any] | None:
        """``report.json`` of a finished run (None when there is none); a usage error when it is not a compress
        report."""
        path = self.path / REPORT_JSON
        if not path.is_file():
            return None
        try:
            report = read_json(path)
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path} is unreadable ({first_line(exc)})") from exc
        gate = report.get("gate") if isinstance(report, dict) else None
        if (
            not isinstance(gate, dict)
            or not isinstance(gate.get("checks"), list)
            or not isinstance(report.get("target"), dict)
        ):
            raise UsageError(f"{path} is not a compress report (no target and gate)")
        return report

    def problems(self, full: bool = False) -> list[str]:
        """How the run directory differs from what compress recorded writing: each stage's record and files, the
        reports. Cheap (sizes and time stamps, hashing only files whose stamp moved) unless ``full``."""
        manifest = self.manifest()
        problems = []
        for entry in manifest["stages"]:
            problems.extend(_stage_problems(self.path, entry, full))
        for relative, record in sorted(manifest.get("files", {}).items()):
            problem = file_problem(self.path / relative, record, full)
            if problem:
                problems.append(f"{self.path / relative} {problem}")
        return problems

    def strays(self) -> list[str]:
        """What stands where compress writes but is not what it wrote: stage folders the manifest does not name
        (orphans), and symbolic links under any name compress uses in a run directory."""
        named = {entry["dir"] for entry in self.manifest()["stages"]}
        ours = {MANIFEST_FILE, RUN_LOG, LOCK_FILE, CHECKPOINTS_DIR, *REPORT_FILES, *REPORT_DIRS}
        found = []
        for item in sorted(self.path.iterdir()):
            is_stage = re.fullmatch(STAGE_DIR_PATTERN, item.name) is not None
            if item.is_symlink() and (is_stage or item.name in ours or _VALIDATE_OUTPUT.fullmatch(item.name)):
                found.append(f"{item} is a symbolic link, which compress never makes")
            elif is_stage and item.name not in named:
                found.append(f"{item} is a stage folder the manifest does not name")
        return found

    def require_intact(self, full: bool = False) -> None:
        """:meth:`problems`, raised as one :class:`ProvenanceError` naming the first (and how many more)."""
        problems = self.problems(full)
        if problems:
            more = (
                f" (and {len(problems) - 1} more; `compress verify {self.path}` lists them)"
                if len(problems) > 1
                else ""
            )
            raise ProvenanceError(f"{problems[0]}{more}; the run directory is not what compress wrote")

    def stage_producing(self, kind: str | tuple[str, ...]) -> tuple[Path, StageFile] | None:
        """The folder and record of the last finished stage whose output is of ``kind`` (one kind, or any of
        several)."""
        kinds = (kind,) if isinstance(kind, str) else kind
        for entry, record in reversed(self.stages()):
            if record is not None and record.output.kind in kinds:
                return self.path / entry["dir"], record
        return None

    def require_stage_producing(self, kind: str | tuple[str, ...], what: str) -> tuple[Path, StageFile]:
        """:meth:`stage_producing`, or a usage error saying the run has no ``what``."""
        found = self.stage_producing(kind)
        if found is None:
            raise UsageError(f"{self.path} has no finished stage producing {what}")
        return found

    def output_path(self, kind: str | tuple[str, ...], what: str) -> Path:
        """Where the last finished stage of ``kind`` keeps its output."""
        folder, record = self.require_stage_producing(kind, what)
        return folder / record.output.path

    def edgellm_engine_folder(self) -> Path | None:
        """The engine folder of a run whose engine is built from an Edge-LLM bundle (it holds an Edge-LLM build
        plan)."""
        found = self.stage_producing(ENGINE)
        if found is None:
            return None
        folder = found[0] / found[1].output.path
        return folder if (folder / EDGELLM_BUILD_PLAN).is_file() else None


def _stage_problems(run_dir: Path, entry: dict[str, Any], full: bool) -> list[str]:
    return stage_check(run_dir, entry["dir"], entry, full)[1]


def stage_check(run_dir: Path, dirname: str, entry: dict[str, Any] | None,
                full: bool = False) -> tuple[StageFile | None, list[str]]:
    """A stage folder's record and how the folder differs from it and from the manifest's ``entry`` for it (None when
    the manifest has none, as after a kill between finishing a stage and rewriting the manifest)."""
    folder = stage_folder(run_dir, dirname)
    record_path = folder / STAGE_RECORD
    if not record_path.is_file():
        return None, [f"{record_path} is missing"]
    if entry is not None and entry.get("record_sha256") != sha256_file(record_path):
        return None, [f"{record_path} is not the record the manifest names (its sha256 differs)"]
    record = StageFile.read(record_path)
    if entry is not None and record.output.sha256 != entry.get("output_sha256"):
        return record, [f"{record_path} records another output than the manifest"]
    if record.files is None:
        return record, [f"{record_path} lists no files (written by an older compress; rerun the stage)"]
    allowed = frozenset({STAGE_RECORD, *record.device_files})
    return record, folder_problems(folder, record.files, full, allowed_extra=allowed)


def read_in_place_problem(record: StageFile, full: bool = False) -> str | None:
    """Why a stage's output read in place (the user's model, outside the run directory) no longer holds what the stage
    hashed; None when it does or when the stage wrote its output into its folder. Cheap unless ``full``: each file is
    hashed again only when its stamp moved. Not part of :func:`stage_check`: the run directory stands without the model
    (a copied run is shown, re-gated and verified elsewhere); what reads the model again (a resumed run) checks this."""
    output = record.output
    if not output.read_in_place:
        return None
    folder = Path(output.path)
    if not folder.is_dir():
        return f"the model read in place, {folder}, is missing"
    if top_level_sha256(folder, sha256_file if full else cached_sha256) != output.sha256:
        return f"the model read in place, {folder}, does not hold what the run read (its sha256 differs)"
    return None


def rerecord_stage(run_dir: Path, dirname: str, record: StageFile) -> None:
    """Rewrite a finished stage's record after a later command added to its folder (``compress build-engine``): its
    files are recorded again and the manifest names the new record."""
    folder = stage_folder(run_dir, dirname)
    record = record.model_copy(update={"files": record_folder(folder, skip=frozenset({STAGE_RECORD}))})
    record.write(folder / STAGE_RECORD)
    manifest = read_manifest_file(Path(run_dir) / MANIFEST_FILE)
    for entry in manifest["stages"]:
        if entry["dir"] == dirname:
            entry["output_sha256"] = record.output.sha256
            entry["record_sha256"] = sha256_file(folder / STAGE_RECORD)
    atomic_write_json(Path(run_dir) / MANIFEST_FILE, manifest)


def record_written(run_dir: Path, paths: list[Path]) -> None:
    """Add files compress just wrote at the top of the run directory (reports, plots, ``validate-*``) to the manifest,
    so that only they are ever removed and ``compress verify`` checks them."""
    run_dir = Path(run_dir)
    manifest = read_manifest_file(run_dir / MANIFEST_FILE)
    files: FileRecords = dict(manifest.get("files", {}))
    for path in paths:
        files[Path(path).resolve().relative_to(run_dir.resolve()).as_posix()] = record_file(path)
    manifest["files"] = files
    atomic_write_json(run_dir / MANIFEST_FILE, manifest)


def plan_identity(recipe: dict[str, Any], model_spec: str) -> dict[str, Any]:
    """What makes two runs "the same plan": recipe name, model and the ordered stage list."""
    stages = [f"{index:02d}_{stage['name']}" for index, stage in enumerate(recipe.get("stages", []), start=1)]
    return {"recipe": recipe.get("name"), "model": model_spec, "stages": stages}


def read_run_manifest(out: Path) -> dict[str, Any] | None:
    """The manifest of a compress run directory; None when ``out`` has none; a usage error when it is not ours."""
    path = Path(out) / MANIFEST_FILE
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_file():
        raise UsageError(
            f"out={out}: {MANIFEST_FILE} is not a file compress wrote; give a new or empty folder (nothing touched)"
        )
    return read_manifest_file(path)


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
        raise UsageError(
            f"{shown} holds a run of another plan (recipe {earlier['recipe']}, model {earlier['model']}, "
            f"stages {' '.join(earlier['stages'])}); use another out= or pass --force to replace its stages"
        )
    return manifest


def clean_for_run(out: Path, manifest: dict[str, Any] | None, identity: dict[str, Any]) -> None:
    """Before a run: remove what compress wrote earlier and must not stand beside a running run.

    That is the previous reports (a running or failed run has no report from an earlier attempt),
    staging folders of a killed run, and, when the plan changed (``--force``), the earlier plan's
    recorded stage folders, each only if it holds nothing but what its record names. Nothing else
    is touched.
    """
    out = Path(out)
    ours = set(identity["stages"])
    if manifest is not None:
        earlier = plan_identity(manifest["recipe"], manifest["model"].get("spec", ""))
        ours |= set(earlier["stages"])
        replaced = []
        if earlier != identity:
            replaced = [
                folder
                for stage in manifest["stages"]
                if stage["dir"] not in identity["stages"] and (folder := stage_folder(out, stage["dir"])).is_dir()
            ]
        for folder in replaced:  # every folder checked before any is removed
            require_only_recorded(folder)
        reports = recorded_reports(out, manifest)
        for folder in replaced:
            log.info("removing %s: a stage of the replaced plan", folder.name)
            shutil.rmtree(folder)
        remove_reports(out, reports)
    remove_stale_staging(out, ours)


def require_only_recorded(folder: Path) -> None:
    """Refuse to remove or replace a stage folder holding files its record does not name (someone else's files)."""
    record_path = folder / STAGE_RECORD
    record = StageFile.read(record_path) if record_path.is_file() else None
    records = {} if record is None else record.files
    if records is None:
        raise ProvenanceError(
            f"{record_path} lists no files (written by an older compress); remove {folder} yourself to rerun"
        )
    allowed = frozenset({STAGE_RECORD, *(record.device_files if record else ())})
    unrecorded = [
        p for p in folder_problems(folder, records, allowed_extra=allowed) if "not a file compress wrote" in p
    ]
    if unrecorded:
        raise ProvenanceError(
            f"{unrecorded[0].split(' is not ')[0]} is not a file compress wrote, so {folder.name} is not "
            "replaced; move it out of the stage folder and rerun"
        )


def recorded_reports(out: Path, manifest: dict[str, Any]) -> list[Path]:
    """The report files the manifest records compress wrote (``report.*``, ``MODEL_CARD.md``, ``plots/*``,
    ``validate-*``) that are there; one changed since (annotated by its reader) is refused, naming it, so it is neither
    removed nor written over."""
    out = Path(out)
    for name in REPORT_DIRS:
        if (out / name).is_symlink():
            raise ProvenanceError(
                f"{out / name} is a symbolic link, which compress never makes; it writes nothing through "
                "a link: remove it and run again"
            )
    found = []
    for relative, record in manifest.get("files", {}).items():
        path = out / relative
        top = Path(relative).parts[0]
        is_report = relative in REPORT_FILES or top in REPORT_DIRS or _VALIDATE_OUTPUT.fullmatch(relative)
        if not is_report or not (path.is_file() or path.is_symlink()):
            continue
        problem = file_problem(path, record, full=True)
        if problem:
            raise ProvenanceError(f"{path} {problem}, so compress does not replace it: move it out of {out} and rerun")
        found.append(path)
    return found


def remove_reports(out: Path, reports: list[Path]) -> None:
    """Remove ``reports`` (see :func:`recorded_reports`) and ``plots/`` once empty."""
    for path in reports:
        path.unlink(missing_ok=True)
    for name in REPORT_DIRS:
        with contextlib.suppress(OSError):
            (out / name).rmdir()  # only when empty


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
    """A non-blocking ``flock`` on ``RUN_DIR/.compress.lock``: exclusive, holding this process's PID, for a command that
    writes; shared for one that only reads (``compress verify``), which also works on a run directory it cannot write
    (then without a lock). The lock file is never opened through a symbolic link."""

    def __init__(self, run_dir: Path, shared: bool = False):
        self.path = Path(run_dir) / LOCK_FILE
        self.shared = shared
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = self._open_shared() if self.shared else open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        if fd is None:
            return
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UsageError(f"{self.path.parent} is in use by another compress process (PID {holder}); "
                                 "wait for it to finish or stop it") from exc
            raise
        if not self.shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def _open_shared(self) -> int | None:
        """The lock file opened for reading, created where it is missing and the directory takes it; None where the
        directory cannot be written (a read-only copy: nothing can change it under this reader either)."""
        try:
            return open_no_follow(self.path, os.O_RDONLY)
        except FileNotFoundError:
            pass
        try:
            return open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        except UsageError as exc:
            if not isinstance(exc.__cause__, OSError) or exc.__cause__.errno not in (
                errno.EROFS,
                errno.EACCES,
                errno.EPERM,
            ):
                raise
        log.info("%s cannot be written: reading it without its lock", self.path.parent)
        return None

    def release(self) -> None:
        if self._fd is not None:
            if not self.shared:
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
def locked(run_dir: Path, shared: bool = False) -> Iterator[RunDirLock]:
    """Hold the run directory's lock (``shared``: for reading only) for the duration of a ``with`` block."""
    lock = RunDirLock(run_dir, shared)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()
