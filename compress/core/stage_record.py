"""``stage.json``: what a finished stage wrote, written and read through one type.

Every stage folder holds one. It names the stage's input and output (kind, path, content hash and
the output's metadata), every file the stage wrote (:mod:`compress.core.records`), the figures the
report plots and what the stage cost. ``schema_version`` is 2 since the record became this type; a
record without one was written by an earlier compress in the same layout and reads as version 1. A
record with a key this type does not know, or without one it needs, is refused as not a stage record
rather than read with defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from compress.core.artifact import Artifact, read_meta
from compress.core.errors import ProvenanceError, first_line
from compress.core.files import atomic_write_json, read_json
from compress.core.records import is_plain_relative

STAGE_RECORD_SCHEMA = 2
# a stage record's output flag: the output is the user's model, outside the run directory
READ_IN_PLACE = "read_in_place"


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StageInput(_Record):
    """The artifact a stage read: its kind, where it was, its content hash."""

    kind: str
    path: str
    sha256: str


class StageOutput(_Record):
    """The artifact a stage produced; ``path`` is relative to the stage folder, absolute for a model read in place."""

    kind: str
    path: str
    meta: dict[str, Any] = Field(default_factory=dict)
    sha256: str
    read_in_place: bool = False

    @model_validator(mode="after")
    def _meta_of_its_kind(self) -> StageOutput:
        read_meta(self.kind, self.meta)  # a key the kind's metadata type does not know is an error naming it
        return self

    def artifact(self, stage_dir: Path) -> Artifact:
        """The output as an :class:`Artifact`, its path resolved against ``stage_dir``."""
        path = Path(self.path)
        return Artifact(self.kind, path if path.is_absolute() else Path(stage_dir) / path, self.meta, self.sha256)


class StageFile(_Record):
    """One stage folder's ``stage.json``."""

    schema_version: Literal[1, 2] = 1
    stage: str
    status: Literal["done", "deferred"]
    fingerprint: str
    config: dict[str, Any]
    input: StageInput
    output: StageOutput
    # relative path -> {"size", "mtime_ns", "ctime_ns", "inode", "sha256"}; None: an older compress listed none
    files: dict[str, dict[str, Any]] | None = None
    device_files: list[str] = Field(default_factory=list)
    device: str = "cpu"
    duration_s: float
    peak_rss_mb: float | None = None
    peak_subprocess_rss_mb: float | None = None
    peak_device_memory_mb: float | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    summary: str = ""
    figures: dict[str, Any] = Field(default_factory=dict)
    versions: dict[str, Any] = Field(default_factory=dict)
    finished_at: str

    def write(self, path: Path) -> None:
        """Write the record atomically, as the current schema version."""
        atomic_write_json(path, self.model_copy(update={"schema_version": STAGE_RECORD_SCHEMA}).model_dump(mode="json"))

    @classmethod
    def read(cls, path: Path) -> StageFile:
        """The record at ``path``; a provenance error naming it when it is unreadable, not a stage record, or records a
        file outside its folder."""
        try:
            data = read_json(path)
        except (OSError, ValueError) as exc:
            raise ProvenanceError(f"{path} is unreadable ({first_line(exc)})") from exc
        try:
            record = cls.model_validate(data)
        except ValidationError as exc:
            problem = exc.errors()[0]
            where = ".".join(str(part) for part in problem["loc"]) or "the record"
            raise ProvenanceError(f"{path} is not a stage record ({where}: {problem['msg'].lower()})") from None
        outside = [name for name in record.files or {} if not is_plain_relative(name)]
        if outside:
            raise ProvenanceError(
                f"{path} records {outside[0]!r}, which is not a plain relative path inside its stage folder"
            )
        return record
