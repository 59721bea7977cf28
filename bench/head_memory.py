"""What quantizing the LM head costs at real vocabulary widths: peak resident memory and time, side by side.

A random-weight bf16 checkpoint of a published width with two decoder layers (``bench/scale_table.py``'s builder:
Qwen3-0.6B's 1024 x 151,936 tied head, Llama-3.1-8B's 4096 x 128,256 untied one) is quantized by the quantize stage's
own code (:func:`compress.transforms.quantize.decoder.quantize_folder`) under one mixed plan: every ``down_proj`` in
FP8, the rest of the blocks FP16 (``--blocks fp16``: every block FP16, the head's cost alone), and the LM head in each
format Edge-LLM quantizes a head in (``fp16``: left as it is, the reference). Each row is a fresh process under
``/usr/bin/time -v``, one after the other; ``--before DIR`` adds the same rows computed by another checkout of compress
(e.g. a ``git worktree`` of an earlier commit), so a change is measured side by side in one run.

    .venv/bin/python bench/head_memory.py                                     # Qwen3-0.6B width: fp16, fp8, int4 heads
    .venv/bin/python bench/head_memory.py --shapes llama-3.1-8b --heads fp16 fp8 --blocks fp16
    git worktree add --detach /tmp/before <commit> && .venv/bin/python bench/head_memory.py --before /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_table import REPO, RUNS, SHAPES, build  # noqa: E402

LAYERS = 2
WIDTHS = {"qwen3-0.6b": "qwen3-0.6b", "llama-3.1-8b": "llama-3.1-8b-4l"}  # a width -> the published shape it comes from

_CHILD = """
import json, sys, time
from pathlib import Path
from compress.core.text import DEFAULT_CALIBRATION, calibration_windows, load_calibration
from compress.models.loading import load_tokenizer
from compress.transforms.quantize.config import QUANTIZE_CONFIG
from compress.transforms.quantize.decoder import quantize_folder
from compress.transforms.quantize.config import candidate_configs
from compress.transforms.quantize.mixed import FLOAT, MixedPlan

folder, out, head, blocks = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
shared = {"calib_windows": 8, "calib_window": 256, "min_calib_tokens": 1}
config = QUANTIZE_CONFIG.validate_python({"method": "auto", **shared})
layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
formats = sorted({"fp8", head} - {FLOAT})
points = {"attn_in": FLOAT, "attn_out": FLOAT, "mlp_in": FLOAT, "mlp_hidden": blocks}
plan = MixedPlan({index: dict(points) for index in range(layers)}, candidate_configs(formats, shared),
                 head=FLOAT if head == "fp16" else head)
windows = calibration_windows(load_tokenizer(folder), load_calibration(DEFAULT_CALIBRATION), 256, 8, min_tokens=1)
started = time.perf_counter()
quantize_folder(folder, out, windows, config, plan=plan)
print(f"SECONDS {time.perf_counter() - started:.1f}")
"""


def shape_folder(width: str) -> Path:
    """A two-layer random bf16 checkpoint of ``width``'s published shape (built once, cached)."""
    name = f"{width}-{LAYERS}l"
    family, shape = SHAPES[WIDTHS[width]]
    SHAPES[name] = (family, {**shape, "num_hidden_layers": LAYERS})
    return build(name, weights=True)


def quantize(folder: Path, head: str, code: Path, label: str, blocks: str) -> dict:
    out = RUNS / f"head-memory-{folder.name}-{head}-{label}"
    subprocess.run(["rm", "-rf", str(out)], check=True)  # this script's own earlier output
    proc = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", _CHILD, str(folder), str(out), head, blocks],
                          cwd=code, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(code)})
    if proc.returncode != 0:
        # before /usr/bin/time's own lines
        program = (
            proc.stderr.split("\tCommand being timed:")[0].strip().splitlines()
        )
        return {"head": head, "code": label, "error": (program or ["?"])[-1]}
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return {"head": head, "code": label, "peak_gb": peak_kb * 1024 / 1e9, "written_gb": written / 1e9,
            "seconds": float(re.search(r"SECONDS ([\d.]+)", proc.stdout).group(1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b"], choices=list(WIDTHS))
    parser.add_argument("--heads", nargs="+", default=["fp16", "fp8", "int4"], choices=["fp16", "fp8", "int4", "nvfp4"])
    parser.add_argument("--before", type=Path, help="another checkout of compress, measured beside this one")
    parser.add_argument(
        "--blocks",
        choices=["fp8", "fp16"],
        default="fp8",
        help="the blocks' down_proj format (fp16: the head's cost alone, much faster at Llama-3.1-8B's width)",
    )
    args = parser.parse_args()
    codes = [("this", REPO)] + ([("before", args.before.resolve())] if args.before else [])
    print("| width | checkpoint GB (bf16) | LM head | code | quantize peak RSS GB | quantized GB written | seconds |\n"
          "|---|---|---|---|---|---|---|")
    for width in args.shapes:
        folder = shape_folder(width)
        checkpoint = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e9
        for head in args.heads:
            for label, code in codes:
                row = quantize(folder, head, code, label, args.blocks)
                figures = (
                    f"{row['peak_gb']:.2f} | {row['written_gb']:.2f} | {row['seconds']:.0f}"
                    if "error" not in row
                    else f"failed: {row['error']} | |"
                )
                print(f"| {width} | {checkpoint:.2f} | {head} | {label} | {figures} |", flush=True)
    print(json.dumps({"layers": LAYERS, "calibration": "8 windows x 256 tokens", "down_proj": args.blocks}))


if __name__ == "__main__":
    main()
