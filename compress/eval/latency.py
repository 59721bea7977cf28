"""Host latency of an ONNX Runtime decoder: time to first token and per-token decode percentiles."""

from __future__ import annotations

import time

import numpy as np


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    """p50/p90/p99 and mean of a list of milliseconds."""
    arr = np.asarray(samples_ms, dtype=np.float64)
    return {
        "p50_ms": float(np.percentile(arr, 50)),
        "p90_ms": float(np.percentile(arr, 90)),
        "p99_ms": float(np.percentile(arr, 99)),
        "mean_ms": float(arr.mean()),
    }


def measure_decoder_latency(decoder, prompt_ids: list[int], new_tokens: int, warmup: int = 2, repeats: int = 1) -> dict:
    """Prefill ``prompt_ids`` (TTFT), then decode ``new_tokens`` one at a time, timing each step.

    The same greedy path a user runs; EOS is ignored so every run decodes the same count.
    """
    prompt = np.asarray([prompt_ids], dtype=np.int64)
    mask0 = np.ones_like(prompt)
    for _ in range(warmup):
        logits, past = decoder.forward(prompt, mask0, decoder.empty_past(1))
        decoder.forward(
            np.asarray([[int(logits[0, -1].argmax())]]), np.ones((1, prompt.shape[1] + 1), dtype=np.int64), past
        )
    ttft, steps = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        logits, past = decoder.forward(prompt, mask0, decoder.empty_past(1))
        ttft.append((time.perf_counter() - start) * 1000)
        mask = mask0
        for _ in range(new_tokens):
            token = np.asarray([[int(logits[0, -1].argmax())]], dtype=np.int64)
            mask = np.concatenate([mask, np.ones((1, 1), dtype=np.int64)], axis=1)
            start = time.perf_counter()
            logits, past = decoder.forward(token, mask, past)
            steps.append((time.perf_counter() - start) * 1000)
    decode = percentiles(steps)
    return {
        "prompt_tokens": len(prompt_ids),
        "new_tokens": new_tokens,
        "ttft_ms": float(np.median(ttft)),
        "decode": decode,
        "tokens_per_s": 1000.0 / decode["mean_ms"],
    }
