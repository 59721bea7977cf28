"""ONNX Runtime's memory in validation's parity check: a whole 512-token window at a time against the chunks it now
runs.

Each way runs in a fresh process on the portable ONNX of a finished run (e.g. the Qwen3-0.6B shape's from
``bench/scale_table.py --measure qwen3-0.6b``): the session is opened, then validation's parity check
(:func:`compress.eval.decoder.onnx_parity`: ONNX Runtime's logits and their perplexity) runs on
``--windows`` windows of 512 random tokens: as it did (a whole window at once, its perplexity taken in
float64 over the whole window), and as it does (128 tokens at a time through the KV cache, the
perplexity 32 rows at a time); the process's peak resident memory after the session opens and after
the windows.

    .venv/bin/python bench/parity_memory.py bench_runs/scale/qwen3-0.6b-default/03_export_onnx/onnx
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
import json, sys
import numpy as np
import torch
from pathlib import Path
from compress.backends.onnx.runtime import OnnxDecoder
from compress.eval import decoder as validation
from compress.eval import perplexity


def peak_gib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024**2


folder, chunk, nll_rows, windows, window = Path(sys.argv[1]), *map(int, sys.argv[2:6])
validation.PARITY_CHUNK, perplexity.NLL_ROWS = chunk, nll_rows
session = OnnxDecoder(folder)
opened = peak_gib()
rows = torch.randint(0, 1000, (windows, window), generator=torch.Generator().manual_seed(0))
torch_side = {i: validation.TorchWindow(0.0, np.zeros(window - 1, dtype=np.int64)) for i in range(windows)}
parity = validation.onnx_parity(session, torch_side, rows)
print(
    json.dumps({"session_gib": round(opened, 2), "after_windows_gib": round(peak_gib(), 2), "tokens": parity["tokens"]})
)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("onnx_dir", type=Path)
    parser.add_argument("--windows", type=int, default=4)
    args = parser.parse_args()
    print("| way | peak GiB, session open | peak GiB, after the windows |\n|---|---|---|")
    ways = (("whole window, its NLL in float64 at once (before)", WINDOW, WINDOW),
            ("whole window, NLL 32 rows at a time", WINDOW, 32),
            ("128 tokens at a time, NLL 32 rows at a time (validation now)", 128, 32))
    for name, chunk, nll_rows in ways:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _CHILD,
                str(args.onnx_dir),
                str(chunk),
                str(nll_rows),
                str(args.windows),
                str(WINDOW),
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        )
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-2000:])
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"| {name} | {row['session_gib']} | {row['after_windows_gib']} |", flush=True)


if __name__ == "__main__":
    main()
