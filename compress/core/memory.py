"""Peak resident memory of this process, per stage and per phase of a stage, and of the CUDA device a run computes on.

The kernel keeps one high-water mark per process (``VmHWM``), which writing ``5`` to
``/proc/self/clear_refs`` resets. The runner starts one at each stage to record the stage's own
peak; a stage that wants to know which of its phases holds the most starts one per phase with
:func:`phase_peak`, and the stage's peak is still the largest of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

_before_phases_mb = 0.0  # the highest mark reset by a phase since the stage began


def _high_water_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_high_water() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def reset_peak(device: str = "cpu") -> None:
    """Start measuring a new peak (the runner, at each stage); on a CUDA ``device``, its allocator's peak too."""
    global _before_phases_mb
    _before_phases_mb = 0.0
    _reset_high_water()
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def peak_mb() -> float:
    """The peak resident memory (MB) since :func:`reset_peak`, over every phase measured since."""
    return max(_before_phases_mb, _high_water_mb())


def device_peak_mb(device: str) -> float | None:
    """The most memory torch's allocator held on a CUDA ``device`` (MB) since :func:`reset_peak`; None on the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.max_memory_reserved(device) / 2**20


@contextlib.contextmanager
def phase_peak(peaks: dict[str, float], name: str) -> Iterator[None]:
    """Record in ``peaks[name]`` the peak resident memory (MB) while the block runs (what the process already held
    counts: a phase's peak is what the machine needed then)."""
    global _before_phases_mb
    _before_phases_mb = max(_before_phases_mb, _high_water_mb())
    _reset_high_water()
    try:
        yield
    finally:
        peaks[name] = round(_high_water_mb(), 1)
        _before_phases_mb = max(_before_phases_mb, peaks[name])
