"""FP8 and NVFP4 for Jetson AGX Thor: the number grids, the quantizers on them, the portable Q/DQ ONNX,
the TensorRT Edge-LLM bundles (real ``tensorrt-edgellm-export``, chain of custody), Edge-LLM's own
linears run on our checkpoints, and the plan-time refusals on Orin."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from safetensors import safe_open

from compress.algorithms.formats import (
    E2M1_LEVELS,
    Fp8Activation,
    Fp8Grid,
    Nvfp4Activation,
    Nvfp4Grid,
    e2m1_codes,
    e2m1_values,
    levels_on_grid,
    pack_fp4,
    quantize_dequantize,
    round_e2m1,
    round_fp8,
    unpack_fp4,
)
from compress.algorithms.quant import awq_search_scales, gptq_quantize, sqnr_db
from compress.backends.edgellm.bundle import check_custody
from compress.backends.edgellm.env import edgellm_python
from compress.backends.onnx.qdq import _nvfp4_activation
from compress.cli.main import main
from compress.core.errors import StageError
from compress.models.weights import CheckpointReader
from compress.transforms.quantize.config import quantize_config
from compress.transforms.quantize.decoder import _search_global_scale
from compress.transforms.quantize.saved import dequantized_weight, load_quantization
from tests.conftest import QUANTIZE_SMALL, REPO, TINY_SMOKE, build_tiny_llama, run_compress, tamper_bundle


def _layer(seed=0, out_features=64, in_features=128, tokens=1024, outliers=4, gain=30.0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    x = torch.randn(tokens, 24, generator=gen) @ torch.randn(24, in_features, generator=gen) + 0.2 * torch.randn(
        tokens, in_features, generator=gen
    )
    x[:, :outliers] *= gain
    return weight, x


def test_e2m1_and_fp8_rounding_are_nearest_ties_to_even_and_saturate():
    levels = torch.tensor(E2M1_LEVELS)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # On a midpoint the even code wins: 0, 1, 1, 2, 2, 4, 4.
    assert round_e2m1(midpoints).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert round_e2m1(-midpoints).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert round_e2m1(torch.tensor([7.0, -100.0])).tolist() == [6.0, -6.0]
    values = torch.empty(4000).uniform_(-6, 6, generator=torch.Generator().manual_seed(0))
    nearest = levels[(values.abs()[:, None] - levels[None, :]).abs().argmin(dim=1)] * values.sign()
    assert torch.equal(round_e2m1(values), nearest)
    wide = torch.randn(4000, generator=torch.Generator().manual_seed(1)) * 100
    expected = np.clip(wide.numpy(), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(round_fp8(wide).numpy(), expected)
    assert round_fp8(torch.tensor([1e4])).item() == 448.0


def test_fp4_codes_and_packing_round_trip_with_even_inputs_in_the_low_nibble():
    values = torch.tensor([[v for v in E2M1_LEVELS] + [-v for v in E2M1_LEVELS[1:]] + [0.0]])
    codes = e2m1_codes(values)
    assert torch.equal(e2m1_values(codes), values) and codes[0, 8] == 0x9  # -0.5 has the sign bit and magnitude 1
    packed = pack_fp4(codes)
    assert packed.shape == (1, 8) and int(packed[0, 0]) == (0x1 << 4) | 0x0  # inputs 0 and 1: 0.0 low, 0.5 high
    assert torch.equal(unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="not on the E2M1 grid"):
        e2m1_codes(torch.tensor([[0.7, 1.0]]))


def test_nvfp4_weights_are_fp4_values_under_fp8_block_scales_and_one_global_scale():
    weight, _ = _layer()
    weight[3, :16] = 0  # an all-zero block
    grid = Nvfp4Grid().bind([weight])
    assert grid.global_scale == pytest.approx(float(weight.abs().max()) / (6 * 448))
    dequantized, block_scales = quantize_dequantize(weight, grid)
    assert block_scales.shape == (64, 8) and torch.equal(round_fp8(block_scales), block_scales)
    assert float(block_scales.max()) == 448.0  # the largest block lands on FP8's maximum
    levels = levels_on_grid(dequantized, grid, block_scales, tolerance=0.0)  # exact: (e2m1 * block scale) * global
    assert torch.isin(levels.abs(), torch.tensor(E2M1_LEVELS)).all()
    assert (dequantized[3, :16] == 0).all()
    assert 15 < sqnr_db(weight, dequantized) < 25


def test_gptq_and_awq_on_the_fp4_grid_beat_round_to_nearest():
    weight, x = _layer()
    reference = x @ weight.T
    grid = Nvfp4Grid().bind([weight])
    rtn, _ = quantize_dequantize(weight, grid)
    gptq, gptq_scales = gptq_quantize(weight, 2 * x.T @ x / x.shape[0], grid)
    # GPTQ's weights lie on the FP4 grid under its own block scales
    levels_on_grid(
        gptq, grid, gptq_scales, tolerance=0.0
    )
    assert torch.equal(round_fp8(gptq_scales), gptq_scales)
    assert sqnr_db(reference, x @ gptq.T) > sqnr_db(reference, x @ rtn.T) + 1.0
    scales, ratio = awq_search_scales(x, [weight], Nvfp4Grid())
    scaled = weight * scales
    awq, _ = quantize_dequantize(scaled, Nvfp4Grid().bind([scaled]))
    assert ratio > 0 and sqnr_db(reference, (x / scales) @ awq.T) > sqnr_db(reference, x @ rtn.T) + 1.0
    fp8 = Fp8Grid()
    assert sqnr_db(reference, x @ gptq_quantize(weight, 2 * x.T @ x / x.shape[0], fp8)[0].T) >= \
        sqnr_db(reference, x @ quantize_dequantize(weight, fp8)[0].T)


def test_the_global_scale_search_clips_where_it_helps_and_never_what_the_attention_sink_reads():
    weight, x = _layer(seed=3, outliers=0)
    weight[0, 50] = 2.0  # one outlying weight stretches the plain global scale
    hessian = x.T @ x / x.shape[0]

    def error(grid, h):
        delta = weight - quantize_dequantize(weight, grid)[0]
        return float(((delta @ h) * delta).sum())

    plain, searched = Nvfp4Grid().bind([weight]), _search_global_scale([weight], hessian)
    # it clips the outlier
    assert (
        error(searched, hessian) <= error(plain, hessian) and searched.global_scale < plain.global_scale
    )
    sink = torch.zeros(1, x.shape[1])
    sink[0, 50] = 3000.0  # a massive activation on the channel that outlying weight reads, in one token
    with_sink = (torch.cat([x, sink]).T @ torch.cat([x, sink])) / (x.shape[0] + 1)
    # clipping it would wreck that token
    assert (
        _search_global_scale([weight], with_sink).global_scale == plain.global_scale
    )


def test_nvfp4_activation_graph_in_onnx_runtime_equals_the_torch_fake_quantization():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 64, generator=gen) * torch.logspace(-3, 1, 64)
    x[0, 0, :16] = 0  # an all-zero block
    x[1, 3, 5] = 300.0
    fmt = Nvfp4Activation()
    scale = fmt.scale_for(float(x.abs().max()))
    consts, nodes, output = _nvfp4_activation("x", scale, "t")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 7, 64])],
                              [helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, [2, 7, 64])], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    ours = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.numpy()}
    )[0]
    assert np.array_equal(ours, fmt.fake_quantize(x, scale).numpy())
    fp8 = Fp8Activation()
    assert fp8.scale_for(448.0 * 3) == 3.0 and torch.equal(
        fp8.fake_quantize(torch.tensor([1e6]), 1.0), torch.tensor([448.0])
    )


def test_quantize_options_that_do_not_go_together_are_refused():
    with pytest.raises(ValueError, match="activations=nvfp4 applies to method nvfp4 only"):
        quantize_config(method="int8", activations="nvfp4")
    with pytest.raises(ValueError, match="weight-only is method int4 or nvfp4"):
        quantize_config(method="fp8", activations="float")
    with pytest.raises(ValueError, match="fp8_weight_scale applies to method fp8 only"):
        quantize_config(method="int8", fp8_weight_scale="channel")
    assert quantize_config(method="nvfp4").precision() == "nvfp4_a16"
    assert quantize_config(method="nvfp4", activations="nvfp4").scheme() == (4, True, 16)
    assert (
        quantize_config(method="fp8").precision() == "fp8"
        and quantize_config(method="fp8", hadamard_block=64).is_w8a8()
    )


@pytest.mark.parametrize("recipe", ["thor-fp8", "thor-nvfp4"])
def test_orin_refuses_fp8_and_nvfp4_at_plan_time_naming_its_precisions(capsys, tmp_path, recipe):
    """The quantize stage's target check runs when the plan is built, before any work."""
    out = tmp_path / "run"
    assert main(["run", "target=jetson-orin", f"recipe={recipe}", f"out={out}", "--dry-run"]) == 2
    error = capsys.readouterr().err
    assert "target jetson-orin-nano-8gb (ampere sm_87) has no" in error
    assert "its precisions are fp32, fp16, int8, int4" in error and "target=jetson-agx-thor" in error
    assert not out.exists()


