"""Sparsity and head-pruning figures side by side, on the quantize benchmark's protocol, in one run.

2:4 with magnitude, Wanda and SparseGPT, 50% unstructured SparseGPT, and 25% / 50% of attention
heads pruned, all without retraining; then both head cuts again with 60 steps of distillation from
the unpruned model. SmolLM2 has 9 query heads in 3 KV groups and every group keeps the same number,
so a head fraction is rounded to whole heads per group, upwards: 25% removes 3 of 9 heads per
layer, 50% removes 6 of 9. Each row is a ``compress run`` (-> export_onnx -> validate)
into ``bench_runs/sparse/<row>``; perplexity is measured in ONNX Runtime on the exported graph.

    .venv/bin/python bench/sparsity_table.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# This table's protocol: one domain (Pride and Prejudice), 8,192 tokens; bench/domain_table.py covers every domain.
AUSTEN_PROTOCOL = ["eval=calib_data/evaluation/prideprejudice.txt", "validate.eval_tokens=8192"]
OUT = REPO / "bench_runs" / "sparse"

ROWS: dict[str, tuple[str, list[str]]] = {
    "2:4 magnitude": ("sparse24", ["sparsify.method=magnitude"]),
    "2:4 wanda": ("sparse24", ["sparsify.method=wanda"]),
    "2:4 sparsegpt": ("sparse24", ["sparsify.method=sparsegpt"]),
    "50% unstructured sparsegpt": (
        "sparse24",
        ["sparsify.method=sparsegpt", "sparsify.pattern=unstructured", "sparsify.ratio=0.5"],
    ),
    "heads -25%": ("prune-heads", ["prune_heads.fraction=0.25"]),
    "heads -50%": ("prune-heads", ["prune_heads.fraction=0.5"]),
    "heads -25% + 60 KD steps": (
        "distill",
        [
            "distill.target_fraction=null",
            "distill.heads_per_group=2",
            "distill.steps=60",
            "distill.eval_every=60",
            "distill.checkpoint_every=60",
        ],
    ),
    "heads -50% + 60 KD steps": (
        "distill",
        [
            "distill.target_fraction=null",
            "distill.heads_per_group=1",
            "distill.steps=60",
            "distill.eval_every=60",
            "distill.checkpoint_every=60",
        ],
    ),
}


def run_row(name: str) -> dict:
    out = OUT / name.replace(" ", "-").replace(":", "").replace("%", "pct")
    recipe, extra = ROWS[name]
    cmd = [str(REPO / ".venv" / "bin" / "compress"), "run", "target=jetson-orin", f"recipe={recipe}", f"out={out}",
           "--no-progress", *AUSTEN_PROTOCOL,
           *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=False)
    report = json.loads((out / "report.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    validate = stages["validate"]["metrics"]
    step = stages.get("sparsify") or stages.get("prune_heads") or stages["distill"]
    metrics = step["metrics"]
    return {
        "row": name,
        "ppl": validate["perplexity_model"],
        "teacher": validate["perplexity_teacher"],
        "ratio": validate["perplexity_model"] / validate["perplexity_teacher"],
        "nonzero_parameters": metrics.get("nonzero_parameters", metrics["parameters"]),
        "parameters": metrics["parameters"],
        "pattern_24": stages["export_onnx"]["metrics"].get("onnx_pattern_24_fraction"),
        "onnx_mb": validate["model_size_bytes"] / 1e6,
        "seconds": step["duration_s"],
    }


def main() -> None:
    names = sys.argv[1:] or list(ROWS)
    rows = [run_row(name) for name in names]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(rows, indent=2))
    print("| row | ppl (ONNX Runtime) | × dense | non-zero params | 2:4 in ONNX | ONNX MB | stage s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        pattern = f"{100 * r['pattern_24']:.2f}%" if r["pattern_24"] is not None else "—"
        print(
            f"| {r['row']} | {r['ppl']:.2f} | {r['ratio']:.2f}x (dense {r['teacher']:.2f}) | "
            f"{r['nonzero_parameters']:,} / {r['parameters']:,} | {pattern} | {r['onnx_mb']:.0f} | {r['seconds']} |"
        )


if __name__ == "__main__":
    main()
