"""Calibration and evaluation text: loading, checking, and cutting into token windows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.config import PROJECT_ROOT
from compress.errors import UsageError
from compress.fsutil import sha256_file

DEFAULT_CALIBRATION = (PROJECT_ROOT / "calib_data" / "calibration" / "emma.txt",
                       PROJECT_ROOT / "calib_data" / "calibration" / "mansfieldpark.txt")
DEFAULT_EVALUATION = PROJECT_ROOT / "calib_data" / "evaluation" / "prideprejudice.txt"
EVAL_SKIP_CHARS = 5000
_OVERLAP_PROBE_LINES = 200
_OVERLAP_MIN_LINE = 60


@dataclass(frozen=True)
class TextSource:
    """A checked text file and its hash."""

    path: Path
    sha256: str
    text: str


def read_text_file(path: Path, role: str) -> TextSource:
    """Read a UTF-8 text file; missing, empty or non-UTF-8 files are usage errors."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{role} text not found: {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{role} text {path} is not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from exc
    if not text.strip():
        raise UsageError(f"{role} text {path} is empty")
    return TextSource(path=path, sha256=sha256_file(path), text=text)


def split_paths(value: str | Sequence[str | Path] | None, default: Sequence[Path]) -> list[Path]:
    """``calib=a.txt,b.txt`` or a list, or the shipped default."""
    if value is None or value == "":
        return list(default)
    if isinstance(value, str):
        return [Path(part) for part in value.split(",") if part]
    return [Path(part) for part in value]


def load_calibration(paths: Sequence[Path]) -> list[TextSource]:
    """Read every calibration file."""
    if not paths:
        raise UsageError("no calibration text given")
    return [read_text_file(path, "calibration") for path in paths]


def check_disjoint(calibration: Sequence[TextSource], evaluation: TextSource) -> None:
    """Refuse calibration text that contains the evaluation text (same file, or shared long lines)."""
    for source in calibration:
        if source.sha256 == evaluation.sha256:
            raise UsageError(f"calibration text {source.path} is the evaluation text; they must not overlap")
    probe = [line.strip() for line in evaluation.text.splitlines() if len(line.strip()) >= _OVERLAP_MIN_LINE]
    probe = probe[:: max(1, len(probe) // _OVERLAP_PROBE_LINES)][:_OVERLAP_PROBE_LINES]
    for source in calibration:
        shared = sum(1 for line in probe if line in source.text)
        if probe and shared > len(probe) // 10:
            raise UsageError(f"calibration text {source.path} shares {shared} of {len(probe)} sampled lines with the evaluation text")


def token_windows(tokenizer, text: str, window: int, max_tokens: int, skip_chars: int = 0) -> torch.Tensor:
    """Tokenize ``text[skip_chars:]``, keep the first ``max_tokens`` and cut non-overlapping windows.

    Returns a ``(n_windows, window)`` tensor of token ids.
    """
    ids = tokenizer(text[skip_chars:], add_special_tokens=False, return_tensors="pt").input_ids[0][:max_tokens]
    n_windows = ids.numel() // window
    if n_windows == 0:
        raise UsageError(f"text has only {ids.numel()} tokens; need at least one window of {window}")
    return ids[: n_windows * window].view(n_windows, window)


def calibration_windows(tokenizer, sources: Sequence[TextSource], window: int, n_windows: int, min_tokens: int = 0) -> torch.Tensor:
    """Calibration windows drawn evenly from all sources; too little text is a usage error."""
    per_source = max(1, -(-n_windows // len(sources)))
    chunks = []
    for source in sources:
        ids = tokenizer(source.text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        usable = ids.numel() // window
        if usable == 0:
            continue
        stride = max(1, usable // per_source)
        picks = list(range(0, usable, stride))[:per_source]
        chunks.extend(ids[p * window:(p + 1) * window] for p in picks)
    windows = torch.stack(chunks[:n_windows]) if chunks else torch.empty(0, window, dtype=torch.long)
    have = windows.numel()
    if windows.shape[0] < n_windows or have < min_tokens:
        raise UsageError(
            f"too little calibration text: {have} tokens in {windows.shape[0]} windows of {window}; "
            f"need {max(min_tokens, n_windows * window)} tokens"
        )
    return windows
