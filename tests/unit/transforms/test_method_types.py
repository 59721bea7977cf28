"""A quantize method is a type: callers ask its config, and no module outside the config compares a method's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from compress.transforms.quantize.config import (
    METHODS,
    AutoConfig,
    Fp8Config,
    Int4Config,
    Int8Config,
    Nvfp4Config,
    quantize_config,
)

PACKAGE = Path(__file__).resolve().parents[3] / "compress"
CONFIG = PACKAGE / "transforms" / "quantize" / "config.py"


def _names_a_method(node: ast.AST) -> bool:
    values = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return any(isinstance(v, ast.Constant) and v.value in METHODS for v in values)


def _reads_method(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "method") or (
        isinstance(node, ast.Name) and node.id == "method"
    )


def _method_comparisons(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_reads_method(side) for side in sides) and any(_names_a_method(side) for side in sides):
                lines.append(node.lineno)
    return lines


def test_no_module_outside_the_config_compares_a_quantize_method_s_name():
    found = {str(path.relative_to(PACKAGE)): lines for path in PACKAGE.rglob("*.py")
             if path != CONFIG and (lines := _method_comparisons(path))}
    assert not found


def test_the_checker_finds_a_comparison_when_there_is_one(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('def f(config):\n    return config.method == "auto" or config.method in ("int8", "fp8")\n')
    assert _method_comparisons(module) == [2, 2]


def test_a_plan_answers_for_its_candidate_formats():
    auto = quantize_config(method="auto", formats=["int8", "nvfp4"])
    assert isinstance(auto, AutoConfig) and auto.is_mixed()
    assert auto.candidate_precisions() == ["int8", "nvfp4"]
    int8, nvfp4 = auto.uniform_configs()
    assert isinstance(int8, Int8Config) and isinstance(nvfp4, Nvfp4Config) and nvfp4.precision().name == "nvfp4"
    assert quantize_config(method="auto").candidate_precisions() is None  # every format the target deploys
    with pytest.raises(ValueError, match="no single precision"):
        auto.precision()


@pytest.mark.parametrize(("options", "smooths", "global_scale", "precision"), [
    ({"method": "int8"}, True, False, "int8"),
    ({"method": "fp8"}, True, False, "fp8"),
    ({"method": "int4", "group_size": 128}, False, False, "int4"),
    ({"method": "nvfp4"}, False, True, "nvfp4_a16"),
    ({"method": "nvfp4", "activations": "nvfp4"}, False, True, "nvfp4"),
    ({"method": "rtn", "bits": 8}, False, False, "int8"),
])
def test_each_uniform_method_answers_for_itself(options, smooths, global_scale, precision):
    config = quantize_config(**options)
    assert not config.is_mixed() and config.uniform_configs() == [config]
    assert config.candidate_precisions() == [precision]
    assert config.smooths_activations() is smooths and config.binds_global_scale() is global_scale
    assert config.describe() and config.algorithm_name()


def test_the_report_words_follow_the_options():
    assert (
        quantize_config(method="fp8", fp8_weight_scale="channel")
        .describe()
        .startswith("FP8 E4M3 weights (one scale per output channel)")
    )
    assert "group 128" in Int4Config(group_size=128).describe()
    assert Nvfp4Config(nvfp4_scale_search=False).algorithm_name() == "awq+gptq"
    assert Nvfp4Config().algorithm_name() == "awq+gptq+global-scale-search" and Nvfp4Config().searches_global_scale()
    assert Fp8Config(weight_algorithm="rtn").algorithm_name() == "smoothquant+rtn"
    assert (
        Int4Config(clip_tokens="all").clip_on_all_tokens()
        and not Int4Config(algorithm="gptq", clip_tokens="all").clip_on_all_tokens()
    )
