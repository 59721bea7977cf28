"""Decoder families: folding smoothing scales is exact on each, every quantize path runs on each, others are refused at plan time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from compress.algorithms.calibration import decoder_blocks
from compress.cli import main
from compress.families import family_of
from compress.models import load_causal_lm
from compress.quantization import QuantizeConfig, _kv_groups, fold_scales, quantize_model
from tests.conftest import REPO, TINY_SMOKE, build_tiny_llama

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "model"
    return request.param, build_tiny_llama(folder, layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, family=request.param)


def test_folding_random_smoothing_scales_leaves_the_float_model_unchanged(family_model):
    name, folder = family_model
    model = load_causal_lm(folder).float().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    family = family_of(model.config)
    generator = torch.Generator().manual_seed(1)
    for block in decoder_blocks(model):
        kv_groups = _kv_groups(block, model.config)
        for point in family.points:
            width = block.get_submodule(point.consumers[0]).in_features
            scales = torch.exp(torch.randn(width, generator=generator))  # per-channel factors across ~e^-3..e^3
            if point.name == "attn_out":
                scales = scales[kv_groups]  # one factor per KV channel, shared by the query heads that read it
            fold_scales(block, point, scales, kv_groups)
    with torch.no_grad():
        after = model(ids).logits
    assert (after - before).abs().max().item() < 1e-4, name
    if name == "qwen2":
        assert decoder_blocks(model)[0].self_attn.v_proj.bias is not None  # the bias was folded with its rows


def test_distill_prune_sparsify_int8_and_export_on_each_family(family_model, tmp_path):
    name, folder = family_model
    recipe = tmp_path / "family.yaml"
    recipe.write_text("name: family\nstages:\n  - load\n  - distill: {target_fraction: 0.7}\n"
                      "  - prune_heads: {fraction: 0.25, calib_windows: 2, calib_window: 64, min_calib_tokens: 128}\n"
                      "  - sparsify: {calib_windows: 2, calib_window: 64, min_calib_tokens: 128}\n"
                      "  - quantize: {method: int8, calib_windows: 4, calib_window: 128, min_calib_tokens: 512}\n"
                      "  - export_onnx\n  - validate\n")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "compress", "run", "target=jetson-orin", f"recipe={recipe}", f"model={folder}",
                           f"out={out}", "--no-progress", "distill.steps=2", "distill.seq_len=64", "distill.eval_every=1000",
                           "distill.eval_windows=1", "distill.teacher_generations=2", "distill.generation_prompt_tokens=16",
                           *TINY_SMOKE], env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    stages = {s["name"]: s for s in json.loads((out / "report.json").read_text())["stages"]}
    assert stages["distill"]["metrics"]["parameters"] < stages["distill"]["metrics"]["teacher_parameters"]
    assert json.loads((out / "02_distill" / "model" / "config.json").read_text())["model_type"] == name
    assert stages["prune_heads"]["metrics"]["heads_after"] < stages["prune_heads"]["metrics"]["heads_before"]
    assert stages["sparsify"]["metrics"]["pattern_24_fraction"] == pytest.approx(1.0)
    parity = stages["export_onnx"]["metrics"]["parity"]
    assert parity["greedy_match"] and parity["max_abs_logit_diff"] < 1e-3, name
    validate = stages["validate"]["metrics"]
    assert validate["onnx_vs_torch_quantized_pct"] < 1.0 and validate["top1_agreement"] > 0.5


def test_int4_awq_gptq_keeps_each_family_close_to_its_float_model(family_model):
    name, folder = family_model
    model = load_causal_lm(folder).float().eval()
    windows = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(windows).logits.argmax(-1)
    config = QuantizeConfig(method="int4", group_size=32, sample_tokens=256)
    result = quantize_model(model, windows, config, progress=False)
    assert len(result.linears) == 2 * len(family_of(model.config).linears())
    for linear, quant in result.linears.items():  # weight-only, one scale per group of 32 inputs
        assert quant.input_scale is None and quant.weight_scales.shape[-1] == model.get_submodule(linear).in_features // 32
    with torch.no_grad():
        after = model(windows).logits.argmax(-1)
    assert (after == before).float().mean().item() > 0.8, name  # 4-bit weights of a random model: most argmaxes survive


def test_undescribed_families_and_windows_shorter_than_the_context_are_refused(capsys, tmp_path):
    phi3 = build_tiny_llama(tmp_path / "phi3", layers=1, hidden=64, heads=4, kv_heads=2, intermediate=128, family="phi3")
    assert main(["run", "target=jetson-orin", "recipe=int8", f"model={phi3}", f"out={tmp_path / 'a'}"]) == 2
    assert "model_type 'phi3' is not a decoder family compress describes (supported: llama, mistral, qwen2, qwen3)" in \
        capsys.readouterr().err
    mistral = build_tiny_llama(tmp_path / "mistral", layers=1, hidden=64, heads=4, kv_heads=2, intermediate=128, family="mistral")
    config = json.loads((mistral / "config.json").read_text())
    config["sliding_window"] = 512
    (mistral / "config.json").write_text(json.dumps(config))
    assert main(["run", "target=jetson-orin", "recipe=int8", f"model={mistral}", f"out={tmp_path / 'b'}"]) == 2
    assert "sliding_window=512 is shorter than the target's context_length 2048" in capsys.readouterr().err
    assert main(["run", "target=jetson-orin", "recipe=int8", f"model={mistral}", "budgets.context_length=512",
                 f"out={tmp_path / 'c'}", "--dry-run"]) == 0
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
