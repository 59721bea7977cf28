"""``compress validate RUN_DIR``: gate a finished run against a (possibly different) target.

The stored measurements of the run's validate stage are reused; only predictions and the gate
are recomputed, so no model is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.config import load_target
from compress.errors import UsageError
from compress.fsutil import atomic_write_json, atomic_write_text, read_json
from compress.gate import exit_code_for, gate_json
from compress.report.markdown import render_markdown
from compress.runner import _apply_budget_overrides
from compress.stages.validate import gate_checks, target_predictions

REVALIDATE_KEYS = ("target", "power")


def _stage_record(run_dir: Path, name: str) -> dict[str, Any]:
    manifest = read_json(run_dir / "manifest.json")
    for stage in manifest["stages"]:
        if stage["name"] == name and (run_dir / stage["dir"] / "stage.json").is_file():
            return read_json(run_dir / stage["dir"] / "stage.json")
    raise UsageError(f"{run_dir} has no finished {name} stage")


def revalidate(run_dir: Path, pairs: dict[str, str], require_measured: bool = False) -> dict[str, Any]:
    """Recompute the gate; writes ``validate-<target>-<mode>.json|.md`` beside ``report.json``."""
    run_dir = Path(run_dir)
    if not (run_dir / "report.json").is_file():
        raise UsageError(f"{run_dir} is not a finished run (no report.json)")
    budget_overrides = {k.split(".", 1)[1]: v for k, v in pairs.items() if k.startswith("budgets.")}
    unknown = [k for k in pairs if k not in REVALIDATE_KEYS and not k.startswith("budgets.")]
    if unknown:
        raise UsageError(f"unknown key {unknown[0]!r} (known: {', '.join(REVALIDATE_KEYS)}, budgets.KEY)")
    report = read_json(run_dir / "report.json")
    target = load_target(pairs.get("target", report["target"]["name"]))
    if budget_overrides:
        target = _apply_budget_overrides(target, budget_overrides)
    mode = target.power_mode(pairs.get("power")).name
    validation = _stage_record(run_dir, "validate")
    metrics = validation["metrics"]
    onnx = _stage_record(run_dir, "export_onnx")
    onnx_dir = run_dir / report["artifacts"]["onnx"]
    predictions = target_predictions(onnx_dir, onnx["output"]["meta"].get("precision", "fp32"), target, mode)
    gate = gate_json(gate_checks(metrics, predictions, target, require_measured))
    new_report = {**report, "target": {"name": target.name, "power_mode": mode, "budgets": target.budgets.model_dump()},
                  "predictions": predictions, "gate": gate, "exit_code": exit_code_for(gate["verdict"]),
                  "revalidated_from": report["target"]["name"]}
    stem = f"validate-{target.name}-{mode}"
    atomic_write_json(run_dir / f"{stem}.json", new_report)
    atomic_write_text(run_dir / f"{stem}.md", render_markdown(new_report))
    return new_report
