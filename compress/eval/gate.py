"""The validator gate: checks with value, limit, verdict and source, and the overall verdict."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, TypedDict

from compress.core.errors import EXIT_FAIL, EXIT_NOT_MEASURED, EXIT_PASS

PASS, FAIL, NOT_MEASURED = "PASS", "FAIL", "NOT_MEASURED"
Verdict = Literal["PASS", "FAIL", "NOT_MEASURED"]
Source = Literal["measured", "predicted"]


class CheckJson(TypedDict):
    name: str
    value: float | None
    limit: float | None
    verdict: Verdict
    source: Source
    unit: str
    detail: str
    bound: Literal["upper", "lower"]


class GateJson(TypedDict):
    """The gate as ``report.json`` and ``validation.json`` hold it: the overall verdict and every check."""

    verdict: Verdict
    checks: list[CheckJson]


@dataclass(frozen=True)
class Check:
    """One gate check: ``value`` compared with ``limit``; ``bound`` says whether the limit is a maximum or a minimum."""

    name: str
    value: float | None
    limit: float | None
    verdict: Verdict
    source: Source
    unit: str = ""
    detail: str = ""
    bound: Literal["upper", "lower"] = "upper"

    def to_json(self) -> CheckJson:
        return CheckJson(**asdict(self))


def upper_bound_check(name: str, value: float | None, limit: float, source: Source, unit: str = "",
                      detail: str = "") -> Check:
    """PASS when ``value <= limit``; a missing value is NOT_MEASURED, never PASS."""
    if value is None:
        return Check(name, None, limit, NOT_MEASURED, source, unit, detail or "not measured")
    verdict: Verdict = PASS if value <= limit else FAIL
    return Check(name, float(value), limit, verdict, source, unit, detail)


def lower_bound_check(name: str, value: float | None, limit: float, source: Source, unit: str = "",
                      detail: str = "") -> Check:
    """PASS when ``value >= limit``; a missing value is NOT_MEASURED, never PASS."""
    if value is None:
        return Check(name, None, limit, NOT_MEASURED, source, unit, detail or "not measured", "lower")
    verdict: Verdict = PASS if value >= limit else FAIL
    return Check(name, float(value), limit, verdict, source, unit, detail, "lower")


def require_measured(checks: list[Check]) -> list[Check]:
    """Turn predicted checks into NOT_MEASURED (for ``--require-measured``)."""
    return [
        Check(
            c.name,
            c.value,
            c.limit,
            NOT_MEASURED,
            c.source,
            c.unit,
            "predicted, but measured values are required",
            c.bound,
        )
        if c.source == "predicted" and c.verdict != FAIL
        else c
        for c in checks
    ]


def overall_verdict(checks: list[Check]) -> Verdict:
    """FAIL if any check fails; else NOT_MEASURED if any is unmeasured (or there are none); else PASS."""
    if any(c.verdict == FAIL for c in checks):
        return FAIL
    if not checks or any(c.verdict == NOT_MEASURED for c in checks):
        return NOT_MEASURED
    return PASS


def exit_code_for(verdict: str) -> int:
    """0 for PASS, 1 for FAIL, 3 for NOT_MEASURED."""
    return {PASS: EXIT_PASS, FAIL: EXIT_FAIL}.get(verdict, EXIT_NOT_MEASURED)


def gate_json(checks: list[Check]) -> GateJson:
    return {"verdict": overall_verdict(checks), "checks": [c.to_json() for c in checks]}
