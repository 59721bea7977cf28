"""``report.json`` as a type: what every run's machine-readable report holds (its ``schema_version`` says which)."""

from __future__ import annotations

from typing import TypedDict

from compress.eval.figures import DecoderPredictions, EncoderPredictions
from compress.eval.gate import CheckJson, Verdict


class ReportTarget(TypedDict):
    name: str
    power_mode: str
    budgets: dict[str, float | int | None]


class ReportModel(TypedDict):
    spec: str
    license: str


class ReportStage(TypedDict, total=False):
    """One stage as the report shows it: status, time, peak memory, its figures and the kind of artifact it made."""

    name: str
    dir: str
    status: str
    duration_s: float | None
    peak_rss_mb: float | None
    peak_device_memory_mb: float | None
    metrics: dict[str, object]
    summary: str | None
    figures: dict[str, object]
    kind: str


class ReportGate(TypedDict, total=False):
    """The gate; ``detail`` says why there is none (a recipe without a validate stage)."""

    verdict: Verdict
    checks: list[CheckJson]
    detail: str


class Report(TypedDict, total=False):
    schema_version: int
    created_at: str
    target: ReportTarget
    model: ReportModel
    recipe: str
    stages: list[ReportStage]
    artifacts: dict[str, str | None]
    predictions: DecoderPredictions | EncoderPredictions | None
    data: dict[str, object]
    versions: dict[str, str]
    gate: ReportGate
    exit_code: int
    plots: dict[str, str]
