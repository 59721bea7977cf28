"""Calibration and evaluation text: loading, checking, and cutting into token windows."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.catalog import TEXT, catalog_dir
from compress.core.errors import UsageError
from compress.core.files import sha256_file

_SHIPPED = catalog_dir(TEXT)
# (domain, file): the shipped text (calib_data/PROVENANCE.md). Calibration and evaluation never share
# a document; the evaluation domains no calibration domain covers are the "unseen" ones.
DEFAULT_CALIBRATION_DOMAINS: tuple[tuple[str, Path], ...] = (
    ("austen", _SHIPPED / "calibration" / "emma.txt"),
    ("austen", _SHIPPED / "calibration" / "mansfieldpark.txt"),
    ("press", _SHIPPED / "calibration" / "press.txt"),
    ("fiction", _SHIPPED / "calibration" / "fiction.txt"),
    ("lore", _SHIPPED / "calibration" / "lore.txt"),
)
DEFAULT_EVALUATION_DOMAINS: tuple[tuple[str, Path], ...] = (
    ("austen", _SHIPPED / "evaluation" / "prideprejudice.txt"),
    ("press", _SHIPPED / "evaluation" / "press.txt"),
    ("fiction", _SHIPPED / "evaluation" / "fiction.txt"),
    ("learned", _SHIPPED / "evaluation" / "learned.txt"),
    ("government", _SHIPPED / "evaluation" / "government.txt"),
    ("religion", _SHIPPED / "evaluation" / "religion.txt"),
)
_SHIPPED_DOMAINS = {path: domain for domain, path in DEFAULT_CALIBRATION_DOMAINS + DEFAULT_EVALUATION_DOMAINS}
DEFAULT_CALIBRATION = tuple(path for _, path in DEFAULT_CALIBRATION_DOMAINS)
DEFAULT_EVALUATION = tuple(path for _, path in DEFAULT_EVALUATION_DOMAINS)
EVAL_SKIP_CHARS = 5000
EVALUATED_CHARS_PER_TOKEN = 6  # generous: English BPE averages about 4, so the span checked covers all that is evaluated
SHINGLE_WORDS = 8
_OVERLAP_PROBES = 2000
_OVERLAP_REFUSE_FRACTION = 0.10


@dataclass(frozen=True)
class TextSource:
    """A checked text file, its hash and the domain it stands for (the file's stem unless shipped with a name)."""

    path: Path
    sha256: str
    text: str
    domain: str = ""


def domain_of(path: Path) -> str:
    """The domain name of a text file: its shipped name, else the file's stem."""
    return _SHIPPED_DOMAINS.get(Path(path).resolve(), Path(path).stem)


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
    return TextSource(path=path, sha256=sha256_file(path), text=text, domain=domain_of(path))


def split_paths(value: str | Sequence[str | Path] | None, default: Sequence[Path]) -> list[Path]:
    """``calib=a.txt,b.txt`` or a list, or the shipped default."""
    if value is None or value == "":
        return list(default)
    if isinstance(value, str):
        return [Path(part) for part in value.split(",") if part]
    return [Path(part) for part in value]


def load_texts(paths: Sequence[Path], role: str) -> list[TextSource]:
    """Read every calibration or evaluation file."""
    if not paths:
        raise UsageError(f"no {role} text given")
    return [read_text_file(path, role) for path in paths]


def load_calibration(paths: Sequence[Path]) -> list[TextSource]:
    """Read every calibration file."""
    return load_texts(paths, "calibration")


def load_evaluation(paths: Sequence[Path]) -> list[TextSource]:
    """Read the evaluation domains; two files of one domain name are refused (the report keys on it)."""
    sources = load_texts(paths, "evaluation")
    names = [s.domain for s in sources]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise UsageError(f"evaluation domains must have distinct file names; {', '.join(duplicated)} appears twice")
    return sources


def unseen_domains(calibration: Sequence[TextSource], evaluation: Sequence[TextSource]) -> list[str]:
    """Evaluation domains no calibration (or distillation training) text came from."""
    seen = {s.domain for s in calibration}
    return [s.domain for s in evaluation if s.domain not in seen]


def word_shingles(text: str, words: int = SHINGLE_WORDS) -> list[str]:
    """Every run of ``words`` consecutive words, lower-cased: line breaks, wrapping and punctuation cannot hide a copy."""
    tokens = re.findall(r"\w+", text.lower())
    return [" ".join(tokens[i:i + words]) for i in range(max(0, len(tokens) - words + 1))]


def shingle_set(text: str) -> set[int]:
    """Hashes of every word shingle of ``text``."""
    return {hash(shingle) for shingle in word_shingles(text)}


def shared_shingle_fraction(probe_text: str, reference: set[int]) -> float:
    """Share of (up to 2,000 evenly sampled) word shingles of ``probe_text`` found in a :func:`shingle_set`."""
    probe = word_shingles(probe_text)
    if not probe:
        return 0.0
    probe = probe[:: max(1, len(probe) // _OVERLAP_PROBES)][:_OVERLAP_PROBES]
    return sum(hash(shingle) in reference for shingle in probe) / len(probe)


def eval_skip(text: str) -> int:
    """Characters of an evaluation text's opening left out (a title page, a licence header) when the text is long."""
    return EVAL_SKIP_CHARS if len(text) > 4 * EVAL_SKIP_CHARS else 0


def evaluated_span(text: str, tokens: int) -> str:
    """The part of an evaluation text that evaluating ``tokens`` tokens reads (or a little more)."""
    skip = eval_skip(text)
    return text[skip: skip + tokens * EVALUATED_CHARS_PER_TOKEN]


def check_disjoint(calibration: Sequence[TextSource], evaluation: Sequence[TextSource], evaluated_tokens: int = 2048) -> None:
    """Refuse calibration text that contains evaluation text: the same file, or 10% of the 8-word sequences of the
    whole evaluation file or of the part of it that is evaluated (its first ``evaluated_tokens`` after the opening)."""
    for evaluated in evaluation:
        for source in calibration:
            if source.sha256 == evaluated.sha256:
                raise UsageError(f"calibration text {source.path} is the evaluation text {evaluated.path}; they must not overlap")
    for source in calibration:
        reference = shingle_set(source.text)
        for evaluated in evaluation:
            for probe, what in ((evaluated.text, "the evaluation text"),
                                (evaluated_span(evaluated.text, evaluated_tokens), "the evaluated part of")):
                shared = shared_shingle_fraction(probe, reference)
                if shared > _OVERLAP_REFUSE_FRACTION:
                    raise UsageError(f"calibration text {source.path} contains {100 * shared:.0f}% of {what} "
                                     f"{evaluated.path} (sequences of {SHINGLE_WORDS} words); they must not overlap")


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


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'”’)]*\s+")


def text_sentences(text: str, limit: int, min_chars: int = 20, max_chars: int = 400, skip_chars: int = 0) -> list[str]:
    """Up to ``limit`` sentences of ``text`` (after ``skip_chars``), whitespace-joined, between ``min_chars`` and ``max_chars``."""
    found = []
    for piece in _SENTENCE_END.split(text[skip_chars:]):
        sentence = " ".join(piece.split())
        if min_chars <= len(sentence) <= max_chars:
            found.append(sentence)
            if len(found) == limit:
                break
    return found


def domain_sentences(sources: Sequence[TextSource], per_domain: int) -> list[tuple[str, list[str]]]:
    """``per_domain`` sentences of each source, by domain (evaluation text skips its opening, as for decoders)."""
    return [(s.domain, text_sentences(s.text, per_domain, skip_chars=eval_skip(s.text)))
            for s in sources]


def calibration_batches(tokenizer, sources: Sequence[TextSource], total: int, batch_size: int, max_length: int) -> list[dict]:
    """About ``total`` tokenised calibration sentences, as many from each source, batch by batch, each padded to its longest."""
    per_domain = -(-total // len(sources))
    sentences = [s for _, found in domain_sentences(sources, per_domain) for s in found]
    if not sentences:
        raise UsageError("the calibration text has no sentences of 20 to 400 characters")
    return [dict(tokenizer(sentences[i:i + batch_size], padding=True, truncation=True, max_length=max_length, return_tensors="pt"))
            for i in range(0, len(sentences), batch_size)]


def domain_windows(tokenizer, sources: list[TextSource], windows: int) -> torch.Tensor | None:
    """``windows`` windows of 512 tokens spread over ``sources`` (the first windows of each domain in turn)."""
    if not sources:
        return None
    per_domain = -(-windows // len(sources))
    picked = [token_windows(tokenizer, s.text, 512, per_domain * 512, skip_chars=eval_skip(s.text))
              for s in sources]
    rows = [w[i] for i in range(per_domain) for w in picked if i < w.shape[0]]
    return torch.stack(rows[:windows])
