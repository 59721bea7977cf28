"""Peers on the validator's protocol: what the quantizers a user would otherwise run do to the embedded model.

Every row quantizes SmolLM2-135M-Instruct (the packaged checkpoint) on the same calibration windows
(the shipped calibration text, ``quantize``'s defaults: 32 windows of 512 tokens) and is measured by
compress's own validation code (:func:`compress.eval.decoder.measure`, torch): perplexity on the six
evaluation domains against the unquantized model (the worst one is what the gate reads), top-1
agreement and KL on the mixed text, and the app prompts' answers.

The peers run in their own virtual environments (``.venv-peers``: llm-compressor and AutoRound;
``.venv-edgellm-quant``: TensorRT Edge-LLM's quantizer, Model Optimizer underneath; their pins differ
from ours, and neither is ever a dependency of compress). Each writes its weights quantized and
dequantized (dense, float32; the child checks every quantized linear's groups hold at most 16
values) so they are measured on the same code path as a float model. llm-compressor's W8A8
(``llm-compressor-w8a8``: its documented recipe, SmoothQuant 0.8 then GPTQ with the ``W8A8`` preset)
quantizes activations per token at run time, which dense weights cannot show: it is measured like
the ``edgellm-*`` rows below, on its own fake quantization. Its per-token dynamic activations are
what vLLM runs; Edge-LLM's W8A8 kernels take one static scale per tensor.

Group size 64: SmolLM2's 576-wide inputs are not a multiple of 128 (Edge-LLM's INT4 group), so
no INT4 recipe of any tool ships this model through Edge-LLM; the table compares the quantizers.

The ``edgellm-*`` rows are what a Jetson user runs instead of compress: Edge-LLM's own quantization
(``tensorrt_edgellm.quantization``: its ``build_quant_config`` for each format it offers, applied by
Model Optimizer's ``mtq.quantize`` on the same calibration windows, as its ``quantize_and_export``
does before exporting). They quantize activations too (W8A8 SmoothQuant, FP8), so they are measured
in that environment on Model Optimizer's own fake quantization (its simulation of the numbers it
exports), by compress's fidelity code on the same evaluation windows, and their greedy answers to
the app prompts are compared with the teacher's by compress; beside them, compress's own rows for
the same formats (``compress-int8``: the ``edgellm-int8`` recipe's quantization; ``compress-fp8``:
``thor-fp8``'s), measured on the deployed numbers. On a machine without CUDA Model Optimizer 0.45
cannot calibrate NVFP4 (``amax must be a CUDA tensor for dynamic block quantization``): that row
says so.

    python3 -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1 auto-round==0.15.1
    python3 -m venv .venv-edgellm-quant && .venv-edgellm-quant/bin/pip install "tensorrt-edgellm[export]==0.11.0" \
        torch==2.13.0 nvidia-modelopt==0.45.0 datasets==5.0.0 einops==0.8.2 peft==0.19.1 tqdm
    .venv/bin/python bench/peer_table.py                     # every row
    .venv/bin/python bench/peer_table.py compress-int4 llm-compressor-gptq
    .venv/bin/python bench/peer_table.py compress-int8 edgellm-int8_sq compress-fp8 edgellm-fp8
    .venv/bin/python bench/peer_table.py llm-compressor-w8a8
    .venv/bin/python bench/peer_table.py edgellm-int4_awq compress-int4 --windows 4   # fewer windows, every row alike
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench_runs" / "peers"
PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"
EDGELLM_QUANT_PYTHON = REPO / ".venv-edgellm-quant" / "bin" / "python"
GROUP = 64
AUTOROUND_ITERS = 50  # AutoRound's "light" setting; its default is 200 (the autoround-200 row)
TUNE_ITERS = 100  # compress's learned rounding (quantize.tune_iters) in the *-tuned rows

ROWS = {
    "compress-rtn-int4": ("compress", {"method": "rtn", "bits": 4, "group_size": GROUP, "hadamard_block": 0}),
    "compress-int4": ("compress", {"method": "int4", "group_size": GROUP}),
    "llm-compressor-rtn": ("peer", {"tool": "llmcompressor-rtn"}),
    "llm-compressor-gptq": ("peer", {"tool": "llmcompressor-gptq"}),
    "compress-int4-tuned": ("compress", {"method": "int4", "group_size": GROUP, "tune_iters": TUNE_ITERS}),
    "compress-int4-rotated-tuned": ("compress", {"method": "int4", "group_size": GROUP, "tune_iters": TUNE_ITERS,
                                                 "rotate": "hadamard"}),
    "autoround": ("peer", {"tool": "autoround", "iters": AUTOROUND_ITERS}),
    "autoround-200": ("peer", {"tool": "autoround", "iters": 200}),
    "llm-compressor-w8a8": ("simulated", {"tool": "llmcompressor", "option": "W8A8"}),
    "compress-int8": ("compress", {"method": "int8", "alpha": "auto", "weight_algorithm": "gptq", "hadamard_block": 0}),
    "edgellm-int8_sq": ("simulated", {"tool": "edgellm", "option": "int8_sq"}),
    "compress-int8-rotated": ("compress", {"method": "int8", "alpha": "auto", "weight_algorithm": "gptq",
                                           "hadamard_block": 0, "rotate": "hadamard"}),
    "compress-int8-rotated-tuned": ("compress", {"method": "int8", "alpha": "auto", "weight_algorithm": "gptq",
                                                 "hadamard_block": 0, "rotate": "hadamard", "tune_iters": TUNE_ITERS}),
    "compress-int8-mse": ("compress", {"method": "int8", "alpha": "auto", "weight_algorithm": "gptq",
                                       "hadamard_block": 0, "act_scale": "mse"}),
    "compress-int8-tuned": ("compress", {"method": "int8", "alpha": "auto", "weight_algorithm": "gptq",
                                         "hadamard_block": 0, "tune_iters": TUNE_ITERS}),
    "compress-fp8": ("compress", {"method": "fp8"}),
    # thor-nvfp4's quantization (W4A4), then with a folded rotation and learned rounding
    "compress-nvfp4": ("compress", {"method": "nvfp4", "activations": "nvfp4", "clip_tokens": "all"}),
    "compress-nvfp4-tuned": ("compress", {"method": "nvfp4", "activations": "nvfp4", "clip_tokens": "all",
                                          "tune_iters": TUNE_ITERS}),
    "compress-nvfp4-rotated-tuned": ("compress", {"method": "nvfp4", "activations": "nvfp4", "clip_tokens": "all",
                                                  "rotate": "hadamard", "tune_iters": TUNE_ITERS}),
    "edgellm-fp8": ("simulated", {"tool": "edgellm", "option": "fp8"}),
    # Edge-LLM's int4_awq groups 128 inputs, which SmolLM2's 576-wide inputs do not divide: the table's group of 64
    # instead
    "edgellm-int4_awq": ("simulated", {"tool": "edgellm", "option": "int4_awq", "group": GROUP}),
    "edgellm-nvfp4": ("simulated", {"tool": "edgellm", "option": "nvfp4"}),
}

_PEER = r"""
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

    scheme = {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group},
    }
    modifier = (GPTQModifier if tool.endswith("gptq") else QuantizationModifier)(
        config_groups={"group_0": scheme}, ignore=["lm_head"]
    )
    data = Dataset.from_dict({"input_ids": windows.tolist(), "attention_mask": torch.ones_like(windows).tolist()})
    oneshot(
        model=model,
        dataset=data,
        recipe=[modifier],
        max_seq_length=windows.shape[1],
        num_calibration_samples=len(windows),
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    with torch.no_grad():  # the weights as its forward pass computes with them (its own fake quantization)
        for name in names:
            module = model.get_submodule(name)
            module.weight.copy_(
                fake_quantize(
                    module.weight,
                    module.weight_scale,
                    getattr(module, "weight_zero_point", None),
                    module.quantization_scheme.weights,
                )
            )
    state = model.state_dict()
else:
    from auto_round import AutoRound

    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in windows]
    rounder = AutoRound(
        model,
        tokenizer,
        bits=4,
        group_size=group,
        sym=True,
        iters=options["iters"],
        nsamples=len(texts),
        seqlen=windows.shape[1],
        dataset=texts,
    )
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
    worst = max(
        len(torch.unique(values[row, g])) for row in range(0, weight.shape[0], 97) for g in range(values.shape[1])
    )
    if worst > 16:
        raise SystemExit(f"{tool}: {name} holds {worst} values in a group of {group}: not quantized")
