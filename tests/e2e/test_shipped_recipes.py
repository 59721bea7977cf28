"""Every shipped recipe either runs on the embedded model or is refused when it is planned, naming why; the distill
recipe, which once planned and then stopped for want of calibration text, runs to a verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from compress.cli.main import main
from tests.conftest import REPO

pytestmark = pytest.mark.e2e
RECIPES = sorted(p.stem for p in (REPO / "compress" / "catalog" / "recipes").glob("*.yaml"))
# What the embedded decoder on the Orin Nano cannot take, and the words that say why.
REFUSED = {
    "edgellm-int4": "Edge-LLM",  # 576-wide inputs: INT4 group 128 does not divide them
    "llama-7b-to-3b": "group_size=128",
    "encoder-fp16": "works on encoders",
    "encoder-int8": "works on encoders",
    "encoder-prune-heads": "works on encoders",
    "encoder-prune-distill": "works on encoders",
    "thor-fp8": "no fp8 tensor cores",
    "thor-nvfp4": "no nvfp4 tensor cores",
}


def test_every_shipped_recipe_plans_on_the_embedded_model_or_is_refused_naming_why(capsys, tmp_path):
    outcomes = {}
    for recipe in RECIPES:
        code = main(["run", "target=jetson-orin", f"recipe={recipe}", f"out={tmp_path / recipe}", "--dry-run"])
        said = capsys.readouterr()
        outcomes[recipe] = (code, said.err.strip().splitlines()[-1] if code else json.loads(said.out)["recipe"])
    refused = {recipe for recipe, (code, _) in outcomes.items() if code}
    assert refused == set(REFUSED)
    for recipe, words in REFUSED.items():
        code, line = outcomes[recipe]
        assert code == 2 and line.startswith("compress: error: ") and words in line, (recipe, line)
    assert all(outcomes[recipe] == (0, recipe) for recipe in RECIPES if recipe not in REFUSED)


def test_the_distill_recipe_runs_to_a_verdict_on_the_embedded_model(tmp_path):
    out = tmp_path / "distill"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "compress",
            "run",
            "target=jetson-orin",
            "recipe=distill",
            f"out={out}",
            "--no-progress",
            "distill.steps=2",
            "distill.teacher_generations=2",
            "distill.generation_prompt_tokens=16",
            "distill.eval_every=1000",
            "distill.checkpoint_every=1000",
            "distill.eval_windows=1",
            "export_onnx.parity_new_tokens=4",
            "validate.eval_tokens=256",
            "validate.window=128",
            "validate.latency_prompt_tokens=16",
            "validate.latency_new_tokens=4",
            "prompts=off",
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # a verdict: PASS or FAIL, not a stopped run
    report = json.loads((out / "report.json").read_text())
    distill = next(s for s in report["stages"] if s["name"] == "distill")["metrics"]
    assert distill["train_windows"] >= 4 and distill["parameters"] < distill["teacher_parameters"]
    assert report["gate"]["verdict"] in ("PASS", "FAIL")
