"""Assemble ``report.json`` from the stage records and write it with ``report.md``."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compress.artifact import EDGELLM_BUNDLE, ENGINE, ONNX, REPORT
from compress.fsutil import atomic_write_json, atomic_write_text, read_json
from compress.gate import NOT_MEASURED, exit_code_for
from compress.report.html import render_html
from compress.report.markdown import render_markdown
from compress.report.model_card import render_model_card
from compress.report.plots import make_plots

if TYPE_CHECKING:
    from compress.runner import Plan, StageRecord

REPORT_SCHEMA_VERSION = "1.0"


def _last_path(records: list[StageRecord], kind: str, run_dir: Path, deferred: bool = False) -> str | None:
    """Path of the last artifact of ``kind``; a deferred engine is a build plan, not an engine."""
    for record in reversed(records):
        if record.artifact.kind == kind and bool(record.artifact.meta.get("deferred")) == deferred:
            path = Path(record.artifact.path)
            if kind == ENGINE and not deferred:
                path = path / record.artifact.meta.get("engine_file", "")
            return str(path.relative_to(run_dir))
    return None


def build_report(plan: Plan, records: list[StageRecord]) -> dict[str, Any]:
    """The machine-readable report of a finished run."""
    from compress.runner import data_record, library_versions

    run_dir = plan.out_dir
    validation = next((r for r in records if r.artifact.kind == REPORT), None)
    gate = validation.artifact.meta["gate"] if validation else {
        "verdict": NOT_MEASURED, "checks": [], "detail": "the recipe has no validate stage"}
    report = {
        "schema_version": REPORT_SCHEMA_VERSION,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "target": {"name": plan.target.name, "power_mode": plan.power_mode, "budgets": plan.target.budgets.model_dump()},
        "model": {"spec": plan.model.spec, "license": plan.model.license},
        "recipe": plan.recipe.name,
        "stages": [
            {"name": r.name, "dir": r.dirname, "status": r.status, "duration_s": r.record.get("duration_s"),
             "peak_rss_mb": r.record.get("peak_rss_mb"), "metrics": r.record.get("metrics", {})}
            for r in records
        ],
        "artifacts": {"onnx": _last_path(records, ONNX, run_dir), "engine": _last_path(records, ENGINE, run_dir),
                      "engine_build_plan": _last_path(records, ENGINE, run_dir, deferred=True),
                      "edgellm_bundle": _last_path(records, EDGELLM_BUNDLE, run_dir)},
        "predictions": validation.artifact.meta.get("predictions") if validation else None,
        "data": data_record(plan),
        "versions": library_versions(),
        "gate": gate,
    }
    report["exit_code"] = exit_code_for(gate["verdict"])
    return report


def write_reports(run_dir: Path, report: dict[str, Any]) -> None:
    """Write ``report.json``, ``report.md``, ``report.html`` (with plots) and ``MODEL_CARD.md`` atomically."""
    onnx_config = None
    if report["artifacts"].get("onnx") and (run_dir / report["artifacts"]["onnx"] / "config.json").is_file():
        onnx_config = read_json(run_dir / report["artifacts"]["onnx"] / "config.json")
    plots = make_plots(report, onnx_config, run_dir / "plots")
    report["plots"] = {name: str(path.relative_to(run_dir)) for name, path in plots.items()}
    atomic_write_json(run_dir / "report.json", report)
    atomic_write_text(run_dir / "report.md", render_markdown(report))
    atomic_write_text(run_dir / "report.html", render_html(report, plots))
    atomic_write_text(run_dir / "MODEL_CARD.md", render_model_card(report))
