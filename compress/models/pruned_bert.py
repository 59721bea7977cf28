"""A pruned BERT that reloads with ``AutoModel.from_pretrained``.

transformers 5 derives BERT's head size from ``hidden_size / num_attention_heads`` and no longer
has ``prune_heads``, so a pruned BERT cannot be described by ``BertConfig`` alone. It is saved as
``compress-pruned-bert``: a ``BertConfig`` plus ``heads_kept_per_layer``, with a ``BertModel``
subclass that builds the smaller attention layers before the weights load. Importing this module
registers both with the transformers Auto classes; the ONNX export needs nothing special.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel, BertConfig, BertModel

from compress.models.surgery import select_linear

PRUNED_BERT_TYPE = "compress-pruned-bert"


class PrunedBertConfig(BertConfig):
    """``BertConfig`` with the heads each layer kept (indices into the unpruned layer)."""

    model_type = PRUNED_BERT_TYPE

    def __init__(self, heads_kept_per_layer: list[list[int]] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.heads_kept_per_layer = heads_kept_per_layer or []


class PrunedBertModel(BertModel):
    """``BertModel`` whose attention layers have the shapes of ``config.heads_kept_per_layer``."""

    config_class = PrunedBertConfig

    def __init__(self, config: PrunedBertConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config, add_pooling_layer=add_pooling_layer)
        if config.heads_kept_per_layer:
            prune_encoder_heads(self, config.heads_kept_per_layer)


AutoConfig.register(PRUNED_BERT_TYPE, PrunedBertConfig, exist_ok=True)
AutoModel.register(PrunedBertConfig, PrunedBertModel, exist_ok=True)


def _layers(model):
    return model.encoder.layer


def prune_encoder_heads(model, plan: list[list[int]]) -> None:
    """Remove heads physically, layer by layer."""
    head_size = model.config.hidden_size // model.config.num_attention_heads
    for layer, kept in zip(_layers(model), plan, strict=True):
        if not kept:
            raise ValueError("a layer cannot lose its last head")
        rows = torch.cat([torch.arange(h * head_size, (h + 1) * head_size) for h in kept])
        attention = layer.attention.self
        attention.query = select_linear(attention.query, rows, dim=0)
        attention.key = select_linear(attention.key, rows, dim=0)
        attention.value = select_linear(attention.value, rows, dim=0)
        attention.num_attention_heads = len(kept)
        attention.all_head_size = len(kept) * head_size
        layer.attention.output.dense = select_linear(layer.attention.output.dense, rows, dim=1)


def save_pruned_encoder(model, tokenizer, plan: list[list[int]], folder: Path) -> None:
    """Weights, tokenizer and a ``compress-pruned-bert`` config carrying the head plan (also set on ``model``)."""
    folder = Path(folder)
    base = {
        k: v
        for k, v in model.config.to_dict().items()
        if k not in ("model_type", "heads_kept_per_layer", "architectures")
    }
    model.config = PrunedBertConfig(heads_kept_per_layer=plan, architectures=[PrunedBertModel.__name__], **base)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def load_pruned_encoder(folder: Path):
    """Reload a pruned encoder saved by :func:`save_pruned_encoder` (``AutoModel.from_pretrained`` in eval mode)."""
    return AutoModel.from_pretrained(Path(folder)).eval()