dense.save_pretrained(out / "model")
tokenizer.save_pretrained(out / "model")
print(json.dumps({"linears": len(names)}))
"""


# A quantizer that simulates activations too, run in its own environment and measured there on its own fake quantization
# (its model's forward pass) by compress's fidelity code: this head, one tool's ``quantize(model)`` (returning the model
# and how many linears it quantized; raising AssertionError for the tool's own refusal), then _MEASURED_TAIL.
_MEASURED_HEAD = r'''
import json, sys, time, warnings
from pathlib import Path
import torch
warnings.filterwarnings("ignore")
from transformers import AutoModelForCausalLM
from compress.eval.fidelity import compare_window_pairs

teacher, work, option = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
group = int(sys.argv[4]) if len(sys.argv) > 4 else 0  # a weight group size in place of the format's own
calibration = torch.load(work / "windows.pt", weights_only=True)
inputs = torch.load(work / "evaluation.pt", weights_only=True)
torch.manual_seed(0)
reference = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
'''

_EDGELLM = r"""
import modelopt.torch.quantization as mtq
from tensorrt_edgellm.quantization.quantization_configs import build_quant_config

TOOL = "Model Optimizer"


def calibrate(m):
    with torch.no_grad():
        for window in calibration:
            m(window[None])


def quant_config():
    config = build_quant_config(option, None, None)
    for entry in config["quant_cfg"] if group else []:
        if entry.get("quantizer_name") == "*weight_quantizer" and (entry.get("cfg") or {}).get("block_sizes"):
            entry["cfg"]["block_sizes"][-1] = group
    return config


