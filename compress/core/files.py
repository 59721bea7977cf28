"""Atomic file-system writes, content hashing (cached by size, time stamp and inode), and compress's cache folder."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from compress.core.errors import UsageError

log = logging.getLogger(__name__)

_DISK_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


_OS_ERROR_IN_TEXT = re.compile(r"os error (\d+)")


def disk_errno(exc: BaseException) -> int | None:
    """The errno of a file system refusing a write, found in ``exc`` or its causes; None otherwise.

    Libraries written in Rust or C++ (safetensors, tokenizers, onnx) report I/O failures as their own
    exception types with ``(os error N)`` in the message, so the text is read too.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_ERRNOS:
            return current.errno
        match = _OS_ERROR_IN_TEXT.search(str(current))
        if match and int(match.group(1)) in _DISK_ERRNOS:
            return int(match.group(1))
        current = current.__cause__ or current.__context__
    return None


def is_disk_write_error(exc: BaseException) -> bool:
    """True when ``exc`` (or its cause) is the file system refusing a write."""
    return disk_errno(exc) is not None


def written_path(exc: BaseException) -> str | None:
    """The path a failed write was writing to: the destination of a copy or rename, else the file named."""
    if isinstance(exc, OSError):
        return exc.filename2 or exc.filename
    return None


def disk_write_error(exc: BaseException, path: Path | str) -> UsageError:
    """A user-facing error for a failed write, naming the path that could not be written."""
    code = disk_errno(exc)
    reason = os.strerror(code) if code is not None else (getattr(exc, "strerror", None) or str(exc))
    return UsageError(f"cannot write to {path}: {reason}")


def require_readable_file(path: Path, what: str, folder_ok: bool = False) -> None:
    """Refuse, naming ``path``, what cannot be read as a data file: nothing there, something that is neither a regular
    file nor (with ``folder_ok``) a folder (a FIFO or a device would block or never end), or an empty file."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{what} not found: {path}")
    if path.is_dir() and folder_ok:
        return
    if not path.is_file():
        kind = "a folder" if path.is_dir() else "a FIFO, a device or a socket"
        raise UsageError(f"{what} {path} is not a regular file ({kind}); give a file")
    if path.stat().st_size == 0:
        raise UsageError(f"{what} {path} is empty")


def refuse_link(path: Path, what: str = "") -> None:
    """Refuse (exit 2) a path compress is about to write through that is a symbolic link: compress never creates one
    inside a run directory, so a link there came from elsewhere and may point anywhere."""
    if Path(path).is_symlink():
        raise UsageError(
            f"{path}{f' ({what})' if what else ''} is a symbolic link, which compress never creates; it writes "
            "nothing through a link: remove it and run again"
        )


def open_no_follow(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a regular file that never follows a symbolic link in the last component; a link or anything but a
    regular file is refused (exit 2) naming it, and a disk error names the path."""
    try:  # non-blocking: a FIFO planted under the name must not hang the open (no effect on a regular file)
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            refuse_link(path)
            raise
        if exc.errno == errno.ENXIO:  # a FIFO with no reader
            raise UsageError(
                f"{path} is not a regular file; compress writes only files it created there: remove it"
            ) from exc
        if is_disk_write_error(exc) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise disk_write_error(exc, path) from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{path} is not a regular file; compress writes only files it created there: remove it")
    return fd


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


def rewrite_in_place(path: Path, data: bytes) -> None:
    """Overwrite an existing regular file with ``data`` over its own blocks, then cut it to ``data``'s length: for a
    record that must be written when the disk is too full for :func:`atomic_write_bytes`' temporary file (``data`` no
    longer than the file needs no new block)."""
    fd = open_no_follow(path, os.O_WRONLY)
    try:
        written = 0
        while written < len(data):
            written += os.pwrite(fd, data[written:], written)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write UTF-8 text atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically, pretty-printed, keys in insertion order."""
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path: Path) -> Any:
    """Read a JSON file; one nested too deeply to parse is a ValueError, as any other malformed JSON is."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{path} is JSON nested too deeply to be a file compress wrote") from None


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


