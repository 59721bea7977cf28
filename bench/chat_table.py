"""Does chat calibration help? Each recipe calibrated on today's text, and on today's text plus the shipped chat set.

Every run is evaluated on the six text domains plus the chat evaluation set (a seventh domain, "chat": the
evaluation prompts with the teacher's answers, rendered with the model's chat template) and gated on the
app prompts (the shipped 40, greedy 32 tokens against the teacher). Columns: worst text domain, the chat
domain's perplexity change, top-1 and KL on the mixed text, identical answers, answer-prefix agreement and
first-token agreement on the prompts. Runs go to ``bench_runs/chat/``.

    .venv/bin/python bench/chat_table.py     # baseline, default, int8, int4 on jetson-orin; thor-fp8 on Thor
    .venv/bin/python bench/chat_table.py --recipes default
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runs import REPO, compress_run  # noqa: E402

from compress.core.text import DEFAULT_CALIBRATION, DEFAULT_EVALUATION  # noqa: E402

CHAT = REPO / "calib_data" / "chat"
TODAY = ",".join(str(p) for p in DEFAULT_CALIBRATION if p.suffix == ".txt")  # the text alone, as before chat was added
WITH_CHAT = ",".join(str(p) for p in DEFAULT_CALIBRATION)
EVALUATION = ",".join(str(p) for p in DEFAULT_EVALUATION) + "," + str(CHAT / "evaluation.jsonl")
TARGETS = {"thor-fp8": "jetson-agx-thor", "thor-nvfp4": "jetson-agx-thor"}


def row(recipe: str, calibration: str, report: dict | None) -> str:
    if report is None:
        return f"| {recipe} | {calibration} | run failed | | | | | | |"
    metrics = next(s["metrics"] for s in report["stages"] if s["name"] == "validate")
    text = {k: v for k, v in metrics["domains"].items() if k != "chat"}
    worst = max(text, key=lambda k: text[k]["perplexity_increase_pct"])
    chat = metrics["domains"].get("chat", {})
    prompts = metrics.get("prompts") or {}
    return (f"| {recipe} | {calibration} | {worst} {text[worst]['perplexity_increase_pct']:+.2f}% | "
            f"{chat.get('perplexity_increase_pct', float('nan')):+.2f}% | {100 * metrics['top1_agreement']:.1f}% | "
            f"{metrics['mean_kl']:.4f} | {100 * prompts.get('identical_answers', float('nan')):.0f}% | "
            f"{100 * prompts.get('answer_prefix_agreement', float('nan')):.1f}% | "
            f"{100 * prompts.get('first_token_agreement', float('nan')):.0f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["baseline", "default", "int8", "int4", "thor-fp8"])
    args = parser.parse_args()
    lines = [
        "| recipe | calibration | worst text domain | chat domain | top-1 | KL | identical answers | answer prefix | "
        "first token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for recipe in args.recipes:
        # The baseline calibrates nothing: one row.
        mixes = (
            (("today's text", TODAY),)
            if recipe == "baseline"
            else (("today's text", TODAY), ("with the chat set", WITH_CHAT))
        )
        for name, calib in mixes:
            out = REPO / "bench_runs" / "chat" / f"{recipe}-{'chat' if calib == WITH_CHAT else 'text'}"
            report = compress_run(
                recipe, out, f"calib={calib}", f"eval={EVALUATION}", target=TARGETS.get(recipe, "jetson-orin")
            )
            lines.append(row(recipe, name, report))
            print("\n".join(lines), flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
