"""Token ids of long texts, remembered by content: every calibrating stage of a run (and every run on the same text and
tokenizer) reads the same few megabytes of text, and tokenizing them again is most of a small run's time."""

from __future__ import annotations

import hashlib
import io
import json
import weakref
from contextlib import suppress

import numpy as np

from compress.core.files import atomic_write_bytes, cache_root

CACHED_MIN_CHARS = 65_536  # shorter texts tokenize in milliseconds; a cache entry would cost more than it saves
_MEMORY_ENTRIES = 16
_in_memory: dict[str, np.ndarray] = {}
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything that decides how a tokenizer splits text: its class, its full definition (the fast
    tokenizer's JSON, else its vocabulary) and the special tokens it was given."""
    with suppress(TypeError):
        if tokenizer in _fingerprints:
            return _fingerprints[tokenizer]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    special = json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str)
    digest = hashlib.sha256(f"{type(tokenizer).__name__}\0{definition}\0{special}".encode()).hexdigest()
    with suppress(TypeError):
        _fingerprints[tokenizer] = digest
    return digest


def encode_plain(tokenizer, text: str) -> np.ndarray:
    """``tokenizer(text, add_special_tokens=False).input_ids`` as int64 (read-only), from memory or the cache folder
    when this tokenizer has read this text before (keyed by both contents; an unreadable or unwritable cache only costs
    the tokenization)."""
    if len(text) < CACHED_MIN_CHARS:
        return _frozen(tokenizer(text, add_special_tokens=False).input_ids)
    key = hashlib.sha256(
        f"{tokenizer_fingerprint(tokenizer)}\0".encode() + text.encode("utf-8", "surrogatepass")
    ).hexdigest()
    if key in _in_memory:
        return _in_memory[key]
    entry = cache_root() / "tokens" / f"{key[:40]}.npy"
    ids = _read_entry(entry)
    if ids is None:
        ids = _frozen(tokenizer(text, add_special_tokens=False).input_ids)
        with suppress(OSError):
            buffer = io.BytesIO()
            np.save(buffer, ids, allow_pickle=False)
            atomic_write_bytes(entry, buffer.getvalue())
    while len(_in_memory) >= _MEMORY_ENTRIES:
        _in_memory.pop(next(iter(_in_memory)))
    _in_memory[key] = ids
    return ids


def _frozen(ids) -> np.ndarray:
    array = np.asarray(ids, dtype=np.int64)
    array.flags.writeable = False
    return array


def _read_entry(entry) -> np.ndarray | None:
    try:
        array = np.load(entry, allow_pickle=False)
    except (OSError, ValueError):
        return None
    return _frozen(array) if array.ndim == 1 and array.dtype == np.int64 else None
