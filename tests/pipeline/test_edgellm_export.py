"""The Edge-LLM export stage: the real ``tensorrt-edgellm-export``, a chain-of-custody check that catches tampering,
and plan-time refusals of what the pinned Edge-LLM cannot express.

These run NVIDIA's exporter on CPU (it needs no GPU); building and running the engine is the device's part.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from compress.backends.edgellm.bundle import check_bundle_config, check_custody
from compress.backends.edgellm.contracts import check_attention_shape
from compress.cli.main import main
from compress.core.errors import StageError, UsageError
from tests.conftest import QUANTIZE_SMALL, TINY_SMOKE, build_tiny_llama, run_compress, tamper_bundle


@pytest.fixture(scope="module")
def tiny_wide(tmp_path_factory) -> Path:
    # 64-aligned widths: Edge-LLM's INT4 GEMM layout needs them.
    return build_tiny_llama(
        tmp_path_factory.mktemp("wide") / "model",
        layers=2,
        hidden=128,
        heads=2,
        kv_heads=1,
        intermediate=256,
        chat_template=True,
    )


def _run(tiny: Path, out: Path, recipe: str, *extra: str) -> subprocess.CompletedProcess:
    return run_compress(
        "run",
        "target=jetson-orin",
        f"recipe={recipe}",
        f"model={tiny}",
        f"out={out}",
        *QUANTIZE_SMALL,
        *TINY_SMOKE,
        *extra,
    )


@pytest.fixture(scope="module")
def int4_run(tiny_wide, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("edgellm4") / "run"
    proc = _run(tiny_wide, out, "edgellm-int4")
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return out


def test_int4_recipe_leaves_a_checked_bundle_named_in_the_report(int4_run):
    report = json.loads((int4_run / "report.json").read_text())
    assert [s["name"] for s in report["stages"]] == [
        "load",
        "quantize",
        "export_onnx",
        "export_edgellm",
        "build_engine",
        "validate",
    ]
    assert report["artifacts"]["edgellm_bundle"] == "04_export_edgellm/bundle"
    bundle = int4_run / "04_export_edgellm" / "bundle" / "llm"
    for name in (
        "model.onnx",
        "model.onnx.data",
        "embedding.safetensors",
        "config.json",
        "tokenizer.json",
        "chat_template.jinja",
    ):
        assert (bundle / name).is_file(), name
    assert json.loads((bundle / "config.json").read_text())["edgellm_version"] == "0.11.0"
    metrics = next(s for s in report["stages"] if s["name"] == "export_edgellm")["metrics"]
    assert metrics["checkpoint"]["quant_algo"] == "W4A16_AWQ" and metrics["checkpoint"]["group_size"] == 128
    # 14 INT4 linears (weights and scales) compared; their 14 GEMM plugins and 2 attention plugins held against the
    # contract.
    assert metrics["custody"] == {
        "tensors_compared": 28,
        "mismatches": 0,
        "int4_plugin_version": 2,
        "kernel_nodes_checked": 16,
        "config_fields": metrics["custody"]["config_fields"],
    }
    assert "num_key_value_heads" in metrics["custody"]["config_fields"]
    # The unified checkpoint the bundle was exported from is gone once the bundle is checked (the quantized folder holds
    # its numbers), and the model was read in place: the run directory holds no second copy of either.
    assert metrics["checkpoint_kept"] is False and metrics["checkpoint_bytes"] > 0
    assert not (int4_run / "04_export_edgellm" / "checkpoint").exists()
    assert not list((int4_run / "01_load").glob("**/*.safetensors"))
    custody = json.loads((int4_run / "04_export_edgellm" / "custody.json").read_text())
    assert {c["tensor"] for c in custody["compared"]} >= {"_model.model.layers.1.mlp.down_proj.weight",
                                                          "_model.model.layers.1.mlp.down_proj.weight_scale"}
    ops = {node.op_type for node in onnx.load(bundle / "model.onnx", load_external_data=False).graph.node}
    assert "Int4GroupwiseGemmPluginV2" in ops and "AttentionPlugin" in ops
    manifest = json.loads((int4_run / "manifest.json").read_text())
    assert manifest["status"] == "finished"


def test_a_corrupted_scale_or_weight_in_the_bundle_is_caught_naming_the_tensor(int4_run, tmp_path):
    quantized = int4_run / "02_quantize" / "model"
    bundle = tmp_path / "bundle"
    shutil.copytree(int4_run / "04_export_edgellm" / "bundle", bundle)
    assert check_custody(quantized, bundle, tmp_path)["mismatches"] == []
    scale = "_model.model.layers.1.self_attn.v_proj.weight_scale"
    tamper_bundle(bundle, scale, lambda a: (a * np.float16(1.01)).astype(a.dtype))
    with pytest.raises(StageError, match=f"does not hold the measured numbers: {scale}: .* values differ"):
        check_custody(quantized, bundle, tmp_path)
    shutil.rmtree(bundle)
    shutil.copytree(int4_run / "04_export_edgellm" / "bundle", bundle)
    weight = "_model.model.layers.0.mlp.up_proj.weight"
    tamper_bundle(bundle, weight, lambda a: np.where(np.arange(a.size).reshape(a.shape) == 7, a ^ 1, a).astype(a.dtype))
    with pytest.raises(StageError, match=f"{weight}: 1 of .* values differ"):
        check_custody(quantized, bundle, tmp_path)


def test_verify_checks_the_bundles_custody_again_and_catches_a_tampered_bundle(capsys, int4_run, tmp_path):
    copy = shutil.copytree(int4_run, tmp_path / "run", ignore=shutil.ignore_patterns(".compress.lock"))
    assert main(["verify", str(copy)]) == 0
    assert "the Edge-LLM bundle holds the quantized numbers (28 tensors)" in capsys.readouterr().out
    tamper_bundle(copy / "04_export_edgellm" / "bundle", "_model.model.layers.0.mlp.up_proj.weight_scale",
                  lambda a: (a * np.float16(1.01)).astype(a.dtype))
    assert main(["verify", str(copy)]) == 2
    assert "04_export_edgellm/bundle/llm/model.onnx" in capsys.readouterr().out
    assert main(["build-engine", str(copy)]) == 2


def test_linears_left_float_beside_int4_ones_are_found_fused_and_transposed(tiny_wide, tmp_path):
    # q (128 x 128) and o (128 x 128) are square, so a transposed copy has the same shape; q, k and v left float are
    # fused by the exporter into one constant.
    out = tmp_path / "run"
    proc = _run(tiny_wide, out, "edgellm-int4", "quantize.float_linears=[q_proj,k_proj,v_proj,o_proj]")
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    custody = json.loads((out / "04_export_edgellm" / "custody.json").read_text())
    assert custody["mismatches"] == []
    compared = {c["tensor"] for c in custody["compared"]}
    assert any(
        t.startswith("_model.model.layers.1.self_attn.k_proj.weight (FP16, rows 128:192 of fused q|k|v")
        for t in compared
    )
    assert any(
        t.startswith("_model.model.layers.1.self_attn.o_proj.weight (FP16, ") and "no initializer" not in t
        for t in compared
    )
    assert "_model.model.layers.1.mlp.down_proj.weight" in compared


def test_a_bundle_config_that_does_not_describe_the_model_is_caught(int4_run, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(int4_run / "04_export_edgellm" / "bundle", bundle)
    model_config = json.loads((int4_run / "02_quantize" / "model" / "config.json").read_text())
    config_path = bundle / "llm" / "config.json"
    config = json.loads(config_path.read_text())
    config["num_key_value_heads"] = 4
    config_path.write_text(json.dumps(config))
    with pytest.raises(StageError, match="num_key_value_heads = 4, the model has 1"):
        check_bundle_config(bundle, model_config)


def test_int8_recipe_bundle_holds_our_integers_and_activation_scales(tiny_wide, tmp_path):
    """With a rotation folded into the weights and learned rounding on top: the bundle is a plain Llama bundle whose
    every tensor is ours (the custody check), the tied head untied, and the report says what was applied."""
    out = tmp_path / "run"
    proc = _run(tiny_wide, out, "edgellm-int8", "quantize.rotate=hadamard", "quantize.tune_iters=3")
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    quantized = json.loads((out / "02_quantize" / "stage.json").read_text())["metrics"]
    assert quantized["residual_rotation"] == {"kind": "hadamard", "lm_head_untied": True}
    assert quantized["learned_rounding"]["blocks"] == 2 and "learned rounding" in quantized["algorithm"]
    assert not json.loads((out / "02_quantize" / "model" / "config.json").read_text())["tie_word_embeddings"]
    metrics = json.loads((out / "04_export_edgellm" / "stage.json").read_text())["metrics"]
    assert metrics["checkpoint"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
    assert metrics["custody"]["tensors_compared"] >= 14 * 3 and metrics["custody"]["mismatches"] == 0
    custody = json.loads((out / "04_export_edgellm" / "custody.json").read_text())
    assert any("activation scale" in c["tensor"] and "k_proj" in c["tensor"] for c in custody["compared"])
    validate = json.loads((out / "06_validate" / "stage.json").read_text())["metrics"]
    assert validate["top1_agreement"] > 0.5 and validate["mean_kl"] >= 0


@pytest.mark.parametrize(
    ("recipe", "extra", "needle"),
    [
        ("edgellm-int8", ["quantize.hadamard_block=128"], "quantize.hadamard_block rotates down_proj inputs online"),
        (
            "edgellm-int4",
            [],
            "q_proj 576 x 576, k_proj 192 x 576, v_proj 192 x 576, o_proj 576 x 576, gate_proj 1536 x 576, "
            "up_proj 1536 x 576 (out x in): Edge-LLM 0.11.0 takes INT4 linears with N and K multiples of 64",
        ),
        (
            "edgellm-int4",
            ["quantize.group_size=64"],
            "quantize.group_size=64, and Edge-LLM 0.11.0 takes INT4 weights in groups of 128",
        ),
        (
            "edgellm-int8",
            ["quantize.method=fp8", "target=jetson-agx-thor", "quantize.fp8_weight_scale=channel"],
            "Edge-LLM takes FP8 linears with one weight scale per tensor",
        ),
    ],
)
def test_what_edgellm_cannot_express_is_refused_before_any_work(capsys, tmp_path, recipe, extra, needle):
    out = tmp_path / "run"
    target = next((e for e in extra if e.startswith("target=")), "target=jetson-orin")
    extra = [e for e in extra if not e.startswith("target=")]
    assert main(["run", target, f"recipe={recipe}", f"out={out}", *extra]) == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_sparse_models_and_other_families_are_refused(capsys, tmp_path, tiny_wide):
    recipe = tmp_path / "sparse-edgellm.yaml"
    recipe.write_text(
        "name: sparse-edgellm\nstages:\n  - load\n  - sparsify\n  - export_onnx\n  - export_edgellm\n  - validate\n"
    )
    assert main(["run", "target=jetson-orin", f"recipe={recipe}", f"model={tiny_wide}", f"out={tmp_path / 'a'}"]) == 2
    assert "Edge-LLM builds engines without sparse weights" in capsys.readouterr().err
    other = tmp_path / "other"
    shutil.copytree(tiny_wide, other)
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "mistral"
    (other / "config.json").write_text(json.dumps(config))
    assert main(["run", "target=jetson-orin", "recipe=edgellm-int4", f"model={other}", f"out={tmp_path / 'b'}"]) == 2
    assert (
        "model_type 'mistral' is not supported for Edge-LLM deployment (supported: llama, phi3, qwen2, qwen3)"
        in capsys.readouterr().err
    )


def test_attention_shapes_and_head_pruning_edgellm_cannot_run_are_refused(capsys, tmp_path):
    narrow_heads = build_tiny_llama(tmp_path / "d32", layers=1, hidden=128, heads=4, kv_heads=2, intermediate=256)
    assert (
        main(["run", "target=jetson-orin", "recipe=edgellm-int8", f"model={narrow_heads}", f"out={tmp_path / 'a'}"])
        == 2
    )
    assert (
        "head_dim 32 has no prefill attention kernel in Edge-LLM 0.11.0, which takes attention head sizes 64, 128, "
        "256, 512"
        in capsys.readouterr().err
    )
    with pytest.raises(UsageError, match="12 query heads cannot share 5 KV heads evenly"):
        check_attention_shape({"num_attention_heads": 12, "num_key_value_heads": 5, "hidden_size": 768})
    recipe = tmp_path / "pruned-edgellm.yaml"
    recipe.write_text(
        "name: pruned-edgellm\nstages:\n  - load\n  - prune_heads\n  - quantize\n  - export_onnx\n  - export_edgellm\n"
    )
    assert main(["run", "target=jetson-orin", f"recipe={recipe}", f"out={tmp_path / 'b'}"]) == 2
    assert "prune_heads.mode=per_layer keeps a different set of heads in each layer" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_phi3_fused_projections_are_checked_part_by_part(tmp_path):
    """Phi-3 stores q/k/v and gate/up fused; Edge-LLM splits them on load, so custody compares each part's rows."""
    folder = build_tiny_llama(
        tmp_path / "phi3",
        layers=2,
        hidden=128,
        heads=2,
        kv_heads=1,
        intermediate=256,
        chat_template=True,
        family="phi3",
    )
    out = tmp_path / "run"
    proc = _run(folder, out, "edgellm-int4")
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    custody = json.loads((out / "04_export_edgellm" / "stage.json").read_text())["metrics"]["custody"]
    assert custody["tensors_compared"] == 14 * 2 and custody["mismatches"] == 0
    assert "partial_rotary_factor" in custody["config_fields"]
    quantized, bundle = out / "02_quantize" / "model", tmp_path / "bundle"
    shutil.copytree(out / "04_export_edgellm" / "bundle", bundle)
    scale = "_model.model.layers.0.self_attn.k_proj.weight_scale"
    tamper_bundle(bundle, scale, lambda a: (a * np.float16(1.01)).astype(a.dtype))
    with pytest.raises(StageError, match=f"{scale}: .* values differ"):
        check_custody(quantized, bundle, tmp_path)
    config_path = bundle / "llm" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "partial_rotary_factor": 1.0}))
    with pytest.raises(StageError, match="partial_rotary_factor = 1.0, the model has 0.5"):
        check_bundle_config(bundle, json.loads((quantized / "config.json").read_text()))


