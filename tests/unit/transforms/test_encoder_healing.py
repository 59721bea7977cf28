"""Healing a pruned encoder by embedding distillation, on the real all-MiniLM-L6-v2 (a quarter of its heads pruned)."""

from __future__ import annotations

import pytest
import torch

from compress.core.text import DEFAULT_CALIBRATION, calibration_batches, load_calibration
from compress.models.sources import resolve_model
from compress.transforms.distill.encoder import DistillEncoderConfig, heal_encoder, pooled_cosine
from compress.transforms.prune.encoder_heads import encoder_head_importance, plan_encoder_heads


@pytest.fixture(scope="module")
def pruned_and_teacher():
    from transformers import AutoModel, AutoTokenizer

    from compress.models.pruned_bert import prune_encoder_heads

    source = resolve_model("all-minilm-l6-v2")
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    teacher = AutoModel.from_pretrained(source.path).eval()
    student = AutoModel.from_pretrained(source.path).eval()
    batches = calibration_batches(tokenizer, load_calibration(DEFAULT_CALIBRATION), 160, 16, 64)
    prune_encoder_heads(student, plan_encoder_heads(encoder_head_importance(student, batches[:4]), 0.25))
    return student, teacher, batches


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_healing_raises_the_held_out_cosine_and_keeps_the_best_weights(pruned_and_teacher):
    student, teacher, batches = pruned_and_teacher
    start = _state(student)
    healed = heal_encoder(student, teacher, batches, DistillEncoderConfig(steps=24, lr=1e-4, eval_every=8),
                          progress=False)
    assert healed["held_out_cosine_after"] > healed["held_out_cosine_before"] + 0.005, healed
    # the weights kept are those of the best evaluation, which the model now reproduces
    held_out = batches[-1:]
    with torch.no_grad():
        targets = [teacher(**b).last_hidden_state.float() for b in held_out]
    assert pooled_cosine(student, held_out, targets) == pytest.approx(healed["held_out_cosine_after"], abs=1e-4)
    assert max(row["held_out_cosine"] for row in healed["history"]) == pytest.approx(
        healed["held_out_cosine_after"], abs=1e-6)
    student.load_state_dict(start)


def test_healing_never_returns_worse_weights_than_it_started_from(pruned_and_teacher):
    student, teacher, batches = pruned_and_teacher
    start = _state(student)
    # a step size that only does harm: the pruned start is kept
    healed = heal_encoder(student, teacher, batches, DistillEncoderConfig(steps=4, lr=0.5, eval_every=2),
                          progress=False)
    assert healed["held_out_cosine_after"] == healed["held_out_cosine_before"]
    assert all(torch.equal(start[k], v) for k, v in student.state_dict().items())
