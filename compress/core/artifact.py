"""Artifacts: what a stage takes and gives, stored in the run directory."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HF_MODEL = "hf-model"
ONNX = "onnx"
ENGINE = "engine"
EDGELLM_BUNDLE = "edgellm-bundle"
REPORT = "report"
SOURCE = "source"


@dataclass(frozen=True)
class Artifact:
    """A stage output: its kind, where it lives, free-form metadata and its content hash."""

    kind: str
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)
    sha256: str = ""

    def to_json(self, relative_to: Path | None = None) -> dict[str, Any]:
        data = asdict(self)
        path = Path(self.path)
        if relative_to is not None:
            with contextlib.suppress(ValueError):
                path = path.relative_to(relative_to)
        data["path"] = str(path)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], base: Path | None = None) -> Artifact:
        path = Path(data["path"])
        if base is not None and not path.is_absolute():
            path = base / path
        return cls(kind=data["kind"], path=path, meta=dict(data.get("meta", {})), sha256=data.get("sha256", ""))
