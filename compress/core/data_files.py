"""Calibration, evaluation and training data from the files teams keep it in, read through the ``datasets`` library.

A data spec is a path, optionally followed by ``:COLUMN``:

* ``.txt``: the whole file is one domain's text (its shipped name, else the file's stem);
* ``.jsonl`` / ``.json``: rows with a ``text`` field, or a chat ``messages`` list of ``{"role", "content"}``;
* ``.csv`` / ``.parquet``: rows with a named column (``file.parquet:body``; ``text`` when none is named);
* a folder written by ``datasets``' ``save_to_disk`` (one split, or its ``train`` split).

A ``domain`` column splits one file into several domains; otherwise the file's stem names its one domain.
Every error names the file, and the row where one row is at fault. ``datasets`` caches what it parses;
compress gives it a temporary folder it removes afterwards, so nothing is written outside what compress created.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.core.errors import UsageError
from compress.core.files import require_readable_file

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt",)
_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
TEXT_COLUMN = "text"
MESSAGES_COLUMN = "messages"
DOMAIN_COLUMN = "domain"
_ARROW_ROW = re.compile(r"in row (\d+)")


@dataclass(frozen=True)
class DataSpec:
    """A data file (or ``datasets`` folder) and the column its text is in (``None``: ``text``, or chat ``messages``)."""

    path: Path
    column: str | None = None

    @property
    def is_plain_text(self) -> bool:
        return self.path.suffix.lower() in TEXT_SUFFIXES

    def __str__(self) -> str:
        return f"{self.path}:{self.column}" if self.column else str(self.path)


def parse_spec(value: str | Path) -> DataSpec:
    """``file.parquet:column`` or a plain path (a path that exists as written is never split at a colon)."""
    text = str(value)
    path = Path(text)
    if not path.exists() and ":" in text:
        head, _, column = text.rpartition(":")
        if head and column and "/" not in column:
            return DataSpec(Path(head), column)
    return DataSpec(path)


@dataclass(frozen=True)
class Record:
    """One row of a data file: plain text, or a conversation (a list of ``{"role", "content"}`` messages)."""

    row: int  # 1-based, as an editor numbers the lines of a JSON-lines file
    domain: str
    text: str = ""
    messages: tuple[dict[str, str], ...] = ()


def _builder(spec: DataSpec, role: str) -> str | None:
    """The ``datasets`` builder for a file, ``None`` for a ``save_to_disk`` folder."""
    if spec.path.is_dir():
        return None
    builder = _BUILDERS.get(spec.path.suffix.lower())
    if builder is None:
        raise UsageError(f"{role} data {spec.path}: unknown format {spec.path.suffix or '(no suffix)'} "
                         f"(use .txt, .jsonl, .json, .csv, .parquet or a datasets folder)")
    return builder


def _datasets():
    # Local files only: the library would otherwise look for the hub (and wait on its time-outs) on a machine without
    # one.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError as exc:  # a declared dependency; an environment without it is broken
        raise UsageError("reading data files needs the `datasets` package (pip install datasets)") from exc
    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its parse errors come back as ours, naming the row
    return datasets


@contextlib.contextmanager
def opened_rows(spec: DataSpec, role: str, streaming: bool = False) -> Iterator[Any]:
    """The rows of a data file as a ``datasets`` dataset (iterable when ``streaming``); its parse cache lives and dies
    here."""
    datasets = _datasets()
    builder = _builder(spec, role)
    require_readable_file(spec.path, f"{role} data", folder_ok=builder is None)
    with tempfile.TemporaryDirectory(prefix="compress-data-") as cache:
        try:
            if builder is None:
                loaded = datasets.load_from_disk(str(spec.path))
                yield _one_split(loaded, spec, role)
            else:
                yield datasets.load_dataset(builder, data_files=str(spec.path), split="train", cache_dir=cache,
                                            streaming=streaming, keep_in_memory=not streaming)
        except UsageError:
            raise
        except Exception as exc:  # the library's parse errors carry the row (0-based) deep in their chain
            raise UsageError(f"{role} data {spec.path}: {_parse_problem(exc)}") from exc


def _one_split(loaded: Any, spec: DataSpec, role: str) -> Any:
    if not hasattr(loaded, "keys"):
        return loaded
    splits = list(loaded.keys())
    if len(splits) == 1:
        return loaded[splits[0]]
    if "train" in splits:
        return loaded["train"]
    raise UsageError(f"{role} data {spec.path}: a datasets folder with splits {', '.join(splits)}; save the one to use")


def _parse_problem(exc: BaseException) -> str:
    """The innermost message of a parse error, with its row counted from 1."""
    messages = []
    while exc is not None:
        messages.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    message = next((m for m in messages if _ARROW_ROW.search(m)), None) or next(
        (m for m in reversed(messages) if m), "cannot be read"
    )
    found = _ARROW_ROW.search(message)
    if found:
        detail = _ARROW_ROW.sub("", message.rpartition(": ")[2]).strip().rstrip(".")
        return f"row {int(found.group(1)) + 1}: " + (
            f"not valid JSON ({detail})" if "JSON parse error" in message else detail
        )
    return message.splitlines()[0]


def iter_records(spec: DataSpec, role: str, streaming: bool = False) -> Iterator[Record]:
    """Every row of a data file as a checked :class:`Record`; a row without usable text is a usage error naming it."""
    with opened_rows(spec, role, streaming) as rows:
        columns = list(rows.column_names or []) if rows.column_names is not None else None
        column = _text_column(spec, columns, role)
        for index, row in enumerate(rows):
            yield _record(row, index + 1, column, spec, role)


def _text_column(spec: DataSpec, columns: list[str] | None, role: str) -> str:
    if spec.column:
        if columns is not None and spec.column not in columns:
            raise UsageError(f"{role} data {spec.path}: no column {spec.column!r} (columns: {', '.join(columns)})")
        return spec.column
    if columns is None or TEXT_COLUMN in columns or MESSAGES_COLUMN in columns:
        return TEXT_COLUMN if columns is None or TEXT_COLUMN in columns else MESSAGES_COLUMN
    raise UsageError(
        f"{role} data {spec.path}: no {TEXT_COLUMN!r} or {MESSAGES_COLUMN!r} column (columns: {', '.join(columns)}); "
        f"name one as {spec.path}:COLUMN"
    )


def _record(row: dict[str, Any], number: int, column: str, spec: DataSpec, role: str) -> Record:
    where = f"{role} data {spec.path} row {number}"
    domain = row.get(DOMAIN_COLUMN) or spec.path.stem
    if not isinstance(domain, str):
        raise UsageError(f"{where}: {DOMAIN_COLUMN!r} must be a string, not {type(domain).__name__}")
    text = row.get(column)
    messages = row.get(MESSAGES_COLUMN) if column == TEXT_COLUMN and text is None else None
    if column == MESSAGES_COLUMN:
        text, messages = None, row.get(MESSAGES_COLUMN)
    if messages is not None:
        return Record(number, domain, messages=_checked_messages(messages, where))
    if not isinstance(text, str) or not text.strip():
        found = "nothing" if text is None else f"{type(text).__name__} {str(text)[:40]!r}"
        raise UsageError(f"{where}: {column!r} holds {found}; expected text")
    return Record(number, domain, text=text)


def _checked_messages(messages: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: {MESSAGES_COLUMN!r} must be a non-empty list of {{role, content}} messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise UsageError(f"{where}: message {i + 1} must have a string 'role' and 'content'")
        checked.append({"role": message["role"], "content": message["content"]})
    return tuple(checked)
