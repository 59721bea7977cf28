"""Real sizes: where a run computes (``device=``) and what it will need, known before it starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from compress.cli.main import main
from compress.core.devices import resolve_device
from tests.conftest import TINY_SMOKE, build_tokenizer


def _config_only(folder: Path, family: str, **shape) -> Path:
    """A model folder of a published shape without weights (what ``--dry-run`` plans from)."""
    folder.mkdir(parents=True)
    getattr(transformers, f"{family}Config")(**shape, dtype="bfloat16").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


QWEN3_06B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
)
QWEN3_DEEPER = {**QWEN3_06B, "num_hidden_layers": 36}
LLAMA_70B = dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)


def _dry_run(capsys, *args: str) -> dict:
    assert main(["run", "target=jetson-orin", *args, "--dry-run"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("device", "needle"), [("cuda:99", "device=cuda:99: torch sees"), ("tpu", "expected auto, cpu, cuda")]
)
def test_a_device_torch_does_not_see_is_refused_at_plan_time(capsys, tmp_path, device, needle):
    assert main(["run", "target=jetson-orin", f"device={device}", f"out={tmp_path / 'run'}", "--dry-run"]) == 2
    assert needle in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_device_is_resolved_in_the_plan_and_recorded_by_the_run(capsys, tmp_path, tiny_llama):
    assert _dry_run(capsys, "recipe=baseline", f"model={tiny_llama}", f"out={tmp_path / 'plan'}")[
        "device"
    ] == resolve_device("auto")
    out = tmp_path / "run"
    assert main(["run", "target=jetson-orin", "recipe=baseline", f"model={tiny_llama}", f"out={out}", "device=cpu",
                 "--no-progress", *TINY_SMOKE]) in (0, 1)
    assert json.loads((out / "manifest.json").read_text())["device"] == "cpu"
    assert json.loads((out / "01_load" / "stage.json").read_text())["device"] == "cpu"


def test_the_plan_estimates_each_stage_from_the_models_size(capsys, tmp_path):
    small = _dry_run(capsys, f"model={_config_only(tmp_path / 'q06', 'Qwen3', **QWEN3_06B)}", f"out={tmp_path / 'a'}")
    large = _dry_run(
        capsys, f"model={_config_only(tmp_path / 'q17', 'Qwen3', **QWEN3_DEEPER)}", f"out={tmp_path / 'b'}"
    )
    stages = [s["name"] for s in small["stages"]]
    assert [e["stage"] for e in small["estimates"]] == stages
    for a, b in zip(small["estimates"], large["estimates"], strict=True):
        assert b["peak_host_gb"] >= a["peak_host_gb"] and b["disk_gb"] >= a["disk_gb"], (a, b)
    quantize = next(e for e in small["estimates"] if e["stage"] == "quantize")
    deeper = next(e for e in large["estimates"] if e["stage"] == "quantize")
    bf16 = 2 * 0.6  # GB: the Qwen3-0.6B checkpoint
    # One block at a time: less than the model in float32, which it never holds; and not instant.
    assert quantize["peak_host_gb"] < 2 * bf16 and quantize["minutes"] > 1
    # flat in depth
    assert (
        deeper["peak_host_gb"] == quantize["peak_host_gb"] and deeper["disk_gb"] > quantize["disk_gb"]
    )
    assert quantize["disk_gb"] < 0.8 * bf16  # int8 linears beside the bf16 embedding: less than the checkpoint
    assert quantize["peak_device_gb"] == 0.0  # this plan computes on the CPU


def _sparse_safetensors(path: Path, parameters: int) -> None:
    """A valid safetensors file of ``parameters`` bf16 zeros that takes no disk (its data is a hole)."""
    header = json.dumps(
        {"weight": {"dtype": "BF16", "shape": [parameters], "data_offsets": [0, 2 * parameters]}}
    ).encode()
    with path.open("wb") as handle:
        handle.write(len(header).to_bytes(8, "little") + header)
        handle.truncate(8 + len(header) + 2 * parameters)


def test_a_model_that_cannot_fit_this_machine_is_refused_before_any_work(capsys, tmp_path):
    model = _config_only(tmp_path / "llama70b", "Llama", **LLAMA_70B)
    for shard in range(28):  # 70B parameters in shards of a published checkpoint's size
        _sparse_safetensors(model / f"model-{shard + 1:05d}-of-00028.safetensors", 2_500_000_000)
    out = tmp_path / "run"
    assert main(["run", "target=jetson-orin", f"model={model}", f"out={out}", "--no-progress"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"model={model}: " in error and "GB of memory" in error and "this machine has" in error
    assert not out.exists()


def test_a_dry_run_plans_for_another_machine_and_says_this_one_is_too_small(capsys, tmp_path):
    model = _config_only(tmp_path / "llama70b", "Llama", **LLAMA_70B)
    assert main(["run", "target=jetson-orin", f"model={model}", f"out={tmp_path / 'run'}", "--dry-run"]) == 0
    printed = capsys.readouterr()
    plan = json.loads(printed.out)
    assert plan["fits_this_machine"] is False and "GB of memory" in plan["fit_problem"]
    assert max(e["peak_host_gb"] for e in plan["estimates"]) > 280  # at least 70B parameters in fp32
    assert printed.err.strip().splitlines()[-1] == f"compress: warning: {plan['fit_problem']}"
    assert not (tmp_path / "run").exists()


def test_a_bf16_checkpoint_is_quantized_into_integers_and_scales_with_no_float_copy(tmp_path):
    from compress.models.weights import CheckpointReader
    from compress.transforms.quantize.saved import load_quantization
    from tests.conftest import QUANTIZE_SMALL, build_tiny_llama

    model = build_tiny_llama(
        tmp_path / "fp32", layers=2, hidden=128, heads=2, kv_heads=1, intermediate=256, chat_template=True
    )
    bf16 = tmp_path / "bf16"
    transformers.AutoModelForCausalLM.from_pretrained(model).to(dtype=torch.bfloat16).save_pretrained(bf16)
    build_tokenizer(chat_template=True).save_pretrained(bf16)
    out = tmp_path / "run"
    assert main(["run", "target=jetson-orin", "recipe=edgellm-int8", f"model={bf16}", f"out={out}", "--no-progress",
                 *QUANTIZE_SMALL, *TINY_SMOKE]) in (0, 1)
    folder = out / "02_quantize" / "model"
    meta, linears = load_quantization(folder)
    assert len(linears) == 14 and all(q.levels.dtype == torch.int8 for q in linears.values())
    saved = CheckpointReader(folder)
    stored = {key: tensor.dtype for key, tensor in saved.read(saved.names()).items()}
    assert not {f"{name}.weight" for name in linears} & set(stored)  # the quantized linears live only as levels
    assert set(stored.values()) == {torch.bfloat16}
    checkpoint = sum(p.stat().st_size for p in bf16.glob("*.safetensors"))
    quantized = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert quantized < 0.85 * checkpoint  # int8 linears and bf16 embeddings, against all of it in bf16
    assert json.loads((out / "03_export_onnx" / "stage.json").read_text())["metrics"]["parity"]["greedy_match"]
    assert json.loads((out / "04_export_edgellm" / "stage.json").read_text())["metrics"]["custody"]["mismatches"] == 0


ONNX_SMOKE = [option for option in TINY_SMOKE if not option.startswith("export_onnx.")]


def test_a_bundle_ships_without_the_portable_onnx_and_is_measured_as_deployed(tmp_path):
    """export_onnx=off: the bundle is made straight from the quantized checkpoint, validation measures the deployed
    numbers in torch (no ONNX Runtime parity, no host latency), and the device reference comes from the same numbers."""
    from tests.conftest import QUANTIZE_SMALL, build_tiny_llama

    model = build_tiny_llama(
        tmp_path / "model", layers=2, hidden=128, heads=2, kv_heads=1, intermediate=256, chat_template=True
    )
    out = tmp_path / "run"
    code = main(["run", "target=jetson-orin", "recipe=edgellm-int8", f"model={model}", f"out={out}", "export_onnx=off",
                 "--no-progress", *QUANTIZE_SMALL, *ONNX_SMOKE, "validate.prompt_new_tokens=8"])
    report = json.loads((out / "report.json").read_text())
    assert code == report["exit_code"]
    assert [s["name"] for s in report["stages"]] == ["load", "quantize", "export_edgellm", "build_engine", "validate"]
    assert report["artifacts"]["onnx"] is None
    bundle = json.loads((out / "03_export_edgellm" / "stage.json").read_text())["metrics"]
    assert bundle["custody"]["mismatches"] == 0 and bundle["custody"]["tensors_compared"] > 0
    metrics = json.loads((out / "05_validate" / "validation.json").read_text())["metrics"]
    assert metrics["onnx_parity"] is None and metrics["host_latency"] is None
    assert metrics["perplexity_model"] > 0 and 0.5 < metrics["top1_agreement"] <= 1.0
    assert metrics["model_size_bytes"] == sum(
        p.stat().st_size for p in (out / "03_export_edgellm" / "bundle").rglob("*") if p.is_file()
    )
    names = {c["name"] for c in report["gate"]["checks"]}
    assert "onnx_vs_torch_quantized_pct" not in names and "answer_prefix_agreement" in names
    reference = json.loads((out / "05_validate" / "device_reference.json").read_text())
    assert reference["host"].startswith("the quantized checkpoint in torch")
    answers = {row["id"]: row["model_ids"] for row in metrics["prompts"]["rows"]}
    for prompt, expected in zip(reference["prompts"][6:], reference["host_output_ids"][6:], strict=True):
        ids = answers[prompt["domain"].removeprefix("prompt ")]
        # the measured answer (8 tokens), continued to the device's 24 where it did not end
        common = min(
            len(ids), len(expected)
        )
        assert expected[:common] == ids[:common] and len(expected) == (len(ids) if len(ids) < 8 else 24)


def test_a_decoder_recipe_without_its_onnx_validates_the_quantized_checkpoint(capsys, tmp_path):
    plan = _dry_run(capsys, "recipe=int8", "export_onnx=off", f"out={tmp_path / 'run'}")
    assert [stage["name"] for stage in plan["stages"]] == ["load", "quantize", "validate"]


@pytest.mark.parametrize(("words", "needle"), [
    (["validate=off"], "stage validate cannot be left out of recipe 'default' (optional: export_onnx)"),
    (["sparsify=off"], "stage sparsify is not in recipe 'default'"),
    (["export_onnx=on"], "export_onnx=on: a stage takes only export_onnx=off"),
])
def test_only_an_optional_stage_of_the_recipe_is_left_out(capsys, tmp_path, words, needle):
    assert main(["run", "target=jetson-orin", *words, f"out={tmp_path / 'run'}", "--dry-run"]) == 2
    assert needle in capsys.readouterr().err


def test_the_estimate_on_a_cuda_device_puts_the_block_work_there_and_takes_its_rates():
    from compress.pipeline.resources import estimate_stages
    from compress.transforms.quantize.config import QUANTIZE_CONFIG

    config = {**QWEN3_06B, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    stages = [("quantize", QUANTIZE_CONFIG.validate_python({"method": "int8"}))]
    cpu, = estimate_stages(stages, config, 1.2e9, "cpu")
    gpu, = estimate_stages(stages, config, 1.2e9, "cuda:0")
    assert cpu.device_bytes == 0 and gpu.device_bytes > 0 and gpu.host_bytes < cpu.host_bytes
    assert gpu.seconds < cpu.seconds / 4  # the calibration and searches run on the GPU


def test_the_estimate_of_an_auto_quantize_stage_counts_its_search():
    from compress.pipeline.resources import estimate_stages
    from compress.transforms.quantize.config import QUANTIZE_CONFIG

    config = {**QWEN3_06B, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    uniform, = estimate_stages([("quantize", QUANTIZE_CONFIG.validate_python({"method": "int4"}))], config, 1.2e9)
    auto = QUANTIZE_CONFIG.validate_python({"method": "auto"})
    two, = estimate_stages([("quantize", auto)], config, 1.2e9, search_formats=2)
    four, = estimate_stages([("quantize", auto)], config, 1.2e9, search_formats=4)
    # the Fisher pass holds the model in its own dtype and a window's logits over a 152k vocabulary, and their gradients
    assert two.host_bytes > uniform.host_bytes and two.host_bytes > 1.2e9 + 4 * 512 * 151936 * 4
    assert two.seconds > 3 * uniform.seconds and four.seconds > two.seconds  # plans measured, sensitivities per format
    on_gpu, = estimate_stages([("quantize", auto)], config, 1.2e9, "cuda:0", search_formats=2)
    assert on_gpu.seconds < two.seconds / 4
