"""The kernel-contract check on a bundle's plugin nodes: each rule, on the nodes as the custody check reads them."""

from __future__ import annotations

import pytest

from compress.backends.edgellm.contracts import (
    RULES,
    check_kernel_nodes,
    check_mixed_plan,
    int4_shape_ok,
    mixed_format_sets,
)
from compress.core.errors import UsageError


def _gemm(n=128, k=256, group=128, scales=None, weights=None, op="Int4GroupwiseGemmPluginV2"):
    shapes = {"2": scales or [k // group, n], "1": weights or [-(-n // 128) * -(-k // 64) * 8, 512]}
    return {"name": "n7", "op_type": op, "attributes": {"gemm_n": n, "gemm_k": k, "group_size": group},
            "initializer_shapes": shapes, "weight": "_model.model.layers.0.mlp.down_proj.weight"}


def _attention(heads=2, kv=1, head_size=64, name="n5"):
    return {
        "name": name,
        "op_type": "AttentionPlugin",
        "attributes": {"num_q_heads": heads, "num_kv_heads": kv, "head_size": head_size},
        "initializer_shapes": {},
    }


def test_nodes_the_kernels_take_pass():
    assert check_kernel_nodes([_gemm(), _gemm(n=64, k=128), _gemm(op="Int4GroupwiseGemmPlugin", weights=[64, 256]),
                               _attention(), _attention(name="n9")]) == []


@pytest.mark.parametrize(("node", "rule", "needle"), [
    (_gemm(group=64), "int4-group-size", "group_size=64"),
    (_gemm(k=192, group=128, scales=[1, 128]), "int4-alignment", "gemm_k=192"),
    (_gemm(n=96), "int4-alignment", "gemm_n=96"),
    (_gemm(scales=[4, 128]), "int4-scale-layout", "scales [4, 128], not [2, 128]"),
    (_gemm(weights=[16, 512]), "int4-scale-layout", "weights [16, 512], not the fragment layout"),
    (_attention(head_size=32), "head-size", "head_size=32"),
    (_attention(heads=3, kv=2), "gqa", "3 query heads over 2 KV heads"),
])
def test_a_node_the_kernels_would_misread_is_named_with_its_rule(node, rule, needle):
    problems = check_kernel_nodes([node])
    assert len(problems) == 1 and problems[0].startswith(f"node {node['name']} ({node['op_type']}")
    assert needle in problems[0] and RULES[rule].rule in problems[0]


def test_layers_with_other_head_counts_are_caught():
    problems = check_kernel_nodes([_attention(heads=2), _attention(heads=4, kv=2, name="n9")])
    assert problems == [f"attention plugins with [2, 4] query heads; Edge-LLM takes {RULES['one-head-count']}"]


def test_int4_shapes_follow_the_group_and_the_tiles():
    assert int4_shape_ok(64, 128) and int4_shape_ok(1536, 1536)
    assert not int4_shape_ok(576, 576) and not int4_shape_ok(96, 128) and not int4_shape_ok(128, 64)


def test_every_rule_cites_where_it_was_read():
    assert all(rule.source and rule.rule for rule in RULES.values())


def test_nvfp4_is_kept_apart_from_the_integer_formats_in_one_bundle():
    assert mixed_format_sets(["int8", "int4", "fp8", "nvfp4"]) == [("int8", "int4", "fp8"), ("fp8", "nvfp4")]
    assert mixed_format_sets(["int8", "int4"]) == [("int8", "int4")]
    assert mixed_format_sets(["nvfp4", "int4"]) == [("nvfp4",), ("int4",)]
    check_mixed_plan(["fp8", "nvfp4", "fp16"])
    with pytest.raises(UsageError, match="mixes int4 and nvfp4"):
        check_mixed_plan(["int4", "fp8", "nvfp4"])
