"""``compress validate RUN_DIR``: gate a finished run against a (possibly different) target.

The stored measurements of the run's validation are reused; only the latency model's predictions
and the gate are recomputed, so no model is loaded. ``--on-device`` replaces the predicted latency
and memory checks with measurements of the run's engine on this device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.core.artifact import REPORT, Deployment
from compress.core.config import Target, apply_budget_overrides, load_target, parse_target, select_power_mode
from compress.core.errors import EXIT_NOT_MEASURED, MissingBackendError, UsageError
from compress.core.files import atomic_write_json, atomic_write_text, read_json
from compress.core.rundir import MANIFEST_FILE, REPORT_JSON, RunDir, locked, record_written, validate_output_stem
from compress.eval import decoder as decoder_gate
from compress.eval import encoder as encoder_gate
from compress.eval.gate import NOT_MEASURED, Check, exit_code_for, gate_json, upper_bound_check
from compress.eval.gate import require_measured as require_measured_checks
from compress.models.config_file import ModelConfig
from compress.pipeline.device import measure_on_device
from compress.report.markdown import render_markdown

REVALIDATE_KEYS = ("target", "power")
ON_DEVICE_CHECKS = ("decode_latency_ms", "ttft_ms", "memory_gb")


def _measured_figures(measured: dict[str, Any]) -> tuple[dict[str, float | None], str]:
    """(decode latency, TTFT, peak memory) from either runtime's measurement, and where they came from."""
    if measured.get("runtime") == "edgellm":
        mode = measured.get("power_mode_read") or "not read (no nvpmodel)"
        return (
            {
                "decode_latency_ms": measured["decode_latency_ms"],
                "ttft_ms": measured["ttft_ms"],
                "memory_gb": measured["peak_device_memory_gb"],
            },
            f"Edge-LLM llm_inference profile, nvpmodel mode {mode}",
        )
    return ({"decode_latency_ms": measured["decode"]["p50_ms"], "ttft_ms": measured["ttft_ms"],
             "memory_gb": measured["peak_device_memory_gb"]}, "TensorRT engine on this device")


def _on_device_checks(run_dir: Path, checks: list[Check], target) -> tuple[list[Check], dict[str, Any]]:
    """Replace predicted latency and memory checks by measurements with the engine, or mark them not run."""
    try:
        measured = measure_on_device(run_dir, target.budgets.prompt_length)
    except MissingBackendError as exc:
        reason = str(exc)
        return [Check(c.name, None, c.limit, NOT_MEASURED, "measured", c.unit, reason) if c.name in ON_DEVICE_CHECKS
                else c for c in checks], {"status": reason, "ran": False}
    budgets = target.budgets
    figures, source = _measured_figures(measured)
    limits = {"decode_latency_ms": (budgets.max_decode_latency_ms, "ms"), "ttft_ms": (budgets.max_ttft_ms, "ms"),
              "memory_gb": (budgets.max_memory_gb, "GB")}
    replaced = []
    for check in checks:
        if check.name not in limits:
            replaced.append(check)
        elif figures[check.name] is None:
            replaced.append(
                Check(check.name, None, check.limit, NOT_MEASURED, "measured", check.unit, f"{source}: no figure")
            )
        else:
            replaced.append(upper_bound_check(check.name, figures[check.name], limits[check.name][0], "measured",
                                              limits[check.name][1], source))
    return replaced, {**measured, "status": "measured", "ran": True}


def revalidate(run_dir: Path, pairs: dict[str, str], require_measured: bool = False,
               on_device: bool = False) -> tuple[dict[str, Any], Path]:
    """Recompute the gate; writes ``validate-<target>-<mode>.json|.md`` beside ``report.json`` and returns the report
    and the ``.md`` path.

    With ``on_device`` and no device to measure on, the exit code is 3 (not measured) whatever the host checks say.
    """
    run_dir = Path(run_dir)
    run = RunDir(run_dir)
    if not (run_dir / REPORT_JSON).is_file() or run.manifest()["status"] != "finished":
        raise UsageError(f"{run_dir} is not a finished run (no {REPORT_JSON})")
    with locked(run_dir):
        run.require_intact()
        return _revalidate(run_dir, pairs, require_measured, on_device)


def _target_of(run_dir: Path, pairs: dict[str, str]) -> Target:
    """The target asked for, else the one the run was made for, as it was resolved then (so a target file that has
    since moved or changed still gates the same way)."""
    if "target" in pairs:
        return load_target(pairs["target"])
    manifest = RunDir(run_dir).manifest()
    if isinstance(manifest.get("target_config"), dict):
        return parse_target(manifest["target_config"], f"{run_dir / MANIFEST_FILE} (target_config)")
    return load_target(manifest["target"])


