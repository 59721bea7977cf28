"""Is the quantize stage flat in depth? The same width at two depths, quantized side by side, peak memory of each.

Llama-3.1-8B's published width (hidden 4096, MLP 14336, 32 / 8 heads, vocab 128256, untied) with 4
and with 8 of its 32 layers, random bf16 weights built in-process (`bench/scale_table.py` builds
and caches them under ``bench_runs/scale/models``). Each is quantized by the quantize stage's own
code (:func:`compress.transforms.quantize.decoder.quantize_folder`: the recipe's method, the
shipped calibration text) in a fresh process under ``/usr/bin/time -v``, one after the other, and
the table gives each process's peak resident memory, the growth from 4 to 8 layers, and what the 4
extra layers hold in bf16: the quantize stage is flat in depth when the growth stays under that
plus 10% (it holds one block at a time, so it should not grow at all).

    .venv/bin/python bench/quantize_depth.py                       # recipe=default's quantize options
    .venv/bin/python bench/quantize_depth.py --recipe edgellm-int4
    # the walk alone, quickly:
    .venv/bin/python bench/quantize_depth.py --with quantize.method=rtn quantize.calib_windows=8
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_table import REPO, RUNS, build  # noqa: E402

SHAPES_BY_DEPTH = ("llama-3.1-8b-4l", "llama-3.1-8b-8l")

_CHILD = """
import sys, time
from pathlib import Path
from compress.core.config import load_recipe
from compress.core.text import DEFAULT_CALIBRATION, calibration_windows, load_calibration
from compress.models.loading import load_tokenizer
from compress.transforms.quantize.config import QUANTIZE_CONFIG
from compress.transforms.quantize.decoder import quantize_folder

import json
folder, out, recipe = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
options = next(s.options for s in load_recipe(recipe).stages if s.name == "quantize")
overrides = json.loads(sys.argv[4])
config = QUANTIZE_CONFIG.validate_python({**options, **overrides} if "method" not in overrides else overrides)
windows = calibration_windows(load_tokenizer(folder), load_calibration(DEFAULT_CALIBRATION), config.calib_window,
                              config.calib_windows, min_tokens=config.min_calib_tokens)
started = time.perf_counter()
quantize_folder(folder, out, windows, config)
print(f"SECONDS {time.perf_counter() - started:.1f}")
"""


def quantize(name: str, recipe: str, overrides: dict) -> dict:
    folder = build(name, weights=True)
    out = RUNS / f"quantize-depth-{name}"
    subprocess.run(["rm", "-rf", str(out)], check=True)  # this script's own earlier output
    proc = subprocess.run(
        ["/usr/bin/time", "-v", sys.executable, "-c", _CHILD, str(folder), str(out), recipe, json.dumps(overrides)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name}: quantize failed: {proc.stderr.strip().splitlines()[-1]}")
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    config = json.loads((folder / "config.json").read_text())
    checkpoint = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return {
        "name": name,
        "layers": config["num_hidden_layers"],
        "peak_gb": peak_kb * 1024 / 1e9,
        "checkpoint_gb": checkpoint / 1e9,
        "seconds": float(re.search(r"SECONDS ([\d.]+)", proc.stdout).group(1)),
        "written_gb": sum(p.stat().st_size for p in out.glob("*.safetensors")) / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="default")
    parser.add_argument(
        "--with",
        dest="overrides",
        nargs="*",
        default=[],
        metavar="OPTION=VALUE",
        help="quantize options over the recipe's (quantize.method=rtn alone starts from rtn's defaults)",
    )
    args = parser.parse_args()
    overrides = {}
    for word in args.overrides:
        key, _, value = word.partition("=")
        overrides[key.removeprefix("quantize.")] = json.loads(value) if value[:1] in "[{0123456789" else value
    rows = [quantize(name, args.recipe, overrides) for name in SHAPES_BY_DEPTH]
    print(
        "| shape | layers | bf16 checkpoint GB | quantize peak RSS GB | quantized GB written | seconds "
        "|\n|---|---|---|---|---|---|"
    )
    for row in rows:
        print(
            f"| {row['name']} | {row['layers']} | {row['checkpoint_gb']:.2f} | {row['peak_gb']:.2f} | "
            f"{row['written_gb']:.2f} | {row['seconds']:.0f} |"
        )
    shallow, deep = rows
    extra_layers = deep["checkpoint_gb"] - shallow["checkpoint_gb"]  # the 4 extra layers' bf16 bytes
    growth = deep["peak_gb"] - shallow["peak_gb"]
    print(f"\npeak grows by {growth:.2f} GB from {shallow['layers']} to {deep['layers']} layers; the extra layers hold "
          f"{extra_layers:.2f} GB in bf16; limit (that + 10%) {1.1 * extra_layers:.2f} GB: "
          f"{'flat in depth' if growth <= 1.1 * extra_layers else 'GROWS WITH DEPTH'}")


if __name__ == "__main__":
    main()