def quantize(model):
    model = mtq.quantize(model, quant_config(), forward_loop=calibrate)
    return model, sum(
        1 for _, m in model.named_modules() if getattr(getattr(m, "weight_quantizer", None), "is_enabled", False)
    )
"""

# llm-compressor's documented W8A8 recipe (SmoothQuant 0.8, then GPTQ with the W8A8 preset: INT8 weights per channel,
# activations INT8 per token, dynamic).
_LLMCOMPRESSOR_W8A8 = r"""
TOOL = "llm-compressor"
def quantize(model):
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
    mask = torch.ones_like(calibration).tolist()
    data = Dataset.from_dict({"input_ids": calibration.tolist(), "attention_mask": mask})
    gptq = GPTQModifier(targets="Linear", scheme=option, ignore=["lm_head"])
    recipe = [SmoothQuantModifier(smoothing_strength=0.8), gptq]
    samples = len(calibration)
    length = calibration.shape[1]
    oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=length, num_calibration_samples=samples)
    model.eval()
    return model, sum(1 for _, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None)
"""

_MEASURED_TAIL = r"""
def measure(model):
    started = time.perf_counter()
    model, quantized = quantize(model)
    seconds = time.perf_counter() - started
    domains = [(name, windows) for name, windows in inputs["domains"]]
    rows = torch.cat([w for _, w in domains])
    with torch.no_grad():
        def pair(i):
            return model(rows[i][None]).logits[0].float().numpy(), reference(rows[i][None]).logits[0].numpy()
        per_domain = compare_window_pairs(pair, domains, progress=False)
        answers = []
        for ids in inputs["prompts"]:
            out = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=inputs["new_tokens"],
                do_sample=False,
                eos_token_id=inputs["eos"] or None,
                pad_token_id=inputs["pad"],
            )
            answer = out[0, len(ids):].tolist()
            cut = next((i + 1 for i, token in enumerate(answer) if token in inputs["eos"]), len(answer))
            answers.append(answer[:cut])
    return {"per_domain": per_domain, "answers": answers, "quantized_linears": quantized, "seconds": seconds}
try:
    print(json.dumps(measure(model)))
# the tool's own refusal (Model Optimizer's NVFP4 dynamic block quantization asks for CUDA)
except AssertionError as exc:
    print(json.dumps({"not_run": f"{TOOL}: {exc}"}))
