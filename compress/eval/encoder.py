"""Measuring an exported encoder against its fp32 model and gating it against the target's budgets.

Measurements: sentence embeddings (or a classifier's labels) of the ONNX model in ONNX Runtime
against the torch fp32 model on sentences of every evaluation domain (cosine similarity: mean and
worst sentence; agreement of each sentence's five nearest neighbours), accuracy on a labelled set
when one is given, and host ONNX Runtime latency per batch at 1, 8 and 32 sentences. The latency
model predicts a batch on the target; the gate compares all of it with the budgets.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from pydantic import PositiveInt

from compress.backends.onnx.encoder import ENCODER_FILE, HIDDEN_OUTPUT, OnnxEncoder, torch_outputs
from compress.core.config import StrictModel, Target
from compress.core.files import path_size, read_json
from compress.core.text import TextSource, domain_sentences
from compress.eval.embeddings import batch_latency, embedding_fidelity, label_fidelity, read_labelled
from compress.eval.figures import EncoderFigures, EncoderPredictions
from compress.eval.gate import Check, lower_bound_check, require_measured, upper_bound_check
from compress.eval.perf_model import predict_encoder_batch
from compress.models.families import encoder_layers
from compress.models.loading import load_encoder, load_tokenizer

log = logging.getLogger(__name__)


LATENCY_BATCHES = (1, 8, 32)


class ValidateEncoderConfig(StrictModel):
    """Options of the validate_encoder stage."""

    sentences_per_domain: PositiveInt = 64
    batch_size: PositiveInt = 32
    max_length: PositiveInt = 128
    latency_sentences: PositiveInt = 64
    latency_repeats: PositiveInt = 2


def measure(onnx_dir: Path, teacher_dir: Path, evaluation: list[TextSource], config: ValidateEncoderConfig,
            labels_file: Path | None = None) -> EncoderFigures:
    """Every target-independent measurement of an exported encoder (``labels_file``: a labelled set for a
    classifier)."""
    encoder = OnnxEncoder(onnx_dir)
    tokenizer = load_tokenizer(onnx_dir)
    teacher = load_encoder(teacher_dir)
    output = encoder.output
    run = encoder.embed if output == HIDDEN_OUTPUT else encoder.logits
    domains = domain_sentences(evaluation, config.sentences_per_domain)
    reference = {
        d: torch_outputs(teacher, tokenizer, s, output, config.batch_size, config.max_length) for d, s in domains if s
    }
    candidate = {d: run(s, batch_size=config.batch_size, max_length=config.max_length) for d, s in domains if s}
    log.info(
        "ONNX encoder vs fp32 torch on %d sentences from %d domains", sum(len(s) for _, s in domains), len(reference)
    )
    metrics: EncoderFigures = {"output": output}
    metrics.update(
        embedding_fidelity(reference, candidate) if output == HIDDEN_OUTPUT else label_fidelity(reference, candidate)
    )
    if labels_file and output != HIDDEN_OUTPUT:
        texts, labels = read_labelled(Path(labels_file), read_json(onnx_dir / "config.json").get("label2id") or {})
        ours = encoder.logits(texts, batch_size=config.batch_size, max_length=config.max_length).argmax(axis=1)
        theirs = torch_outputs(teacher, tokenizer, texts, output, config.batch_size, config.max_length).argmax(axis=1)
        metrics["labelled"] = {
            "file": str(labels_file),
            "sentences": len(texts),
            "accuracy": float((ours == labels).mean()),
            "accuracy_fp32": float((theirs == labels).mean()),
        }
    sentences = [s for _, found in domains for s in found][: config.latency_sentences]
    metrics["host_latency"] = [
        batch_latency(
            lambda chunk: run(list(chunk), batch_size=len(chunk), max_length=config.max_length),
            sentences,
            batch,
            config.latency_repeats,
        )
        for batch in LATENCY_BATCHES
    ]
    lengths = [len(ids) for ids in tokenizer(sentences, truncation=True, max_length=config.max_length).input_ids]
    metrics["median_tokens"] = int(np.median(lengths))
    metrics["model_size_bytes"] = path_size(onnx_dir / ENCODER_FILE)
    return metrics


def encoder_shape(model) -> dict[str, int]:
    """What the latency model needs of an encoder, with the parameters its layers' linears really have (pruned or
    not)."""
    config = model.config
    linears = sum(
        m.weight.numel() for layer in encoder_layers(model) for m in layer.modules() if isinstance(m, torch.nn.Linear)
    )
    return {
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "intermediate_size": getattr(config, "intermediate_size", None) or config.hidden_dim,
        "vocab_size": config.vocab_size,
        "linear_params": linears,
    }


def predictions(shape: dict[str, int], precision: str, target: Target, power_mode: str, tokens: int
                ) -> EncoderPredictions:
    """Predicted batch latency for every power mode at the budget's batch, and the chosen mode's."""
    batch = target.budgets.encoder_batch
    modes = [predict_encoder_batch(target, mode, shape, precision, batch, tokens) for mode in target.power_modes]
    chosen = next(m for m in modes if m["power_mode"] == power_mode)
    return {"target": target.name, "kind": "encoder", "modes": modes, "chosen": chosen}


def gate_checks(metrics: EncoderFigures, predicted: EncoderPredictions, target: Target, must_measure: bool
                ) -> list[Check]:
    """Compare measurements and predictions with the target's budgets."""
    budgets = target.budgets
    where = f"{metrics['sentences']} evaluation sentences"
    quality = _embedding_checks(metrics, budgets, where) if metrics["output"] == HIDDEN_OUTPUT else _label_checks(
        metrics, budgets, where)
    chosen = predicted["chosen"]
    shape = f"batch {chosen['batch']} x {chosen['tokens']} tokens"
    checks = [
        *quality,
        upper_bound_check("encoder_batch_ms", chosen["batch_ms"], budgets.max_encoder_batch_ms, "predicted", "ms",
                          f"{target.name} {chosen['power_mode']}, {chosen['precision']}, {shape}"),
        upper_bound_check("memory_gb", chosen["memory_gb"], budgets.max_memory_gb, "predicted", "GB",
                          "weights + activations + runtime"),
    ]
    return require_measured(checks) if must_measure else checks