@contextmanager
def waiting_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed), waiting for any other holder to let go.

    For work several processes may start at once and only one should do, such as filling a cache
    entry: the kernel releases the lock when its holder exits, however it exits.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def cache_root() -> Path:
    """Where compress caches what it can recompute (converted models, file hashes, timing caches): ``$COMPRESS_CACHE``
    or ``~/.cache/compress``; a usage error when that names a file."""
    root = Path(os.environ.get("COMPRESS_CACHE") or Path.home() / ".cache" / "compress")
    if root.exists() and not root.is_dir():
        raise UsageError(
            f"COMPRESS_CACHE={root} is a file; point it at a folder (compress caches converted models there)"
        )
    return root


def sha256_file(path: Path) -> str:
    """Hex sha256 of one file."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def file_stamp(path: Path) -> dict[str, int]:
    """What identifies a file's content cheaply: size, modification and change times (ns) and inode. The change time
    moves on every write and cannot be set back, so a file rewritten with its old modification time is still seen."""
    stat = Path(path).stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns, "inode": stat.st_ino}


def cached_sha256(path: Path) -> str:
    """:func:`sha256_file`, remembered in the cache folder by absolute path, size, time stamp and inode, so a large
    model is read once until it changes."""
    path = Path(path).resolve()
    stamp = file_stamp(path)
    entry = cache_root() / "hashes" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    try:
        known = json.loads(entry.read_text(encoding="utf-8"))
        if known.get("path") == str(path) and all(known.get(key) == value for key, value in stamp.items()):
            return known["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    if stamp["size"] > 1 << 29:
        log.info("hashing %s (%.1f GB; once until it changes)", path.name, stamp["size"] / 1e9)
    digest = sha256_file(path)
    with suppress(OSError):  # an unwritable cache only costs the next reader a full read
        atomic_write_json(entry, {"path": str(path), **stamp, "sha256": digest})
    return digest


def folder_files(path: Path) -> list[Path]:
    """The files under a folder, sorted, following no linked folder (a link loop cannot recurse)."""
    found = []
    for root, dirs, files in os.walk(path, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not os.path.islink(os.path.join(root, d)))
        found.extend(Path(root) / name for name in files)
    return sorted(found)


def top_level_files(folder: Path) -> list[Path]:
    """The files at the top of a folder, sorted: no sub-folder's, no hidden one (a hub's ``.cache``, a lock)."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and not p.name.startswith("."))


def top_level_sha256(folder: Path, file_sha256=cached_sha256) -> str:
    """Hex sha256 over :func:`top_level_files` of ``folder`` (names and contents): the content of a model folder."""
    digest = hashlib.sha256()
    for file in top_level_files(folder):
        digest.update(file.name.encode())
        digest.update(file_sha256(file).encode())
    return digest.hexdigest()


def sha256_path(path: Path, file_sha256=sha256_file) -> str:
    """Hex sha256 of a file, or of a folder (relative names and contents, in sorted order)."""
    path = Path(path)
    if path.is_file():
        return file_sha256(path)
    digest = hashlib.sha256()
    for item in folder_files(path):
        digest.update(str(item.relative_to(path)).encode())
        digest.update(file_sha256(item).encode())
    return digest.hexdigest()


def content_sha256(path: Path) -> str:
    """:func:`sha256_path` with each file's hash cached (a model folder or file the user gave)."""
    return sha256_path(path, cached_sha256)


_FICLONE = 0x40049409  # linux/fs.h: share the source's blocks copy-on-write (btrfs, XFS, bcachefs)


def clone_or_copy(source: Path, destination: Path) -> None:
    """A copy of ``source`` at ``destination`` that shares no writable inode with it: a copy-on-write clone where the
    file system makes one, else a plain copy. Never a hard link (writing through one would change the source)."""
    with open(source, "rb") as src, open(destination, "wb") as dst:
        try:
            fcntl.ioctl(dst.fileno(), _FICLONE, src.fileno())
        except OSError:
            shutil.copyfileobj(src, dst, 1 << 24)
    shutil.copystat(source, destination)


def path_size(path: Path) -> int:
    """Bytes on disk of a file or of every file under a folder."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in folder_files(path))
