"""``report.html``: one self-contained page (plots embedded), readable offline."""

from __future__ import annotations

import base64
from html import escape
from pathlib import Path
from typing import Any

from compress.report.figures import DOMAIN_QUALITY, figure
from compress.report.markdown import DOMAIN_HEADERS, _fmt, decoder_predictions, domain_rows

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:60rem;color:#222}
table{border-collapse:collapse;margin:1rem 0;width:100%}td,th{border:1px solid #ccc;padding:.3rem .5rem;text-align:left}
th{background:#f3f3f3}.PASS{color:#1a7f37;font-weight:bold}.FAIL{color:#cf222e;font-weight:bold}
.NOT_MEASURED{color:#9a6700;font-weight:bold}img{max-width:100%;border:1px solid #eee;margin:.5rem 0}
"""


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _image(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def _domain_section(report: dict[str, Any]) -> list[str]:
    metrics = figure(report, DOMAIN_QUALITY) or {}
    rows = domain_rows(metrics)
    if not rows:
        return []
    unseen = ", ".join(metrics.get("unseen_domains") or []) or "none"
    return [
        "<h2>Quality per evaluation domain</h2>",
        f"<p>The accuracy budget applies to the worst domain (<b>{escape(metrics['worst_domain'])}</b>). Unseen "
        "domains "
        f"(no calibration or training text came from them): {escape(unseen)}.</p>",
        _table(DOMAIN_HEADERS, [[escape(cell) for cell in row] for row in rows]),
    ]


def render_html(report: dict[str, Any], plots: dict[str, Path]) -> str:
    """The report as a standalone HTML page."""
    gate = report["gate"]
    target = report["target"]
    bound = {"lower": "≥ ", "upper": "≤ "}
    checks = [[escape(c["name"]), f"{_fmt(c['value'])} {escape(c.get('unit', ''))}",
               f"{bound.get(c.get('bound', 'upper'), '')}{_fmt(c['limit'])} {escape(c.get('unit', ''))}",
               f'<span class="{c["verdict"]}">{c["verdict"]}</span>', escape(c["source"]), escape(c.get("detail", ""))]
              for c in gate["checks"]]
    stages = [[str(i), escape(s["name"]), escape(s["status"]), _fmt(s.get("duration_s")), _fmt(s.get("peak_rss_mb")),
               escape(s.get("summary", ""))] for i, s in enumerate(report["stages"], start=1)]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>compress report: {escape(report['model']['spec'])} on {escape(target['name'])}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{escape(report['model']['spec'])} on {escape(target['name'])}</h1>",
        f"<p>Gate: <span class='{gate['verdict']}'>{gate['verdict']}</span> (exit code {report['exit_code']}), "
        f"recipe <code>{escape(report['recipe'])}</code>, power mode <code>{escape(target['power_mode'])}</code>.</p>",
        "<h2>Gate checks</h2>",
        _table(["check", "value", "limit", "verdict", "source", "detail"], checks),
        *_domain_section(report),
        "<h2>Stages</h2>",
        _table(["#", "stage", "status", "time (s)", "peak RSS (MB)", "summary"], stages),
    ]
    predictions = decoder_predictions(report)
    if predictions:
        rows = [
            [
                escape(m["power_mode"]),
                _fmt(m["watts"]),
                f"{m['decode_tokens_per_s']:.1f}",
                f"{m['decode_latency_ms']:.2f}",
                f"{m['ttft_ms']:.1f}",
                f"{m['memory_gb']:.2f}",
                f"{m['joules_per_token']:.3f}",
            ]
            for m in predictions["modes"]
        ]
        parts += [f"<h2>Predicted on {escape(predictions['target'])} (latency model)</h2>",
                  _table(["power mode", "W", "tokens/s", "ms/token", "TTFT ms", "memory GB", "J/token"], rows)]
    titles = {"stages": "Size and perplexity per stage", "domains": "Perplexity change per evaluation domain",
              "power_modes": "Decode latency per power mode",
              "pareto": "Accuracy vs latency", "sensitivity": "Per-layer quantization sensitivity",
              "distill_curve": "Distillation: perplexity vs steps"}
    for key, path in plots.items():
        parts += [f"<h2>{escape(titles.get(key, key))}</h2>", _image(path, titles.get(key, key))]
    parts.append("</body></html>")
    return "\n".join(parts)
