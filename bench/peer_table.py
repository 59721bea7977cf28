"""Peers on the validator's protocol: what the quantizers a user would otherwise run do to the embedded model.

Every row quantizes SmolLM2-135M-Instruct (the packaged checkpoint) on the same calibration windows
(the shipped calibration text, ``quantize``'s defaults: 32 windows of 512 tokens) and is measured by
compress's own validation code (:func:`compress.eval.decoder.measure`, torch): perplexity on the six
evaluation domains against the unquantized model (the worst one is what the gate reads), top-1
agreement and KL on the mixed text, and the app prompts' answers.

The peers run in their own virtual environment (``.venv-peers``: llm-compressor and AutoRound, whose
pins differ from ours; never a dependency of compress). Each writes its weights quantized and
dequantized (dense, float32; the child checks every quantized linear's groups hold at most 16
values) so they are measured on the same code path as a float model. Weight-only rows only:
llm-compressor's W8A8 quantizes activations per token at run time, which dense weights cannot show.

Group size 64: SmolLM2's 576-wide inputs are not a multiple of 128 (Edge-LLM's INT4 group), so
no INT4 recipe of any tool ships this model through Edge-LLM; the table compares the quantizers.

    python3 -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1 auto-round==0.15.1
    .venv/bin/python bench/peer_table.py                     # every row (about 30 min on 2 cores)
    .venv/bin/python bench/peer_table.py compress-int4 llm-compressor-gptq
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench_runs" / "peers"
PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"
GROUP = 64
AUTOROUND_ITERS = 50  # AutoRound's "light" setting; its default (200) takes hours on two cores

ROWS = {
    "compress-rtn-int4": ("compress", {"method": "rtn", "bits": 4, "group_size": GROUP, "hadamard_block": 0}),
    "compress-int4": ("compress", {"method": "int4", "group_size": GROUP}),
    "llm-compressor-rtn": ("peer", {"tool": "llmcompressor-rtn"}),
    "llm-compressor-gptq": ("peer", {"tool": "llmcompressor-gptq"}),
    "autoround": ("peer", {"tool": "autoround", "iters": AUTOROUND_ITERS}),
}

_PEER = r'''
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer

teacher, out, windows_file, options = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), json.loads(sys.argv[4])
group, tool = options["group"], options["tool"]
windows = torch.load(windows_file, weights_only=True)
tokenizer = AutoTokenizer.from_pretrained(teacher)
model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
if tool.startswith("llmcompressor"):
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                 "group_size": group}}
    modifier = (GPTQModifier if tool.endswith("gptq") else QuantizationModifier)(config_groups={"group_0": scheme},
                                                                                  ignore=["lm_head"])
    data = Dataset.from_dict({"input_ids": windows.tolist(), "attention_mask": torch.ones_like(windows).tolist()})
    oneshot(model=model, dataset=data, recipe=[modifier], max_seq_length=windows.shape[1], num_calibration_samples=len(windows))
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    with torch.no_grad():  # the weights as its forward pass computes with them (its own fake quantization)
        for name in names:
            module = model.get_submodule(name)
            module.weight.copy_(fake_quantize(module.weight, module.weight_scale, getattr(module, "weight_zero_point", None),
                                              module.quantization_scheme.weights))
    state = model.state_dict()
else:
    from auto_round import AutoRound
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in windows]
    rounder = AutoRound(model, tokenizer, bits=4, group_size=group, sym=True, iters=options["iters"], nsamples=len(texts),
                        seqlen=windows.shape[1], dataset=texts)
    rounder.quantize_and_save(str(out / "fake"), format="fake")
    saved = next((out / "fake").rglob("config.json")).parent  # AutoRound names a sub-folder after the model and scheme
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    state = model.state_dict()
dense = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
keys = set(dense.state_dict())
missing = keys - set(state)
if missing:
    raise SystemExit(f"{tool}: the quantized model lacks {sorted(missing)[:3]}")
dense.load_state_dict({k: v.float() for k, v in state.items() if k in keys})
for name in names:  # each quantized linear's weight is on a 4-bit grid: at most 16 values per group
    weight = dense.get_submodule(name).weight.detach()
    values = weight.reshape(weight.shape[0], -1, group)
    worst = max(len(torch.unique(values[row, g])) for row in range(0, weight.shape[0], 97) for g in range(values.shape[1]))
    if worst > 16:
        raise SystemExit(f"{tool}: {name} holds {worst} values in a group of {group}: not quantized")
dense.save_pretrained(out / "model")
tokenizer.save_pretrained(out / "model")
print(json.dumps({"linears": len(names)}))
'''


def _teacher() -> Path:
    from compress.models.sources import materialize, resolve_model

    return materialize(resolve_model("smollm2-135m-instruct"))


def _calibration(teacher: Path):
    from compress.core.text import DEFAULT_CALIBRATION, calibration_windows, load_calibration
    from compress.models.loading import load_tokenizer
    from compress.transforms.quantize.config import QUANTIZE_CONFIG

    config = QUANTIZE_CONFIG.validate_python({"method": "int4"})
    return calibration_windows(load_tokenizer(teacher), load_calibration(DEFAULT_CALIBRATION), config.calib_window,
                               config.calib_windows, min_tokens=config.min_calib_tokens)


def quantize_row(name: str, teacher: Path, windows, out: Path) -> tuple[Path, float]:
    """The row's quantized model folder (ours: the quantize stage's folder; a peer's: its dense weights) and seconds."""
    import torch

    kind, options = ROWS[name]
    started = time.perf_counter()
    if kind == "compress":
        from compress.models.loading import load_tokenizer, save_side_files
        from compress.transforms.quantize.config import QUANTIZE_CONFIG
        from compress.transforms.quantize.decoder import quantize_folder

        folder = out / "model"
        quantize_folder(teacher, folder, windows, QUANTIZE_CONFIG.validate_python(options), progress=False)
        save_side_files(load_tokenizer(teacher), teacher, folder)
        return folder, time.perf_counter() - started
    if not PEERS_PYTHON.is_file():
        raise SystemExit(f"{name}: {PEERS_PYTHON} is missing; create it as this script's docstring says")
    windows_file = out / "windows.pt"
    torch.save(windows, windows_file)
    proc = subprocess.run([str(PEERS_PYTHON), "-c", _PEER, str(teacher), str(out), str(windows_file),
                           json.dumps({**options, "group": GROUP})], capture_output=True, text=True, cwd=out)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return out / "model", time.perf_counter() - started


