"""A checkpoint read by name, one part at a time, and a model built empty around it."""

from __future__ import annotations

import pytest
import torch

from compress.core.errors import UsageError
from compress.models.families import decoder_blocks
from compress.models.loading import load_causal_lm, load_tokenizer, save_model_folder
from compress.models.weights import (
    CheckpointReader,
    empty_causal_lm,
    is_materialized,
    materialize,
    module_prefix,
    release,
)


@pytest.fixture(scope="module")
def sharded(tiny_llama, tmp_path_factory):
    """The tiny model saved in shards of a few kilobytes (so every block spans files), beside the single-file
    original."""
    folder = tmp_path_factory.mktemp("sharded")
    load_causal_lm(tiny_llama).save_pretrained(folder, max_shard_size="20KB")
    load_tokenizer(tiny_llama).save_pretrained(folder)
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    return folder


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_a_reader_gives_the_stored_tensors_of_either_layout(tiny_llama, sharded, layout):
    reader = CheckpointReader(tiny_llama if layout == "single" else sharded)
    state = load_causal_lm(tiny_llama).state_dict()
    assert set(reader.names()) == set(state) - {"lm_head.weight"}  # tied: the LM head is the embedding, stored once
    block = reader.read_prefix("model.layers.1.")
    assert set(block) == {name for name in state if name.startswith("model.layers.1.")}
    for name, tensor in block.items():
        assert torch.equal(tensor, state[name]), name
    with pytest.raises(UsageError, match="no tensor 'model.layers.9.mlp.up_proj.weight'"):
        reader.read(["model.layers.9.mlp.up_proj.weight"])


def test_an_empty_model_holds_no_weights_until_a_part_is_materialized_and_none_after_release(tiny_llama):
    model = empty_causal_lm(tiny_llama)
    blocks = decoder_blocks(model)
    assert all(p.is_meta for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())  # rotary frequencies are computed, not stored: they are real
    reader = CheckpointReader(tiny_llama)
    materialize(blocks[1], module_prefix(model, blocks[1]), reader, dtype=torch.float32)
    assert is_materialized(blocks[1]) and not is_materialized(blocks[0])
    reference = load_causal_lm(tiny_llama)
    for (name, ours), (_, theirs) in zip(
        blocks[1].named_parameters(), decoder_blocks(reference)[1].named_parameters(), strict=True
    ):
        assert torch.equal(ours, theirs), name
    release(blocks[1])
    assert all(p.is_meta for p in model.parameters())


def test_a_parameter_can_be_left_for_the_caller(tiny_llama):
    model = empty_causal_lm(tiny_llama)
    block = decoder_blocks(model)[0]
    materialize(block, "model.layers.0", CheckpointReader(tiny_llama), skip=frozenset({"mlp.down_proj.weight"}))
    assert block.mlp.down_proj.weight.is_meta and not block.mlp.up_proj.weight.is_meta


def test_a_model_saved_in_bf16_is_read_in_bf16(tiny_llama, tmp_path):
    save_model_folder(
        load_causal_lm(tiny_llama).to(torch.bfloat16), load_tokenizer(tiny_llama), tiny_llama, tmp_path / "bf16"
    )
    model = empty_causal_lm(tmp_path / "bf16")
    embeddings = model.get_input_embeddings()
    materialize(embeddings, module_prefix(model, embeddings), CheckpointReader(tmp_path / "bf16"))
    assert embeddings.weight.dtype == torch.bfloat16 and not embeddings.weight.is_meta


def test_a_tensor_of_another_shape_than_the_config_gives_is_named(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    save_model_folder(load_causal_lm(tiny_llama), load_tokenizer(tiny_llama), tiny_llama, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:64].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model = empty_causal_lm(folder)
    with pytest.raises(
        UsageError, match=r"model.layers.1.mlp.up_proj.weight is \(64, 64\) where config.json gives \(128, 64\)"
    ):
        materialize(decoder_blocks(model)[1], "model.layers.1", CheckpointReader(folder))
