"""Assemble ``report.json`` from what the run directory holds, and write it with the human reports.

Everything comes from the run directory: the manifest (target, budgets, recipe, model, data,
versions, the stage list) and each stage's ``stage.json`` (status, duration, memory, metrics, its
summary line and figures). No stage is found by its name: the gate is the stage whose output is
a report, the artifacts are the last of each kind.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from compress.core.artifact import EDGELLM_BUNDLE, ENGINE, ONNX, REPORT
from compress.core.files import atomic_write_json, atomic_write_text
from compress.core.rundir import MODEL_CARD, PLOTS_DIR, REPORT_HTML, REPORT_JSON, REPORT_MD, RunDir
from compress.core.stage_record import StageFile
from compress.eval.gate import NOT_MEASURED, exit_code_for
from compress.report.html import render_html
from compress.report.markdown import render_markdown
from compress.report.model_card import render_model_card
from compress.report.plots import make_plots
from compress.report.schema import Report

REPORT_SCHEMA_VERSION = "1.0"


def _artifact_path(stages: list[dict[str, Any]], kind: str, run_dir: Path, deferred: bool = False) -> str | None:
    """Path of the last artifact of ``kind``; a deferred engine is a build plan, not an engine."""
    for stage in reversed(stages):
        output = stage["output"]
        if output["kind"] == kind and bool(output["meta"].get("deferred")) == deferred:
            path = run_dir / stage["dir"] / output["path"]
            if kind == ENGINE and not deferred:
                path = path / output["meta"].get("engine_file", "")
            return str(path.relative_to(run_dir))
    return None


_UNFINISHED = {"duration_s": None, "peak_rss_mb": None, "peak_device_memory_mb": None, "metrics": {}, "summary": "",
               "figures": {}, "output": {"kind": None, "path": "", "meta": {}}}


def _stage_figures(record: StageFile) -> dict[str, Any]:
    """What the report shows of a finished stage's record."""
    output = record.output.model_dump(mode="json", include={"kind", "path", "meta", "sha256", "read_in_place"})
    figures = record.model_dump(mode="json", include={"duration_s", "peak_rss_mb", "peak_device_memory_mb", "metrics",
                                                      "summary", "figures"})
    return {**figures, "output": output}


def _stage_entries(run: RunDir) -> list[dict[str, Any]]:
    entries = []
    for entry, record in run.stages():
        entries.append({"name": entry["name"], "dir": entry["dir"], "status": entry["status"],
                        **(_stage_figures(record) if record else _UNFINISHED)})
    return entries


def build_report(run_dir: Path) -> Report:
    """The machine-readable report of the run in ``run_dir``."""
    run = RunDir(run_dir)
    manifest = run.manifest()
    stages = _stage_entries(run)
    validation = next((s["output"]["meta"] for s in reversed(stages) if s["output"]["kind"] == REPORT), None)
    gate = (
        validation["gate"]
        if validation
        else {"verdict": NOT_MEASURED, "checks": [], "detail": "the recipe has no validate stage"}
    )
    report: Report = {
        "schema_version": REPORT_SCHEMA_VERSION,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "target": {"name": manifest["target"], "power_mode": manifest["power_mode"], "budgets": manifest["budgets"]},
        "model": {"spec": manifest["model"]["spec"], "license": manifest["model"].get("license", "unknown")},
        "recipe": manifest["recipe"]["name"],
        "stages": [
            {
                key: stage[key]
                for key in (
                    "name",
                    "dir",
                    "status",
                    "duration_s",
                    "peak_rss_mb",
                    "peak_device_memory_mb",
                    "metrics",
                    "summary",
                    "figures",
                )
            }
            | {"kind": stage["output"]["kind"]}
            for stage in stages
        ],
        "artifacts": {
            "onnx": _artifact_path(stages, ONNX, run.path),
            "engine": _artifact_path(stages, ENGINE, run.path),
            "engine_build_plan": _artifact_path(stages, ENGINE, run.path, deferred=True),
            "edgellm_bundle": _artifact_path(stages, EDGELLM_BUNDLE, run.path),
        },
        "predictions": validation.get("predictions") if validation else None,
        "data": manifest["data"],
        "versions": manifest["versions"],
        "gate": gate,
    }
    report["exit_code"] = exit_code_for(gate["verdict"])
    return report


def write_reports(run_dir: Path, report: Report) -> list[Path]:
    """Write ``report.json``, ``report.md``, ``report.html`` (with plots) and ``MODEL_CARD.md`` atomically; returns
    every file written."""
    plots = make_plots(report, run_dir / PLOTS_DIR)
    report["plots"] = {name: str(path.relative_to(run_dir)) for name, path in plots.items()}
    atomic_write_json(run_dir / REPORT_JSON, report)
    atomic_write_text(run_dir / REPORT_MD, render_markdown(report))
    atomic_write_text(run_dir / REPORT_HTML, render_html(report, plots))
    atomic_write_text(run_dir / MODEL_CARD, render_model_card(report))
    return [run_dir / name for name in (REPORT_JSON, REPORT_MD, REPORT_HTML, MODEL_CARD)] + list(plots.values())
