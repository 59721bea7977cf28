"""Real sizes: where a run computes (``device=``) and what it will need, known before it starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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


QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, vocab_size=151936, tie_word_embeddings=True)
QWEN3_DEEPER = {**QWEN3_06B, "num_hidden_layers": 36}
LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                 vocab_size=128256, tie_word_embeddings=False)


def _dry_run(capsys, *args: str) -> dict:
    assert main(["run", "target=jetson-orin", *args, "--dry-run"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("device", "needle"), [("cuda:99", "device=cuda:99: torch sees"), ("tpu", "expected auto, cpu, cuda")])
def test_a_device_torch_does_not_see_is_refused_at_plan_time(capsys, tmp_path, device, needle):
    assert main(["run", "target=jetson-orin", f"device={device}", f"out={tmp_path / 'run'}", "--dry-run"]) == 2
    assert needle in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_device_is_resolved_in_the_plan_and_recorded_by_the_run(capsys, tmp_path, tiny_llama):
    assert _dry_run(capsys, "recipe=baseline", f"model={tiny_llama}", f"out={tmp_path / 'plan'}")["device"] == resolve_device("auto")
    out = tmp_path / "run"
    assert main(["run", "target=jetson-orin", "recipe=baseline", f"model={tiny_llama}", f"out={out}", "device=cpu",
                 "--no-progress", *TINY_SMOKE]) in (0, 1)
    assert json.loads((out / "manifest.json").read_text())["device"] == "cpu"
    assert json.loads((out / "01_load" / "stage.json").read_text())["device"] == "cpu"


def test_the_plan_estimates_each_stage_from_the_models_size(capsys, tmp_path):
    small = _dry_run(capsys, f"model={_config_only(tmp_path / 'q06', 'Qwen3', **QWEN3_06B)}", f"out={tmp_path / 'a'}")
    large = _dry_run(capsys, f"model={_config_only(tmp_path / 'q17', 'Qwen3', **QWEN3_DEEPER)}", f"out={tmp_path / 'b'}")
    stages = [s["name"] for s in small["stages"]]
    assert [e["stage"] for e in small["estimates"]] == stages
    for a, b in zip(small["estimates"], large["estimates"], strict=True):
        assert b["peak_host_gb"] >= a["peak_host_gb"] and b["disk_gb"] >= a["disk_gb"], (a, b)
    quantize = next(e for e in small["estimates"] if e["stage"] == "quantize")
    assert quantize["peak_host_gb"] > 4 * 0.6 and quantize["minutes"] > 1  # more than the model's fp32 copy, and not instant


def test_a_model_that_cannot_fit_this_machine_is_refused_before_any_work(capsys, tmp_path):
    model = _config_only(tmp_path / "llama70b", "Llama", **LLAMA_70B)
    out = tmp_path / "run"
    assert main(["run", "target=jetson-orin", f"model={model}", f"out={out}", "--dry-run"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"model={model}: " in error and "GB of memory" in error and "this machine has" in error
    assert not out.exists()
