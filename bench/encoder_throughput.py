"""all-MiniLM-L6-v2 as fp32, INT8 (compress's W8A8) and head-pruned (a quarter of the heads): sentences/s in ONNX
Runtime and in torch at batch 1, 8 and 32, and the embedding fidelity of each to the fp32 model (and of the same W8A8
without SmoothQuant's migration).

Sentences come from the six evaluation domains, dynamically padded in both backends; the backends
and variants alternate round by round so machine noise affects all alike. torch's INT8 is its
dynamic quantization of the linears (``torch.ao.quantization.quantize_dynamic``), the INT8 path
torch has on a CPU. Sorted-length bucketing is measured at batch 32 in ONNX Runtime.

    .venv/bin/python bench/encoder_throughput.py
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from compress.backends.onnx.encoder import (
    ENCODER_FILE,
    HIDDEN_OUTPUT,
    OnnxEncoder,
    export_encoder,
    torch_outputs,
    write_encoder_qdq,
)
from compress.core.text import (
    DEFAULT_CALIBRATION,
    DEFAULT_EVALUATION,
    domain_sentences,
    load_calibration,
    load_evaluation,
)
from compress.eval.embeddings import cosines, neighbour_agreement
from compress.models.loading import load_encoder, load_tokenizer
from compress.models.pruned_bert import prune_encoder_heads
from compress.models.sources import resolve_model
from compress.transforms.prune.encoder_heads import encoder_head_importance, plan_encoder_heads
from compress.transforms.quantize.encoder import EncoderQuantizeConfig, quantize_encoder

ROUNDS = 3
PER_DOMAIN = 48


def _onnx(model, tokenizer, quantized=None) -> OnnxEncoder:
    folder = Path(tempfile.mkdtemp())
    export_encoder(model, folder / ENCODER_FILE)
    if quantized:
        write_encoder_qdq(model, quantized, folder / ENCODER_FILE)
    tokenizer.save_pretrained(folder)
    return OnnxEncoder(folder)


def _torch_embed(model, tokenizer, sentences: list[str], batch_size: int) -> np.ndarray:
    return torch_outputs(model, tokenizer, sentences, HIDDEN_OUTPUT, batch_size)


def _variants(folder: Path, tokenizer, sentences: list[str]):
    reference = load_encoder(folder)
    calibration = [s for _, found in domain_sentences(load_calibration(DEFAULT_CALIBRATION), 52) for s in found]
    batches = [
        dict(tokenizer(calibration[i : i + 32], padding=True, truncation=True, max_length=128, return_tensors="pt"))
        for i in range(0, len(calibration), 32)
    ]
    quantized_model = load_encoder(folder)
    quantized = quantize_encoder(quantized_model, batches, EncoderQuantizeConfig())
    unsmoothed_model = load_encoder(folder)
    unsmoothed = quantize_encoder(unsmoothed_model, batches, EncoderQuantizeConfig(alpha=0.0))
    pruned = copy.deepcopy(reference)
    prune_encoder_heads(pruned, plan_encoder_heads(encoder_head_importance(pruned, batches), 0.25))
    torch_int8 = torch.ao.quantization.quantize_dynamic(copy.deepcopy(reference), {torch.nn.Linear}, dtype=torch.qint8)
    variants = {
        "fp32": (_onnx(reference, tokenizer), reference),
        "INT8": (_onnx(quantized_model, tokenizer, quantized), torch_int8),
        "pruned 25%": (_onnx(pruned, tokenizer), pruned),
    }
    return variants, reference, _onnx(unsmoothed_model, tokenizer, unsmoothed)


def main() -> None:
    folder = resolve_model("all-minilm-l6-v2").path
    tokenizer = load_tokenizer(folder)
    sentences = [s for _, found in domain_sentences(load_evaluation(DEFAULT_EVALUATION), PER_DOMAIN) for s in found]
    variants, reference, unsmoothed = _variants(folder, tokenizer, sentences)
    truth = _torch_embed(reference, tokenizer, sentences, 32)
    print(f"{len(sentences)} evaluation sentences, {torch.get_num_threads()} threads\n")
    print("| variant | backend | cosine mean | cosine min | 5-NN agreement |\n|---|---|---|---|---|")
    for name, (encoder, model) in variants.items():
        for backend, embeddings in (
            ("ONNX Runtime", encoder.embed(sentences)),
            ("torch", _torch_embed(model, tokenizer, sentences, 32)),
        ):
            c = cosines(embeddings, truth)
            print(
                f"| {name} | {backend} | {c.mean():.4f} | {c.min():.4f} | {neighbour_agreement(truth, embeddings):.3f} "
                "|"
            )
    embeddings = unsmoothed.embed(sentences)
    c = cosines(embeddings, truth)
    print(f"| INT8 without migration (alpha 0) | ONNX Runtime | {c.mean():.4f} | {c.min():.4f} | "
          f"{neighbour_agreement(truth, embeddings):.3f} |")
    print("\n| batch | variant | ONNX Runtime sentences/s | torch sentences/s | ORT / torch |\n|---|---|---|---|---|")
    for batch_size in (1, 8, 32):
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(ROUNDS):
            for name, (encoder, model) in variants.items():
                for backend, run in (("onnx", lambda e=encoder, b=batch_size: e.embed(sentences, batch_size=b)),
                                     ("torch", lambda m=model, b=batch_size: _torch_embed(m, tokenizer, sentences, b))):
                    started = time.perf_counter()
                    run()
                    times.setdefault((name, backend), []).append(time.perf_counter() - started)
        for name in variants:
            onnx_rate = len(sentences) / sorted(times[(name, "onnx")])[ROUNDS // 2]
            torch_rate = len(sentences) / sorted(times[(name, "torch")])[ROUNDS // 2]
            print(
                f"| {batch_size} | {name} | {onnx_rate:.0f} | {torch_rate:.0f} | {onnx_rate / torch_rate:.2f}x |",
                flush=True,
            )
    encoder = variants["fp32"][0]
    rates = {}
    for _ in range(ROUNDS):
        for bucket in (False, True):
            started = time.perf_counter()
            encoder.embed(sentences, batch_size=32, bucket=bucket)
            rates.setdefault(bucket, []).append(len(sentences) / (time.perf_counter() - started))
    plain, bucketed = (sorted(rates[b])[ROUNDS // 2] for b in (False, True))
    print(f"\nfp32 ONNX Runtime at batch 32: {plain:.0f} sentences/s in input order, {bucketed:.0f} sorted by length "
          f"({bucketed / plain:.2f}x)")


if __name__ == "__main__":
    main()
