"""Per-token decode latency of compress.runtime's ONNX Runtime path vs a bare ONNX Runtime loop, same model.

    .venv/bin/python bench/runtime_overhead.py RUN_DIR

Both decode the same greedy continuation of the same prompt with the same session options; the
two loops alternate for several rounds and the medians are compared.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import compress.runtime
from compress.backends.onnx.runtime import past_names

ROUNDS = 5
NEW_TOKENS = 48


def bare_loop(session, layout, prompt: list[int], new_tokens: int) -> list[float]:
    names = past_names(layout.num_layers)
    ids = np.asarray([prompt], dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(len(prompt))[None]}
    feed.update(
        {n: np.zeros((1, layout.num_kv_heads[i // 2], 0, layout.head_dim), np.float32) for i, n in enumerate(names)}
    )
    out = session.run(None, feed)
    steps = []
    for step in range(new_tokens):
        start = time.perf_counter()
        token = int(out[0][0, -1].argmax())
        total = len(prompt) + step + 1
        feed = {"input_ids": np.asarray([[token]], np.int64), "attention_mask": np.ones((1, total), np.int64),
                "position_ids": np.asarray([[total - 1]], np.int64)}
        feed.update(zip(names, out[1:], strict=True))
        out = session.run(None, feed)
        steps.append((time.perf_counter() - start) * 1000)
    return steps


def runtime_loop(model, prompt: list[int], new_tokens: int) -> list[float]:
    steps = []
    start = time.perf_counter()
    for _ in model.stream_ids(prompt, new_tokens):
        now = time.perf_counter()
        steps.append((now - start) * 1000)
        start = now
    return steps[1:]  # the first step includes the prefill


def main() -> None:
    model = compress.runtime.load(sys.argv[1])
    prompt = model.encode("Write a short story about a robot that learns to paint.", chat=True)
    bare, ours = [], []
    for _ in range(ROUNDS):
        bare.append(float(np.median(bare_loop(model.decoder.session, model.decoder.layout, prompt, NEW_TOKENS))))
        ours.append(float(np.median(runtime_loop(model, prompt, NEW_TOKENS))))
    bare_ms, ours_ms = sorted(bare)[ROUNDS // 2], sorted(ours)[ROUNDS // 2]
    print(f"bare ONNX Runtime loop: {bare_ms:.2f} ms/token; compress.runtime: {ours_ms:.2f} ms/token; "
          f"overhead {100 * (ours_ms / bare_ms - 1):+.1f}%")


if __name__ == "__main__":
    main()
