"""Report plots as PNG files (matplotlib, no display needed)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from compress.core.files import disk_write_error, is_disk_write_error, refuse_link  # noqa: E402
from compress.report.figures import (  # noqa: E402
    DOMAIN_QUALITY,
    LAYER_SQNR,
    PERPLEXITY_BY_STAGE,
    PRECISION_SEARCH,
    SIZE_MB,
    TRAINING_CURVE,
    figure,
    validation_metrics,
)
from compress.report.markdown import decoder_predictions  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    partial = path.with_name(f".{path.stem}.partial.png")
    refuse_link(partial)
    try:
        fig.savefig(partial, dpi=110)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        if is_disk_write_error(exc):
            raise disk_write_error(exc, path) from exc
        raise
    finally:
        plt.close(fig)
    os.replace(partial, path)
    return path


def _stage_size_and_ppl(report: dict[str, Any]) -> tuple[list[str], list[float | None], list[float | None]]:
    """Per stage that recorded a size or was measured: its name, model size (MB) and perplexity."""
    perplexities = figure(report, PERPLEXITY_BY_STAGE) or {}
    names, sizes, ppls = [], [], []
    for stage in report["stages"]:
        size = (stage.get("figures") or {}).get(SIZE_MB)
        ppl = perplexities.get(stage["name"])
        if size is None and stage["name"] not in perplexities:
            continue
        names.append(stage["name"])
        sizes.append(size)
        ppls.append(ppl)
    return names, sizes, ppls


def plot_stages(report: dict[str, Any], path: Path) -> Path:
    """Size on disk and perplexity after each stage."""
    names, sizes, ppls = _stage_size_and_ppl(report)
    fig, left = plt.subplots(figsize=(6.5, 3.6))
    positions = range(len(names))
    left.bar(positions, [s or 0 for s in sizes], color="#4C72B0", width=0.5, label="size (MB)")
    left.set_ylabel("size on disk (MB)")
    left.set_xticks(list(positions), names)
    right = left.twinx()
    right.plot([p for p, v in zip(positions, ppls, strict=True) if v], [v for v in ppls if v], "o-", color="#C44E52",
               label="perplexity")
    right.set_ylabel("perplexity (evaluation text)")
    left.set_title("Size and perplexity per stage")
    return _save(fig, path)


def plot_power_modes(report: dict[str, Any], path: Path) -> Path:
    """Predicted decode latency per power mode against the budget."""
    predictions = report["predictions"]
    modes = predictions["modes"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    labels = [f"{m['power_mode']}\n{m['watts']:g} W" for m in modes]
    values = [m["decode_latency_ms"] for m in modes]
    budget = report["target"]["budgets"]["max_decode_latency_ms"]
    ax.bar(labels, values, color=["#55A868" if v <= budget else "#C44E52" for v in values])
    ax.axhline(budget, color="black", linestyle="--", label=f"budget {budget:g} ms")
    ax.set_ylabel("predicted decode latency (ms/token)")
    ax.set_title(f"{predictions['target']}: decode latency per power mode (predicted)")
    ax.legend()
    return _save(fig, path)


def plot_pareto(report: dict[str, Any], path: Path) -> Path:
    """Accuracy against predicted latency: the teacher in FP16 and the final model at its precision."""
    validate = validation_metrics(report)
    predictions = report["predictions"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    points = []
    reference = predictions.get("reference_fp16")
    if reference is not None and validate.get("perplexity_teacher"):
        points.append(("teacher (fp16)", reference["decode_latency_ms"], validate["perplexity_teacher"]))
    final = predictions["chosen"]
    points.append((f"final ({final['precision']})", final["decode_latency_ms"], validate.get("perplexity_model")))
    for label, latency, ppl in points:
        if ppl is None:
            continue
        ax.scatter([latency], [ppl], s=60)
        ax.annotate(label, (latency, ppl), textcoords="offset points", xytext=(6, 6))
    budgets = report["target"]["budgets"]
    ax.axvline(budgets["max_decode_latency_ms"], color="grey", linestyle=":", label="latency budget")
    ax.set_xlabel("predicted decode latency (ms/token)")
    ax.set_ylabel("perplexity")
    ax.set_title("Accuracy vs latency")
    ax.legend()
    return _save(fig, path)


def plot_sensitivity(report: dict[str, Any], path: Path) -> Path | None:
    """Per-layer quantization SQNR, one line per linear kind; None when nothing was recorded."""
    sensitivity = figure(report, LAYER_SQNR)
    if not sensitivity or not sensitivity.get("linears"):
        return None
    series: dict[str, dict[int, float]] = {}
    for row in sensitivity["linears"]:
        match = re.search(r"layers\.(\d+)\.(?:\w+\.)?(\w+)$", row["name"])
        if match:
            series.setdefault(match.group(2), {})[int(match.group(1))] = row["sqnr_db"]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for kind, values in sorted(series.items()):
        layers = sorted(values)
        ax.plot(layers, [values[i] for i in layers], marker=".", label=kind)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("output SQNR (dB, higher is better)")
    ax.set_title(f"Quantization sensitivity per layer ({sensitivity.get('method')})")
    ax.legend(fontsize=7, ncol=4)
    return _save(fig, path)


def plot_distill_curve(report: dict[str, Any], path: Path) -> Path | None:
    """Student perplexity against training steps, with the teacher's as a reference line."""
    distill = figure(report, TRAINING_CURVE)
    points = [p for p in (distill or {}).get("points", []) if "perplexity" in p]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    steps = [0] + [p["step"] for p in points]
    values = [distill["before"]] + [p["perplexity"] for p in points]
    ax.plot(steps, values, "o-", label=f"student ({distill['loss']}), seen domains")
    ax.axhline(distill["teacher"], color="black", linestyle="--", label="teacher, seen domains")
    unseen = [p for p in points if "perplexity_unseen" in p]
    if unseen and distill.get("before_unseen") is not None:
        ax.plot(
            [0] + [p["step"] for p in unseen],
            [distill["before_unseen"]] + [p["perplexity_unseen"] for p in unseen],
            "s-",
            color="#C44E52",
            label="student, unseen domains",
        )
        ax.axhline(distill["teacher_unseen"], color="#C44E52", linestyle=":", label="teacher, unseen domains")
    if distill.get("stopped_early_at"):
        ax.axvline(distill["stopped_early_at"], color="grey", linewidth=0.8, label="stopped: unseen domains got worse")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title("Distillation: perplexity vs steps")
    ax.legend()
    return _save(fig, path)


