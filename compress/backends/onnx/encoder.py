"""Encoders (BERT, RoBERTa, XLM-R, DistilBERT, MPNet): ONNX export and batched embeddings or labels.

Each batch is padded to its own longest sentence, not to the model's maximum length, so short
sentences cost short sequences; with ``bucket=True`` sentences are sorted by length first, so a
batch holds sentences of similar length (results come back in the caller's order).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import torch

from compress.backends.onnx.qdq import LinearForExport, apply_qdq
from compress.backends.onnx.runtime import make_session
from compress.core.files import read_json
from compress.models.loading import load_tokenizer

ENCODER_FILE = "encoder.onnx"
HIDDEN_OUTPUT, LOGITS_OUTPUT = "last_hidden_state", "logits"

if TYPE_CHECKING:
    from compress.transforms.quantize.encoder import EncoderLinearQuant


def encoder_input_names(model) -> list[str]:
    """The inputs the model's forward takes: DistilBERT and MPNet have no token types."""
    accepted = inspect.signature(model.forward).parameters
    return ["input_ids", "attention_mask"] + (["token_type_ids"] if "token_type_ids" in accepted else [])


def is_classifier(model) -> bool:
    return any(
        name.endswith("ForSequenceClassification") for name in (model.config.architectures or [type(model).__name__])
    ) and hasattr(model, "classifier")


def export_encoder(model, path: Path, opset: int = 18) -> str:
    """Export an encoder with dynamic batch and sequence axes; returns its output (hidden states, or a classifier's
    logits).

    The dynamo exporter is used: tracing BERT's mask and position handling with the TorchScript
    exporter bakes example values into the graph. A half-precision model exports an FP16 graph.
    """
    names = encoder_input_names(model)
    output = LOGITS_OUTPUT if is_classifier(model) else HIDDEN_OUTPUT

    class _Encoder(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *inputs):
            return getattr(self.inner(**dict(zip(names, inputs, strict=True))), output)

    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    example = (torch.randint(100, 1000, (2, 7)), mask, torch.zeros(2, 7, dtype=torch.long))[: len(names)]
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    shapes = ({0: batch, 1: sequence},) * len(names)
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(_Encoder(model.eval()), example, str(path), input_names=names, output_names=[output],
                          dynamic_shapes=(shapes,), opset_version=opset, dynamo=True, external_data=False)
    quiet.setLevel(level)
    return output


def mean_pool(hidden: np.ndarray, mask: np.ndarray, normalize: bool = True) -> np.ndarray:
    """Mask-aware mean over tokens (sentence-transformers pooling), optionally L2-normalised, in float32."""
    hidden = hidden.astype(np.float32)
    weights = mask[..., None].astype(np.float32)
    pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
    if normalize:
        pooled /= np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
    return pooled


def torch_outputs(model, tokenizer, sentences: Sequence[str], output: str, batch_size: int = 32,
                  max_length: int = 256) -> np.ndarray:
    """What :class:`OnnxEncoder` returns, computed by the torch model: pooled embeddings, or a classifier's logits."""
    out = []
    for start in range(0, len(sentences), batch_size):
        batch = tokenizer(
            list(sentences[start : start + batch_size]),
            padding="longest",
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        with torch.no_grad():
            values = getattr(model(**batch), output).float().numpy()
        out.append(mean_pool(values, batch["attention_mask"].numpy()) if output == HIDDEN_OUTPUT else values)
    return np.concatenate(out)


class OnnxEncoder:
    """Sentence embeddings (``embed``) or class labels (``classify``) from an exported encoder in ONNX Runtime."""

    backend = "onnxruntime"

    def __init__(self, folder: Path, threads: int | None = None) -> None:
        self.session = make_session(Path(folder) / ENCODER_FILE, threads)
        self._setup(folder, [i.name for i in self.session.get_inputs()], self.session.get_outputs()[0].name)

    def _setup(self, folder: Path, input_names: list[str], output: str) -> None:
        self.folder = Path(folder)
        self.tokenizer = load_tokenizer(self.folder)
        self.input_names = input_names
        self.output = output
        self.last_batch_width = 0
        self.provenance: dict = {"onnx_folder": str(self.folder)}

    def _forward(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        return self.session.run(None, feed)[0]

    def _run(self, sentences: Sequence[str], batch_size: int, max_length: int, bucket: bool, pool) -> np.ndarray:
        order = (
            sorted(range(len(sentences)), key=lambda i: len(sentences[i])) if bucket else list(range(len(sentences)))
        )
        out = []
        for start in range(0, len(order), batch_size):
            chosen = [sentences[i] for i in order[start:start + batch_size]]
            batch = self.tokenizer(
                chosen, padding="longest", truncation=True, max_length=max_length, return_tensors="np"
            )
            self.last_batch_width = batch["input_ids"].shape[1]
            feed = {
                name: batch[name].astype(np.int64)
                if name in batch
                else np.zeros_like(batch["input_ids"], dtype=np.int64)
                for name in self.input_names
            }
            out.append(pool(self._forward(feed), feed["attention_mask"]))
        if not out:
            return np.zeros((0, 0), dtype=np.float32)
        result = np.concatenate(out)
        restored = np.empty_like(result)
        restored[order] = result
        return restored

    def embed(
        self, sentences: Sequence[str], batch_size: int = 32, max_length: int = 256, bucket: bool = False
    ) -> np.ndarray:
        """L2-normalised mean-pooled embeddings of ``sentences``, batch by batch, each padded to its longest
        sentence."""
        if self.output != HIDDEN_OUTPUT:
            raise ValueError(f"{self.folder} is a classifier; use classify()")
        return self._run(sentences, batch_size, max_length, bucket, mean_pool)

    def logits(
        self, sentences: Sequence[str], batch_size: int = 32, max_length: int = 256, bucket: bool = False
    ) -> np.ndarray:
        """Class logits of ``sentences`` (a classifier export)."""
        if self.output != LOGITS_OUTPUT:
            raise ValueError(f"{self.folder} has no classification head; use embed()")
        return self._run(sentences, batch_size, max_length, bucket, lambda logits, _mask: logits.astype(np.float32))

    def classify(
        self, sentences: Sequence[str], batch_size: int = 32, max_length: int = 256, bucket: bool = True
    ) -> list[str]:
        """The label of each sentence (names from the model's ``id2label``)."""
        id2label = read_json(self.folder / "config.json").get("id2label") or {}
        return [
            id2label.get(str(int(i)), str(int(i)))
            for i in self.logits(sentences, batch_size, max_length, bucket).argmax(axis=1)
        ]


def write_encoder_qdq(model, linears: dict[str, EncoderLinearQuant], path: Path) -> dict[str, int]:
    """Rewrite the float ONNX graph at ``path``, exported from ``model``, into its Q/DQ INT8 graph (``linears``: the
    quantize_encoder stage's :class:`~compress.transforms.quantize.encoder.EncoderLinearQuant` by linear)."""
    graph = onnx.load(str(path))
    stats = apply_qdq(graph, [LinearForExport(name, model.base_model.get_submodule(name).weight.detach().numpy(),
                                              q.weight_scales.numpy(), 8, q.input_scale, 0,
                                              None if q.smoothing is None else q.smoothing.numpy())
                              for name, q in linears.items()])
    onnx.save(graph, str(path))
    return stats


PARITY_SENTENCES = (
    "The robot arm picks up the red block.",
    "Stop.",
    "Navigate to the charging dock and wait for instructions from the operator.",
    "Emma Woodhouse, handsome, clever, and rich, seemed to unite some of the best blessings of existence.",
)
