"""BERT-family encoders: ONNX export and batched sentence embeddings with dynamic padding.

Each batch is padded to its own longest sentence, not to the model's maximum length, so short
sentences cost short sequences.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from compress.runtime.onnx_decoder import make_session

ENCODER_FILE = "encoder.onnx"


def export_encoder(model, path: Path, opset: int = 18) -> None:
    """Export a Hugging Face encoder (``last_hidden_state``) with dynamic batch and sequence axes.

    The dynamo exporter is used: tracing BERT's mask and position handling with the TorchScript
    exporter bakes example values into the graph.
    """

    class _Encoder(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state

    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    example = (torch.randint(100, 1000, (2, 7)), mask, torch.zeros(2, 7, dtype=torch.long))
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    shapes = ({0: batch, 1: sequence},) * 3
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Encoder(model.eval()), example, str(path), input_names=["input_ids", "attention_mask", "token_type_ids"],
                          output_names=["last_hidden_state"], dynamic_shapes=shapes, opset_version=opset, dynamo=True,
                          external_data=False)


def mean_pool(hidden: np.ndarray, mask: np.ndarray, normalize: bool = True) -> np.ndarray:
    """Mask-aware mean over tokens (sentence-transformers pooling), optionally L2-normalised."""
    weights = mask[..., None].astype(hidden.dtype)
    pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
    if normalize:
        pooled /= np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
    return pooled


class OnnxEncoder:
    """Sentence embeddings from an exported encoder in ONNX Runtime."""

    def __init__(self, folder: Path, threads: int | None = None) -> None:
        from compress.models import load_tokenizer

        self.folder = Path(folder)
        self.tokenizer = load_tokenizer(self.folder)
        self.session = make_session(self.folder / ENCODER_FILE, threads)
        self.last_batch_width = 0

    def embed(self, sentences: Sequence[str], batch_size: int = 32, max_length: int = 256) -> np.ndarray:
        """Embeddings for ``sentences``, batch by batch, each batch padded to its longest sentence."""
        out = []
        for start in range(0, len(sentences), batch_size):
            batch = self.tokenizer(list(sentences[start:start + batch_size]), padding="longest", truncation=True,
                                   max_length=max_length, return_tensors="np")
            self.last_batch_width = batch["input_ids"].shape[1]
            feed = {"input_ids": batch["input_ids"].astype(np.int64), "attention_mask": batch["attention_mask"].astype(np.int64),
                    "token_type_ids": batch.get("token_type_ids", np.zeros_like(batch["input_ids"])).astype(np.int64)}
            hidden = self.session.run(None, feed)[0]
            out.append(mean_pool(hidden, feed["attention_mask"]))
        return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)
