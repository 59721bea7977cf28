"""2:4 and unstructured sparsity: masks, the pattern checker, SparseGPT vs Wanda vs magnitude, and the pipeline."""

from __future__ import annotations

import json

import pytest
import torch

from compress.algorithms.sparse import (
    fraction_in_24_pattern,
    magnitude_mask,
    onnx_24_fraction,
    sparsegpt_prune,
    wanda_mask,
)
from compress.cli.main import main
from tests.conftest import TINY_SMOKE


def _layer(seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 128, generator=gen)
    x = torch.randn(1024, 32, generator=gen) @ torch.randn(32, 128, generator=gen) + 0.1 * torch.randn(
        1024, 128, generator=gen
    )
    x[:, :6] *= 20  # outlier input channels
    return weight, x


def test_masks_hold_the_pattern_and_ratio():
    weight, x = _layer()
    for mask in (magnitude_mask(weight, "2:4"), wanda_mask(weight, x.norm(dim=0), "2:4")):
        assert fraction_in_24_pattern(weight * mask) == 1.0
        assert (mask.reshape(64, 32, 4).sum(dim=2) == 2).all()
    unstructured = magnitude_mask(weight, "unstructured", 0.5)
    assert (unstructured.sum(dim=1) == 64).all()


def test_checker_catches_violations():
    weight, _ = _layer()
    pruned = weight * magnitude_mask(weight, "2:4")
    assert fraction_in_24_pattern(pruned) == 1.0
    pruned[0, 0:4] = 1.0
    assert fraction_in_24_pattern(pruned) == pytest.approx(1 - 1 / (64 * 32))
    assert fraction_in_24_pattern(weight) == 0.0


def test_sparsegpt_beats_wanda_beats_magnitude():
    weight, x = _layer()
    reference = x @ weight.T
    hessian = 2 * x.T @ x / x.shape[0]

    def error(w):
        return float((x @ w.T - reference).pow(2).mean())

    magnitude = error(weight * magnitude_mask(weight, "2:4"))
    wanda = error(weight * wanda_mask(weight, x.norm(dim=0), "2:4"))
    sparsegpt_weight = sparsegpt_prune(weight, hessian, "2:4")
    assert fraction_in_24_pattern(sparsegpt_weight) == 1.0
    assert error(sparsegpt_weight) < wanda < magnitude


@pytest.fixture(scope="module")
def sparse_int8_run(tiny_llama, tmp_path_factory):
    base = tmp_path_factory.mktemp("sparse")
    recipe = base / "sparse-int8.yaml"
    recipe.write_text(
        "name: sparse-int8\nstages:\n  - load\n  - sparsify: {method: sparsegpt, calib_window: 256, calib_windows: 8,"
        " min_calib_tokens: 1024}\n  - quantize: {method: int8, calib_window: 256, calib_windows: 8,"
        " min_calib_tokens: 1024, hadamard_block: 128}\n  - export_onnx\n  - build_engine\n  - validate\n"
    )
    out = base / "run"
    code = main(["run", "target=jetson-orin", f"recipe={recipe}", f"model={tiny_llama}", f"out={out}", *TINY_SMOKE])
    return code, out


def test_pattern_survives_int8_quantization_and_export(sparse_int8_run):
    code, out = sparse_int8_run
    assert code in (0, 1)
    report = json.loads((out / "report.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["sparsify"]["metrics"]["pattern_24_fraction"] == 1.0
    assert stages["quantize"]["metrics"]["rotated_linears"] == []  # a rotation would break the 2:4 pattern
    assert stages["export_onnx"]["metrics"]["onnx_pattern_24_fraction"] == 1.0
    assert onnx_24_fraction(out / "04_export_onnx" / "onnx" / "model.onnx", skip_output_dim=512) == 1.0
    check = next(c for c in report["gate"]["checks"] if c["name"] == "sparsity_24_violations_pct")
    assert check["value"] == 0.0 and check["verdict"] == "PASS"
    plan = json.loads((out / "05_build_engine" / "engine" / "build_plan.json").read_text())
    assert plan["sparse_weights"] is True
    assert "--sparsity=enable" in (out / "05_build_engine" / "engine" / "build_on_device.sh").read_text()


def test_sparse24_recipe_and_int4_keep_zeros(tiny_llama, tmp_path):
    out = tmp_path / "s"
    code = main(["run", "target=jetson-orin", "recipe=sparse24", f"model={tiny_llama}", f"out={out}", *TINY_SMOKE,
                 "sparsify.calib_window=256", "sparsify.calib_windows=8", "sparsify.min_calib_tokens=1024"])
    assert code in (0, 1)
    stages = {s["name"]: s for s in json.loads((out / "report.json").read_text())["stages"]}
    assert stages["export_onnx"]["metrics"]["onnx_pattern_24_fraction"] == 1.0
    assert abs(stages["sparsify"]["metrics"]["linear_sparsity"] - 0.5) < 1e-6
