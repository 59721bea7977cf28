"""Encoder fidelity and host latency: embeddings and labels of a model against its fp32 reference."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from compress.core.errors import UsageError

NEIGHBOURS = 5


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity."""
    return (a * b).sum(axis=1) / np.clip(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12, None)


def neighbour_agreement(reference: np.ndarray, candidate: np.ndarray, k: int = NEIGHBOURS) -> float:
    """Mean overlap of each row's ``k`` nearest neighbours (cosine, itself excluded) in the two embedding sets."""
    def nearest(embeddings: np.ndarray) -> np.ndarray:
        unit = embeddings / np.clip(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12, None)
        similarity = unit @ unit.T
        np.fill_diagonal(similarity, -np.inf)
        return np.argsort(-similarity, axis=1)[:, :k]

    ours, theirs = nearest(candidate), nearest(reference)
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(ours, theirs, strict=True)]))


def embedding_fidelity(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> dict[str, Any]:
    """Cosine similarity per sentence (mean, worst, per domain) and neighbour agreement over all sentences."""
    per_domain = {domain: cosines(reference[domain], candidate[domain]) for domain in reference}
    every = np.concatenate(list(per_domain.values()))
    stacked_reference = np.concatenate([reference[d] for d in reference])
    stacked_candidate = np.concatenate([candidate[d] for d in reference])
    worst_domain = min(per_domain, key=lambda d: float(per_domain[d].mean()))
    return {
        "sentences": int(every.size),
        "embedding_cosine_mean": float(every.mean()),
        "embedding_cosine_min": float(every.min()),
        "neighbour_agreement": neighbour_agreement(stacked_reference, stacked_candidate),
        "worst_domain": worst_domain,
        "domains": {
            d: {"sentences": int(c.size), "cosine_mean": float(c.mean()), "cosine_min": float(c.min())}
            for d, c in per_domain.items()
        },
    }


def label_fidelity(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> dict[str, Any]:
    """Share of sentences whose argmax label equals the reference's, overall and per domain."""
    per_domain = {d: reference[d].argmax(axis=1) == candidate[d].argmax(axis=1) for d in reference}
    every = np.concatenate(list(per_domain.values()))
    return {
        "sentences": int(every.size),
        "label_agreement": float(every.mean()),
        "domains": {d: {"sentences": int(a.size), "label_agreement": float(a.mean())} for d, a in per_domain.items()},
    }


def read_labelled(path: Path, label2id: dict[str, int]) -> tuple[list[str], np.ndarray]:
    """A labelled set: JSON lines ``{"text": ..., "label": ...}`` or tab-separated ``label<TAB>text`` lines.

    Labels are names from the model's ``label2id`` or integer class ids.
    """
    texts, labels = [], []
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"eval_labels={path}: the file is empty")
    for number, line in enumerate(lines, start=1):
        try:
            if path.suffix == ".jsonl":
                row = json.loads(line)
                text, label = row["text"], row["label"]
            else:
                label, text = line.split("\t", 1)
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"eval_labels={path}: line {number} is not a labelled sentence "
                             "(JSON lines with text and label, or label<TAB>text)") from exc
        labels.append(_label_id(label, label2id, path, number))
        texts.append(text)
    return texts, np.array(labels)


def _label_id(label: Any, label2id: dict[str, int], path: Path, number: int) -> int:
    if str(label) in label2id:
        return int(label2id[str(label)])
    if str(label).lstrip("-").isdigit() and int(label) in label2id.values():
        return int(label)
    raise UsageError(f"eval_labels={path}: line {number}: label {label!r} is not one of the model's "
                     f"({', '.join(sorted(label2id))})")


def batch_latency(
    run: Callable[[Sequence[str]], Any], sentences: Sequence[str], batch: int, repeats: int = 3
) -> dict[str, float]:
    """Host milliseconds per batch of ``batch`` sentences (p50, p90 over every batch of every repeat) and
    sentences/s."""
    times = []
    chunks = [sentences[i:i + batch] for i in range(0, len(sentences) - batch + 1, batch)] or [sentences[:batch]]
    run(chunks[0])  # warm-up: session and thread-pool start
    for _ in range(repeats):
        for chunk in chunks:
            started = time.perf_counter()
            run(chunk)
            times.append((time.perf_counter() - started) * 1000)
    p50, p90 = float(np.percentile(times, 50)), float(np.percentile(times, 90))
    return {
        "batch": batch,
        "p50_ms": round(p50, 3),
        "p90_ms": round(p90, 3),
        "sentences_per_s": round(1000.0 * batch / p50, 1),
    }
