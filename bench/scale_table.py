"""The models people deploy, at their real shapes: what each stage needs on this machine, estimated and measured.

Random-weight bf16 checkpoints of published shapes are built in-process from each family's config
class (no download; quality on them means nothing, memory, disk and time are real): Qwen3-0.6B,
Qwen3-1.7B and Llama-3.2-3B at full depth, Llama-3.1-8B at full width with 4 and 8 of its 32
layers. Each gets the embedded SmolLM2's tokenizer (every id it makes is below their vocabularies).

For every shape the plan's own estimate (``compress run --dry-run``: each stage's peak host memory,
disk and time) is printed. ``--measure SHAPE...`` also runs ``compress run`` for real under
``/usr/bin/time -v`` (peak resident memory of the whole run, the run directory's size, each
stage's wall time and peak memory from its ``stage.json``), side by side with the estimate. Models
and runs go to ``bench_runs/scale/``.

    .venv/bin/python bench/scale_table.py                          # estimates for every shape (a minute)
    .venv/bin/python bench/scale_table.py --measure qwen3-0.6b      # and one measured run (about 20 min on 2 cores)
    .venv/bin/python bench/scale_table.py --measure qwen3-0.6b --recipe edgellm-int8
    .venv/bin/python bench/scale_table.py --measure qwen3-1.7b --with export_onnx=off   # the bundle without the ONNX
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "bench_runs" / "scale"
COMPRESS = [sys.executable, "-m", "compress"]

# Published shapes (config.json of each model card), as keyword arguments of the family's config class.
SHAPES = {
    "qwen3-0.6b": (
        "Qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-1.7b": (
        "Qwen3",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
    ),
    "llama-3.2-3b": (
        "Llama",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            tie_word_embeddings=True,
        ),
    ),
    "llama-3.1-8b-4l": (
        "Llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            tie_word_embeddings=False,
        ),
    ),
    "llama-3.1-8b-8l": (
        "Llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            tie_word_embeddings=False,
        ),
    ),
    "llama-3.1-8b": (
        "Llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            tie_word_embeddings=False,
        ),
    ),
}


def _tokenizer_folder() -> Path:
    sys.path.insert(0, str(REPO))
    from compress.models.sources import materialize, resolve_model

    return materialize(resolve_model("smollm2-135m-instruct"))


def build(name: str, weights: bool, tokenizer: Path | None = None) -> Path:
    """The model folder of ``name``: config and ``tokenizer``'s files (the embedded model's by default), and random bf16
    weights when ``weights`` (drawn on the GPU where there is one: an 8B model's on the CPU take minutes)."""
    import torch
    import transformers

    family, shape = SHAPES[name]
    folder = RUNS / "models" / name
    if (folder / "model.safetensors.index.json").is_file() or (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = getattr(transformers, f"{family}Config")(
        **shape, max_position_embeddings=32768, rms_norm_eps=1e-6, dtype="bfloat16"
    )
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        source = (tokenizer or _tokenizer_folder()) / file
        if source.is_file():
            shutil.copy(source, folder / file)
    if not weights:
        config.save_pretrained(folder)
        return folder
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = getattr(transformers, f"{family}ForCausalLM")._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="4GB")
    return folder


def _env() -> dict[str, str]:
    """This checkout first on the path (packages carried beside it stay reachable)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def estimate(folder: Path, recipe: str, extra: list[str]) -> list[dict]:
    proc = subprocess.run([*COMPRESS, "run", "target=jetson-orin", f"recipe={recipe}", f"model={folder}",
                           f"out={RUNS / 'plan-only'}", "--dry-run", *extra], cwd=REPO, capture_output=True, text=True,
                          env=_env())
    if proc.returncode != 0:
        return [{"stage": "refused", "reason": proc.stderr.strip().splitlines()[-1]}]
    plan = json.loads(proc.stdout)
    rows = plan["estimates"]
    if not plan["fits_this_machine"]:
        # a real run is refused; the dry run only says so
        rows.append(
            {"stage": "refused", "reason": plan["fit_problem"]}
        )
    return rows


def measure(folder: Path, name: str, recipe: str, extra: list[str]) -> dict:
    out = RUNS / f"{name}-{recipe}"
    if out.exists():
        shutil.rmtree(out)  # this script's own earlier run: a measurement computes every stage afresh
    timer = ["/usr/bin/time", "-v"] if Path("/usr/bin/time").is_file() else []  # else the stages' own peaks alone
    command = [*timer, *COMPRESS, "run", "target=jetson-orin", f"recipe={recipe}", f"model={folder}", f"out={out}",
               "--no-progress", *extra]
    print("$", " ".join(command), flush=True)
    started = time.monotonic()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=_env())
    seconds = time.monotonic() - started
    peak_kb = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    stages = {}
    for record in sorted(out.glob("0*/stage.json")):
        data = json.loads(record.read_text())
        child, device = data.get("peak_subprocess_rss_mb"), data.get("peak_device_memory_mb")
        stages[data["stage"]] = {"s": data["duration_s"], "peak_gb": round(data["peak_rss_mb"] / 1024, 2),
                                 "subprocess_gb": round(child / 1024, 2) if child else None,
                                 "device_gb": round(device / 1024, 2) if device is not None else None}
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    checkpoint = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    # compress resets the kernel's high-water mark at each stage (to record each stage's peak), which also lowers what
    # /usr/bin/time reads at exit; the run's peak is the larger of that and every stage's own.
    stage_peak = max((max(s["peak_gb"], s["subprocess_gb"] or 0.0) for s in stages.values()), default=0.0)
    time_peak = int(peak_kb.group(1)) / 1024**2 if peak_kb else 0.0
    return {
        "exit": proc.returncode,
        "peak_rss_gb": max(time_peak, stage_peak) or None,
        "wall": f"{int(seconds) // 60}:{int(seconds) % 60:02d}",
        "run_dir_gb": size / 1e9,
        "checkpoint_gb": checkpoint / 1e9,
        "stages": stages,
        "error": proc.stderr.strip().splitlines()[-1] if proc.returncode not in (0, 1, 3) else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=[s for s in SHAPES if s != "llama-3.1-8b"], choices=list(SHAPES))
    parser.add_argument("--measure", nargs="*", default=[], choices=list(SHAPES))
    parser.add_argument("--recipe", default="default")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="a folder whose tokenizer files the models get (default: the embedded model's, which needs its package)",
    )
    parser.add_argument("--with", dest="extra", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more words for compress run (export_onnx=off, quantize.calib_windows=16, ...)")
    args = parser.parse_args()
    print(
        "| shape | parameters | stage | estimated peak GB | estimated disk GB | estimated min "
        "|\n|---|---|---|---|---|---|"
    )
    for name in args.shapes:
        folder = build(name, weights=name in args.measure, tokenizer=args.tokenizer)
        sys.path.insert(0, str(REPO))
        from compress.pipeline.resources import parameter_count

        params = parameter_count(json.loads((folder / "config.json").read_text()))
        for row in estimate(folder, args.recipe, args.extra):
            if "reason" in row:
                print(f"| {name} | {params / 1e9:.2f}B | refused: {row['reason']} | | | |")
                continue
            print(
                f"| {name} | {params / 1e9:.2f}B | {row['stage']} | {row['peak_host_gb']} | {row['disk_gb']} | "
                f"{row['minutes']} |"
            )
    for name in args.measure:
        result = measure(build(name, weights=True, tokenizer=args.tokenizer), name, args.recipe, args.extra)
        print(
            f"\n{name}, recipe={args.recipe} {' '.join(args.extra)}: exit {result['exit']}, wall {result['wall']}, "
            "peak RSS "
            f"{result['peak_rss_gb']:.2f} GiB ({result['peak_rss_gb'] * 1.073741824 / result['checkpoint_gb']:.1f}x "
            f"the {result['checkpoint_gb']:.2f} GB bf16 checkpoint), run directory {result['run_dir_gb']:.2f} GB "
            f"({result['run_dir_gb'] / result['checkpoint_gb']:.1f}x)"
            + (f"; error: {result['error']}" if result["error"] else "")
        )
        print(
            "| stage | wall s | peak GiB (compress) | peak GiB (a program it ran) | peak GiB (CUDA device) "
            "|\n|---|---|---|---|---|"
        )
        for stage, row in result["stages"].items():
            device = "—" if row["device_gb"] is None else row["device_gb"]
            print(f"| {stage} | {row['s']:.1f} | {row['peak_gb']} | {row['subprocess_gb'] or '—'} | {device} |")


if __name__ == "__main__":
    main()
