"""Writing small GGUF files of each family from Hugging Face folders, the way llama.cpp's converter lays them out.

Only for tests: a tiny random model of a family is written as a GGUF file (float32 tensors, its
byte-level BPE tokenizer as GGUF "gpt2" tokenizer fields), so compress's GGUF path can be checked
against the folder it came from. The layout follows llama.cpp's ``convert_hf_to_gguf.py`` conventions that transformers
undoes on load: Llama's q/k rows interleaved for its rotary kernel, Gemma's norms stored as ``1 + w``,
Phi-3's ``gate_up_proj`` under ``ffn_up``; the architecture's metadata keys are those llama.cpp writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

# GGUF architecture of each transformers model type (llama.cpp writes Mistral as "llama").
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "gemma3_text": "gemma3"}


def _add_tokenizer(writer, folder: Path) -> None:
    """The folder's byte-level BPE tokenizer as GGUF "gpt2" tokenizer fields."""
    from gguf import TokenType

    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    vocab.update(special)
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    eos = next(iter(special.values()))
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(eos)


def _interleave_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of Llama's q/k rows (the inverse of what transformers applies on load)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_gguf(
    folder: Path, path: Path, general_name: str = "tiny", extra_tensors: dict[str, np.ndarray] | None = None
) -> Path:
    """Write the model and tokenizer in ``folder`` as a float32 GGUF file (plus ``extra_tensors`` by GGUF name)."""
    from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map

    config = json.loads((folder / "config.json").read_text())
    arch_name = GGUF_ARCH[config["model_type"]]
    arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch_name and a in MODEL_ARCH)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = GGUFWriter(str(path), arch_name)
    writer.add_name(general_name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3 keeps one per layer kind; GGUF holds the full-attention one
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(
        int(head_dim * rope.get("partial_rotary_factor", config.get("partial_rotary_factor") or 1.0))
    )
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, folder)
    names = get_tensor_name_map(arch, config["num_hidden_layers"])
    for key, tensor in sorted(load_file(str(folder / "model.safetensors")).items()):
        module, _, suffix = key.rpartition(".")
        name = names.get_name(module)
        if name is None:
            raise KeyError(f"no GGUF name for {key}")
        if arch_name == "llama" and module.endswith(("q_proj", "k_proj")):
            tensor = _interleave_rotary_rows(tensor, heads if module.endswith("q_proj") else kv)
        if arch_name == "gemma3" and module.endswith("norm"):
            tensor = tensor + 1.0
        writer.add_tensor(f"{name}.{suffix}", np.ascontiguousarray(tensor, dtype=np.float32))
    for name, tensor in (extra_tensors or {}).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
