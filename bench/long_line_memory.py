"""Peak memory of a run whose evaluation file is one very long line (``validate.eval_tokens`` small): what evaluation
text costs beyond the tokens the budget needs.

    .venv/bin/python bench/long_line_memory.py [--megabytes 200] [--model FOLDER]

Writes ``bench_runs/long_line/eval.txt`` (random words of a shipped text on one line), runs ``compress run
recipe=baseline`` with it under ``/usr/bin/time -v`` and prints the gate's exit code, the wall time and the peak
resident memory. Without ``--model`` it builds a tiny random-weight decoder of SmolLM2's family (its figures measure the
text's cost, not a model's).
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench_runs" / "long_line"


def write_line(path: Path, megabytes: int) -> None:
    words = (REPO / "compress" / "catalog" / "text" / "evaluation" / "learned.txt").read_text(encoding="utf-8").split()
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as handle:
        written = 0
        while written < megabytes * 1_000_000:
            chunk = " ".join(rng.choice(words) for _ in range(100_000)) + " "
            handle.write(chunk)
            written += len(chunk)


def tiny_model(folder: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from tests.conftest import build_tiny_llama

    return folder if (folder / "config.json").is_file() else build_tiny_llama(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--model", type=Path, help="a model folder (default: a tiny random-weight decoder)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    text = OUT / "eval.txt"
    write_line(text, args.megabytes)
    model = args.model or tiny_model(OUT / "model")
    run = OUT / "run"
    shutil.rmtree(run, ignore_errors=True)
    command = [
        "/usr/bin/time",
        "-v",
        str(REPO / ".venv" / "bin" / "compress"),
        "run",
        "target=jetson-orin",
        "recipe=baseline",
        f"model={model}",
        f"out={run}",
        f"eval={text}",
        "validate.eval_tokens=256",
        "validate.window=64",
        "export_onnx.parity_new_tokens=4",
        "--no-progress",
    ]
    started = time.monotonic()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    print(
        f"{text.stat().st_size / 1e6:.0f} MB on one line: exit {proc.returncode}, {time.monotonic() - started:.0f} s, "
        f"peak {int(peak.group(1)) / 1024**2:.2f} GiB"
        if peak
        else proc.stderr[-2000:]
    )


if __name__ == "__main__":
    main()
