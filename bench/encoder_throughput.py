"""Sentence embeddings per second with all-MiniLM-L6-v2: compress.runtime's ONNX Runtime encoder vs torch.

Batches of 1, 8 and 32 Austen sentences, dynamically padded in both; the two backends alternate
round by round so machine noise affects both alike.

    .venv/bin/python bench/encoder_throughput.py
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

import torch

from compress.data import DEFAULT_EVALUATION
from compress.models import resolve_model
from compress.runtime.encoder import ENCODER_FILE, OnnxEncoder, export_encoder, mean_pool

ROUNDS = 3
SENTENCES = 256


def main() -> None:
    from transformers import AutoModel, AutoTokenizer

    text = DEFAULT_EVALUATION[0].read_text(encoding="utf-8")[5000:200_000]
    sentences = [s.strip().replace("\n", " ") for s in re.split(r"(?<=[.!?])\s+", text) if len(s.strip()) > 20][:SENTENCES]
    source = resolve_model("all-minilm-l6-v2").path
    model = AutoModel.from_pretrained(source).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    folder = Path(tempfile.mkdtemp())
    export_encoder(model, folder / ENCODER_FILE)
    tokenizer.save_pretrained(folder)
    encoder = OnnxEncoder(folder)

    def torch_embed(batch_size: int) -> None:
        for start in range(0, len(sentences), batch_size):
            batch = tokenizer(sentences[start:start + batch_size], padding="longest", truncation=True, max_length=256,
                              return_tensors="pt")
            with torch.no_grad():
                hidden = model(**batch).last_hidden_state
            mean_pool(hidden.numpy(), batch["attention_mask"].numpy())

    print("| batch | ONNX Runtime sentences/s | torch sentences/s | speed-up |\n|---|---|---|---|")
    for batch_size in (1, 8, 32):
        times = {"onnx": [], "torch": []}
        for _ in range(ROUNDS):
            start = time.perf_counter()
            encoder.embed(sentences, batch_size=batch_size)
            times["onnx"].append(time.perf_counter() - start)
            start = time.perf_counter()
            torch_embed(batch_size)
            times["torch"].append(time.perf_counter() - start)
        onnx_rate = len(sentences) / sorted(times["onnx"])[ROUNDS // 2]
        torch_rate = len(sentences) / sorted(times["torch"])[ROUNDS // 2]
        print(f"| {batch_size} | {onnx_rate:.0f} | {torch_rate:.0f} | {onnx_rate / torch_rate:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