def test_an_fp8_kv_cache_needs_fp8_and_a_checkpoint_edgellm_reads_it_from(capsys, tmp_path):
    assert (
        main(
            ["run", "target=jetson-orin", "recipe=int8", "quantize.kv_cache=fp8", f"out={tmp_path / 'a'}", "--dry-run"]
        )
        == 2
    )
    assert "quantize.kv_cache=fp8: target jetson-orin-nano-8gb (ampere sm_87) has no FP8" in capsys.readouterr().err
    assert (
        main(
            [
                "run",
                "target=jetson-agx-thor",
                "recipe=edgellm-int4",
                "quantize.kv_cache=fp8",
                f"out={tmp_path / 'b'}",
                "--dry-run",
            ]
        )
        == 2
    )
    error = capsys.readouterr().err
    assert (
        "quantize.kv_cache=fp8 with INT4 weights" in error
        and "takes no FP8 KV cache read from a W4A16_AWQ checkpoint" in error
    )


def test_a_generic_tensorrt_build_of_an_nvfp4_graph_is_refused_before_any_work(capsys, tmp_path):
    recipe = tmp_path / "nvfp4-onnx.yaml"
    recipe.write_text(
        "name: nvfp4-onnx\nstages:\n  - load\n  - quantize: {method: nvfp4}\n  - export_onnx\n  - build_engine\n"
        "  - validate\n"
    )
    assert main(["run", "target=jetson-agx-thor", f"recipe={recipe}", f"out={tmp_path / 'run'}", "--dry-run"]) == 2
    assert "ONNX parser of TensorRT 10.13 on jetson-agx-thor reads opset 21 at most" in capsys.readouterr().err