def _encoder_checks(run_dir: Path, stored: dict[str, Any], target, mode: str,
                    on_device: bool) -> tuple[list[Check], dict[str, Any], dict[str, Any] | None]:
    """An encoder run's gate for ``target``: stored fidelity, predictions recomputed, batch latency measured when
    asked."""
    predicted = encoder_gate.predictions(
        stored["shape"], stored["precision"], target, mode, stored["metrics"]["median_tokens"]
    )
    checks = encoder_gate.gate_checks(stored["metrics"], predicted, target, must_measure=False)
    if not on_device:
        return checks, predicted, None
    try:
        measured = measure_on_device(run_dir, encoder_batch=target.budgets.encoder_batch)
    except MissingBackendError as exc:
        return (
            [
                Check(c.name, None, c.limit, NOT_MEASURED, "measured", c.unit, str(exc))
                if c.name == "encoder_batch_ms"
                else c
                for c in checks
            ],
            predicted,
            {"status": str(exc), "ran": False},
        )
    row = next(r for r in measured["batches"] if r["batch"] == target.budgets.encoder_batch)
    checks = [
        upper_bound_check(
            c.name,
            row["p50_ms"],
            target.budgets.max_encoder_batch_ms,
            "measured",
            "ms",
            f"TensorRT engine on this device, batch {row['batch']} (p50)",
        )
        if c.name == "encoder_batch_ms"
        else c
        for c in checks
    ]
    return checks, predicted, {**measured, "status": "measured", "ran": True}


def _decoder_checks(run_dir: Path, stored: dict[str, Any], target, mode: str,
                    on_device: bool) -> tuple[list[Check], dict[str, Any], dict[str, Any] | None]:
    """A decoder run's gate for ``target``: stored quality, predictions recomputed, latency measured when asked."""
    predictions = decoder_gate.target_predictions(
        ModelConfig(stored["model_config"]), stored["precision"], target, mode,
        Deployment.model_validate(stored["deployment"])
    )
    checks = decoder_gate.gate_checks(stored["metrics"], predictions, target, must_measure=False)
    device_result = None
    if on_device:
        checks, device_result = _on_device_checks(run_dir, checks, target)
    return checks, predictions, device_result


def _revalidate(
    run_dir: Path, pairs: dict[str, str], require_measured: bool, on_device: bool
) -> tuple[dict[str, Any], Path]:
    budget_overrides = {k.split(".", 1)[1]: v for k, v in pairs.items() if k.startswith("budgets.")}
    unknown = [k for k in pairs if k not in REVALIDATE_KEYS and not k.startswith("budgets.")]
    if unknown:
        raise UsageError(f"unknown key {unknown[0]!r} (known: {', '.join(REVALIDATE_KEYS)}, budgets.KEY)")
    report = read_json(run_dir / REPORT_JSON)
    target = _target_of(run_dir, pairs)
    if budget_overrides:
        target = apply_budget_overrides(target, budget_overrides)
    mode = (select_power_mode(target, pairs["power"]) if "power" in pairs else target.power_mode()).name
    validation_dir, record = RunDir(run_dir).require_stage_producing(REPORT, "a validation")
    # The measurements as the stage recorded them; what they were made on (shape, precision) from its output.
    stored = {**read_json(validation_dir / record.output.path), "metrics": record.metrics}
    gate_for = _encoder_checks if stored.get("model_kind") == "encoder" else _decoder_checks
    checks, predictions, device_result = gate_for(run_dir, stored, target, mode, on_device)
    gate = gate_json(require_measured_checks(checks) if require_measured else checks)
    exit_code = (
        EXIT_NOT_MEASURED if device_result is not None and not device_result["ran"] else exit_code_for(gate["verdict"])
    )
    new_report = {**report, "target": {"name": target.name, "power_mode": mode, "budgets": target.budgets.model_dump()},
                  "predictions": predictions, "gate": gate, "exit_code": exit_code,
                  "revalidated_from": report["target"]["name"], "on_device": device_result}
    stem = validate_output_stem(target.name, mode)
    atomic_write_json(run_dir / f"{stem}.json", new_report)
    atomic_write_text(run_dir / f"{stem}.md", render_markdown(new_report))
    record_written(run_dir, [run_dir / f"{stem}.json", run_dir / f"{stem}.md"])
    return new_report, run_dir / f"{stem}.md"