"""


MODELS = {"smollm2": ("SmolLM2-135M-Instruct", 64), "gemma3-270m": ("Gemma-3-270M", 128)}  # name, INT4 group


def _teacher(model: str) -> Path:
    if model == "gemma3-270m":
        sys.path.insert(0, str(REPO / "bench"))
        from gemma import gemma_folder

        return gemma_folder()
    from compress.models.sources import materialize, resolve_model

    return materialize(resolve_model("smollm2-135m-instruct"))


def _grouped(options: dict, group: int) -> dict:
    """A row's options with its INT4 group size (compress's ``group_size``, a peer's ``group``) set to ``group``."""
    return {**options, **{key: group for key in ("group_size", "group") if key in options}}


def _calibration(teacher: Path):
    from compress.core.text import DEFAULT_CALIBRATION, calibration_windows, load_calibration
    from compress.models.loading import load_tokenizer
    from compress.transforms.quantize.config import QUANTIZE_CONFIG

    config = QUANTIZE_CONFIG.validate_python({"method": "int4"})
    return calibration_windows(load_tokenizer(teacher), load_calibration(DEFAULT_CALIBRATION), config.calib_window,
                               config.calib_windows, min_tokens=config.min_calib_tokens)


def quantize_row(kind: str, options: dict, teacher: Path, windows, out: Path) -> tuple[Path, float]:
    """A row's quantized model folder (ours: the quantize stage's folder; a peer's: its dense weights) and seconds."""
    import torch

    started = time.perf_counter()
    if kind == "compress":
        from compress.models.loading import load_tokenizer, save_side_files
        from compress.transforms.quantize.config import QUANTIZE_CONFIG
        from compress.transforms.quantize.decoder import quantize_folder

        folder = out / "model"
        quantize_folder(teacher, folder, windows, QUANTIZE_CONFIG.validate_python(options))
        save_side_files(load_tokenizer(teacher), teacher, folder)
        return folder, time.perf_counter() - started
    if not PEERS_PYTHON.is_file():
        raise SystemExit(f"{options['tool']}: {PEERS_PYTHON} is missing; create it as this script's docstring says")
    windows_file = out / "windows.pt"
    torch.save(windows, windows_file)
    proc = subprocess.run([str(PEERS_PYTHON), "-c", _PEER, str(teacher), str(out), str(windows_file),
                           json.dumps({"group": GROUP, **options})], capture_output=True, text=True, cwd=out)
    if proc.returncode != 0:
        raise SystemExit(f"{options['tool']} failed:\n{proc.stderr[-3000:]}")
    return out / "model", time.perf_counter() - started


def _evaluation():
    from compress.core.text import (
        DEFAULT_CALIBRATION,
        DEFAULT_EVALUATION,
        load_calibration,
        load_evaluation,
        unseen_domains,
    )

    evaluation = load_evaluation(DEFAULT_EVALUATION)
    return evaluation, unseen_domains(load_calibration(DEFAULT_CALIBRATION), evaluation)


def measure_row(folder: Path, teacher: Path) -> dict:
    from compress.eval.decoder import DeployedFiles, ValidateConfig, measure

    evaluation, unseen = _evaluation()
    return measure(DeployedFiles(folder, teacher), evaluation, ValidateConfig(), progress=False, unseen=unseen)


