"""``MODEL_CARD.md``: what the final model is, where it came from, and how it measured."""

from __future__ import annotations

from typing import Any

from compress.report.figures import QUANTIZATION, figure, validation_metrics
from compress.report.markdown import md_code, md_text


def render_model_card(report: dict[str, Any]) -> str:
    """A model card for the run's final artifact."""
    stages = [s["name"] for s in report["stages"]]
    validate = validation_metrics(report)
    quantization = figure(report, QUANTIZATION)
    data = report.get("data", {})
    lines = [
        f"# Model card: {md_text(report['model']['spec'])} compressed for {report['target']['name']}",
        "",
        f"- Source model: {md_code(report['model']['spec'])} (licence: {md_text(report['model']['license'])})",
        f"- Target: `{report['target']['name']}`, power mode `{report['target']['power_mode']}`",
        f"- Recipe: `{report['recipe']}` ({' → '.join(stages)})",
        f"- Final artifact: `{report['artifacts'].get('engine') or report['artifacts'].get('onnx')}`",
        f"- Gate: **{report['gate']['verdict']}**",
        "",
        "## Compression",
        "",
    ]
    if quantization:
        lines.append(f"- Quantization: {quantization}")
    else:
        lines.append("- None (reference export)")
    lines += ["", "## Calibration and evaluation data", ""]
    for role in ("calibration", "evaluation"):
        for item in data.get(role, []):
            lines.append(
                f"- {role} ({md_text(item.get('domain', ''))}): {md_code(item['path'])} (sha256 `{item['sha256']}`)"
            )
    if data.get("unseen_domains"):
        names = ", ".join(map(md_text, data["unseen_domains"]))
        lines.append(f"- evaluation domains no calibration or training text came from: {names}")
    lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
    for key in (
        "perplexity_teacher",
        "perplexity_model",
        "perplexity_onnx",
        "perplexity_torch_quantized",
        "perplexity_increase_pct",
        "perplexity_increase_pct_mixed",
        "top1_agreement",
        "mean_kl",
        "model_size_bytes",
    ):
        if validate.get(key) is not None:
            lines.append(f"| {key} | {validate[key]:.4g} |")
    for check in report["gate"]["checks"]:
        lines.append(
            f"| {check['name']} ({check['source']}) | {check['value']} (limit {check['limit']}, {check['verdict']}) |"
        )
    lines += ["", "## Library versions", ""]
    for name, version in report.get("versions", {}).items():
        lines.append(f"- {name} {version}")
    return "\n".join(lines) + "\n"