def measure_row(folder: Path, teacher: Path) -> dict:
    from compress.core.text import DEFAULT_CALIBRATION, DEFAULT_EVALUATION, load_calibration, load_evaluation, unseen_domains
    from compress.eval.decoder import ValidateConfig, measure

    evaluation = load_evaluation(DEFAULT_EVALUATION)
    unseen = unseen_domains(load_calibration(DEFAULT_CALIBRATION), evaluation)
    return measure(folder, teacher, evaluation, ValidateConfig(), progress=False, unseen=unseen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    teacher = _teacher()
    windows = _calibration(teacher)
    results = []
    for name in args.rows:
        out = OUT / name
        subprocess.run(["rm", "-rf", str(out)], check=True)  # this script's own earlier row
        out.mkdir(parents=True)
        folder, seconds = quantize_row(name, teacher, windows, out)
        metrics = measure_row(folder, teacher)
        row = {"row": name, "seconds": round(seconds, 1), "worst_domain": metrics["worst_domain"],
               "worst_pct": metrics["perplexity_increase_pct"], "top1": metrics["top1_agreement"], "kl": metrics["mean_kl"],
               "prefix": (metrics["prompts"] or {}).get("answer_prefix_agreement"),
               "domains": {d: r["perplexity_increase_pct"] for d, r in metrics["domains"].items()}}
        (out / "row.json").write_text(json.dumps(row, indent=2))
        results.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nSmolLM2-135M-Instruct, W4A16 group {GROUP}, {len(windows)} calibration windows of {windows.shape[1]} tokens; "
          "measured by compress's validation (torch) against the unquantized model\n")
    print("| row | worst domain | top-1 | KL | app-prompt answer prefix | quantize s |\n|---|---|---|---|---|---|")
    for row in results:
        prefix = f"{100 * row['prefix']:.1f}%" if row["prefix"] is not None else "—"
        print(f"| {row['row']} | {row['worst_pct']:+.2f}% ({row['worst_domain']}) | {100 * row['top1']:.1f}% | {row['kl']:.4f} | "
              f"{prefix} | {row['seconds']:.0f} |")


if __name__ == "__main__":
    main()