def plot_domains(report: dict[str, Any], path: Path) -> Path | None:
    """Perplexity change against the teacher per evaluation domain, unseen domains marked, with the budget."""
    domains = (figure(report, DOMAIN_QUALITY) or {}).get("domains")
    if not domains:
        return None
    names = list(domains)
    changes = [domains[n]["perplexity_increase_pct"] for n in names]
    colours = ["#4C72B0" if domains[n].get("seen") else "#C44E52" for n in names]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.bar(range(len(names)), changes, color=colours, width=0.6)
    ax.set_xticks(range(len(names)), [n if domains[n].get("seen") else f"{n}\n(unseen)" for n in names], fontsize=8)
    budget = report["target"]["budgets"].get("max_ppl_increase_pct")
    if budget is not None:
        ax.axhline(budget, color="black", linestyle="--", label=f"budget {budget:g}% (worst domain)")
        ax.legend(fontsize=8)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_ylabel("perplexity vs teacher (%)")
    ax.set_title("Quality per evaluation domain (blue: seen in calibration, red: unseen)")
    return _save(fig, path)


FORMAT_COLOURS = {
    "fp16": "#BBBBBB",
    "int8": "#4C72B0",
    "fp8": "#8172B2",
    "int4": "#55A868",
    "nvfp4": "#C44E52",
    "nvfp4_a16": "#DD8452",
}


def plot_precision_search(report: dict[str, Any], path: Path) -> Path | None:
    """``quantize.method=auto``: every plan measured and the uniform references (predicted KL against predicted decode
    latency), and the chosen plan's format per block and group of linears."""
    search = figure(report, PRECISION_SEARCH)
    if not search:
        return None
    fig, (front, heat) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1.1, 1]})
    for reference in search["references"]:
        front.scatter([reference["predicted_decode_ms"]], [reference["predicted_kl"]], marker="s", color="#999999")
        front.annotate(reference["name"], (reference["predicted_decode_ms"], reference["predicted_kl"]), fontsize=7,
                       textcoords="offset points", xytext=(4, 4))
    for candidate in search["candidates"]:
        colour = "#55A868" if candidate["chosen"] else "#8FBF9A" if candidate["passed"] else "#C44E52"
        front.scatter([candidate["predicted_decode_ms"]], [candidate["predicted_kl"]], color=colour, s=50)
        front.annotate(
            f"plan {candidate['round']}: held-out {candidate['measured']['worst_increase_pct']:+.2f}%",
            (candidate["predicted_decode_ms"], candidate["predicted_kl"]),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, -10),
        )
    front.axhline(
        search["budget_kl"], color="black", linestyle="--", linewidth=0.8, label="first budget (predicted KL)"
    )
    front.set_xlabel("predicted decode latency (ms/token)")
    front.set_ylabel("predicted KL to the teacher (nats/token)")
    front.set_title("Plans measured (green: chosen; pale: held, slower) and uniform references", fontsize=9)
    front.legend(fontsize=7)
    plan = search["plan"]
    points = sorted({point for groups in plan.values() for point in groups})
    names = sorted({name for groups in plan.values() for name in groups.values()})
    codes = {name: index for index, name in enumerate(names)}
    grid = [[codes[plan[block][point]] for block in sorted(plan, key=int)] for point in points]
    from matplotlib.colors import ListedColormap

    heat.imshow(grid, aspect="auto", cmap=ListedColormap([FORMAT_COLOURS.get(n, "#000000") for n in names]), vmin=-0.5,
                vmax=len(names) - 0.5, interpolation="nearest")
    heat.set_yticks(range(len(points)), points, fontsize=8)
    heat.set_xlabel("decoder block")
    heat.set_title(
        "Format chosen per block: " + ", ".join(names) + f"; the LM head: {search.get('lm_head', 'fp16')}", fontsize=9
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=FORMAT_COLOURS.get(n, "#000000")) for n in names]
    heat.legend(handles, names, fontsize=7, loc="upper right", bbox_to_anchor=(1.0, -0.12), ncol=len(names))
    return _save(fig, path)


def make_plots(report: dict[str, Any], folder: Path) -> dict[str, Path]:
    """Every plot the report has data for, written into ``folder`` (never through a link)."""
    refuse_link(folder, "the report's plots")
    folder.mkdir(parents=True, exist_ok=True)
    plots = {"stages": plot_stages(report, folder / "stages.png")}
    if decoder_predictions(report):
        plots["power_modes"] = plot_power_modes(report, folder / "power_modes.png")
        plots["pareto"] = plot_pareto(report, folder / "pareto.png")
    for name, plot in (
        ("domains", plot_domains),
        ("sensitivity", plot_sensitivity),
        ("distill_curve", plot_distill_curve),
        ("precision_search", plot_precision_search),
    ):
        made = plot(report, folder / f"{name}.png")
        if made:
            plots[name] = made
    return plots
