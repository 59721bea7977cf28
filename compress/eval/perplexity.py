"""Perplexity on non-overlapping token windows, for torch models and ONNX Runtime decoders.

Protocol: ``exp(mean NLL)`` of every next-token prediction inside each window (a window of
``n`` tokens scores ``n - 1`` predictions); windows never see each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np
import torch
from tqdm import tqdm


class LogitRows(Protocol):
    """A window's ``(positions, vocab)`` logits as a reader slices them (``rows[32:64]`` is an array): an array, or
    logits computed as they are read, so that no reader needs a whole window's at once."""

    def __len__(self) -> int: ...

    def __getitem__(self, positions: slice) -> np.ndarray: ...


def window_nll(logits: np.ndarray, ids: np.ndarray) -> tuple[float, int]:
    """Summed next-token NLL and the number of predictions for one ``(seq, vocab)`` window."""
    return targets_nll(logits[:-1], ids[1:])


# Rows taken to float64 at a time: three temporaries of 32 rows of a 150k vocabulary are 0.1 GB (a whole 512-token
# window's would be 1.9 GB).
NLL_ROWS = 32


def targets_nll(logits: LogitRows, targets: np.ndarray) -> tuple[float, int]:
    """Summed NLL of ``targets`` under ``(n, vocab)`` logits (row i predicting ``targets[i]``) and their number."""
    total = 0.0
    for start in range(0, len(targets), NLL_ROWS):
        rows = logits[start:start + NLL_ROWS].astype(np.float64)
        shifted = rows - rows.max(axis=-1, keepdims=True)
        log_norm = np.log(np.exp(shifted).sum(axis=-1))
        picked = shifted[np.arange(len(rows)), targets[start:start + NLL_ROWS]]
        total += float((log_norm - picked).sum())
    return total, len(targets)


def perplexity(logits_fn: Callable[[np.ndarray], np.ndarray], windows: torch.Tensor, progress: bool = True,
               desc: str = "perplexity") -> float:
    """Perplexity of a model given as ``logits_fn(ids[1, n]) -> logits[1, n, vocab]``."""
    total, count = 0.0, 0
    rows: Iterable = tqdm(windows, desc=desc, unit="window", disable=not progress, leave=False)
    for row in rows:
        ids = row.numpy()[None, :]
        nll, n = window_nll(np.asarray(logits_fn(ids))[0], ids[0])
        total += nll
        count += n
    return math.exp(total / count)


def torch_logits_fn(model) -> Callable[[np.ndarray], np.ndarray]:
    """Adapter: a torch causal LM as ``logits_fn``."""

    def logits(ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(ids)).logits.numpy()

    return logits


def seen_and_unseen_perplexity(model, seen: torch.Tensor, unseen: torch.Tensor | None):
    """Perplexity on windows of the domains training saw, and of the domains it never saw."""
    def evaluate() -> dict[str, float]:
        figures = {"perplexity": perplexity(torch_logits_fn(model), seen, progress=False)}
        if unseen is not None:
            figures["perplexity_unseen"] = perplexity(torch_logits_fn(model), unseen, progress=False)
        return figures

    return evaluate
