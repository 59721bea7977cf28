"""Distillation figures on the embedded default, side by side in one run.

A student of about half the teacher's parameters (depth and MLP-width pruned) is trained for the
same number of steps twice from the same initialisation: with the teacher (KD) and with plain
next-token cross-entropy. Perplexity follows the quantize benchmark's protocol on the first
2,048 evaluation tokens (4 windows of 512) at every evaluation point.

    .venv/bin/python bench/distill_curve.py [STEPS]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench_runs" / "distill"


def run(loss: str, steps: int) -> dict:
    out = OUT / loss
    cmd = [
        str(REPO / ".venv" / "bin" / "compress"),
        "run",
        "target=jetson-orin",
        "recipe=distill",
        f"out={out}",
        "--no-progress",
        f"distill.loss={loss}",
        f"distill.steps={steps}",
        f"distill.eval_every={max(1, steps // 4)}",
        f"distill.checkpoint_every={max(1, steps // 4)}",
        "validate.eval_tokens=2048",
        "validate.latency_new_tokens=16",
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=False)
    report = json.loads((out / "report.json").read_text())
    return next(s for s in report["stages"] if s["name"] == "distill")["metrics"]


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 120
    kd, ce = run("kd", steps), run("ce", steps)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps({"kd": kd, "ce": ce}, indent=2))
    print(
        f"student shape {kd['student_shape']}, {kd['parameters']:,} parameters (teacher {kd['teacher_parameters']:,})"
    )
    print(f"kept layers {kd['kept_layers']}")
    print("| | perplexity |\n|---|---|")
    print(f"| teacher | {kd['perplexity_teacher']:.2f} |")
    print(f"| student before training | {kd['perplexity_before']:.2f} |")
    print(f"| after {steps} steps of KD | {kd['perplexity_after']:.2f} |")
    print(f"| after {steps} steps of plain next-token training | {ce['perplexity_after']:.2f} |")
    print(f"training: {kd['tokens_trained']:,} tokens, KD {kd['tokens_per_s']} tokens/s, {kd['train_seconds']} s; "
          f"CE {ce['tokens_per_s']} tokens/s, {ce['train_seconds']} s")
    print("curve (step: KD ppl / CE ppl):")
    ce_points = {p["step"]: p.get("perplexity") for p in ce["curve"]}
    for point in kd["curve"]:
        if "perplexity" in point:
            print(f"  {point['step']}: {point['perplexity']:.2f} / {ce_points.get(point['step'], float('nan')):.2f}")


if __name__ == "__main__":
    main()