def simulated_row(
    tool: str, option: str, teacher: Path, windows, out: Path, group: int = 0
) -> tuple[dict | None, float, str | None]:
    """A tool's quantization of the teacher (Edge-LLM's, or llm-compressor's W8A8), measured in its own environment on
    its own fake quantization: the metrics validation computes (its prompts compared here with the teacher's answers),
    the seconds, or why it did not run. ``group``: a weight group size in place of the format's own (0: the
    format's)."""
    import torch

    from compress.eval.decoder import (
        ValidateConfig,
        domain_quality,
        evaluation_windows,
        model_eos_ids,
        pad_id_of,
        teacher_answers,
    )
    from compress.eval.prompts import DEFAULT_PROMPTS, compare_answers, load_prompts, prompt_ids
    from compress.models.loading import load_tokenizer

    python, script = {
        "edgellm": (EDGELLM_QUANT_PYTHON, _EDGELLM),
        "llmcompressor": (PEERS_PYTHON, _LLMCOMPRESSOR_W8A8),
    }[tool]
    if not python.is_file():
        raise SystemExit(f"{tool} {option}: {python} is missing; create it as this script's docstring says")
    config, tokenizer = ValidateConfig(), load_tokenizer(teacher)
    evaluation, unseen = _evaluation()
    cases = load_prompts(DEFAULT_PROMPTS)
    eos = model_eos_ids(teacher, tokenizer)
    torch.save(windows, out / "windows.pt")
    torch.save(
        {
            "domains": evaluation_windows(tokenizer, evaluation, config),
            "prompts": [prompt_ids(tokenizer, c.prompt) for c in cases],
            "new_tokens": config.prompt_new_tokens,
            "eos": eos,
            "pad": pad_id_of(tokenizer, eos),
        },
        out / "evaluation.pt",
    )
    proc = subprocess.run(
        [str(python), "-c", _MEASURED_HEAD + script + _MEASURED_TAIL, str(teacher), str(out), option, str(group)],
        capture_output=True,
        text=True,
        cwd=out,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if proc.returncode != 0:
        raise SystemExit(f"{tool} {option} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "not_run" in result:
        return None, 0.0, result["not_run"]
    teacher_ids = teacher_answers(cases, tokenizer, teacher, eos, config.prompt_new_tokens)
    prompts = compare_answers(
        cases, tokenizer, teacher_ids, result["answers"], config.prompt_new_tokens, "the shipped app prompts"
    )
    quality = {
        **domain_quality(result["per_domain"], unseen),
        "prompts": prompts,
        "quantized_linears": result["quantized_linears"],
    }
    return quality, result["seconds"], None


def _value(text: str):
    """A ``--set`` value as JSON where it parses (numbers, true, null), else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--windows", type=int, help="calibrate every row on the first N windows only (default: all 32)")
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2",
                        help="the packaged SmolLM2 (INT4 group 64) or Gemma-3-270M (group 128, bench/gemma.py)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="quantize options replacing those a compress row has (e.g. tune_iters=50 for the tuned "
                             "rows); the row is named with them")
    args = parser.parse_args()
    overrides = {key: _value(value) for key, value in (item.split("=", 1) for item in args.set)}
    sys.path.insert(0, str(REPO))
    label, group = MODELS[args.model]
    teacher = _teacher(args.model)
    windows = _calibration(teacher)[: args.windows]
    results = []
    for name in args.rows:
        out = OUT / args.model / name
        subprocess.run(["rm", "-rf", str(out)], check=True)  # this script's own earlier row
        out.mkdir(parents=True)
        kind, options = ROWS[name]
        options = _grouped({**options, "group": group} if kind == "peer" else options, group)
        if kind == "simulated":
            metrics, seconds, why = simulated_row(options["tool"], options["option"], teacher, windows, out,
                                                 options.get("group", 0))
            if metrics is None:
                print(json.dumps({"row": name, "not_run": why}), flush=True)
                results.append({"row": name, "not_run": why})
                continue
        else:
            changed = {key: value for key, value in overrides.items() if kind == "compress" and key in options}
            if changed:
                options = {**options, **changed}
                name = name + "".join(f" {key}={value}" for key, value in changed.items())
            folder, seconds = quantize_row(kind, options, teacher, windows, out)
            metrics = measure_row(folder, teacher)
        row = {
            "row": name,
            "seconds": round(seconds, 1),
            "worst_domain": metrics["worst_domain"],
            "worst_pct": metrics["perplexity_increase_pct"],
            "top1": metrics["top1_agreement"],
            "kl": metrics["mean_kl"],
            "prefix": (metrics["prompts"] or {}).get("answer_prefix_agreement"),
            "domains": {d: r["perplexity_increase_pct"] for d, r in metrics["domains"].items()},
        }
        (out / "row.json").write_text(json.dumps(row, indent=2))
        results.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\n{label}, {len(windows)} calibration windows of {windows.shape[1]} tokens; measured by "
        "compress's "
        "validation code against the unquantized model (edgellm rows: on Model Optimizer's fake quantization)\n"
    )
    print("| row | worst domain | top-1 | KL | app-prompt answer prefix | quantize s |\n|---|---|---|---|---|---|")
    for row in results:
        if "not_run" in row:
            print(f"| {row['row']} | not run: {row['not_run']} | | | | |")
            continue
        prefix = f"{100 * row['prefix']:.1f}%" if row["prefix"] is not None else "—"
        print(
            f"| {row['row']} | {row['worst_pct']:+.2f}% ({row['worst_domain']}) | {100 * row['top1']:.1f}% | "
            f"{row['kl']:.4f} | {prefix} | {row['seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()
