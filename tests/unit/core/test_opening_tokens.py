"""A text far longer than the token budget is tokenized only as far as the budget needs, and the tokens kept are exactly
the whole text's first tokens."""

from __future__ import annotations

import random
import resource
import time

import pytest

from compress.core import text
from compress.core.text import TextSource, source_ids
from compress.core.token_cache import encode_plain
from tests.conftest import REPO, build_tokenizer

EVALUATION = sorted((REPO / "compress" / "catalog" / "text" / "evaluation").glob("*.txt"))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize("path", EVALUATION, ids=lambda p: p.stem)
def test_the_opening_s_tokens_are_the_whole_text_s(tokenizer, path, tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    whole = path.read_text(encoding="utf-8")
    expected = encode_plain(tokenizer, whole)
    for budget in (1, 256, 2048):
        assert text._encode_opening(tokenizer, whole, budget).tolist() == expected[:budget].tolist()


def test_a_single_line_of_many_megabytes_is_tokenized_no_further_than_the_budget(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "omicron"]
    line = " ".join(rng.choice(words) for _ in range(5_000_000))  # about 33 MB, one line
    seen: list[int] = []
    real = text.encode_plain

    def counting(tok, piece):
        seen.append(len(piece))
        return real(tok, piece)

    monkeypatch.setattr(text, "encode_plain", counting)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    ids = source_ids(tokenizer, TextSource(tmp_path / "huge.txt", "0" * 64, line, "huge"), max_tokens=256)
    assert ids.numel() == 256 and max(seen) < 100_000  # characters handed to the tokenizer at most
    assert time.monotonic() - started < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # kB: no whole-text tokenization


@pytest.mark.parametrize("path", EVALUATION[:3], ids=lambda p: p.stem)
def test_the_overlap_check_samples_the_same_shingles_without_building_them_all(path):
    whole = path.read_text(encoding="utf-8")
    every = text.word_shingles(whole)
    assert text.sampled_shingles(whole) == every[:: max(1, len(every) // text._OVERLAP_PROBES)][: text._OVERLAP_PROBES]
    assert text.sampled_shingles("too few words here") == []
