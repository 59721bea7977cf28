"""Token ids remembered by content: what comes back is what the tokenizer says, for this tokenizer and this text
only."""

from __future__ import annotations

import numpy as np
import pytest

from compress.core import token_cache
from compress.core.token_cache import CACHED_MIN_CHARS, encode_plain
from tests.conftest import CALIB, build_tokenizer


@pytest.fixture()
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(token_cache, "_in_memory", {})
    return tmp_path / "cache" / "tokens"


def test_cached_ids_are_the_tokenizers_and_a_damaged_entry_is_tokenized_again(fresh_cache, monkeypatch):
    tokenizer = build_tokenizer()
    text = CALIB.read_text(encoding="utf-8")[:2 * CACHED_MIN_CHARS]
    expected = tokenizer(text, add_special_tokens=False).input_ids
    assert encode_plain(tokenizer, text).tolist() == expected
    (entry,) = fresh_cache.iterdir()
    monkeypatch.setattr(token_cache, "_in_memory", {})
    assert encode_plain(tokenizer, text).tolist() == expected  # read back from the folder
    entry.write_bytes(b"not an array")
    monkeypatch.setattr(token_cache, "_in_memory", {})
    assert encode_plain(tokenizer, text).tolist() == expected


def test_another_tokenizer_or_another_text_is_another_entry(fresh_cache):
    text = CALIB.read_text(encoding="utf-8")[:2 * CACHED_MIN_CHARS]
    small, large = build_tokenizer(vocab_size=300), build_tokenizer(vocab_size=600)
    ids_small, ids_large = encode_plain(small, text), encode_plain(large, text)
    assert len(ids_small) > len(ids_large)  # a larger vocabulary merges more
    assert ids_large.tolist() == large(text, add_special_tokens=False).input_ids
    assert encode_plain(small, text[1:]).tolist() == small(text[1:], add_special_tokens=False).input_ids
    assert len(list(fresh_cache.iterdir())) == 3
    with pytest.raises(ValueError):
        ids_small[0] = 0  # shared between readers: never changed in place
    assert isinstance(ids_small, np.ndarray)
