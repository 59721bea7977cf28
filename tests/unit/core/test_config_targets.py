"""Targets and recipes are validated data; overrides are typed."""

from __future__ import annotations

import pytest
import yaml

from compress.core.config import Recipe, available_recipes, available_targets, load_recipe, load_target, parse_target
from compress.core.errors import UsageError
from compress.pipeline.plan import RunOptions, build_plan
from compress.pipeline.stage import all_stages


@pytest.mark.parametrize("name", sorted(available_targets()))
def test_every_shipped_target_validates(name):
    target = load_target(name)
    assert target.budgets.max_memory_gb <= target.memory_gb
    assert target.power_mode().name == target.default_power_mode


def test_required_targets_and_alias():
    names = set(available_targets())
    assert {"jetson-orin-nano-8gb", "jetson-orin-nx-16gb", "jetson-agx-orin-64gb", "rtx-4090"} <= names
    assert load_target("jetson-orin").name == "jetson-orin-nano-8gb"
    nano = load_target("jetson-orin-nano-8gb")
    assert "MAXN_SUPER" in [m.name for m in nano.power_modes]
    assert nano.gpu.sm == 87 and "fp8" not in nano.gpu.precisions and nano.dla_count == 0


def _target_data():
    from compress.core.config import available_targets as files

    return yaml.safe_load(files()["jetson-orin-nano-8gb"].read_text())


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.update(colour="red"), "colour: unknown key"),
        (lambda d: d["budgets"].update(max_ppl_increase_pct=-1), "max_ppl_increase_pct"),
        (lambda d: d["budgets"].pop("max_memory_gb"), "max_memory_gb"),
        (lambda d: d.update(memory_bandwidth_gbps="fast"), "memory_bandwidth_gbps"),
        (lambda d: d.update(default_power_mode="TURBO"), "default_power_mode"),
        (lambda d: d["gpu"].update(precisions=["fp16", "fp3"]), "precisions"),
        (lambda d: d.update(int8_tops_sparse=1), "int8_tops_sparse"),
    ],
)
def test_target_rejects_bad_values(mutate, needle):
    data = _target_data()
    mutate(data)
    with pytest.raises(UsageError, match=needle):
        parse_target(data, "test")


def test_recipes_reference_registered_stages_in_a_valid_order():
    stages = all_stages()
    assert {"default", "baseline", "smoke"} <= set(available_recipes())
    for name in available_recipes():
        recipe = load_recipe(name)
        assert all(spec.name in stages for spec in recipe.stages)
        encoder = name.startswith("encoder-")
        # FP8 and NVFP4 need Thor's tensor cores
        target = (
            "jetson-agx-thor" if name.startswith("thor-") else "jetson-orin"
        )
        # On the embedded model Edge-LLM's INT4 kernels (groups of 128) take only down_proj's 1536-wide input.
        group_128 = any(spec.options.get("group_size") == 128 for spec in recipe.stages)
        overrides = {"quantize.float_linears": "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj]"} if group_128 else {}
        build = build_plan(
            RunOptions(
                target=target,
                recipe=name,
                model="all-minilm-l6-v2" if encoder else "smollm2-135m-instruct",
                overrides=overrides,
            )
        )
        assert build.stages[-1].stage.name == ("validate_encoder" if encoder else "validate")


def test_recipe_short_forms():
    recipe = Recipe.model_validate(
        {"name": "x", "stages": ["load", {"export_onnx": {"opset": 17}}, {"name": "validate"}]}
    )
    assert [s.name for s in recipe.stages] == ["load", "export_onnx", "validate"]
    assert recipe.stages[1].options == {"opset": 17}


def test_plan_refuses_wrong_stage_order(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nstages: [load, build_engine]\n")
    with pytest.raises(
        UsageError, match="stage build_engine takes edgellm-bundle or onnx but the step before it gives hf-model"
    ):
        build_plan(RunOptions(target="jetson-orin", recipe=str(bad)))


def test_override_values_are_typed():
    plan = build_plan(RunOptions.from_pairs({"target": "jetson-orin", "recipe": "smoke", "validate.eval_tokens": "2048",
                                             "budgets.max_ttft_ms": "250.5"}))
    validate = plan.stages[-1].config
    assert validate.eval_tokens == 2048
    assert plan.target.budgets.max_ttft_ms == 250.5


def test_a_targets_default_recipe_exists():
    for name in available_targets():
        target = load_target(name)
        if target.default_recipe is not None:
            assert target.default_recipe.name in available_recipes() and target.default_recipe.why
