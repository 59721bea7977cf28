"""Records of written files (size, time stamps, inode, sha256) and checking files against them.

A record is what compress knew of a file when it wrote it. Checking a file against its record is
cheap when nothing changed (size, modification and change times and inode are compared: the change
time moves on every write and cannot be set back) and exact when something did (a file whose stamp
moved, say one copied to another machine, is hashed in full and passes only when its content is
unchanged; its hash is then remembered by its new stamp in the cache folder, so the next check is cheap
again). ``full=True`` hashes every file afresh whatever its stamp; a record without a change time or inode (an
older compress wrote it) is checked by hash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.core.files import cached_sha256, file_stamp, folder_files, sha256_file

FileRecords = dict[str, dict[str, Any]]  # relative path -> {"size", "mtime_ns", "ctime_ns", "inode", "sha256"}
_STAMP = ("mtime_ns", "ctime_ns", "inode")


def record_file(path: Path, sha256: str | None = None) -> dict[str, Any]:
    """The record of one file: size, modification and change times in nanoseconds, inode and content hash (computed
    unless given)."""
    return {**file_stamp(path), "sha256": sha256 or sha256_file(path)}


def record_folder(folder: Path, skip: frozenset[str] = frozenset()) -> FileRecords:
    """Records of every file under ``folder`` by relative path (``skip``: relative paths left out)."""
    folder = Path(folder)
    records = {}
    for path in folder_files(folder):
        relative = path.relative_to(folder).as_posix()
        if relative not in skip:
            records[relative] = record_file(path)
    return records


def is_plain_relative(path: str) -> bool:
    """Whether a recorded path is a plain relative POSIX path that stays where it is recorded: no root, no ``..``, no
    ``.``, no empty part, no backslash."""
    parts = path.split("/")
    return bool(path) and "\\" not in path and not path.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def file_problem(path: Path, record: dict[str, Any], full: bool = False) -> str | None:
    """Why ``path`` no longer holds what ``record`` says (missing, another size, another content); None when it does."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return "is missing" if not path.is_symlink() else "is a symbolic link, not the file compress wrote"
    stamp = file_stamp(path)
    if stamp["size"] != record.get("size"):
        return f"has {stamp['size']} bytes where {record.get('size')} were written"
    if not full and all(record.get(key) is not None and stamp[key] == record[key] for key in _STAMP):
        return None
    # A moved stamp (a copy, another machine) is hashed once and remembered by its own stamp, as a model's files are;
    # ``full`` hashes afresh.
    digest = sha256_file(path) if full else cached_sha256(path)
    if digest != record.get("sha256"):
        return "does not hold the content compress wrote (its sha256 differs)"
    return None


def folder_problems(
    folder: Path, records: FileRecords, full: bool = False, allowed_extra: frozenset[str] = frozenset()
) -> list[str]:
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
