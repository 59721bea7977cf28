"""Loading and saving models safely: safetensors or ``weights_only``, ``trust_remote_code`` off unless asked."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from compress.core.errors import UsageError, first_line
from compress.core.files import disk_write_error, is_disk_write_error


def load_encoder(folder: Path, trust_remote_code: bool = False, name: str | None = None):
    """Load an encoder in fp32, safely: with its sequence-classification head when it has one, else the bare encoder."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    import compress.models.pruned_bert  # noqa: F401  lazy: registers the pruned-BERT classes; BERT's modelling code loads slowly

    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    heads = any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or [])
    loader = AutoModelForSequenceClassification if heads else AutoModel
    try:
        model = loader.from_pretrained(folder, dtype=torch.float32, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise UsageError(f"cannot load encoder {name or folder}: {first_line(exc)}") from exc
    return model.eval()


def load_causal_lm(folder: Path, trust_remote_code: bool = False, name: str | None = None):
    """Load a causal LM in fp32 for CPU work, safely; ``name`` is what the user called the model, for errors."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise UsageError(f"cannot load model {name or folder}: {first_line(exc)}") from exc
    return model.eval()


def load_tokenizer(folder: Path, trust_remote_code: bool = False):
    """Load the tokenizer saved beside a model."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise UsageError(f"cannot load tokenizer from {folder}: {exc}") from exc


def link_or_copy_tree(src: Path, dst: Path) -> None:
    """Populate ``dst`` with ``src``'s files, hard-linking where the file system allows."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        target = dst / item.name
        if item.is_dir():
            link_or_copy_tree(item, target)
            continue
        try:
            os.link(item, target)
        except OSError:
            try:
                shutil.copy2(item, target)
            except OSError as exc:
                if is_disk_write_error(exc):
                    raise disk_write_error(exc, target) from exc
                raise


def save_model_folder(model, tokenizer, source: Path, out: Path) -> None:
    """Save a transformed model beside its tokenizer and the source's generation files."""
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for extra in ("generation_config.json", "chat_template.jinja"):
        if (Path(source) / extra).is_file() and not (out / extra).exists():
            shutil.copy2(Path(source) / extra, out / extra)


def count_parameters(model) -> int:
    """Unique parameters (tied embeddings counted once)."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of ``prompt`` wrapped in the tokenizer's chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
        return list(encoded["input_ids"])
    return tokenizer(prompt, add_special_tokens=True).input_ids
