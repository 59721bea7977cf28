"""The latency model against every published point: the table docs/latency-model.md shows.

Decode tokens/s and prefill milliseconds, predicted by ``compress.eval.perf_model`` for each point of
``compress.eval.published_rates`` (TensorRT Edge-LLM's performance pages and two earlier figures),
with the point's role: ``anchor`` (fitted), ``held out`` (checked: decode within 10%, prefill within
20%) or ``earlier release`` (reported only). Ends with the fitted constants. Exits 1 if a fitted or
held-out point is outside its tolerance.

    .venv/bin/python bench/latency_anchors.py
"""

from __future__ import annotations

import sys

from compress.core.config import load_target
from compress.eval.perf_model import anchor_errors, decode_fit_for, prefill_fit_for

TOLERANCE_PCT = {"decode tokens/s": 10.0, "prefill ms": 20.0}
FITS = (("jetson-agx-orin-64gb", "int4"), ("jetson-agx-thor", "int4"), ("jetson-agx-thor", "nvfp4"),
        ("jetson-agx-thor", "fp8"))


def main() -> int:
    rows = anchor_errors()
    print("| point (batch 1) | role | measure | measured | predicted | error |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.anchor} | {row.role} | {row.measure} | {row.measured:g} | {row.predicted:.1f} | "
              f"{row.error_pct:+.1f}% |")
    print()
    for target_name, precision in FITS:
        target = load_target(target_name)
        decode, prefill = decode_fit_for(target, precision), prefill_fit_for(target, precision)
        print(f"{target_name} {precision}: decode efficiency {decode.efficiency:.3f}, "
              f"{decode.per_layer_ms:.4f} ms/layer; prefill utilisation {prefill.utilisation:.3f}, "
              f"{prefill.per_layer_ms:.4f} ms/layer")
    misses = [row for row in rows if row.role != "earlier release" and abs(row.error_pct) > TOLERANCE_PCT[row.measure]]
    for row in misses:
        print(f"outside tolerance: {row.anchor} ({row.measure}) {row.error_pct:+.1f}%", file=sys.stderr)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
