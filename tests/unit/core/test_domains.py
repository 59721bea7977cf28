"""Multi-domain evaluation: shipped domains, unseen domains, fidelity figures, and a gate on the worst domain."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from compress.core.config import load_target
from compress.core.errors import UsageError
from compress.core.text import (
    DEFAULT_CALIBRATION,
    DEFAULT_EVALUATION,
    check_disjoint,
    load_calibration,
    load_evaluation,
    unseen_domains,
)
from compress.eval.decoder import domain_quality, gate_checks
from compress.eval.fidelity import Tally, compare_on_domains
from compress.eval.gate import FAIL, PASS, lower_bound_check


def test_shipped_domains_are_disjoint_and_three_are_unseen(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))  # the check itself, not a remembered pass
    calibration = load_calibration(DEFAULT_CALIBRATION)
    evaluation = load_evaluation(DEFAULT_EVALUATION)
    assert [s.domain for s in calibration][-1] == "chat"  # for models with a chat template
    assert [s.domain for s in evaluation] == ["austen", "press", "fiction", "learned", "government", "religion"]
    assert unseen_domains(calibration, evaluation) == ["learned", "government", "religion"]
    check_disjoint(calibration, evaluation)
    assert len(list((tmp_path / "disjoint").iterdir())) == 1  # a pass is remembered by content
    for source in evaluation:
        assert len(source.text) > 40_000, source.path
        assert "/nn" not in source.text and "``" not in source.text, f"{source.path} still carries Brown tags"


def test_two_evaluation_files_of_one_domain_name_are_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder in ("a", "b"):
        (tmp_path / folder / "news.txt").write_text("Some news text. " * 100)
    with pytest.raises(UsageError, match="news appears twice"):
        load_evaluation([tmp_path / "a" / "news.txt", tmp_path / "b" / "news.txt"])


def test_tally_matches_a_direct_computation():
    rng = np.random.default_rng(0)
    reference = rng.normal(size=(300, 40))
    model = reference + rng.normal(scale=0.5, size=reference.shape)
    ids = rng.integers(0, 40, size=300)
    tally = Tally()
    tally.add_window(model, reference, ids, chunk=64)
    figures = tally.figures()
    ref_lp = torch.log_softmax(torch.tensor(reference[:-1]), -1)
    mod_lp = torch.log_softmax(torch.tensor(model[:-1]), -1)
    targets = torch.tensor(ids[1:])
    assert figures["tokens"] == 299
    assert figures["perplexity_model"] == pytest.approx(math.exp(-mod_lp[range(299), targets].mean().item()), rel=1e-9)
    assert figures["perplexity_reference"] == pytest.approx(
        math.exp(-ref_lp[range(299), targets].mean().item()), rel=1e-9
    )
    kl = torch.nn.functional.kl_div(mod_lp, ref_lp, log_target=True, reduction="sum").item() / 299
    assert figures["mean_kl"] == pytest.approx(kl, rel=1e-9)
    assert figures["top1_agreement"] == pytest.approx((ref_lp.argmax(-1) == mod_lp.argmax(-1)).double().mean().item())
    same = Tally()
    same.add_window(reference, reference, ids)
    assert same.figures()["mean_kl"] == pytest.approx(0.0, abs=1e-12) and same.figures()["top1_agreement"] == 1.0


def _logits_fn(vocab: int, damage_token: int | None):
    """A fixed bigram-like model; with ``damage_token`` it mispredicts after that token only."""
    table = np.random.default_rng(1).normal(size=(vocab, vocab)) * 3

    def logits(ids: np.ndarray) -> np.ndarray:
        out = table[ids[0]].copy()
        if damage_token is not None:
            out[ids[0] == damage_token] = np.roll(out[ids[0] == damage_token], 7, axis=-1)
        return out[None]

    return logits


def test_the_gate_takes_the_worst_domain_not_the_mix():
    vocab = 16
    clean = torch.randint(1, vocab, (4, 64), generator=torch.Generator().manual_seed(0))
    clean[clean == 3] = 4
    damaged = clean.clone()
    damaged[:, ::8] = 3  # only this domain has the token the compressed model gets wrong
    domains = [("a", clean), ("b", clean.flip(1)), ("c", clean.roll(5, 1)), ("d", clean.roll(9, 1)), ("rare", damaged)]
    per_domain = compare_on_domains(_logits_fn(vocab, 3), _logits_fn(vocab, None), domains, progress=False)
    metrics = domain_quality(per_domain, unseen=["rare"])
    assert metrics["worst_domain"] == "rare" and metrics["unseen_domains"] == ["rare"]
    assert metrics["domains"]["a"]["perplexity_increase_pct"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["perplexity_increase_pct"] > 4 * metrics["perplexity_increase_pct_mixed"] > 0
    target = load_target("jetson-orin")
    budget = (metrics["perplexity_increase_pct_mixed"] + metrics["perplexity_increase_pct"]) / 2
    target = target.model_copy(update={"budgets": target.budgets.model_copy(update={
        "max_ppl_increase_pct": budget, "min_top1_agreement": 0.5, "max_mean_kl": 10.0})})
    predictions = {"chosen": {"power_mode": "MAXN_SUPER", "precision": "int8", "decode_latency_ms": 1.0, "ttft_ms": 1.0,
                              "memory_gb": 0.1}}
    checks = {c.name: c for c in gate_checks(metrics, predictions, target, must_measure=False)}
    assert checks["perplexity_increase_pct"].verdict == FAIL
    assert "worst of 5 evaluation domains: rare (unseen)" in checks["perplexity_increase_pct"].detail
    assert checks["top1_agreement"].verdict == PASS and checks["mean_kl"].verdict == PASS


def test_lower_bound_check():
    assert lower_bound_check("agree", 0.9, 0.85, "measured").verdict == PASS
    assert lower_bound_check("agree", 0.8, 0.85, "measured").verdict == FAIL
    assert lower_bound_check("agree", None, 0.85, "measured").verdict == "NOT_MEASURED"
