"""Where the heavy work of a run is computed: ``device=auto|cpu|cuda|cuda:N``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from compress.core.errors import UsageError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(spec: str) -> str:
    """The torch device a run computes on: ``auto`` is the first CUDA device when torch sees one, else the CPU; a CUDA
    device torch does not see is a usage error naming it."""
    import torch  # lazy: planning a run on a named device is the only reason to import it here

    if spec == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return "cpu"
    match = re.fullmatch(r"cuda(?::(\d+))?", spec)
    if match is None:
        raise UsageError(f"device={spec}: expected {DEVICE_CHOICES}")
    index = int(match.group(1) or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        seen = f"torch sees {count} CUDA device{'s' if count != 1 else ''}" if count else "torch sees no CUDA device"
        raise UsageError(f"device={spec}: {seen}; use device=cpu (or device=auto)")
    return f"cuda:{index}"


@dataclass(frozen=True)
class Compute:
    """Where block-by-block work is computed (a torch device name) and whether it shows progress bars."""

    device: str = "cpu"
    progress: bool = False


ON_CPU = Compute()  # the default: on the CPU, no progress bars
