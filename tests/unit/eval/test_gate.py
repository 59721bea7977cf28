"""The gate never passes silently."""

from __future__ import annotations

from compress.eval.gate import (
    FAIL,
    NOT_MEASURED,
    PASS,
    Check,
    exit_code_for,
    overall_verdict,
    require_measured,
    upper_bound_check,
)


def test_upper_bound_check():
    assert upper_bound_check("x", 1.0, 2.0, "measured").verdict == PASS
    assert upper_bound_check("x", 2.0, 2.0, "measured").verdict == PASS
    assert upper_bound_check("x", 2.5, 2.0, "measured").verdict == FAIL
    missing = upper_bound_check("x", None, 2.0, "measured")
    assert missing.verdict == NOT_MEASURED and missing.value is None


def test_overall_verdict():
    ok = Check("a", 1, 2, PASS, "measured")
    bad = Check("b", 3, 2, FAIL, "predicted")
    unknown = Check("c", None, 2, NOT_MEASURED, "measured")
    assert overall_verdict([ok, ok]) == PASS
    assert overall_verdict([ok, unknown]) == NOT_MEASURED
    assert overall_verdict([ok, unknown, bad]) == FAIL
    assert overall_verdict([]) == NOT_MEASURED


def test_exit_codes_are_distinct():
    assert (exit_code_for(PASS), exit_code_for(FAIL), exit_code_for(NOT_MEASURED)) == (0, 1, 3)


def test_require_measured_only_touches_predicted_passes():
    checks = [
        Check("a", 1, 2, PASS, "measured"),
        Check("b", 1, 2, PASS, "predicted"),
        Check("c", 3, 2, FAIL, "predicted"),
    ]
    verdicts = [c.verdict for c in require_measured(checks)]
    assert verdicts == [PASS, NOT_MEASURED, FAIL]
