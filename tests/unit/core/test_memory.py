"""Peak memory per phase: a phase's peak is its own, and the stage's peak still counts every phase."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

from compress.core.memory import peak_mb, phase_peak, reset_peak

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the per-phase peak reads Linux's VmHWM")

MB = 1 << 20


def _hold(megabytes: int) -> np.ndarray:
    return np.ones(megabytes * MB, dtype=np.uint8)  # written, so resident


def test_each_phase_has_its_own_peak_and_the_stage_keeps_the_largest():
    reset_peak()
    peaks: dict[str, float] = {}
    with phase_peak(peaks, "large"):
        block = _hold(300)
        del block
        gc.collect()
    with phase_peak(peaks, "small"):
        block = _hold(20)
        del block
    assert peaks["large"] - peaks["small"] > 200  # the small phase's mark was reset after the large one
    assert peak_mb() >= peaks["large"]  # the stage's peak is still the large phase's
    reset_peak()  # a new stage starts afresh
    assert peak_mb() < peaks["large"] - 200
