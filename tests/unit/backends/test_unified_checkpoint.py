"""The unified quantized checkpoint: integers on disk that TensorRT Edge-LLM's own loader reads back unchanged."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from compress.algorithms.formats import expand_scales
from compress.backends.edgellm.checkpoint import grid_values, pack_int4, unpack_int4, write_unified_checkpoint
from compress.backends.edgellm.env import edgellm_python
from compress.core.errors import UsageError
from compress.models.weights import CheckpointReader
from compress.transforms.quantize.saved import LinearQuant, load_quantization, load_quantized_causal_lm
from tests.conftest import QUANTIZE_SMALL, REPO, TINY_SMOKE, build_tiny_llama, run_compress


@pytest.fixture(scope="module")
def tiny_wide(tmp_path_factory) -> Path:
    # 64-aligned widths: Edge-LLM's INT4 GEMM layout needs N % 64 == 0 and K % 64 == 0.
    return build_tiny_llama(
        tmp_path_factory.mktemp("wide") / "model",
        layers=2,
        hidden=128,
        heads=2,
        kv_heads=1,
        intermediate=256,
        chat_template=True,
    )


def _quantized(tiny: Path, out: Path, recipe: str, *extra: str) -> Path:
    proc = run_compress(
        "run",
        "target=jetson-orin",
        f"recipe={recipe}",
        f"model={tiny}",
        f"out={out}",
        *QUANTIZE_SMALL,
        *TINY_SMOKE,
        *extra,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return out / "02_quantize" / "model"


PLAN_CALIBRATION = {"calib_windows": 4, "calib_window": 64, "min_calib_tokens": 1, "sample_tokens": 128}


def _plan_quantized(tiny: Path, out: Path, points: dict, seed: int, head: str = "fp16") -> Path:
    """``tiny`` quantized under a mixed plan (``points``: each block's formats, ``head``: the LM head's) into ``out``,
    with its tokenizer."""
    from compress.models.loading import load_tokenizer, save_side_files
    from compress.transforms.quantize.config import QUANTIZE_CONFIG, candidate_configs
    from compress.transforms.quantize.decoder import quantize_folder
    from compress.transforms.quantize.mixed import MixedPlan

    used = sorted(({name for block in points.values() for name in block.values()} | {head}) - {"fp16"})
    plan = MixedPlan(points, candidate_configs(used, PLAN_CALIBRATION), head=head)
    windows = torch.randint(0, 400, (4, 64), generator=torch.Generator().manual_seed(seed))
    quantize_folder(
        tiny,
        out,
        windows,
        QUANTIZE_CONFIG.validate_python({"method": "auto", **PLAN_CALIBRATION}),
        plan=plan,
    )
    save_side_files(load_tokenizer(tiny), tiny, out)
    return out


def _probe(checkpoint: Path, tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What Edge-LLM's loader holds after reading ``checkpoint`` (run in Edge-LLM's own environment)."""
    out = tmp_path / "probe.safetensors"
    proc = subprocess.run(
        [str(edgellm_python()), str(REPO / "tests" / "support" / "edgellm_probe.py"), str(checkpoint), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with safe_open(str(out), framework="pt") as probe:
        keys = list(probe.keys())
        return {key: probe.get_tensor(key) for key in keys}, probe.metadata()


def _our_integers(quantized: Path) -> tuple[dict[str, torch.Tensor], dict[str, LinearQuant], int]:
    """The integers of each quantized linear, recovered from the float weight the folder rebuilds (not from the levels
    the checkpoint writer reads)."""
    meta, linears = load_quantization(quantized)
    model = load_quantized_causal_lm(quantized)
    integers = {}
    for name, quant in linears.items():
        weight = model.get_submodule(name).weight.detach().double()
        ratio = weight / expand_scales(quant.weight_scales.double(), weight.shape[1])
        assert float((ratio - ratio.round()).abs().max()) < 1e-3, name
        integers[name] = ratio.round().to(torch.int8)
    return integers, linears, meta.weight_bits


def test_int8_checkpoint_is_read_by_edgellm_with_our_integers_and_scales(tiny_wide, tmp_path):
    quantized = _quantized(tiny_wide, tmp_path / "run", "int8", "quantize.hadamard_block=0")
    summary = write_unified_checkpoint(quantized, tmp_path / "ckpt")
    assert summary.quant_algo == "W8A8_SQ_PER_CHANNEL" and summary.linears == 14
    assert 0.5 <= summary.quantized_bytes / summary.fp16_bytes < 0.53  # int8 weights + per-channel scales
    hf_quant = json.loads((tmp_path / "ckpt" / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
    loaded, meta = _probe(tmp_path / "ckpt", tmp_path)
    assert meta["quant_type"] == "int8_sq" and "lm_head" in meta["excluded"].split(",")
    integers, linears, _ = _our_integers(quantized)
    for name, ours in integers.items():
        assert torch.equal(loaded[f"{name}.loaded.weight"], ours), name
        assert torch.equal(loaded[f"{name}.loaded.weight_scale"], linears[name].weight_scales.float()), name
        assert float(loaded[f"{name}.loaded.input_scale"]) == pytest.approx(linears[name].input_scale, rel=1e-7), name
        assert torch.equal(
            loaded[f"{name}.loaded.pre_quant_scale"], torch.ones_like(loaded[f"{name}.loaded.pre_quant_scale"])
        )


def test_int4_checkpoint_is_read_by_edgellm_with_our_integers_and_scales(tiny_wide, tmp_path):
    quantized = _quantized(tiny_wide, tmp_path / "run", "int4", "quantize.group_size=32")
    summary = write_unified_checkpoint(quantized, tmp_path / "ckpt")
    assert summary.quant_algo == "W4A16_AWQ" and summary.group_size == 32
    # nibbles + fp32 scales
    assert summary.quantized_bytes / summary.fp16_bytes == pytest.approx(
        0.25 + 4 / (32 * 2), rel=1e-9
    )
    written = CheckpointReader(tmp_path / "ckpt").read(["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"])
    weight = written["model.layers.0.self_attn.q_proj.weight"]
    assert weight.dtype == torch.uint8 and tuple(weight.shape) == (64, 128)
    assert written["model.norm.weight"].dtype == torch.float16
    loaded, meta = _probe(tmp_path / "ckpt", tmp_path)
    assert meta["quant_type"] == "int4_awq_modelopt" and meta["group_size"] == "32"
    integers, linears, _ = _our_integers(quantized)
    for name, ours in integers.items():
        assert torch.equal(loaded[f"{name}.integers"], ours), name
        assert int(loaded[f"{name}.group_size"]) == 32
        assert torch.equal(loaded[f"{name}.loaded.weight_scale"], linears[name].weight_scales.float().t().half()), name


def test_int4_packing_round_trips_every_value():
    values = torch.arange(-8, 8, dtype=torch.int8).repeat(4, 3)  # [4, 48]: every value in both nibbles
    values = torch.cat([values, values.flip(1)])
    packed = pack_int4(values)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (4, 48)
    assert torch.equal(unpack_int4(packed), values)
    # even row low nibble, two's complement
    assert (
        int(pack_int4(torch.tensor([[-1], [0]], dtype=torch.int8))[0, 0]) == 0x0F
    )


def test_rotated_or_damaged_levels_are_refused():
    scales = torch.full((4,), 0.5)
    levels = torch.tensor([[2, -3], [1, 0], [4, 127], [-128, 1]], dtype=torch.int8)
    assert torch.equal(grid_values("x", LinearQuant(scales, 0.1, 40.0, levels=levels, precision="int8")), levels)
    with pytest.raises(UsageError, match="not 4-bit integers"):
        grid_values("x", LinearQuant(scales, 0.1, 40.0, levels=levels, precision="int4", group_size=2))
    with pytest.raises(UsageError, match="not 8-bit integers"):
        grid_values("x", LinearQuant(scales, 0.1, 40.0, levels=levels.float() + 0.5, precision="int8"))
    with pytest.raises(UsageError, match="Hadamard-rotated online.*quantize.hadamard_block=0"):
        grid_values(
            "model.layers.3.mlp.down_proj", LinearQuant(scales, 0.1, 40.0, rotation=64, levels=levels, precision="int8")
        )


def test_qwen3_int4_checkpoint_is_read_by_edgellm_and_exported_with_its_numbers(tmp_path):
    qwen3 = build_tiny_llama(
        tmp_path / "qwen3",
        layers=2,
        hidden=128,
        heads=2,
        kv_heads=1,
        intermediate=256,
        chat_template=True,
        family="qwen3",
    )
    proc = run_compress("run", "target=jetson-orin", "recipe=edgellm-int4", f"model={qwen3}", f"out={tmp_path / 'run'}",
                        *QUANTIZE_SMALL, *TINY_SMOKE)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    quantized = tmp_path / "run" / "02_quantize" / "model"
    assert json.loads((quantized / "config.json").read_text())["model_type"] == "qwen3"
    custody = json.loads((tmp_path / "run" / "04_export_edgellm" / "stage.json").read_text())["metrics"]["custody"]
    assert custody["tensors_compared"] == 28 and custody["mismatches"] == 0
    write_unified_checkpoint(quantized, tmp_path / "ckpt")
    loaded, meta = _probe(tmp_path / "ckpt", tmp_path)
    assert meta["quant_type"] == "int4_awq_modelopt"
    integers, linears, _ = _our_integers(quantized)
    for name, ours in integers.items():
        assert torch.equal(loaded[f"{name}.integers"], ours), name
        assert torch.equal(loaded[f"{name}.loaded.weight_scale"], linears[name].weight_scales.float().t().half()), name


def test_linears_left_float_are_fp16_in_the_checkpoint_and_in_the_bundle(tiny_wide, tmp_path):
    out = tmp_path / "run"
    proc = run_compress(
        "run",
        "target=jetson-orin",
        "recipe=edgellm-int8",
        f"model={tiny_wide}",
        f"out={out}",
        "quantize.float_linears=[down_proj]",
        "export_edgellm.keep_checkpoint=true",
        *QUANTIZE_SMALL,
        *TINY_SMOKE,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    quantized = out / "02_quantize" / "model"
    _, linears = load_quantization(quantized)
    assert len(linears) == 12 and not any(name.endswith("down_proj") for name in linears)
    metrics = json.loads((out / "04_export_edgellm" / "stage.json").read_text())["metrics"]
    assert metrics["checkpoint"]["float_linears"] == 2 and metrics["custody"]["tensors_compared"] == 12 * 3 + 2
    checkpoint = out / "04_export_edgellm" / "checkpoint"
    excluded = json.loads((checkpoint / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert excluded == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    loaded, _ = _probe(checkpoint, tmp_path)
    ours = CheckpointReader(quantized)
    for layer in (0, 1):
        name = f"model.layers.{layer}.mlp.down_proj"
        assert torch.equal(
            loaded[f"{name}.float.weight"].half(), ours.read([f"{name}.weight"])[f"{name}.weight"].half()
        ), name


def test_a_rotation_of_an_input_left_float_is_a_configuration_error(capsys):
    from compress.cli.main import main

    assert main(["run", "target=jetson-orin", "recipe=int8", "quantize.float_linears=[down_proj]", "--dry-run"]) == 2
    assert (
        "hadamard_block rotates the down_proj input, which float_linears leaves unquantized" in capsys.readouterr().err
    )


def test_a_mixed_precision_plan_is_read_by_edgellm_linear_by_linear_and_exported_with_its_numbers(tiny_wide, tmp_path):
    """quantize.method=auto's checkpoint: MIXED_PRECISION, each linear in its own format. Edge-LLM's own loader reads
    INT8 linears as W8A8 with our integers, INT4 ones as packed W4A16 with our integers, the rest as FP16; the exported
    bundle passes the custody check linear by linear."""
    from compress.backends.edgellm.bundle import export_bundle
    from compress.transforms.quantize.mixed import FLOAT

    quantized = _plan_quantized(tiny_wide, tmp_path / "quantized", {
        0: {"attn_in": "int8", "attn_out": FLOAT, "mlp_in": "int4", "mlp_hidden": "int8"},
        1: {"attn_in": "int4", "attn_out": "int8", "mlp_in": FLOAT, "mlp_hidden": "int4"}}, seed=4)
    summary = write_unified_checkpoint(quantized, tmp_path / "ckpt")
    quantization = json.loads((tmp_path / "ckpt" / "hf_quant_config.json").read_text())["quantization"]
    assert summary.quant_algo == quantization["quant_algo"] == "MIXED_PRECISION"
    _, linears = load_quantization(quantized)
    assert quantization["quantized_layers"] == {
        name: {"quant_algo": "W8A8_SQ_PER_CHANNEL"}
        if q.precision == "int8"
        else {"quant_algo": "W4A16_AWQ", "group_size": 128}
        for name, q in linears.items()
    }
    loaded, _ = _probe(tmp_path / "ckpt", tmp_path)
    integers, _, _ = _our_integers(quantized)
    for name, quant in linears.items():
        key = f"{name}.loaded.weight" if quant.precision == "int8" else f"{name}.integers"
        assert torch.equal(loaded[key], integers[name]), name
    floats = {"model.layers.0.self_attn.o_proj", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"}
    assert {key.removesuffix(".float.weight") for key in loaded if key.endswith(".float.weight")} == floats
    metrics = export_bundle(quantized, tmp_path / "work")
    assert metrics["checkpoint"]["quant_algo"] == "MIXED_PRECISION" and metrics["custody"]["mismatches"] == 0
    assert metrics["custody"]["tensors_compared"] > len(linears)


def test_edgellm_misreads_int8_beside_nvfp4_so_a_plan_mixing_them_is_refused(tiny_wide, tmp_path):
    """The contract is real: with one NVFP4 linear in a MIXED_PRECISION checkpoint, Edge-LLM 0.11's exporter turns every
    INT8 weight into FP4 of twice the width (the custody check sees it); so the bundle stage refuses such a plan before
    exporting, naming the rule. This proves compress's refusal and custody check, not a TensorRT engine."""
    from compress.backends.edgellm.bundle import check_custody, export_bundle, run_export
    from compress.backends.edgellm.contracts import RULES
    from compress.transforms.quantize.mixed import FLOAT

    points = {"attn_in": "nvfp4", "attn_out": FLOAT, "mlp_in": "int8", "mlp_hidden": FLOAT}
    quantized = _plan_quantized(tiny_wide, tmp_path / "quantized", {0: points, 1: points}, seed=5)
    with pytest.raises(UsageError, match="mixes int8 and nvfp4.*reinterprets every int8 weight initializer"):
        export_bundle(quantized, tmp_path / "refused")
    assert not (tmp_path / "refused" / "checkpoint").exists()

    work = tmp_path / "work"
    write_unified_checkpoint(quantized, work / "checkpoint")
    run_export(work / "checkpoint", work / "bundle", work / "export.log")
    with pytest.raises(Exception, match=r"mlp\.(gate|up)_proj\.weight: shape \[256, 256\] instead of \[256, 128\]"):
        check_custody(quantized, work / "bundle", work)
    report = json.loads((work / "custody.json").read_text())
    misread = {entry["tensor"] for entry in report["mismatches"]}
    assert misread == {
        f"_model.model.layers.{layer}.mlp.{name}.weight" for layer in (0, 1) for name in ("gate_proj", "up_proj")
    }
    assert "_fix_nvfp4_weight_dtype" in RULES["mixed-nvfp4-integers"].source


@pytest.mark.parametrize("points", [
    ({"attn_in": "fp8", "attn_out": "int8", "mlp_in": "int8", "mlp_hidden": "int4"},
     {"attn_in": "int8", "attn_out": "fp8", "mlp_in": "fp16", "mlp_hidden": "fp8"}),
    ({"attn_in": "nvfp4", "attn_out": "fp8", "mlp_in": "nvfp4", "mlp_hidden": "fp16"},
     {"attn_in": "fp8", "attn_out": "nvfp4", "mlp_in": "fp8", "mlp_hidden": "nvfp4"}),
], ids=["int8+int4+fp8", "fp8+nvfp4"])
def test_edgellm_loads_each_linear_of_a_mixed_plan_in_its_own_format(tiny_wide, tmp_path, points):
    """Both sets of formats one Thor bundle may hold: Edge-LLM's loader builds each linear as the plan says (FP8, NVFP4,
    INT8, INT4 or FP16) and holds our FP8 values and packed FP4 codes; the set with NVFP4 also exports with every number
    in
    custody."""
    from compress.algorithms.formats import e2m1_codes, pack_fp4
    from compress.backends.edgellm.bundle import export_bundle

    used = sorted({name for block in points for name in block.values()} - {"fp16"})
    quantized = _plan_quantized(tiny_wide, tmp_path / "quantized", dict(enumerate(points)), seed=6)
    write_unified_checkpoint(quantized, tmp_path / "ckpt")
    loaded, metadata = _probe(tmp_path / "ckpt", tmp_path)
    _, linears = load_quantization(quantized)
    formats = json.loads(metadata["formats"])
    family_linears = [
        f"model.layers.{i}.{part}"
        for i in range(2)
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    expected = {name: linears[name].precision if name in linears else "fp16" for name in family_linears}
    for fused in [name for name in formats if name.endswith(".qkv_proj_fused")]:  # NVFP4 q/k/v fused into one linear
        parts = [fused.replace("qkv_proj_fused", part) for part in ("q_proj", "k_proj", "v_proj")]
        assert {expected.pop(part) for part in parts} == {formats[fused]}
        expected[fused] = formats[fused]
        packed = torch.cat([pack_fp4(e2m1_codes(grid_values(part, linears[part]))) for part in parts])
        assert torch.equal(loaded[f"{fused}.loaded.weight"].view(torch.uint8), packed), fused
    assert formats == expected and {*used, "fp16"} >= set(formats.values()) >= set(used)
    for name, quant in linears.items():
        if quant.precision == "fp8":
            assert torch.equal(loaded[f"{name}.loaded.weight"].float(), grid_values(name, quant).float()), name
        elif quant.precision == "nvfp4" and f"{name}.loaded.weight" in loaded:
            ours = pack_fp4(e2m1_codes(grid_values(name, quant)))
            assert torch.equal(loaded[f"{name}.loaded.weight"].view(torch.uint8), ours), name
    if "nvfp4" in used:
        assert export_bundle(quantized, tmp_path / "work")["custody"]["mismatches"] == 0


@pytest.mark.parametrize("head", ["fp8", "int4"])
def test_a_quantized_lm_head_is_built_by_edgellm_from_its_own_tensors_and_exported_in_custody(
    tiny_wide, tmp_path, head
):
    """A plan may quantize the (tied) LM head: the checkpoint is written untied with lm_head listed in its format;
    Edge-LLM's loader builds the head in that format from our numbers (not from the embedding table) and the exported
    bundle holds them (custody compares lm_head's tensors too)."""
    from compress.backends.edgellm.bundle import export_bundle

    points = {"attn_in": "int8", "attn_out": "int8", "mlp_in": "int8", "mlp_hidden": "int8"}
    quantized = _plan_quantized(tiny_wide, tmp_path / "quantized", {0: points, 1: points}, seed=7, head=head)
    write_unified_checkpoint(quantized, tmp_path / "ckpt")
    quantization = json.loads((tmp_path / "ckpt" / "hf_quant_config.json").read_text())["quantization"]
    assert "lm_head" not in quantization["exclude_modules"]
    assert quantization["quantized_layers"]["lm_head"]["quant_algo"] == ("FP8" if head == "fp8" else "W4A16_AWQ")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["tie_word_embeddings"] is False
    loaded, metadata = _probe(tmp_path / "ckpt", tmp_path)
    assert metadata["head"] == head
    _, linears = load_quantization(quantized)
    if head == "fp8":
        assert torch.equal(loaded["lm_head.loaded.weight"].float(), grid_values("lm_head", linears["lm_head"]).float())
    else:
        integers, _, _ = _our_integers(quantized)
        assert torch.equal(loaded["lm_head.integers"], integers["lm_head"])
    metrics = export_bundle(quantized, tmp_path / "work")
    assert metrics["custody"]["mismatches"] == 0
    report = json.loads(next((tmp_path / "work").rglob("custody.json")).read_text())
    assert any("lm_head" in entry["tensor"] for entry in report["compared"])
