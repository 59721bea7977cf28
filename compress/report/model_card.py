"""``MODEL_CARD.md``: what the final model is, where it came from, and how it measured."""

from __future__ import annotations

from typing import Any


def render_model_card(report: dict[str, Any]) -> str:
    """A model card for the run's final artifact."""
    stages = {s["name"]: s for s in report["stages"]}
    validate = stages.get("validate", {}).get("metrics", {})
    quant = (stages.get("quantize") or stages.get("quantize_encoder") or {}).get("metrics")
    data = report.get("data", {})
    lines = [
        f"# Model card: {report['model']['spec']} compressed for {report['target']['name']}",
        "",
        f"- Source model: `{report['model']['spec']}` (licence: {report['model']['license']})",
        f"- Target: `{report['target']['name']}`, power mode `{report['target']['power_mode']}`",
        f"- Recipe: `{report['recipe']}` ({' → '.join(stages)})",
        f"- Final artifact: `{report['artifacts'].get('engine') or report['artifacts'].get('onnx')}`",
        f"- Gate: **{report['gate']['verdict']}**",
        "",
        "## Compression",
        "",
    ]
    if quant:
        scheme = quant.get("scheme") or (f"{quant['weight_bits']}-bit weights"
                                         + (f", group {quant['group_size']}" if quant.get("group_size") else ", per output channel"))
        lines.append(f"- Quantization: {quant['method']} ({quant['algorithm']}), {scheme}"
                     + (f"; calibrated on {quant['calibration_tokens']:,} tokens" if "calibration_tokens" in quant else ""))
    else:
        lines.append("- None (reference export)")
    lines += ["", "## Calibration and evaluation data", ""]
    for role in ("calibration", "evaluation"):
        for item in data.get(role, []):
            lines.append(f"- {role} ({item.get('domain', '')}): `{item['path']}` (sha256 `{item['sha256']}`)")
    if data.get("unseen_domains"):
        lines.append(f"- evaluation domains no calibration or training text came from: {', '.join(data['unseen_domains'])}")
    lines += ["", "## Metrics", "", "| metric | value |", "|---|---|"]
    for key in ("perplexity_teacher", "perplexity_torch_quantized", "perplexity_onnx", "perplexity_increase_pct",
                "perplexity_increase_pct_mixed", "top1_agreement", "mean_kl", "model_size_bytes"):
        if validate.get(key) is not None:
            lines.append(f"| {key} | {validate[key]:.4g} |")
    for check in report["gate"]["checks"]:
        lines.append(f"| {check['name']} ({check['source']}) | {check['value']} (limit {check['limit']}, {check['verdict']}) |")
    lines += ["", "## Library versions", ""]
    for name, version in report.get("versions", {}).items():
        lines.append(f"- {name} {version}")
    return "\n".join(lines) + "\n"
