"""A memory-mapped checkpoint's pages handed back to the OS page cache once the part that read them has computed.

A model loaded from safetensors holds its weights as views of the file mapped into memory (pages
read from disk when first touched). A pass over the whole model touches every page, so the process
ends up holding the whole checkpoint, although it computes with one block at a time. After a part
has computed, :class:`MappedPages` gives its pages back (``madvise(MADV_DONTNEED)``): the process
holds one part; the kernel keeps the file in its page cache while memory allows (the next pass reads
it from there) and reads it from disk again when not. This is what reading each block from the
checkpoint at its turn does, without the copy.

Discarding a page of a private mapping also discards anything written into it, so only pages that
still are the file's are handed back, and they are made read-only for as long as they are managed
(a write into them faults instead of being lost). Linux only; elsewhere nothing is handed back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_FILE_PAGE = 1 << 61  # /proc/self/pagemap: the page is the file's (or shared), not a private copy written to
_PRESENT = 1 << 63


@dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    writable: bool


@dataclass(frozen=True)
class _Span:
    start: int  # page-aligned: the pages lying wholly inside one tensor
    end: int
    writable: bool  # the mapping's own protection, restored when released


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None
    if libc is not None:
        for call in (libc.madvise, libc.mprotect):
            call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            call.restype = ctypes.c_int
    return libc


def _file_mappings() -> list[_Mapping]:
    """This process's mappings of regular files (from ``/proc/self/maps``)."""
    mappings = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/") or fields[5].endswith("(deleted)"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        mappings.append(_Mapping(start, end, "w" in fields[1]))
    return mappings


def _all_file_pages(pagemap: BinaryIO, start: int, end: int) -> bool:
    """Whether every page of ``[start, end)`` present in memory is still the file's (none was written to); ``pagemap``:
    ``/proc/self/pagemap`` opened for reading."""
    pagemap.seek(start // PAGE * 8)
    entries = pagemap.read((end - start) // PAGE * 8)
    flags = memoryview(entries).cast("Q")
    return all(not entry & _PRESENT or entry & _FILE_PAGE for entry in flags)


class MappedPages:
    """The pages of the given tensors that lie in a mapped file, handed back after each use (see the module docstring).

    Use as a context manager; :meth:`release` hands back the pages of some of them (tensors not mapped from a file, or
    whose pages were written to, are left alone)."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self._spans: dict[int, _Span] = {}  # a tensor's address -> its managed pages
        libc = _libc()
        if libc is None:
            return
        try:
            mappings = _file_mappings()
            with open("/proc/self/pagemap", "rb") as pagemap:
                for tensor in tensors:
                    span = self._span(tensor, mappings, pagemap)
                    if span is not None and self._protect(libc, span, writable=False):
                        self._spans[tensor.data_ptr()] = span
        except OSError as exc:  # no /proc: nothing is managed
            log.debug("mapped pages not managed: %s", exc)
            self.close()

    @staticmethod
    def _span(tensor: torch.Tensor, mappings: list[_Mapping], pagemap: BinaryIO) -> _Span | None:
        if tensor.device.type != "cpu" or not tensor.numel() or not tensor.is_contiguous():
            return None
        first = tensor.data_ptr()
        last = first + tensor.numel() * tensor.element_size()
        start, end = -(-first // PAGE) * PAGE, last // PAGE * PAGE
        mapping = next((m for m in mappings if m.start <= first and last <= m.end), None)
        if mapping is None or end <= start or not _all_file_pages(pagemap, start, end):
            return None
        return _Span(start, end, mapping.writable)

    @staticmethod
    def _protect(libc: ctypes.CDLL, span: _Span, writable: bool) -> bool:
        protection = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return libc.mprotect(span.start, span.end - span.start, protection) == 0

    def __len__(self) -> int:
        return len(self._spans)

    def managed_bytes(self) -> int:
        """The bytes of mapped pages this hands back after use."""
        return sum(span.end - span.start for span in self._spans.values())

    def release(self, tensors: Iterable[torch.Tensor]) -> None:
        """Hand back the mapped pages of ``tensors`` (those it manages); the next read maps them again."""
        if not self._spans:  # called after every part's forward: a model not mapped from a file has nothing to walk
            return
        libc = _libc()
        for tensor in tensors:
            span = self._spans.get(tensor.data_ptr()) if tensor.device.type == "cpu" else None
            if span is not None:
                libc.madvise(span.start, span.end - span.start, mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Give the managed pages their mapping's protection back (they stay where they are)."""
        libc = _libc()
        for span in self._spans.values():
            if not self._protect(libc, span, span.writable):
                log.warning(
                    "could not restore the protection of a mapped checkpoint's pages: %s",
                    os.strerror(ctypes.get_errno()),
                )
        self._spans.clear()

    def __enter__(self) -> MappedPages:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
