"""The teacher held for the app prompts: its mapped checkpoint's pages kept, against handed back after each part.

Each way runs in a fresh process on a float Hugging Face folder (e.g. the Qwen3-1.7B shape that
``bench/scale_table.py`` builds): the model held in its own dtype as validation holds it
(:func:`compress.transforms.quantize.saved.held_deployed_causal_lm`), computed in float32 part by
part, answers the first ``--prompts`` shipped app prompts greedily (``--new-tokens`` each), with
``hand_back_pages`` off and on (:mod:`compress.core.mapped_pages`). Printed: the process's peak
resident memory (``VmHWM``), the largest anonymous and file-backed parts sampled while it answers,
the wall time, and whether the answers are the same token ids either way.

    .venv/bin/python bench/held_pages.py bench_runs/scale/models/qwen3-1.7b --prompts 40 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = r'''
import json, sys, threading, time
from pathlib import Path
from compress.eval.decoder import model_eos_ids, pad_id_of
from compress.eval.prompts import answer_prompts, resolve_prompts, torch_greedy_batched
from compress.models.compute import computed_in_float32
from compress.models.loading import load_tokenizer
from compress.transforms.quantize.saved import held_deployed_causal_lm

def status():
    return {l.split(":")[0]: int(l.split()[1]) / 1024**2 for l in open("/proc/self/status")
            if l.split(":")[0] in ("VmHWM", "RssAnon", "RssFile")}

largest = {"RssAnon": 0.0, "RssFile": 0.0}
def sample():
    while True:
        now = status()
        for key in largest:
            largest[key] = max(largest[key], now[key])
        time.sleep(0.02)

folder, prompts, new_tokens, hand_back = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
tokenizer = load_tokenizer(folder)
cases, _ = resolve_prompts(None, tokenizer)
threading.Thread(target=sample, daemon=True).start()
started = time.perf_counter()
model, _ = held_deployed_causal_lm(folder)
eos = model_eos_ids(folder, tokenizer)
with computed_in_float32(model, hand_back_pages=hand_back):
    answers = answer_prompts(cases[:prompts], tokenizer, torch_greedy_batched(model, eos, pad_id_of(tokenizer, eos)),
                             new_tokens, progress=False)
print(json.dumps({"peak_gib": round(status()["VmHWM"], 2), "anon_gib": round(largest["RssAnon"], 2),
                  "file_gib": round(largest["RssFile"], 2), "seconds": round(time.perf_counter() - started, 1),
                  "answers": answers}))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    print(
        "| pages | peak GiB | of it, anonymous (largest sampled) | of it, the checkpoint mapped (largest sampled) | "
        "seconds |\n|---|---|---|---|---|"
    )
    answers = []
    for hand_back in (False, True):
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _CHILD,
                str(args.model_dir),
                str(args.prompts),
                str(args.new_tokens),
                "1" if hand_back else "0",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        )
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-2000:])
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        answers.append(row["answers"])
        name = "handed back after each part" if hand_back else "kept (every page read stays)"
        print(f"| {name} | {row['peak_gib']} | {row['anon_gib']} | {row['file_gib']} | {row['seconds']} |", flush=True)
    print(f"answers identical: {answers[0] == answers[1]} ({args.prompts} prompts, {args.new_tokens} new tokens)")


if __name__ == "__main__":
    main()
