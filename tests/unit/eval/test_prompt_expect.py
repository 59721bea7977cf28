"""An app prompt's ``expect`` pattern runs under a time bound: one that backtracks without bound is an error, not a
hang."""

from __future__ import annotations

import time

import pytest

from compress.core.errors import UsageError
from compress.eval.prompts import EXPECT_TIMEOUT_S, passes_expect


def test_a_backtracking_pattern_is_stopped_and_named():
    started = time.monotonic()
    with pytest.raises(UsageError, match=r"\(a\|aa\)\+\$.*backtracks"):
        passes_expect("(a|aa)+$", "a" * 60 + "b")
    assert time.monotonic() - started < 3 * EXPECT_TIMEOUT_S + 5  # the engine looks at its clock now and then


def test_the_pattern_that_hung_validation_returns_at_once():
    started = time.monotonic()
    assert passes_expect("(.|.)*QQQZ", "an answer of some length " * 40) is False
    assert time.monotonic() - started < EXPECT_TIMEOUT_S


def test_an_ordinary_pattern_still_matches_case_insensitively():
    assert passes_expect(r"\bparis\b", "The capital of France is Paris.") is True
    assert passes_expect(r"\blyon\b", "The capital of France is Paris.") is False
    assert passes_expect(None, "anything") is None
