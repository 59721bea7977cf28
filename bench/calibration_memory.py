"""Peak memory of layer-by-layer calibration: the 30-layer default vs the same model cut to 15 layers.

Each case runs in its own process. The model's weights are loaded first; then the peak RSS is
reset and quantization runs. If calibration held activations for every layer, the extra memory
would double with depth; walking the blocks one by one keeps it flat.

    .venv/bin/python bench/calibration_memory.py            # int8 and int4
    .venv/bin/python bench/calibration_memory.py int8
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
from compress.core.text import DEFAULT_CALIBRATION, calibration_windows, load_calibration
from compress.models.sources import BUILTIN_MODELS, DEFAULT_MODEL, materialize, resolve_model
from compress.models.loading import load_causal_lm, load_tokenizer
from compress.transforms.quantize.config import QUANTIZE_CONFIG, quantize_config
from compress.transforms.quantize.decoder import quantize_model


def rss(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024


layers, method = int(sys.argv[1]), sys.argv[2]
folder = materialize(resolve_model(DEFAULT_MODEL))
model = load_causal_lm(folder)
model.model.layers = model.model.layers[:layers]
model.config.num_hidden_layers = layers
tokenizer = load_tokenizer(folder)
windows = calibration_windows(tokenizer, load_calibration(DEFAULT_CALIBRATION), 512, 16)
weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
Path("/proc/self/clear_refs").write_text("5")
before = rss("VmRSS:")
start = time.perf_counter()
# The recipes' settings: int8 with the Hadamard down_proj rotation, int4 AWQ + GPTQ.
config = quantize_config(method=method, hadamard_block=128) if method == "int8" else quantize_config(method=method)
quantize_model(model, windows, config, progress=False)
print(
    json.dumps(
        {
            "layers": layers,
            "method": method,
            "weights_mb": round(weights_mb, 1),
            "rss_before_mb": round(before, 1),
            "peak_rss_mb": round(rss("VmHWM:"), 1),
            "extra_mb": round(rss("VmHWM:") - before, 1),
            "seconds": round(time.perf_counter() - start, 1),
        }
    )
)
"""


def main() -> None:
    rows = []
    for method in sys.argv[1:] or ("int8", "int4"):
        for layers in (15, 30):
            proc = subprocess.run([sys.executable, "-c", CHILD, str(layers), method], cwd=REPO,
                                  capture_output=True, text=True, check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    print("| method | layers | weights MB | RSS before MB | peak RSS MB | extra over weights MB | seconds |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['layers']} | {r['weights_mb']} | {r['rss_before_mb']} | {r['peak_rss_mb']} | "
              f"{r['extra_mb']} | {r['seconds']} |")


if __name__ == "__main__":
    main()
