"""Multi-domain quality of a compressed model against its reference: perplexity per domain, top-1 agreement, KL.

Every domain is scored on the same token windows for both models, window by window, so the
per-domain perplexity change and the token-level fidelity come from one pass over the text:

* perplexity per domain, and its change against the reference (the gate takes the worst domain);
* top-1 agreement: the share of next-token predictions where both models' argmax agree;
* mean KL divergence ``KL(reference || model)`` per predicted token, in nats.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from compress.eval.perplexity import LogitRows

LogitsFn = Callable[[np.ndarray], np.ndarray]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@dataclass
class Tally:
    """Sums over predicted tokens; add windows, then read the figures."""

    tokens: int = 0
    nll_model: float = 0.0
    nll_reference: float = 0.0
    agree: int = 0
    kl: float = 0.0

    def add_window(
        self, model_logits: LogitRows, reference_logits: LogitRows, ids: np.ndarray, chunk: int = 32
    ) -> None:
        """One ``(seq, vocab)`` window of both models' logits and its ``(seq,)`` token ids (float64, in row chunks: 32
        rows of a 150k-token vocabulary take 0.2 GB of temporaries, 128 took 0.8)."""
        targets = ids[1:]
        for start in range(0, len(targets), chunk):
            stop = min(start + chunk, len(targets))
            model_lp = _log_softmax(model_logits[start:stop].astype(np.float64))
            reference_lp = _log_softmax(reference_logits[start:stop].astype(np.float64))
            rows = np.arange(stop - start)
            picked = targets[start:stop]
            self.nll_model -= float(model_lp[rows, picked].sum())
            self.nll_reference -= float(reference_lp[rows, picked].sum())
            self.agree += int((model_lp.argmax(-1) == reference_lp.argmax(-1)).sum())
            self.kl += float((np.exp(reference_lp) * (reference_lp - model_lp)).sum())
        self.tokens += len(targets)

    def merge(self, other: Tally) -> None:
        self.tokens += other.tokens
        self.nll_model += other.nll_model
        self.nll_reference += other.nll_reference
        self.agree += other.agree
        self.kl += other.kl

    def figures(self) -> dict[str, float | int]:
        ppl_model = math.exp(self.nll_model / self.tokens)
        ppl_reference = math.exp(self.nll_reference / self.tokens)
        return {
            "tokens": self.tokens,
            "perplexity_model": ppl_model,
            "perplexity_reference": ppl_reference,
            "perplexity_increase_pct": 100.0 * (ppl_model / ppl_reference - 1.0),
            "top1_agreement": self.agree / self.tokens,
            "mean_kl": self.kl / self.tokens,
        }


def compare_on_domains(model: LogitsFn, reference: LogitsFn, domains: Sequence[tuple[str, torch.Tensor]],
                       progress: bool = True) -> dict[str, dict[str, float | int]]:
    """Figures per domain plus ``"mixed"`` (all domains' tokens pooled), from ``(name, windows[n, seq])`` pairs."""
    rows = [row for _, windows in domains for row in windows]

    def pair(index: int) -> tuple[np.ndarray, np.ndarray]:
        ids = rows[index].numpy()[None, :]
        return np.asarray(model(ids))[0], np.asarray(reference(ids))[0]

    return compare_window_pairs(pair, domains, progress)


WindowPair = Callable[[int], tuple[LogitRows, LogitRows]]


def compare_window_pairs(pair: WindowPair, domains: Sequence[tuple[str, torch.Tensor]],
                         progress: bool = True) -> dict[str, dict[str, float | int]]:
    """:func:`compare_on_domains` with the logits given by window: ``pair(i)`` is ``(model, reference)`` logits ``(seq,
    vocab)`` of the ``i``-th window, counting through the domains' windows in order."""
    results: dict[str, dict[str, float | int]] = {}
    mixed = Tally()
    total = sum(int(w.shape[0]) for _, w in domains)
    bar = tqdm(total=total, desc="multi-domain eval", unit="window", disable=not progress, leave=False)
    index = 0
    for name, windows in domains:
        tally = Tally()
        for row in windows:
            model_logits, reference_logits = pair(index)
            tally.add_window(model_logits, reference_logits, row.numpy())
            index += 1
            bar.update(1)
        results[name] = tally.figures()
        mixed.merge(tally)
    bar.close()
    results["mixed"] = mixed.figures()
    return results


def worst_domain(per_domain: dict[str, dict[str, float | int]]) -> str:
    """The domain (not ``mixed``) with the largest perplexity increase."""
    return max((name for name in per_domain if name != "mixed"), key=lambda n: per_domain[n]["perplexity_increase_pct"])
