"""ONNX Runtime's CPU session of an exported decoder: resident memory and speed under each session setting.

Each setting opens the portable ONNX of a finished run in a fresh process (the session options validation
uses, plus the setting), then runs ``--tokens`` random tokens through the graph ``--chunk`` at a time (as
validation's parity check does) and greedily decodes ``--decode`` more. It prints the process's peak
resident memory once the session is open and after the tokens (and how much of what is resident at the end is
the graph's external data file mapped into memory), the seconds each part took, and the
largest difference of its logits from the first setting's (validation's own options,
``compress.backends.onnx.runtime.session_options``).

    .venv/bin/python bench/session_memory.py bench_runs/scale/qwen3-0.6b-default/03_export_onnx/onnx
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {
    "as validation (fold, prepack)": {},
    "no prepacking": {"config": {"session.disable_prepacking": "1"}},
    "no constant folding": {"disabled_optimizers": ["ConstantFolding"]},
    "no constant folding, no arena": {"disabled_optimizers": ["ConstantFolding"], "arena": False},
    "folding only outputs up to 1 MiB": {
        "config": {"optimization.constant_folding_max_output_size_in_bytes": str(2**20)}
    },
    "folding only outputs up to 1 MiB, no prepacking": {
        "config": {
            "optimization.constant_folding_max_output_size_in_bytes": str(2**20),
            "session.disable_prepacking": "1",
        }
    },
}

_CHILD = r"""
import json, sys, time
from pathlib import Path
import numpy as np
import onnxruntime as ort
from compress.backends.onnx import runtime


def status_gib(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":")) / 1024**2


def peak_gib():
    return status_gib("VmHWM")


folder, setting, tokens, chunk, decode, reference = (
    Path(sys.argv[1]),
    json.loads(sys.argv[2]),
    *map(int, sys.argv[3:6]),
    sys.argv[6],
)
layout = runtime.DecoderLayout.load(folder)
options = runtime.session_options(int8_activations=layout.int8_activations)
options.enable_cpu_mem_arena = setting.get("arena", True)
for key, value in setting.get("config", {}).items():
    options.add_session_config_entry(key, value)
start = time.perf_counter()
session = ort.InferenceSession(
    str(folder / runtime.ONNX_FILE),
    options,
    providers=["CPUExecutionProvider"],
    disabled_optimizers=setting.get("disabled_optimizers", []),
)
open_s, opened = time.perf_counter() - start, peak_gib()
names = runtime.past_names(layout.num_layers)
dtype = np.float16 if {i.name: i.type for i in session.get_inputs()}[names[0]] == "tensor(float16)" else np.float32
past = [
    np.zeros((1, layout.num_kv_heads[i // 2], 0, layout.head_dim), dtype=dtype) for i in range(2 * layout.num_layers)
]
vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
ids = np.random.default_rng(0).integers(0, min(vocab, 1000), (1, tokens))


def step(piece, past):
    length = past[0].shape[2] + piece.shape[1]
    feed = {
        "input_ids": piece,
        "attention_mask": np.ones((1, length), dtype=np.int64),
        "position_ids": np.arange(length - piece.shape[1], length)[None],
    }
    feed.update(zip(names, past))
    out = session.run(None, feed)
    return out[0], out[1:]


start, last = time.perf_counter(), []
for begin in range(0, tokens, chunk):
    logits, past = step(ids[:, begin : begin + chunk], past)
    last.append(logits[0, -1].astype(np.float32))
prefill_s = time.perf_counter() - start
start = time.perf_counter()
for _ in range(decode):
    logits, past = step(np.asarray([[int(logits[0, -1].argmax())]]), past)
    last.append(logits[0, -1].astype(np.float32))
decode_s = time.perf_counter() - start
last = np.stack(last)
if Path(reference).exists():
    difference = float(np.abs(last - np.load(reference)).max())
else:
    np.save(reference, last)
    difference = 0.0
print(
    json.dumps(
        {
            "open_s": round(open_s, 1),
            "session_gib": round(opened, 2),
            "after_gib": round(peak_gib(), 2),
            "file_gib": round(status_gib("RssFile"), 2),
            "prefill_s": round(prefill_s, 1),
            "decode_ms_per_token": round(1000 * decode_s / max(decode, 1), 1),
            "max_logit_difference": difference,
        }
    )
)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("onnx_dir", type=Path)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    args = parser.parse_args()
    graph_gb = sum(f.stat().st_size for f in args.onnx_dir.iterdir() if f.is_file()) / 1e9
    print(
        f"graph files {graph_gb:.2f} GB; {args.tokens} tokens {args.chunk} at a time, then {args.decode} greedy "
        "tokens\n"
    )
    print(
        "| session setting | open s | peak GiB, session open | peak GiB, after the tokens | of it, the graph's file "
        "mapped | prefill s | decode ms/token | largest logit difference |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        reference = str(Path(scratch) / "reference.npy")
        for name in args.settings:
            result = subprocess.run([sys.executable, "-c", _CHILD, str(args.onnx_dir), json.dumps(SETTINGS[name]),
                                     str(args.tokens), str(args.chunk), str(args.decode), reference],
                                    capture_output=True, text=True, cwd=REPO, check=False)
            if result.returncode:
                print(f"| {name} | failed: {result.stderr.strip().splitlines()[-1]} | | | | | | |")
                continue
            r = json.loads(result.stdout.strip().splitlines()[-1])
            print(
                f"| {name} | {r['open_s']} | {r['session_gib']} | {r['after_gib']} | {r['file_gib']} | "
                f"{r['prefill_s']} | "
                f"{r['decode_ms_per_token']} | {r['max_logit_difference']:.2e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
