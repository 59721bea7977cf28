"""A rotation folded into the weights leaves the float model's logits unchanged (float32 round-off), per family; a
family whose blocks normalise a branch's output before the residual add is refused by name."""

from __future__ import annotations

import pytest
import torch

from compress.core.errors import UsageError
from compress.models.families import decoder_blocks, final_norm
from compress.models.loading import load_causal_lm
from compress.transforms.rotate import ResidualRotation, rotate_model
from tests.conftest import build_tiny_llama


def _with_trained_looking_norms(model) -> None:
    """Norm weights and biases away from their initial ones and zeros, so folding them is tested."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                parameter.copy_(0.5 + torch.rand(parameter.shape, generator=generator))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3"])
def test_the_rotated_float_model_computes_the_same_logits(tmp_path, family):
    folder = build_tiny_llama(tmp_path / family, layers=2, hidden=96, heads=4, kv_heads=2, intermediate=160,
                              family=family)
    model = load_causal_lm(folder)
    _with_trained_looking_norms(model)
    tokens = torch.randint(0, 400, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(tokens).logits
    untied = rotate_model(model, ResidualRotation.for_config(model.config))
    with torch.no_grad():
        after = model(tokens).logits
    assert untied and not model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    scale = float(before.abs().max())
    assert float((after - before).abs().max()) <= 1e-4 * scale
    # the rotation moved the weights: the norms read one, the embedding rows are no longer the original ones
    assert all(float(block.input_layernorm.weight.sub(1).abs().max()) == 0 for block in decoder_blocks(model))
    assert float(final_norm(model).weight.sub(1).abs().max()) == 0


def test_a_family_with_post_norms_is_refused_by_name(tmp_path):
    folder = build_tiny_llama(tmp_path / "gemma", layers=2, hidden=64, heads=4, kv_heads=1, family="gemma3")
    with pytest.raises(UsageError, match="gemma3_text normalises each branch's output"):
        ResidualRotation.for_config(load_causal_lm(folder).config)