def test_qwen2_biases_are_part_of_the_chain_of_custody(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_llama(
        tmp_path / "qwen2",
        layers=2,
        hidden=128,
        heads=2,
        kv_heads=1,
        intermediate=256,
        chat_template=True,
        family="qwen2",
    )
    model = AutoModelForCausalLM.from_pretrained(folder)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):  # transformers starts biases at zero, which would all share one initializer
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    model.save_pretrained(folder)
    out = tmp_path / "run"
    proc = _run(folder, out, "edgellm-int8")
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    custody = json.loads((out / "04_export_edgellm" / "stage.json").read_text())["metrics"]["custody"]
    assert custody["tensors_compared"] == 14 * 3 + 6 and custody["mismatches"] == 0
    bundle = tmp_path / "bundle"
    shutil.copytree(out / "04_export_edgellm" / "bundle", bundle)
    bias = "_model.model.layers.1.self_attn.v_proj.bias"
    tamper_bundle(bundle, bias, lambda a: (a + np.float16(0.01)).astype(a.dtype))
    with pytest.raises(StageError, match=f"model.layers.1.self_attn.v_proj bias \\({bias}\\): .* values differ"):
        check_custody(out / "02_quantize" / "model", bundle, tmp_path)


def test_a_group_size_the_kernels_do_not_take_is_caught_by_custody_naming_the_node(tiny_wide, tmp_path):
    """The portable int4 recipe quantizes in groups of 64; forced into a bundle past the plan check, the exporter writes
    it (it passes group_size through), the numbers match, and the contract check on the plugin nodes catches it."""
    from compress.backends.edgellm.bundle import export_bundle

    out = tmp_path / "run"
    proc = _run(tiny_wide, out, "int4", "quantize.group_size=64")
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(
        StageError,
        match=r"would misread: node \S+ \(Int4GroupwiseGemmPluginV2, _model\.model\.layers\.\d\.\S+\.weight\): "
        r"group_size=64; the kernels take INT4 weights in groups of 128 input channels only",
    ):
        export_bundle(out / "02_quantize" / "model", work)
    custody = json.loads((work / "custody.json").read_text())
    assert custody["mismatches"] == []  # the numbers are ours; it is their reading that is wrong