def test_the_fp8_kv_cache_rounds_what_attention_reads_to_fp8_under_each_layers_scales(tiny_wide):
    from compress.algorithms import kv_cache
    from compress.models.families import decoder_blocks
    from compress.models.loading import load_causal_lm

    model = load_causal_lm(tiny_wide)
    ids = torch.randint(0, 400, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits
    kv_cache.route_attention(model)
    blocks = decoder_blocks(model)
    recorded = [kv_cache.record_amax(block) for block in blocks]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference)  # routing alone changes nothing
    seen = []
    scales = {i: (kv_cache.kv_scale(k), kv_cache.kv_scale(v)) for i, (k, v) in enumerate(recorded)}
    for block in blocks:
        kv_cache.stop_recording(block)
    kv_cache.attach_kv_cache_quant(model, scales)
    inner = kv_cache.ALL_ATTENTION_FUNCTIONS["sdpa"]

    def spy(module, query, key, value, *args, **kwargs):
        seen.append((key / module.compress_kv_scales[0], value / module.compress_kv_scales[1]))
        return inner(module, query, key, value, *args, **kwargs)

    kv_cache.ALL_ATTENTION_FUNCTIONS["sdpa"] = spy
    try:
        with torch.no_grad():
            quantized = model(ids).logits
    finally:
        kv_cache.ALL_ATTENTION_FUNCTIONS["sdpa"] = inner
    assert len(seen) == 2 and all(torch.allclose(round_fp8(t), t, rtol=1e-6) for pair in seen for t in pair)
    assert 0 < (quantized - reference).abs().max() < 0.05 * reference.abs().max()
    kv_cache.restore_attention(model)
    assert model.config._attn_implementation == "sdpa" and not hasattr(blocks[0].self_attn, "compress_kv_scales")


