"""The encoder path on the real all-MiniLM-L6-v2: ONNX export, parity with torch, dynamic padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.backends.onnx.encoder import ENCODER_FILE, OnnxEncoder, export_encoder, mean_pool
from compress.models.sources import BUILTIN_MODELS, resolve_model

SENTENCES = [
    "The robot arm picks up the red block.",
    "Stop.",
    "Emma was handsome, clever, and rich, with a comfortable home.",
    "Navigate to the charging dock and wait for instructions from the operator.",
]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    from transformers import AutoModel, AutoTokenizer

    source = resolve_model("all-minilm-l6-v2")
    assert BUILTIN_MODELS["all-minilm-l6-v2"].license == "MIT"
    model = AutoModel.from_pretrained(source.path).eval()
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    folder = tmp_path_factory.mktemp("minilm")
    export_encoder(model, folder / ENCODER_FILE)
    tokenizer.save_pretrained(folder)
    return model, tokenizer, folder


def test_onnx_embeddings_match_torch(minilm):
    model, tokenizer, folder = minilm
    encoder = OnnxEncoder(folder)
    onnx_embeddings = encoder.embed(SENTENCES, batch_size=3)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.numpy()
    reference = mean_pool(hidden, batch["attention_mask"].numpy())
    assert onnx_embeddings.shape == (4, 384)
    cosine = (onnx_embeddings * reference).sum(axis=1)
    assert cosine.min() > 0.9999
    similar = onnx_embeddings[0] @ onnx_embeddings[3]
    unrelated = onnx_embeddings[1] @ onnx_embeddings[2]
    assert similar > unrelated


def test_batches_are_padded_to_their_longest_sentence(minilm):
    _, tokenizer, folder = minilm
    encoder = OnnxEncoder(folder)
    encoder.embed(["Stop.", "Go."], batch_size=2)
    assert encoder.last_batch_width == max(len(tokenizer(s).input_ids) for s in ["Stop.", "Go."])
    padded_alone = encoder.embed(["Stop."], batch_size=1)
    padded_with_long = encoder.embed(["Stop.", SENTENCES[3]], batch_size=2)[:1]
    np.testing.assert_allclose(padded_alone, padded_with_long, atol=1e-5)


def test_encoder_head_pruning_through_onnx(minilm, tmp_path):
    import copy

    from compress.models.pruned_bert import load_pruned_encoder, prune_encoder_heads, save_pruned_encoder
    from compress.transforms.prune.encoder_heads import encoder_head_importance, plan_encoder_heads

    model, tokenizer, _ = minilm
    batch = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    scores = encoder_head_importance(model, [batch])
    assert scores.shape == (6, 12) and (scores > 0).all()
    plan = plan_encoder_heads(scores, 0.25)
    assert all(len(kept) == 9 for kept in plan)
    head_size = 32
    masked = copy.deepcopy(model)
    handles = []
    for layer, kept in zip(masked.encoder.layer, plan, strict=True):
        mask = torch.zeros(384)
        for h in kept:
            mask[h * head_size:(h + 1) * head_size] = 1
        handles.append(
            layer.attention.output.dense.register_forward_pre_hook(lambda _m, args, mask=mask: (args[0] * mask,))
        )
    with torch.no_grad():
        reference = masked(**batch).last_hidden_state
    pruned = copy.deepcopy(model)
    prune_encoder_heads(pruned, plan)
    assert pruned.encoder.layer[0].attention.self.query.out_features == 9 * head_size
    with torch.no_grad():
        torch.testing.assert_close(pruned(**batch).last_hidden_state, reference, atol=1e-4, rtol=1e-4)
    save_pruned_encoder(pruned, tokenizer, plan, tmp_path / "pruned")
    from transformers import AutoModel

    reloaded = AutoModel.from_pretrained(tmp_path / "pruned").eval()
    assert reloaded.encoder.layer[0].attention.self.query.out_features == 9 * head_size
    assert reloaded.config.heads_kept_per_layer == plan
    assert load_pruned_encoder(tmp_path / "pruned").encoder.layer[5].attention.output.dense.in_features == 9 * head_size
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).last_hidden_state, reference, atol=1e-4, rtol=1e-4)
    export_encoder(reloaded, tmp_path / "pruned" / ENCODER_FILE)
    onnx_embeddings = OnnxEncoder(tmp_path / "pruned").embed(SENTENCES, batch_size=4)
    torch_embeddings = mean_pool(reference.numpy(), batch["attention_mask"].numpy())
    assert (onnx_embeddings * torch_embeddings).sum(axis=1).min() > 0.9999
