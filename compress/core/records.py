"""Records of written files (size, time stamp, sha256) and checking files against them.

A record is what compress knew of a file when it wrote it. Checking a file against its record is
cheap when nothing changed (size and modification time are compared) and exact when something did
(a file whose time stamp moved, say one copied to another machine, is hashed in full and passes
only when its content is unchanged). ``full=True`` hashes every file whatever its time stamp.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.core.files import folder_files, sha256_file

FileRecords = dict[str, dict[str, Any]]  # relative path -> {"size", "mtime_ns", "sha256"}


def record_file(path: Path, sha256: str | None = None) -> dict[str, Any]:
    """The record of one file: size, modification time in nanoseconds and content hash (computed unless given)."""
    stat = Path(path).stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256 or sha256_file(path)}


def record_folder(folder: Path, skip: frozenset[str] = frozenset()) -> FileRecords:
    """Records of every file under ``folder`` by relative path (``skip``: relative paths left out)."""
    folder = Path(folder)
    records = {}
    for path in folder_files(folder):
        relative = path.relative_to(folder).as_posix()
        if relative not in skip:
            records[relative] = record_file(path)
    return records


def file_problem(path: Path, record: dict[str, Any], full: bool = False) -> str | None:
    """Why ``path`` no longer holds what ``record`` says (missing, another size, another content); None when it does."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return "is missing" if not path.is_symlink() else "is a symbolic link, not the file compress wrote"
    stat = path.stat()
    if stat.st_size != record.get("size"):
        return f"has {stat.st_size} bytes where {record.get('size')} were written"
    if not full and stat.st_mtime_ns == record.get("mtime_ns"):
        return None
    if sha256_file(path) != record.get("sha256"):
        return "does not hold the content compress wrote (its sha256 differs)"
    return None


def folder_problems(folder: Path, records: FileRecords, full: bool = False, allowed_extra: frozenset[str] = frozenset()) -> list[str]:
    """Every difference between ``folder`` and its records: files changed or missing, and files no record names
    (``allowed_extra``: relative paths that may be there unrecorded; one ending in "/" allows a whole folder)."""
    folders = tuple(name for name in allowed_extra if name.endswith("/"))
    folder = Path(folder)
    problems = []
    for relative, record in sorted(records.items()):
        problem = file_problem(folder / relative, record, full)
        if problem:
            problems.append(f"{folder / relative} {problem}")
    for path in folder_files(folder):
        relative = path.relative_to(folder).as_posix()
        if relative not in records and relative not in allowed_extra and not relative.startswith(folders):
            problems.append(f"{path} is not a file compress wrote")
    return problems