def test_thor_runs_the_default_its_target_names(capsys):
    assert main(["run", "target=jetson-agx-thor", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    quantize = next(s for s in plan["stages"] if s["name"] == "quantize")["config"]
    assert plan["recipe"] == "thor-fp8" and quantize["method"] == "fp8"
    assert "export_edgellm" in [s["name"] for s in plan["stages"]]


# --- the pipeline on a tiny model, through the real Edge-LLM exporter -------------------------------------------


@pytest.fixture(scope="module")
def tiny_wide(tmp_path_factory) -> Path:
    return build_tiny_llama(
        tmp_path_factory.mktemp("thor") / "model",
        layers=2,
        hidden=128,
        heads=2,
        kv_heads=1,
        intermediate=256,
        chat_template=True,
    )


def _thor_run(tiny: Path, out: Path, recipe: str, *extra: str) -> Path:
    proc = run_compress(
        "run",
        "target=jetson-agx-thor",
        f"recipe={recipe}",
        f"model={tiny}",
        f"out={out}",
        *QUANTIZE_SMALL,
        *TINY_SMOKE,
        *extra,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tiny_wide, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("thor-runs")
    keep = "export_edgellm.keep_checkpoint=true"  # the tests read the unified checkpoint back with Edge-LLM's loader
    return {"fp8": _thor_run(tiny_wide, root / "fp8", "thor-fp8", "quantize.kv_cache=fp8", keep),
            "w4a4": _thor_run(tiny_wide, root / "w4a4", "thor-nvfp4", keep),
            "w4a16": _thor_run(tiny_wide, root / "w4a16", "thor-nvfp4", "quantize.activations=float", keep)}


def test_per_channel_fp8_weights_go_to_the_portable_onnx_and_not_to_edgellm(tiny_wide, tmp_path, capsys):
    weight, _ = _layer()
    dequantized, scales = quantize_dequantize(weight, Fp8Grid(per_channel=True))
    assert scales.shape == (64,) and torch.equal(scales.half().float(), scales)
    levels_on_grid(dequantized, Fp8Grid(per_channel=True), scales, tolerance=0.0)
    assert (
        main(
            [
                "run",
                "target=jetson-agx-thor",
                "recipe=thor-fp8",
                "quantize.fp8_weight_scale=channel",
                f"out={tmp_path / 'a'}",
                "--dry-run",
            ]
        )
        == 2
    )
    error = capsys.readouterr().err
    assert "quantize.fp8_weight_scale=channel" in error and "FP8 linears with one weight scale per tensor" in error
    recipe = tmp_path / "fp8-onnx.yaml"
    recipe.write_text(
        "name: fp8-onnx\nstages:\n  - load\n  - quantize: {method: fp8, fp8_weight_scale: channel}\n  - export_onnx\n"
        "  - validate\n"
    )
    out = tmp_path / "run"
    assert main(
        [
            "run",
            "target=jetson-agx-thor",
            f"recipe={recipe}",
            f"model={tiny_wide}",
            f"out={out}",
            *QUANTIZE_SMALL,
            *TINY_SMOKE,
        ]
    ) in (0, 1)
    graph = onnx.load(str(out / "03_export_onnx" / "onnx" / "model.onnx"), load_external_data=False).graph
    inits = {i.name: i for i in graph.initializer}
    weight_dqs = [n for n in graph.node if n.op_type == "DequantizeLinear" and inits.get(n.input[0]) is not None
                  and inits[n.input[0]].data_type == onnx.TensorProto.FLOAT8E4M3FN]
    # one scale per output channel
    assert len(weight_dqs) == 14 and all(
        len(inits[n.input[1]].dims) == 1 for n in weight_dqs
    )
    report = json.loads((out / "report.json").read_text())
    assert {c["name"]: c for c in report["gate"]["checks"]}["onnx_vs_torch_quantized_pct"]["value"] < 1.0


def _stage_metrics(run: Path, stage: str) -> dict:
    folder = next(run.glob(f"0*_{stage}"))
    return json.loads((folder / "stage.json").read_text())["metrics"]


def _initializer_types(path: Path) -> set[str]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return {onnx.TensorProto.DataType.Name(init.data_type) for init in graph.initializer}


def test_fp8_bundle_holds_our_fp8_values_fp16_scales_and_kv_cache_scales(runs):
    run = runs["fp8"]
    bundle = _stage_metrics(run, "export_edgellm")
    assert bundle["checkpoint"]["quant_algo"] == "FP8" and bundle["exporter_arguments"] == []
    assert bundle["custody"]["tensors_compared"] == 14 * 3 + 2 and bundle["custody"]["mismatches"] == 0
    custody = json.loads((run / "04_export_edgellm" / "custody.json").read_text())
    assert [c["tensor"] for c in custody["compared"] if "KV cache" in c["tensor"]] == [
        "layer 0 AttentionPlugin FP8 KV cache (k_scale, v_scale)",
        "layer 1 AttentionPlugin FP8 KV cache (k_scale, v_scale)",
    ]
    hf_quant = json.loads((run / "04_export_edgellm" / "checkpoint" / "hf_quant_config.json").read_text())[
        "quantization"
    ]
    assert hf_quant["kv_cache_quant_algo"] == "FP8"
    assert _stage_metrics(run, "export_onnx")["kv_cache_qdq_pairs"] == 4
    checkpoint = CheckpointReader(run / "04_export_edgellm" / "checkpoint")
    up = checkpoint.read(["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.input_scale"])
    assert up["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert up["model.layers.0.mlp.up_proj.input_scale"].shape == ()
    ours = run / "03_export_onnx" / "onnx" / "model.onnx"
    assert "FLOAT8E4M3FN" in _initializer_types(ours)
    report = json.loads((run / "report.json").read_text())
    checks = {c["name"]: c for c in report["gate"]["checks"]}
    assert checks["onnx_vs_torch_quantized_pct"]["value"] < 1.0
    assert report["predictions"]["chosen"]["precision"] == "fp8"


def test_nvfp4_w4a4_bundle_is_fused_by_edgellm_and_checked_row_by_row(runs):
    run = runs["w4a4"]
    bundle = _stage_metrics(run, "export_edgellm")
    assert bundle["checkpoint"]["quant_algo"] == "NVFP4" and bundle["checkpoint"]["group_size"] == 16
    assert bundle["custody"]["tensors_compared"] == 14 * 4 and bundle["custody"]["mismatches"] == 0
    custody = json.loads((run / "04_export_edgellm" / "custody.json").read_text())
    # v's rows of the fused GEMM
    assert any(
        "qkv_proj_fused.weight[128:192]" in c["tensor"] for c in custody["compared"]
    )
    graph = onnx.load(str(run / "04_export_edgellm" / "bundle" / "llm" / "model.onnx"), load_external_data=False).graph
    assert "TRT_FP4DynamicQuantize" in {n.op_type for n in graph.node}
    ours = run / "03_export_onnx" / "onnx" / "model.onnx"
    model = onnx.load(str(ours), load_external_data=False)
    assert (
        "FLOAT4E2M1" in _initializer_types(ours) and max(o.version for o in model.opset_import if o.domain == "") == 23
    )
    report = json.loads((run / "report.json").read_text())
    assert {c["name"]: c for c in report["gate"]["checks"]}["onnx_vs_torch_quantized_pct"]["value"] < 1.0


def test_nvfp4_weight_only_bundle_keeps_every_input_in_fp16(runs):
    run = runs["w4a16"]
    bundle = _stage_metrics(run, "export_edgellm")
    assert bundle["checkpoint"]["quant_algo"] == "W4A16_NVFP4" and bundle["exporter_arguments"] == [
        "--no-quantize-activations"
    ]
    custody = json.loads((run / "04_export_edgellm" / "custody.json").read_text())
    assert sum("weight-only" in c["tensor"] for c in custody["compared"]) == 14 and not custody["mismatches"]
    meta, linears = load_quantization(run / "02_quantize" / "model")
    assert meta.activations == "float" and all(q.input_scale is None for q in linears.values())
    # Distinct per-tensor scales keep q, k and v apart: Edge-LLM 0.11's fused GEMM would quantize their input.
    layer = "model.layers.0.self_attn"
    assert len({linears[f"{layer}.{p}"].global_scale for p in ("q_proj", "k_proj", "v_proj")}) == 3


def _our_weight(run: Path, module: str) -> torch.Tensor:
    """The float weight our quantized folder computes with (rebuilt from its stored levels and scales)."""
    meta, linears = load_quantization(run / "02_quantize" / "model")
    if module.endswith("qkv_proj_fused"):
        parent = module.rsplit(".", 1)[0]
        return torch.cat([dequantized_weight(linears[f"{parent}.{p}"]) for p in ("q_proj", "k_proj", "v_proj")])
    return dequantized_weight(linears[module])


def _input_scale(run: Path, module: str) -> float | None:
    _, linears = load_quantization(run / "02_quantize" / "model")
    name = module.rsplit(".", 1)[0] + ".q_proj" if module.endswith("qkv_proj_fused") else module
    return linears[name].input_scale


@pytest.mark.parametrize(("kind", "fmt"), [("fp8", Fp8Activation()), ("w4a4", Nvfp4Activation()), ("w4a16", None)])
def test_edgellm_runs_our_checkpoint_with_the_numbers_our_simulation_measured(runs, tmp_path, kind, fmt):
    """Edge-LLM's own FP8 / NVFP4 linears (the definitions its ONNX export emits as Q/DQ nodes), loaded from our
    checkpoint: their dequantized weights are our quantized folder's weights, their input quantization is ours, value
    for value."""
    run = runs[kind]
    out = tmp_path / "probe.safetensors"
    flags = ["--no-quantize-activations"] if kind == "w4a16" else []
    proc = subprocess.run(
        [
            str(edgellm_python()),
            str(REPO / "tests" / "support" / "edgellm_fp_probe.py"),
            str(run / "04_export_edgellm" / "checkpoint"),
            str(out),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with safe_open(str(out), framework="pt") as probe:
        modules = json.loads(probe.metadata()["modules"])
        assert len(modules) == (10 if kind == "w4a4" else 14)
        for module in modules:
            x, x_q, weight, y = (probe.get_tensor(f"{module}.{k}") for k in ("x", "x_q", "weight", "y"))
            assert torch.equal(weight, _our_weight(run, module).half()), module
            scale = _input_scale(run, module)
            ours = x if fmt is None else fmt.fake_quantize(x.float(), scale).half()
            assert (scale is None) == (fmt is None) and torch.equal(x_q, ours), module
            torch.testing.assert_close(y.float(), ours.float() @ weight.float().T, rtol=2e-2, atol=2e-2)


def test_a_changed_fp4_value_or_block_scale_in_the_bundle_is_caught(runs, tmp_path):
    run = runs["w4a4"]
    quantized = run / "02_quantize" / "model"
    bundle = tmp_path / "bundle"
    shutil.copytree(run / "04_export_edgellm" / "bundle", bundle)
    weight = "_model.model.layers.1.mlp.down_proj.weight"

    def flip_one(values):
        flat = values.astype(np.float32).reshape(-1)
        flat[5] = 6.0 if flat[5] != 6.0 else -6.0
        return flat.reshape(values.shape).astype(ml_dtypes.float4_e2m1fn)

    tamper_bundle(bundle, weight, flip_one)
    with pytest.raises(StageError, match=f"{weight} \\(FP4\\): 1 of .* values differ"):
        check_custody(quantized, bundle, tmp_path)
    shutil.rmtree(bundle)
    shutil.copytree(run / "04_export_edgellm" / "bundle", bundle)
    scales = "_model.model.layers.0.self_attn.o_proj.weight_scale"
    tamper_bundle(bundle, scales, lambda a: (a.astype(np.float32) * 2).astype(ml_dtypes.float8_e4m3fn))
    with pytest.raises(StageError, match="o_proj block scales \\(FP8\\): .* values differ"):
        check_custody(quantized, bundle, tmp_path)
    assert check_custody(quantized, run / "04_export_edgellm" / "bundle", tmp_path)["mismatches"] == []
