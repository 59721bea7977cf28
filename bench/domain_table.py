"""Quality per evaluation domain for every recipe, with the multi-domain data and with Austen-only data, side by side.

Every cell is a full ``compress run`` into ``bench_runs/domains/<data>/<recipe>``; its validate stage
measures the exported ONNX model in ONNX Runtime against the fp32 teacher on the six evaluation
domains (2,048 tokens each, the same windows for every row). Two data settings:

* ``multi`` — the shipped calibration (Austen, Brown press, fiction and lore): what ``compress run``
  uses; the distill recipes also train on teacher generations where the recipe asks for them;
* ``austen`` — calibration and distillation text from *Emma* and *Mansfield Park* only (the data the
  toolkit shipped before), so five of the six domains are unseen.

Reruns resume finished cells, so an interrupted table continues where it stopped.

    .venv/bin/python bench/domain_table.py                       # every recipe, both data settings (hours on 2 cores)
    .venv/bin/python bench/domain_table.py --data multi int8 int4
"""

from __future__ import annotations

import argparse
import json

from runs import REPO, compress_run

OUT = REPO / "bench_runs" / "domains"
RECIPES = ["baseline", "int8", "int4", "sparse24", "prune-heads", "distill", "default"]
DATA = {
    "multi": [],
    "austen": ["calib=calib_data/calibration/emma.txt,calib_data/calibration/mansfieldpark.txt",
               "distill.teacher_generations=0"],
}
DISTILLING = {"distill"}


def run_cell(data: str, recipe: str) -> dict | None:
    extra = [a for a in DATA[data] if not a.startswith("distill.") or recipe in DISTILLING]
    report = compress_run(recipe, OUT / data / recipe, *extra)
    if report is None:
        return None
    validate = next(s["metrics"] for s in report["stages"] if s["name"] == "validate")
    distill = next((s["metrics"] for s in report["stages"] if s["name"] == "distill"), None)
    return {
        "data": data,
        "recipe": recipe,
        "verdict": report["gate"]["verdict"],
        "domains": validate["domains"],
        "worst_domain": validate["worst_domain"],
        "worst_pct": validate["perplexity_increase_pct"],
        "mixed_pct": validate["perplexity_increase_pct_mixed"],
        "top1": validate["top1_agreement"],
        "kl": validate["mean_kl"],
        "stopped_early_at": distill.get("stopped_early_at") if distill else None,
    }


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    domains = list(rows[0]["domains"])
    print(
        "\nperplexity change vs the fp32 teacher per domain (ONNX Runtime; * = unseen by that row's "
        "calibration/training)\n"
    )
    print("| data | recipe | " + " | ".join(domains) + " | worst | mixed | top-1 | KL | gate |")
    print("|---|---|" + "---|" * (len(domains) + 5))
    for row in rows:
        cells = [
            f"{row['domains'][d]['perplexity_increase_pct']:+.2f}%{'' if row['domains'][d]['seen'] else '*'}"
            for d in domains
        ]
        stopped = f" (stopped at {row['stopped_early_at']})" if row["stopped_early_at"] else ""
        print(
            f"| {row['data']} | {row['recipe']}{stopped} | "
            + " | ".join(cells)
            + f" | {row['worst_pct']:+.2f}% ({row['worst_domain']}) | {row['mixed_pct']:+.2f}% | "
                f"{100 * row['top1']:.1f}% "
            f"| {row['kl']:.4f} | {row['verdict']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipes", nargs="*", metavar="RECIPE", help=f"any of {', '.join(RECIPES)} (default: all)")
    parser.add_argument("--data", choices=["multi", "austen", "both"], default="both")
    args = parser.parse_args()
    recipes = args.recipes or RECIPES
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown:
        parser.error(f"unknown recipe {unknown[0]!r} (known: {', '.join(RECIPES)})")
    settings = ["multi", "austen"] if args.data == "both" else [args.data]
    rows = []
    for recipe in recipes:
        for data in settings:
            if data == "austen" and recipe == "baseline":
                continue  # no calibration or training: the same model under both settings
            row = run_cell(data, recipe)
            if row:
                rows.append(row)
                (OUT / "table.json").write_text(json.dumps(rows, indent=2))
    print_table(rows)


if __name__ == "__main__":
    main()
