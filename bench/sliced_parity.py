"""ONNX Runtime's parity check over the whole graph in one session against the graph cut into slices of whole blocks.

Each way runs in a fresh process on the portable ONNX of a finished run (e.g. the Qwen3-0.6B shape's
``compress run target=jetson-orin model=bench_runs/scale/models/qwen3-0.6b quantize.calib_windows=4
out=/tmp/q06``): validation's parity check (:func:`compress.eval.decoder.onnx_parity`, 128 tokens at a
time through the KV cache) on ``--windows`` windows of 512 random tokens, the graph run whole or in
slices of at most ``--slices-mb`` MiB of weights (``validate.onnx_session_mb``), one session at a
time. Printed: the slices, the process's peak resident memory, the wall time, and ONNX Runtime's
perplexity on those windows (the same graph's numbers either way).

    .venv/bin/python bench/sliced_parity.py /tmp/q06/03_export_onnx/onnx --slices-mb 256 128
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
import numpy as np
import torch
from pathlib import Path
from compress.backends.onnx.runtime import OnnxDecoder
from compress.eval import decoder as validation


def peak_gib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024**2


folder, limit_mb, windows = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
started = time.perf_counter()
decoder = validation._sliced_decoder(folder, limit_mb * 2**20) if limit_mb else None
slices = len(decoder.slices) if decoder is not None else 1
decoder = decoder or OnnxDecoder(folder)
rows = torch.randint(0, 1000, (windows, 512), generator=torch.Generator().manual_seed(0))
torch_side = {i: validation.TorchWindow(0.0, np.zeros(511, dtype=np.int64)) for i in range(windows)}
parity = validation.onnx_parity(decoder, torch_side, rows)
print(
    json.dumps(
        {
            "slices": slices,
            "peak_gib": round(peak_gib(), 2),
            "seconds": round(time.perf_counter() - started, 1),
            "perplexity_onnx": parity["perplexity_onnx"],
        }
    )
)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("onnx_dir", type=Path)
    parser.add_argument("--slices-mb", type=int, nargs="+", default=[512, 256])
    parser.add_argument("--windows", type=int, default=4)
    args = parser.parse_args()
    print("| way | slices | peak GiB | seconds | ONNX Runtime perplexity |\n|---|---|---|---|---|")
    for limit in [0, *args.slices_mb]:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(args.onnx_dir), str(limit), str(args.windows)],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        )
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-2000:])
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        name = "whole graph, one session" if limit == 0 else f"slices of at most {limit} MiB of weights"
        print(
            f"| {name} | {row['slices']} | {row['peak_gib']} | {row['seconds']} | {row['perplexity_onnx']:.6f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