def _embedding_checks(metrics: EncoderFigures, budgets, where: str) -> list[Check]:
    """An embedding model's sentence vectors against the fp32 model's."""
    return [
        lower_bound_check("embedding_cosine_mean", metrics["embedding_cosine_mean"], budgets.min_embedding_cosine,
                          "measured", "",
                          f"ONNX Runtime vs fp32 torch, {where} (worst domain {metrics['worst_domain']})"),
        lower_bound_check("embedding_cosine_min", metrics["embedding_cosine_min"], budgets.min_embedding_cosine_worst,
                          "measured", "", f"lowest over {where}"),
        lower_bound_check("neighbour_agreement", metrics["neighbour_agreement"], budgets.min_neighbour_agreement,
                          "measured", "",
                          f"overlap of each sentence's 5 nearest neighbours with the fp32 model's, {where}"),
    ]


def _label_checks(metrics: EncoderFigures, budgets, where: str) -> list[Check]:
    """A classifier's labels against the fp32 model's, and its accuracy where the text is labelled."""
    checks = [lower_bound_check("label_agreement", metrics["label_agreement"], budgets.min_label_agreement, "measured",
                                "", f"argmax equal to the fp32 model's, {where}")]
    if "labelled" in metrics:
        labelled = metrics["labelled"]
        drop = 100.0 * (labelled["accuracy_fp32"] - labelled["accuracy"])
        checks.append(upper_bound_check("accuracy_drop_pct", drop, budgets.max_accuracy_drop_pct, "measured", "points",
                                        f"{labelled['sentences']} labelled sentences of {labelled['file']}"))
    return checks
