"""Loading and saving models safely: safetensors or ``weights_only``, ``trust_remote_code`` off unless asked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from compress.core.errors import UsageError, first_line
from compress.core.files import clone_or_copy, disk_write_error, is_disk_write_error


def load_encoder(folder: Path, trust_remote_code: bool = False, name: str | None = None):
    """Load an encoder in fp32, safely: with its sequence-classification head when it has one, else the bare encoder."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    import compress.models.pruned_bert  # noqa: F401  lazy: registers the pruned-BERT classes; BERT's modelling code loads slowly

    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    heads = any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or [])
    loader = AutoModelForSequenceClassification if heads else AutoModel
    model, info = _from_pretrained(loader, folder, name or folder, "encoder", trust_remote_code)
    # The bare encoder of a checkpoint with a task head leaves the head's tensors unread; they are no part of it.
    own = {child for child, _ in model.named_children()}
    _refuse_partial_load(info, name or folder, lambda key: key.split(".")[0] in own or heads)
    return model.eval()


def _refuse_partial_load(info: dict, name, counts=lambda key: True, left_out: frozenset[str] = frozenset()) -> None:
    """A model whose weights and config disagree would run with randomly initialised tensors: refuse it, naming them
    (``left_out``: keys the folder stores elsewhere, which the caller fills in)."""
    problems = [
        ("missing from the weights", sorted(set(info.get("missing_keys") or ()) - left_out)),
        (
            "in the weights but not in the model config.json describes",
            sorted(k for k in info.get("unexpected_keys") or () if counts(k)),
        ),
        (
            "of another shape than config.json says",
            sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or ()),
        ),
    ]
    for what, keys in problems:
        if keys:
            listed = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            raise UsageError(f"model {name}: tensors {what}: {listed}; the weights do not match config.json")


def load_causal_lm(folder: Path, trust_remote_code: bool = False, name: str | None = None, own_dtype: bool = False,
                   left_out: frozenset[str] = frozenset()):
    """Load a causal LM safely, in fp32 for the stages that compute in it, or in the checkpoint's own dtype
    (``own_dtype``: half the memory of a bf16 checkpoint); ``name`` is what the user called the model; ``left_out``:
    weights the folder stores elsewhere (a quantized checkpoint's levels), which the caller must fill in."""
    from transformers import AutoModelForCausalLM

    model, info = _from_pretrained(AutoModelForCausalLM, folder, name or folder, "model", trust_remote_code, own_dtype)
    _refuse_partial_load(info, name or folder, left_out=left_out)
    return model.eval()


def _from_pretrained(loader, folder: Path, name, what: str, trust_remote_code: bool, own_dtype: bool = False):
    """``loader.from_pretrained`` in fp32 (or the checkpoint's dtype) with its loading report; a tensor of the wrong
    shape is named."""
    import torch

    options = {
        "dtype": "auto" if own_dtype else torch.float32,
        "trust_remote_code": trust_remote_code,
        "output_loading_info": True,
    }
    try:
        return loader.from_pretrained(folder, **options)
    except RuntimeError as exc:
        if "ignore_mismatched_sizes" not in str(exc):
            raise UsageError(f"cannot load {what} {name}: {first_line(exc)}") from exc
        _, info = loader.from_pretrained(folder, **options, ignore_mismatched_sizes=True)  # only to name the tensors
        _refuse_partial_load(info, name)
        raise UsageError(f"cannot load {what} {name}: {first_line(exc)}") from exc
    except Exception as exc:
        raise UsageError(f"cannot load {what} {name}: {first_line(exc)}") from exc


def load_tokenizer(folder: Path, trust_remote_code: bool = False):
    """Load the tokenizer saved beside a model."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise UsageError(f"cannot load tokenizer from {folder}: {exc}") from exc


def copy_model_folder(files: list[Path], dst: Path) -> None:
    """Copy a model's files into ``dst`` (copy-on-write clones where the file system allows; never hard links, so
    nothing written into the copy reaches the user's model)."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in files:
        target = dst / item.name
        try:
            clone_or_copy(item, target)
        except OSError as exc:
            if is_disk_write_error(exc):
                raise disk_write_error(exc, target) from exc
            raise


def save_model_folder(model, tokenizer, source: Path, out: Path, state_dict: dict | None = None) -> None:
    """Save a transformed model (``state_dict``: only these of its tensors) beside its tokenizer and the source's
    generation files."""
    model.save_pretrained(out, state_dict=state_dict)
    save_side_files(tokenizer, source, out)


def save_side_files(tokenizer, source: Path, out: Path) -> None:
    """The tokenizer and the source's generation files beside a model written to ``out``."""
    tokenizer.save_pretrained(out)
    for extra in ("generation_config.json", "chat_template.jinja"):
        if (Path(source) / extra).is_file() and not (Path(out) / extra).exists():
            shutil.copy2(Path(source) / extra, Path(out) / extra)


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
