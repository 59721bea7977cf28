"""The runtime API, the human report (plots, HTML, model card) and the examples, on a tiny Llama run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from html.parser import HTMLParser

import pytest
import torch

import compress.runtime
from compress.cli.main import main
from compress.core.errors import CompressError
from tests.conftest import REPO, TINY_SMOKE


@pytest.fixture(scope="module")
def tiny_run(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("rt") / "run"
    code = main(["run", "target=jetson-orin", "recipe=smoke", f"model={tiny_llama}", f"out={out}", *TINY_SMOKE,
                 "quantize.calib_window=256", "quantize.min_calib_tokens=512"])
    assert code in (0, 1)
    return out


@pytest.fixture(scope="module")
def baseline_run(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("rtb") / "run"
    assert main(["run", "target=jetson-orin", "recipe=baseline", f"model={tiny_llama}", f"out={out}", *TINY_SMOKE]) in (
        0,
        1,
    )
    return out


def test_runtime_greedy_tokens_match_torch(baseline_run, tiny_llama):
    from transformers import AutoModelForCausalLM

    model = compress.runtime.load(baseline_run)
    assert model.backend == "onnxruntime"
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    prompt = model.tokenizer("It is a truth universally acknowledged").input_ids
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=reference.config.eos_token_id,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert model.generate_ids(prompt, 12) == expected


def test_batch_streaming_stop_and_sampling(baseline_run):
    model = compress.runtime.load(baseline_run)
    prompts = ["Emma Woodhouse, handsome, clever", "It was", "The family of Dashwood had long been settled in Sussex"]
    batch = model.generate(prompts, max_new_tokens=8, chat=False)
    singles = [model.generate(p, max_new_tokens=8, chat=False) for p in prompts]
    assert batch == singles
    streamed = "".join(model.stream(prompts[0], max_new_tokens=8, chat=False))
    assert streamed == singles[0]
    full = model.generate(prompts[0], max_new_tokens=12, chat=False)
    stop = full[2:4]
    assert stop and model.generate(prompts[0], max_new_tokens=12, chat=False, stop=[stop]) == full[: full.index(stop)]
    sampled = [model.generate(prompts[1], greedy=False, seed=3, max_new_tokens=8, chat=False) for _ in range(2)]
    assert sampled[0] == sampled[1]
    with pytest.raises(CompressError, match="unknown generation option"):
        model.generate("x", colour="red")


def test_provenance_is_checked_before_loading(baseline_run, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(baseline_run, copy)
    (copy / "02_export_onnx" / "onnx" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(
        compress.runtime.ProvenanceError, match="tokenizer_config.json has 2 bytes where .* were written"
    ):
        compress.runtime.load(copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["status"] = "running"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(compress.runtime.ProvenanceError, match="not a finished run"):
        compress.runtime.load(copy)


def test_tensorrt_backend_demanded_without_an_engine_is_a_clear_error(tiny_run):
    with pytest.raises(compress.runtime.ProvenanceError, match="compress build-engine"):
        compress.runtime.load(tiny_run, backend="tensorrt")


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.text = [], []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_data(self, data):
        self.text.append(data)


def test_report_files_have_every_stage_check_and_plot(tiny_run):
    report = json.loads((tiny_run / "report.json").read_text())
    markdown = (tiny_run / "report.md").read_text()
    parser = _Collect()
    parser.feed((tiny_run / "report.html").read_text())
    html_text = " ".join(parser.text)
    for stage in report["stages"]:
        assert stage["name"] in markdown and stage["name"] in html_text
    for check in report["gate"]["checks"]:
        assert check["name"] in markdown and check["name"] in html_text
    assert set(report["plots"]) == {"stages", "power_modes", "pareto", "domains", "sensitivity"}
    assert len(parser.images) == 5 and all(src.startswith("data:image/png;base64,") for src in parser.images)
    from PIL import Image

    for path in report["plots"].values():
        image = Image.open(tiny_run / path).convert("L")
        assert image.size[0] > 300 and image.size[1] > 200
        extrema = image.getextrema()
        assert extrema[1] - extrema[0] > 100, f"{path} looks blank"
    card = (tiny_run / "MODEL_CARD.md").read_text()
    for needle in ("Source model", "licence", "jetson-orin-nano-8gb", "smoke", "calibration (", "sha256", "torch 2.13"):
        assert needle in card


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_chat_example_streams_an_answer(tiny_run):
    proc = subprocess.run(
        [
            sys.executable,
            "examples/chat_on_device.py",
            str(tiny_run),
            "--prompt",
            "Who is Emma?",
            "--max-new-tokens",
            "6",
            "--greedy",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "[onnxruntime]" in proc.stderr


def test_release_gate_passes_and_blocks(tiny_llama, tmp_path):
    gate = REPO / "examples" / "release_gate" / "gate.sh"
    venv_cli = REPO / ".venv" / "bin" / "compress"
    env = {**_env(), "COMPRESS": str(venv_cli) if venv_cli.exists() else "compress"}
    common = ["target=jetson-orin", "recipe=baseline", f"model={tiny_llama}", *TINY_SMOKE]
    ok = subprocess.run(
        ["bash", str(gate), *common, f"out={tmp_path / 'ok'}"], env=env, capture_output=True, text=True, timeout=600
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "release gate: PASS" in ok.stdout
    failing = subprocess.run(["bash", str(gate), *common, f"out={tmp_path / 'fail'}", "budgets.max_memory_gb=0.0001"],
                             env=env, capture_output=True, text=True, timeout=600)
    assert failing.returncode == 1 and "release gate: FAIL" in failing.stdout
    unmeasured = subprocess.run(["bash", str(gate), *common, f"out={tmp_path / 'nm'}", "--require-measured"],
                                env=env, capture_output=True, text=True, timeout=600)
    assert unmeasured.returncode == 3 and "NOT_MEASURED" in unmeasured.stdout
    workflow = (REPO / "examples" / "release_gate" / "compress-release-gate.yml").read_text()
    assert "gate.sh" in workflow and "upload-artifact" in workflow


def test_python_api_example(tiny_llama, tmp_path):
    proc = subprocess.run(
        [sys.executable, "examples/python_api.py", "jetson-orin", str(tmp_path / "api"), str(tiny_llama)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    assert "gate:" in proc.stdout and "answer:" in proc.stdout
    assert (tmp_path / "api" / "report.json").is_file()
