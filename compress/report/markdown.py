"""``report.md``: the run as a person reads it."""

from __future__ import annotations

import re
from typing import Any

from compress.report.figures import DOMAIN_QUALITY, PRECISION_SEARCH, PROMPT_ANSWERS, figure
from compress.report.schema import Report


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def decoder_predictions(report: dict[str, Any]) -> dict[str, Any] | None:
    """The latency model's decoder predictions of a report (None for an encoder run or without a validate stage)."""
    predictions = report.get("predictions")
    return predictions if predictions and predictions.get("kind") != "encoder" else None


DOMAIN_HEADERS = ["domain", "seen", "tokens", "perplexity", "reference", "change", "top-1 agreement", "mean KL (nats)"]


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>|#~!])")


def md_text(value: Any) -> str:
    """``value`` as one line of Markdown text that renders as itself: whitespace (line breaks included) collapsed and
    the characters Markdown reads as markup escaped, so a name a user gave (a domain, a prompt id, a path) can neither
    start a heading nor break a table."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(str(value).split()))


def md_code(value: Any) -> str:
    """``value`` as an inline code span on one line, fenced by more backticks than it holds."""
    text = " ".join(str(value).split())
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence} {text} {fence}" if fence != "`" else f"`{text}`"


def domain_rows(metrics: dict[str, Any]) -> list[list[str]]:
    """One row of text cells per evaluation domain, then the mixed text; empty without domain metrics."""
    domains = metrics.get("domains")
    if not domains:
        return []
    rows = []
    for name, row in [*domains.items(), ("mixed", metrics.get("mixed") or {})]:
        if not row:
            continue
        seen = "—" if name == "mixed" else ("yes" if row.get("seen") else "no (unseen)")
        rows.append(
            [
                name,
                seen,
                f"{row['tokens']:,}",
                f"{row['perplexity_model']:.3f}",
                f"{row['perplexity_reference']:.3f}",
                f"{row['perplexity_increase_pct']:+.2f}%",
                f"{100 * row['top1_agreement']:.1f}%",
                f"{row['mean_kl']:.4f}",
            ]
        )
    return rows


def _domain_table(report: dict[str, Any]) -> list[str]:
    metrics = figure(report, DOMAIN_QUALITY) or {}
    rows = domain_rows(metrics)
    if not rows:
        return []
    return [
        "",
        "## Quality per evaluation domain",
        "",
        f"The accuracy budget applies to the worst domain (**{md_text(metrics['worst_domain'])}**). Unseen domains (no "
        "calibration or training text came from them): "
        f"{', '.join(map(md_text, metrics.get('unseen_domains') or [])) or 'none'}. "
        f"{_prefix_sentence(metrics.get('window_prefix'))}",
        "",
        "| " + " | ".join(DOMAIN_HEADERS) + " |",
        "|" + "---|" * len(DOMAIN_HEADERS),
        *("| " + " | ".join([md_text(row[0]), *row[1:]]) + " |" for row in rows),
    ]


def _prefix_sentence(prefix: list[str] | None) -> str:
    """What was put before each evaluation window (the tokenizer's own rule for the start of a text)."""
    if prefix is None:
        return ""
    if not prefix:
        return "Nothing is put before a window: the tokenizer starts a text with no special token."
    return f"Each window starts with {' '.join(f'`{t}`' for t in prefix)}, as the tokenizer starts a text."


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def marked_answer(row: dict[str, Any]) -> str:
    """The deployed answer with its first difference from the teacher's marked ``⟦…⟧``."""
    if row["identical"]:
        return row["model_answer"]
    common = row["common_prefix"]
    rest = row["model_answer"][len(common):] if row["model_answer"].startswith(common) else row["model_answer"]
    return f"{common}⟦{rest}⟧"


def _prompt_table(report: dict[str, Any]) -> list[str]:
    measured = figure(report, PROMPT_ANSWERS)
    if not measured:
        return []
    lines = [
        "",
        "## The app's prompts",
        "",
        f"{measured['prompts']} prompts ({measured['source']}), greedy answers of {measured['new_tokens']} tokens at "
        f"most: **{100 * measured['identical_answers']:.0f}%** identical to the teacher's, "
        f"**{100 * measured['answer_prefix_agreement']:.0f}%** of the teacher's answer matched on average before the "
        f"first difference, first token equal in **{100 * measured['first_token_agreement']:.0f}%**.",
        "",
        "Worst first; the deployed answer's part after its first difference is marked ⟦…⟧.",
        "",
        "| id | prompt | matched | teacher's answer | deployed answer | expect |",
        "|---|---|---|---|---|---|",
    ]
    for row in measured["rows"]:
        expect = (
            "—"
            if row["expect"] is None
            else (
                f"`{row['expect']}`: teacher {'✓' if row['teacher_passes'] else '✗'}, "
                f"deployed {'✓' if row['model_passes'] else '✗'}"
            )
        )
        lines.append(f"| {md_text(row['id'])} | {_cell(row['prompt'], 80)} | {100 * row['prefix_fraction']:.0f}% | "
                     f"{_cell(row['teacher_answer'])} | {_cell(marked_answer(row))} | {_cell(expect, 80)} |")
    return lines


def _search_section(report: dict[str, Any]) -> list[str]:
    """``quantize.method=auto``: the plans measured, the uniform references, the chosen plan per block."""
    search = figure(report, PRECISION_SEARCH)
    if not search:
        return []
    answered = any("answer_prefix_agreement" in c["measured"] for c in search["candidates"])
    lines = [
        "",
        "## Precision search (quantize.method=auto)",
        "",
        f"Formats the target's deployment runs: {', '.join(search['formats'])}. First budget: predicted KL "
        f"{search['budget_kl']:.4g} nats/token ({search['margin']:g} of the gate's). Each plan is measured against the "
        f"teacher on {search['selection']['windows']} held-out calibration windows "
        f"({', '.join(search['selection']['domains'])}); the evaluation text stays for the gate"
        + (
            "; a chat model's answers to the chat calibration prompts, not the gate's, against the teacher's."
            if answered
            else "."
        ),
        "",
        "| plan | formats (groups) | predicted KL | predicted tok/s | predicted GB | predicted J/token "
        "| held-out worst domain | top-1 | KL | answer prefix | accepted |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += _search_candidates(search["candidates"])
    lines += _search_references(search)
    return lines


def _search_candidates(candidates: list[dict[str, Any]]) -> list[str]:
    """One row per plan measured, and what the next-faster plan lost."""
    lines = []
    for c in candidates:
        measured = c["measured"]
        prefix = measured.get("answer_prefix_agreement")
        lines.append(
            f"| {c['round']} | {', '.join(f'{n} {k}' for n, k in c['formats'].items())} | {c['predicted_kl']:.4g} | "
            f"{c['predicted_tokens_per_s']:.1f} | {_fmt(c.get('predicted_memory_gb'))} | "
            f"{_fmt(c.get('predicted_joules_per_token'))} | {measured['worst_domain']} "
            f"{measured['worst_increase_pct']:+.2f}% | "
            f"{100 * measured['top1_agreement']:.1f}% | {measured['mean_kl']:.4f} | "
            f"{'-' if prefix is None else f'{100 * prefix:.1f}%'} | {_verdict(c)} |"
        )
    chosen = next(c for c in candidates if c["chosen"])
    faster = [c for c in candidates if c["predicted_tokens_per_s"] > chosen["predicted_tokens_per_s"]]
    if faster:
        nearest = min(faster, key=lambda c: c["predicted_tokens_per_s"])
        lines += ["", f"The next-faster plan measured ({nearest['predicted_tokens_per_s']:.1f} tok/s predicted) lost "
                      f"{nearest['measured']['worst_increase_pct']:+.2f}% on {nearest['measured']['worst_domain']}."]
    return lines


def _search_references(search: dict[str, Any]) -> list[str]:
    """The uniform references and the chosen plan per block."""
    lines = [
        "",
        "Uniform references (each format wherever the shapes allow it, FP16 elsewhere; predicted):",
        "",
        "| reference | predicted KL | predicted tok/s | predicted GB | predicted J/token |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['name']} | {r['predicted_kl']:.4g} | {r['predicted_tokens_per_s']:.1f} | "
        f"{_fmt(r.get('predicted_memory_gb'))} | {_fmt(r.get('predicted_joules_per_token'))} |"
        for r in search["references"]
    ]
    plan = search["plan"]
    points = sorted({point for groups in plan.values() for point in groups})
    lines += [
        "",
        "The chosen plan, per block:",
        "",
        "| block | " + " | ".join(points) + " |",
        "|---|" + "---|" * len(points),
    ]
    lines += [f"| {block} | " + " | ".join(plan[block][p] for p in points) + " |" for block in sorted(plan, key=int)]
    lines += ["", f"The LM head: {search.get('lm_head', 'fp16')}."]
    return lines


def _verdict(candidate: dict[str, Any]) -> str:
    if candidate["chosen"]:
        return "yes (chosen)"
    return "yes (a faster one held)" if candidate["passed"] else "no"


def _on_device_section(report: dict[str, Any]) -> list[str]:
    """What ``validate --on-device`` measured, or why it did not run."""
    device = report.get("on_device")
    if not device:
        return []
    if not device.get("ran"):
        return ["", "## On the device", "", f"Not measured: {device.get('status')}."]
    lines = ["", "## On the device", "", "| figure | value |", "|---|---|"]
    rows = [
        ("runtime", device.get("runtime", "tensorrt")),
        ("power mode read", device.get("power_mode_read")),
        ("decode tokens/s", device.get("decode_tokens_per_s") or device.get("tokens_per_s")),
        ("time to first token (ms)", device.get("ttft_ms")),
        ("peak device memory (GB)", device.get("peak_device_memory_gb")),
        ("greedy prefix agreement with the host model", device.get("greedy_prefix_agreement")),
        ("greedy sequences identical", device.get("greedy_sequences_identical")),
    ]
    lines += [f"| {name} | {_fmt(value)} |" for name, value in rows if value is not None]
    return lines


def _encoder_predictions(report: dict[str, Any]) -> list[str]:
    predictions = report.get("predictions")
    if not predictions or predictions.get("kind") != "encoder":
        return []
    lines = [
        "",
        f"## Predicted on {predictions['target']} (latency model, not measured)",
        "",
        f"Compute at {predictions['chosen']['compute_efficiency_assumed']:.0%} of the tensor cores' peak (assumed).",
        "",
        "| power mode | batch | tokens | ms per batch | sentences/s | bound | memory GB |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {m['power_mode']} | {m['batch']} | {m['tokens']} | {m['batch_ms']:.2f} | {m['sentences_per_s']:.0f} | "
        f"{m['bound']} | {m['memory_gb']:.2f} |"
        for m in predictions["modes"]
    ]
    return lines


def render_markdown(report: Report) -> str:
    """Render the report as Markdown."""
    target = report["target"]
    gate = report["gate"]
    lines = [
        f"# compress report: {md_text(report['model']['spec'])} on {target['name']}",
        "",
        f"**Gate: {gate['verdict']}** (exit code {report['exit_code']}) — recipe `{report['recipe']}`, "
        f"power mode `{target['power_mode']}`.",
        "",
        "## Gate checks",
        "",
        "| check | value | limit | verdict | source | detail |",
        "|---|---|---|---|---|---|",
    ]
    for check in gate["checks"]:
        unit = check.get("unit", "")
        bound = "≥ " if check.get("bound") == "lower" else "≤ "
        lines.append(f"| {check['name']} | {_fmt(check['value'])} {unit} | {bound}{_fmt(check['limit'])} {unit} | "
                     f"**{check['verdict']}** | {check['source']} | {check.get('detail', '')} |")
    if not gate["checks"]:
        lines.append(f"| — | — | — | **{gate['verdict']}** | — | {gate.get('detail', '')} |")
    lines += _domain_table(report)
    lines += _prompt_table(report)
    lines += _search_section(report)
    lines += _on_device_section(report)
    on_gpu = any(stage.get("peak_device_memory_mb") is not None for stage in report["stages"])
    device_column = (" peak device memory (MB) |", "---|") if on_gpu else ("", "")
    lines += ["", "## Stages", "", f"| # | stage | status | time (s) | peak RSS (MB) |{device_column[0]} summary |",
              f"|---|---|---|---|---|{device_column[1]}---|"]
    for index, stage in enumerate(report["stages"], start=1):
        device = f" {_fmt(stage.get('peak_device_memory_mb'))} |" if on_gpu else ""
        lines.append(f"| {index} | {stage['name']} | {stage['status']} | {_fmt(stage['duration_s'])} | "
                     f"{_fmt(stage['peak_rss_mb'])} |{device} {stage.get('summary', '')} |")
    predictions = decoder_predictions(report)
    lines += _encoder_predictions(report)
    if predictions:
        lines += [
            "",
            f"## Predicted on {predictions['target']} (latency model, not measured)",
            "",
            "| power mode | W | decode tokens/s | ms/token | TTFT ms | memory GB | J/token |",
            "|---|---|---|---|---|---|---|",
        ]
        for mode in predictions["modes"]:
            lines.append(f"| {mode['power_mode']} | {_fmt(mode['watts'])} | {mode['decode_tokens_per_s']:.1f} | "
                         f"{mode['decode_latency_ms']:.2f} | {mode['ttft_ms']:.1f} | {mode['memory_gb']:.2f} | "
                         f"{mode['joules_per_token']:.3f} |")
    if predictions and "lowest_power_mode_meeting_latency_budget" in predictions:
        lowest = predictions["lowest_power_mode_meeting_latency_budget"]
        lines += ["", f"Lowest-power mode that meets the decode-latency budget: **{lowest or 'none'}**."]
    for name, path in (report.get("plots") or {}).items():
        lines += ["", f"![{name}]({path})"]
    lines += ["", "## Artifacts", ""]
    for name, path in report["artifacts"].items():
        lines.append(f"- {name}: `{path}`" if path else f"- {name}: not produced")
    return "\n".join(lines) + "\n"