@pytest.mark.parametrize(("rule", "model", "extra"), [
    ("int4-group-size", "default", ["recipe=edgellm-int4", "quantize.group_size=64"]),
    ("int4-alignment", "default", ["recipe=edgellm-int4"]),
    ("online-rotation", "default", ["recipe=edgellm-int8", "quantize.hadamard_block=128"]),
    ("fp8-weight-scale", "default", ["target=jetson-agx-thor", "recipe=thor-fp8", "quantize.fp8_weight_scale=channel"]),
    ("int4-kv-cache", "default", ["target=jetson-agx-thor", "recipe=edgellm-int4", "quantize.kv_cache=fp8"]),
    ("head-size", "head_dim_32", ["recipe=edgellm-int8"]),
    ("one-head-count", "default", ["recipe=pruned-edgellm.yaml"]),
    ("model-type", "mistral", ["recipe=edgellm-int8"]),
    ("uniform-layers", "qwen3", ["recipe=edgellm-int8"]),
    ("sliding-window", "qwen3_sliding", ["recipe=edgellm-int8"]),
])
def test_each_contract_rule_refuses_a_plan_that_breaks_it(capsys, tmp_path, tiny_wide, rule, model, extra):
    from compress.backends.edgellm.contracts import RULES

    models = {
        "default": [],
        "head_dim_32": [f"model={build_tiny_llama(tmp_path / 'd32', layers=1, hidden=128, heads=4, kv_heads=2)}"],
    }
    if model in ("mistral", "qwen3"):
        mixed = {
            "sliding_window": 8192,
            "use_sliding_window": True,
            "layer_types": ["sliding_attention", "full_attention"],
        }
        folder = build_tiny_llama(
            tmp_path / model,
            layers=2,
            hidden=128,
            heads=2,
            kv_heads=1,
            intermediate=256,
            family=model,
            **(mixed if model == "qwen3" else {}),
        )
        models[model] = [f"model={folder}"]
    if (
        model == "qwen3_sliding"
    ):  # every layer slides over 512 tokens: one layer type, a window shorter than Orin's 2048
        folder = build_tiny_llama(
            tmp_path / model,
            layers=2,
            hidden=128,
            heads=2,
            kv_heads=1,
            intermediate=256,
            family="qwen3",
            sliding_window=512,
            use_sliding_window=True,
            layer_types=["sliding_attention"] * 2,
        )
        models[model] = [f"model={folder}"]
    (tmp_path / "pruned-edgellm.yaml").write_text(
        "name: pruned-edgellm\nstages:\n  - load\n  - prune_heads\n  - quantize\n  - export_onnx\n  - export_edgellm\n"
    )
    extra = [f"recipe={tmp_path / 'pruned-edgellm.yaml'}" if e == "recipe=pruned-edgellm.yaml" else e for e in extra]
    target = next((e for e in extra if e.startswith("target=")), "target=jetson-orin")
    words = [e for e in extra if not e.startswith("target=")]
    assert main(["run", target, *models[model], *words, f"out={tmp_path / 'run'}"]) == 2
    assert RULES[rule].rule.split(" (")[0] in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_uniform_head_pruning_ships_and_computes_what_masked_heads_compute(tmp_path, family):
    """Every layer keeps the same heads (by summed importance), so the bundle's one num_attention_heads describes it."""
    from transformers import AutoModelForCausalLM

    folder = build_tiny_llama(
        tmp_path / family,
        layers=2,
        hidden=128,
        heads=4,
        kv_heads=2,
        intermediate=256,
        chat_template=True,
        family=family,
        head_dim=64,
    )
    recipe = tmp_path / "pruned.yaml"
    recipe.write_text(
        "name: pruned\nstages:\n  - load\n  - prune_heads:\n      fraction: 0.5\n      mode: uniform\n"
        "      calib_window: 64\n      min_calib_tokens: 128\n  - quantize:\n      method: int8\n  - export_onnx\n"
        "  - export_edgellm\n"
    )
    out = tmp_path / "run"
    proc = run_compress(
        "run",
        "target=jetson-orin",
        f"recipe={recipe}",
        f"model={folder}",
        f"out={out}",
        *QUANTIZE_SMALL,
        "export_onnx.parity_new_tokens=4",
    )
    assert proc.returncode == 3, proc.stderr[-3000:]  # no validate stage: the gate is not measured
    kept = json.loads((out / "02_prune_heads" / "stage.json").read_text())["metrics"]["heads_kept_per_layer"]
    assert kept[0] == kept[1] and len(kept[0]) == 2  # one head kept in each of the 2 KV groups, the same in both layers
    bundled = json.loads((out / "05_export_edgellm" / "bundle" / "llm" / "config.json").read_text())
    assert bundled["num_attention_heads"] == 2 and bundled["num_key_value_heads"] == 2 and bundled["head_dim"] == 64
    assert json.loads((out / "05_export_edgellm" / "stage.json").read_text())["metrics"]["custody"]["mismatches"] == 0

    full = AutoModelForCausalLM.from_pretrained(folder).eval()
    pruned = AutoModelForCausalLM.from_pretrained(out / "02_prune_heads" / "model").eval()
    dropped = [h for h in range(4) if h not in kept[0]]

    def mask(_module, args):
        x = args[0].clone()
        for head in dropped:
            x[..., head * 64:(head + 1) * 64] = 0
        return (x,)

    for layer in full.model.layers:
        layer.self_attn.o_proj.register_forward_pre_hook(mask)
    ids = torch.randint(0, 400, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(pruned(ids).logits, full(ids).logits, rtol=1e-5, atol=1e-5)
