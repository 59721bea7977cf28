"""Head pruning: removing heads physically equals zeroing their outputs; GQA stays consistent; plain reload works."""

from __future__ import annotations

import json

import pytest
import torch

from compress.cli.main import main
from compress.core.errors import UsageError
from compress.models.surgery import prune_heads
from compress.transforms.prune.heads import PruneHeadsConfig, head_importance, heads_per_group_to_keep, plan_heads
from tests.conftest import TINY_SMOKE, build_tiny_llama


@pytest.fixture(scope="module")
def llama6(tmp_path_factory):
    """6 query heads over 2 KV heads (3 per group), so pruning has choices inside each group."""
    return build_tiny_llama(
        tmp_path_factory.mktemp("h6") / "m", layers=2, hidden=96, heads=6, kv_heads=2, intermediate=128
    )


def _zero_heads_hooks(model, plan, heads, head_dim):
    handles = []
    for block, kept in zip(model.model.layers, plan, strict=True):
        mask = torch.zeros(heads * head_dim)
        for h in kept:
            mask[h * head_dim:(h + 1) * head_dim] = 1

        def hook(_module, args, mask=mask):
            return (args[0] * mask,)

        handles.append(block.self_attn.o_proj.register_forward_pre_hook(hook))
    return handles


def test_physical_pruning_equals_masked_original(llama6, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama6).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    plan = [[0, 2, 3, 5], [1, 2, 4, 5]]  # two heads per group in both layers, different heads per layer
    handles = _zero_heads_hooks(model, plan, 6, 16)
    with torch.no_grad():
        masked = model(ids).logits
    for handle in handles:
        handle.remove()
    prune_heads(model, plan)
    with torch.no_grad():
        pruned = model(ids).logits
    torch.testing.assert_close(pruned, masked, atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path / "pruned")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned").eval()
    assert reloaded.config.num_attention_heads == 4 and reloaded.config.num_key_value_heads == 2
    assert reloaded.model.layers[0].self_attn.q_proj.out_features == 4 * 16
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, masked, atol=1e-5, rtol=1e-5)


def test_plan_is_gqa_consistent_and_follows_importance():
    scores = torch.tensor([[5.0, 1.0, 3.0, 0.5, 9.0, 2.0], [0.1, 0.2, 0.3, 0.6, 0.5, 0.4]])
    plan = plan_heads(scores, kv_heads=2, keep_per_group=2)
    assert plan == [[0, 2, 4, 5], [1, 2, 3, 4]]
    for kept in plan:
        assert sum(h < 3 for h in kept) == 2 and sum(h >= 3 for h in kept) == 2
    assert plan_heads(scores, kv_heads=2, keep_per_group=1) == [[0, 4], [2, 3]]


def test_keep_count_from_fraction_or_parameters(llama6):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(llama6)
    assert heads_per_group_to_keep(config, PruneHeadsConfig(fraction=0.25), lambda k: 0) == 2
    assert heads_per_group_to_keep(config, PruneHeadsConfig(fraction=0.5), lambda k: 0) == 1
    assert heads_per_group_to_keep(config, PruneHeadsConfig(fraction=0.9), lambda k: 0) == 1  # never the last head
    by_params = PruneHeadsConfig(target_parameters=1000)
    assert heads_per_group_to_keep(config, by_params, lambda k: 900 + 100 * k) == 1
    with pytest.raises(UsageError, match="cannot be reached"):
        heads_per_group_to_keep(config, by_params, lambda k: 5000 + k)


def test_taylor_importance_prefers_heads_that_matter(llama6):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama6).eval()
    with torch.no_grad():  # silence head 1 of layer 0: its o_proj columns are zero, so it cannot matter
        model.model.layers[0].self_attn.o_proj.weight[:, 16:32] = 0
    windows = torch.randint(0, model.config.vocab_size, (2, 32))
    scores = head_importance(model, windows, "taylor")
    assert scores.shape == (2, 6)
    assert scores[0, 1] < 1e-9 < scores[0].max()


def test_prune_heads_recipe_end_to_end(llama6, tmp_path):
    out = tmp_path / "run"
    code = main(["run", "target=jetson-orin", "recipe=prune-heads", f"model={llama6}", f"out={out}", *TINY_SMOKE,
                 "prune_heads.calib_window=128", "prune_heads.calib_windows=4", "prune_heads.min_calib_tokens=256"])
    assert code in (0, 1)
    report = json.loads((out / "report.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    metrics = stages["prune_heads"]["metrics"]
    assert metrics["heads_after"] == 4 and len(metrics["heads_kept_per_layer"]) == 2
    assert metrics["parameters"] < metrics["parameters_before"]
    assert stages["export_onnx"]["metrics"]["parity"]["greedy_match"]
