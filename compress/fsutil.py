"""Atomic file-system writes and content hashing."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from compress.errors import UsageError

_DISK_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def is_disk_write_error(exc: BaseException) -> bool:
    """True when ``exc`` is an OS error caused by the file system refusing a write."""
    return isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS


def disk_write_error(exc: OSError, path: Path | str) -> UsageError:
    """A user-facing error for a failed write."""
    return UsageError(f"cannot write to {path}: {exc.strerror or exc}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write UTF-8 text atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically, pretty-printed, keys in insertion order."""
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path: Path) -> Any:
    """Read a JSON file."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


@contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder that is renamed to ``final`` only on success.

    A crash or kill leaves at most a ``.tmp-`` folder, never a half-written ``final``.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        os.chmod(tmp, 0o755)
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_staging(folder: Path) -> None:
    """Remove ``.tmp-*`` folders left behind by a killed process."""
    for stale in Path(folder).glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of one file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_path(path: Path) -> str:
    """Hex sha256 of a file, or of a folder (relative names and contents, in sorted order)."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    digest = hashlib.sha256()
    for item in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(item.relative_to(path)).encode())
        digest.update(sha256_file(item).encode())
    return digest.hexdigest()


def path_size(path: Path) -> int:
    """Bytes on disk of a file or of every file under a folder."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
