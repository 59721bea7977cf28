"""Validation's comparison of the deployed numbers with the teacher: its peak memory with whole windows' logits and with
logits read a few positions at a time.

Each way runs in a fresh process on one checkpoint folder (e.g. ``bench_runs/scale/models/qwen3-0.6b`` from
``bench/scale_table.py``), measured twice as validation measures a model and its teacher (two block-by-block
passes, :func:`compress.transforms.checkpoint_logits.window_logits`, over ``--windows`` windows of 512 random
tokens: validation's six domains of 2,048 tokens are 24), then compared window by window
(:func:`compress.eval.fidelity.compare_window_pairs`): as it did (each window's whole ``(512, vocab)`` logits of
both models) and as it does (:meth:`WindowLogits.rows`, a block of positions at a time: 192 at a 150k
vocabulary). It prints the process's peak resident memory after the passes and after the comparison, and the
comparison's seconds.

    .venv/bin/python bench/compare_memory.py bench_runs/scale/models/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WINDOW = 512

_CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
from compress.eval.fidelity import compare_window_pairs
from compress.transforms.checkpoint_logits import window_logits


def peak_gib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024**2


folder, way, count, window = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
windows = torch.randint(0, 1000, (count, window), generator=torch.Generator().manual_seed(0))
model, teacher = window_logits(folder, windows), window_logits(folder, windows)
after_passes = peak_gib()
read = (
    (lambda i: (model.logits(i), teacher.logits(i))) if way == "whole" else (lambda i: (model.rows(i), teacher.rows(i)))
)
start = time.perf_counter()
figures = compare_window_pairs(read, [("all", windows)], progress=False)["mixed"]
print(
    json.dumps(
        {
            "after_passes_gib": after_passes,
            "after_comparison_gib": peak_gib(),
            "comparison_s": time.perf_counter() - start,
            "mean_kl": figures["mean_kl"],
        }
    )
)
"""

WAYS = {"whole": "whole windows' logits (as it did)", "rows": "a block of positions at a time (as it does)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--windows", type=int, default=24)
    args = parser.parse_args()
    print("| comparison reads | peak GiB, after both passes | peak GiB, after the comparison | comparison s |")
    print("|---|---|---|---|")
    for way, label in WAYS.items():
        out = subprocess.run([sys.executable, "-c", _CHILD, str(args.folder), way, str(args.windows), str(WINDOW)],
                             cwd=REPO, check=True, capture_output=True, text=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        print(
            f"| {label} | {row['after_passes_gib']:.2f} | {row['after_comparison_gib']:.2f} | "
            f"{row['comparison_s']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
