"""Calibration and evaluation text: loading, checking, and cutting into token windows."""

from __future__ import annotations

import collections
import hashlib
import random
import re
from collections.abc import Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from compress.catalog import TEXT, catalog_dir
from compress.core.data_files import DataSpec, Record, iter_records, parse_spec
from compress.core.errors import UsageError
from compress.core.files import (
    atomic_write_text,
    cache_root,
    cached_sha256,
    require_readable_file,
    sha256_file,
    sha256_path,
)
from compress.core.token_cache import encode_plain

_SHIPPED = catalog_dir(TEXT)
# (domain, file): the shipped text (calib_data/PROVENANCE.md). Calibration and evaluation never share
# a document; the evaluation domains no calibration domain covers are the "unseen" ones.
DEFAULT_CALIBRATION_DOMAINS: tuple[tuple[str, Path], ...] = (
    ("austen", _SHIPPED / "calibration" / "emma.txt"),
    ("austen", _SHIPPED / "calibration" / "mansfieldpark.txt"),
    ("press", _SHIPPED / "calibration" / "press.txt"),
    ("fiction", _SHIPPED / "calibration" / "fiction.txt"),
    ("lore", _SHIPPED / "calibration" / "lore.txt"),
    ("chat", _SHIPPED / "chat" / "calibration.jsonl"),  # for a model with a chat template (usable_sources)
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
# generous: English BPE averages about 4, so the span checked covers all that is evaluated
EVALUATED_CHARS_PER_TOKEN = 6
SHINGLE_WORDS = 8
MAX_EVALUATION_DOMAINS = 64  # each domain is evaluated on its own; the gate takes the worst
_OVERLAP_PROBES = 2000
_OVERLAP_REFUSE_FRACTION = 0.10


@dataclass(frozen=True)
class TextSource:
    """One domain's checked text: the file it came from, the file's hash and the domain's name (the file's stem unless
    shipped with a name, or the rows' ``domain``); plain text, chat conversations (rendered later with the model's own
    chat template), or both."""

    path: Path
    sha256: str
    text: str
    domain: str = ""
    conversations: tuple[tuple[dict[str, str], ...], ...] = ()
    whole_file: bool = True  # a book-like .txt file, whose opening (a title page, a licence) evaluation leaves out

    @property
    def is_chat(self) -> bool:
        return bool(self.conversations)

    @property
    def words(self) -> str:
        """Every word the source holds (its text and its messages' contents): what overlap checks compare."""
        contents = "\n".join(m["content"] for conversation in self.conversations for m in conversation)
        return "\n".join(part for part in (self.text, contents) if part)


def domain_of(path: Path) -> str:
    """The domain name of a text file: its shipped name, else the file's stem."""
    return _SHIPPED_DOMAINS.get(Path(path).resolve(), Path(path).stem)


def read_text_file(path: Path, role: str) -> TextSource:
    """Read a UTF-8 text file; missing, empty or non-UTF-8 files are usage errors."""
    path = Path(path)
    require_readable_file(path, f"{role} text")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{role} text {path} is not UTF-8 (byte {exc.start}: {raw[exc.start : exc.start + 1]!r})"
        ) from exc
    if not text.strip():
        raise UsageError(f"{role} text {path} is empty")
    return TextSource(path=path, sha256=sha256_file(path), text=text, domain=domain_of(path))


def split_paths(value: str | Sequence[str | Path] | None, default: Sequence[Path]) -> list[DataSpec]:
    """``calib=a.txt,b.parquet:body`` or a list, or the shipped default."""
    if value is None or value == "":
        return [DataSpec(Path(path)) for path in default]
    parts = value.split(",") if isinstance(value, str) else list(value)
    return [parse_spec(part) for part in parts if str(part)]


def read_source(spec: DataSpec | Path, role: str) -> list[TextSource]:
    """The domains of one data file: a ``.txt`` file is one; a table or JSON-lines file one per ``domain`` value."""
    spec = spec if isinstance(spec, DataSpec) else DataSpec(Path(spec))
    if spec.is_plain_text:
        if spec.column:
            raise UsageError(f"{role} text {spec.path} is plain text; it has no column {spec.column!r}")
        return [read_text_file(spec.path, role)]
    by_domain: dict[str, list[Record]] = {}
    for record in iter_records(spec, role):
        by_domain.setdefault(record.domain, []).append(record)
    if not by_domain:
        raise UsageError(f"{role} data {spec} has no rows")
    digest = sha256_path(spec.path)
    return [TextSource(path=spec.path, sha256=digest, domain=domain, whole_file=False,
                       text="\n\n".join(r.text for r in records if r.text),
                       conversations=tuple(r.messages for r in records if r.messages))
            for domain, records in by_domain.items()]


def load_texts(specs: Sequence[DataSpec | Path], role: str) -> list[TextSource]:
    """Read every calibration or evaluation file."""
    if not specs:
        raise UsageError(f"no {role} text given")
    return [source for spec in specs for source in read_source(spec, role)]


def load_calibration(specs: Sequence[DataSpec | Path]) -> list[TextSource]:
    """Read every calibration file."""
    return load_texts(specs, "calibration")


def load_evaluation(specs: Sequence[DataSpec | Path]) -> list[TextSource]:
    """Read the evaluation domains; two sources of one domain name are refused (the report keys on it)."""
    sources = load_texts(specs, "evaluation")
    if len(sources) > MAX_EVALUATION_DOMAINS:
        raise UsageError(
            f"evaluation text has {len(sources):,} domains; at most {MAX_EVALUATION_DOMAINS} are evaluated (each "
            "is its own measurement of validate.eval_tokens): give fewer distinct 'domain' values"
        )
    names = [s.domain for s in sources]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise UsageError(f"evaluation domains must have distinct names (file names or 'domain' values); "
                         f"{', '.join(duplicated)} appears twice")
    return sources


def unseen_domains(calibration: Sequence[TextSource], evaluation: Sequence[TextSource]) -> list[str]:
    """Evaluation domains no calibration (or distillation training) text came from."""
    seen = {s.domain for s in calibration}
    return [s.domain for s in evaluation if s.domain not in seen]


_WORD = re.compile(r"\w+")


def word_shingles(text: str, words: int = SHINGLE_WORDS) -> list[str]:
    """Every run of ``words`` consecutive words, lower-cased: line breaks, wrapping and punctuation cannot hide a
    copy."""
    tokens = _WORD.findall(text.lower())
    return [" ".join(tokens[i:i + words]) for i in range(max(0, len(tokens) - words + 1))]


def shingle_set(text: str) -> set[int]:
    """Hashes of every word shingle of ``text``."""
    return {hash(shingle) for shingle in word_shingles(text)}


def sampled_shingles(text: str, words: int = SHINGLE_WORDS, probes: int = _OVERLAP_PROBES) -> list[str]:
    """Up to ``probes`` evenly spaced word shingles of ``text`` (those of :func:`word_shingles` at every
    ``len // probes``-th place), found in two passes that hold ``words`` words at a time, never every shingle of a long
    text."""
    lowered = text.lower()
    count = max(0, sum(1 for _ in _WORD.finditer(lowered)) - words + 1)
    if not count:
        return []
    starts = set(range(0, count, max(1, count // probes))[:probes])
    recent: collections.deque[str] = collections.deque(maxlen=words)
    found = []
    for index, match in enumerate(_WORD.finditer(lowered)):
        recent.append(match.group())
        if index - words + 1 in starts:
            found.append(" ".join(recent))
    return found


def shared_shingle_fraction(probe_text: str, reference: set[int]) -> float:
    """Share of (up to 2,000 evenly sampled) word shingles of ``probe_text`` found in a :func:`shingle_set`."""
    probe = sampled_shingles(probe_text)
    if not probe:
        return 0.0
    return sum(hash(shingle) in reference for shingle in probe) / len(probe)


def eval_skip(source: TextSource) -> int:
    """Characters of an evaluation text's opening left out (a title page, a licence header) when it is a long book-like
    file."""
    return EVAL_SKIP_CHARS if source.whole_file and len(source.text) > 4 * EVAL_SKIP_CHARS else 0


def evaluated_span(source: TextSource, tokens: int) -> str:
    """The part of an evaluation source that evaluating ``tokens`` tokens reads (or a little more)."""
    skip = eval_skip(source)
    return source.words[skip: skip + tokens * EVALUATED_CHARS_PER_TOKEN]


def check_disjoint(
    calibration: Sequence[TextSource], evaluation: Sequence[TextSource], evaluated_tokens: int = 2048
) -> None:
    """Refuse calibration text that contains evaluation text: the same file, or 10% of the 8-word sequences of the
    whole evaluation file or of the part of it that is evaluated (its first ``evaluated_tokens`` after the opening)."""
    for evaluated in evaluation:
        for source in calibration:
            if source.sha256 == evaluated.sha256:
                raise UsageError(
                    f"calibration text {source.path} is the evaluation text {evaluated.path}; they must not overlap"
                )
    checked = _disjoint_marker(calibration, evaluation, evaluated_tokens)
    if checked.is_file():
        return
    _check_shingles(calibration, evaluation, evaluated_tokens)
    with suppress(OSError):  # an unwritable cache only costs the next run the same check
        atomic_write_text(checked, "disjoint\n")


def _disjoint_marker(
    calibration: Sequence[TextSource], evaluation: Sequence[TextSource], evaluated_tokens: int
) -> Path:
    """Where a passed overlap check of exactly these texts is remembered (by content, so any change checks again)."""
    digest = hashlib.sha256(f"{SHINGLE_WORDS} {_OVERLAP_PROBES} {_OVERLAP_REFUSE_FRACTION} {evaluated_tokens}".encode())
    for role, sources in (("calibration", calibration), ("evaluation", evaluation)):
        for source in sources:
            digest.update(
                f"\0{role}\0".encode() + hashlib.sha256(source.words.encode("utf-8", "surrogatepass")).digest()
            )
    return cache_root() / "disjoint" / digest.hexdigest()[:40]


def _check_shingles(calibration: Sequence[TextSource], evaluation: Sequence[TextSource], evaluated_tokens: int) -> None:
    for source in calibration:
        reference = shingle_set(source.words)
        for evaluated in evaluation:
            for probe, what in ((evaluated.words, "the evaluation text"),
                                (evaluated_span(evaluated, evaluated_tokens), "the evaluated part of")):
                shared = shared_shingle_fraction(probe, reference)
                if shared > _OVERLAP_REFUSE_FRACTION:
                    raise UsageError(f"calibration text {source.path} contains {100 * shared:.0f}% of {what} "
                                     f"{evaluated.path} (sequences of {SHINGLE_WORDS} words); they must not overlap")


def window_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer's own rule puts before any text (a BOS token for Llama 3 or Gemma; none for many others).

    Windows are cut from text tokenized without special tokens, then each gets this prefix, so a model trained to see
    its BOS first sees it at the start of every calibration, evaluation and training window.
    """
    plain = tokenizer("a", add_special_tokens=False).input_ids
    special = tokenizer("a", add_special_tokens=True).input_ids
    for start in range(len(special) - len(plain) + 1):
        if special[start:start + len(plain)] == plain:
            return list(special[:start])
    return []


def prefix_tokens(tokenizer) -> list[str]:
    """The window prefix as token strings (what reports say was prepended)."""
    return tokenizer.convert_ids_to_tokens(window_prefix(tokenizer))


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def rendered_conversation(tokenizer, messages: Sequence[dict[str, str]], where: Path | str = "") -> str:
    """A conversation as the deployed model sees it: rendered with the tokenizer's own chat template."""
    if not has_chat_template(tokenizer):
        raise UsageError(f"{where} holds chat conversations, but the model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(list(messages), tokenize=False)


def source_ids(tokenizer, source: TextSource, skip_chars: int = 0, max_tokens: int | None = None) -> torch.Tensor:
    """The token stream of a source (text after ``skip_chars``, then each conversation rendered by the chat template),
    without special tokens the tokenizer would add and without a leading :func:`window_prefix` a template writes
    itself."""
    prefix = window_prefix(tokenizer)
    pieces: list[np.ndarray] = []
    if source.text[skip_chars:].strip():
        pieces.append(_encode_opening(tokenizer, source.text[skip_chars:], max_tokens))
    for conversation in source.conversations:
        if max_tokens is not None and sum(map(len, pieces)) >= max_tokens:
            break
        ids = encode_plain(tokenizer, rendered_conversation(tokenizer, conversation, source.path))
        pieces.append(ids[len(prefix):] if prefix and ids[:len(prefix)].tolist() == prefix else ids)
    ids = torch.from_numpy(np.concatenate(pieces)) if pieces else torch.empty(0, dtype=torch.long)
    return ids if max_tokens is None else ids[:max_tokens]


# Tokens past the budget a prefix must still hold, so the budget's tokens are those of the whole text: only the word at
# the cut can tokenize otherwise.
_CUT_MARGIN_TOKENS = 64
_FIRST_CHARS_PER_TOKEN = 8


def _encode_opening(tokenizer, text: str, max_tokens: int | None) -> np.ndarray:
    """Token ids of ``text``, or of as much of its opening as ``max_tokens`` needs: a growing prefix is tokenized (never
    the whole of a text far longer than the budget), and cut only where it holds ``_CUT_MARGIN_TOKENS`` more."""
    if max_tokens is None:
        return encode_plain(tokenizer, text)
    chars = (max_tokens + _CUT_MARGIN_TOKENS) * _FIRST_CHARS_PER_TOKEN
    while chars < len(text):
        ids = encode_plain(tokenizer, text[:chars])
        if len(ids) >= max_tokens + _CUT_MARGIN_TOKENS:
            return ids[:max_tokens]
        chars *= 4
    return encode_plain(tokenizer, text)


def _windowed(prefix: list[int], body: torch.Tensor) -> torch.Tensor:
    """``(n, window - len(prefix))`` body rows with the prefix in front of each."""
    if not prefix:
        return body
    return torch.cat([torch.tensor(prefix, dtype=torch.long).expand(body.shape[0], -1), body], dim=1)


def token_windows(tokenizer, source: TextSource, window: int, max_tokens: int, skip_chars: int = 0) -> torch.Tensor:
    """Non-overlapping windows over the first ``max_tokens`` of a source (after ``skip_chars``), each led by the window
    prefix.

    Returns a ``(n_windows, window)`` tensor of token ids.
    """
    prefix = window_prefix(tokenizer)
    body = window - len(prefix)
    per_window_cap = max_tokens // window * body if max_tokens >= window else max_tokens
    ids = source_ids(tokenizer, source, skip_chars, max_tokens=per_window_cap)
    n_windows = ids.numel() // body
    if n_windows == 0:
        raise UsageError(
            f"{source.path} ({source.domain}) has only {ids.numel()} tokens; need at least one window of {window}"
        )
    return _windowed(prefix, ids[: n_windows * body].view(n_windows, body))


def calibration_windows(tokenizer, sources: Sequence[TextSource], window: int, n_windows: int, min_tokens: int = 0,
                        at_least: int | None = None) -> torch.Tensor:
    """Calibration windows drawn evenly from all sources, each led by the window prefix; too little text is a usage
    error.

    ``n_windows`` are asked for; with ``at_least``, fewer are taken where the text holds no more (a training budget),
    and only fewer than ``at_least`` is an error. A shipped chat source is left out for a model without a chat template
    (a user's is refused)."""
    sources = usable_sources(tokenizer, sources)
    if not sources:
        raise UsageError("no calibration text this model can read (the shipped chat text needs a chat template)")
    prefix = window_prefix(tokenizer)
    body = window - len(prefix)
    per_source = max(1, -(-n_windows // len(sources)))
    chunks = []
    for source in sources:
        ids = source_ids(tokenizer, source)
        usable = ids.numel() // body
        if usable == 0:
            continue
        chunks.extend(ids[p * body:(p + 1) * body] for p in _calibration_picks(usable, per_source))
    windows = _windowed(prefix, torch.stack(chunks[:n_windows])) if chunks else torch.empty(0, window, dtype=torch.long)
    have = windows.numel()
    needed = n_windows if at_least is None else at_least
    if windows.shape[0] < needed or have < min_tokens:
        raise UsageError(
            f"too little calibration text: {have} tokens in {windows.shape[0]} windows of {window}; "
            f"need {max(min_tokens, needed * window)} tokens"
        )
    return windows


def _calibration_picks(usable: int, per_source: int) -> list[int]:
    """Which of a source's ``usable`` whole windows calibration reads: ``per_source`` of them, evenly spaced."""
    stride = max(1, usable // per_source)
    return list(range(0, usable, stride))[:per_source]


def held_out_windows(tokenizer, sources: Sequence[TextSource], window: int, calibration_count: int, per_domain: int
                     ) -> list[tuple[str, torch.Tensor]]:
    """Windows of the calibration sources that calibration (``calibration_count`` windows) does not read, by domain: the
    window after each one it reads, up to ``per_domain`` per domain. What a search over quantization choices may
    measure itself on without touching the evaluation text."""
    sources = usable_sources(tokenizer, sources)
    prefix = window_prefix(tokenizer)
    body = window - len(prefix)
    per_source = max(1, -(-calibration_count // len(sources)))
    by_domain: dict[str, list[torch.Tensor]] = {}
    for source in sources:
        ids = source_ids(tokenizer, source)
        usable = ids.numel() // body
        read = set(_calibration_picks(usable, per_source))
        free = [p + 1 for p in sorted(read) if p + 1 < usable and p + 1 not in read]
        kept = by_domain.setdefault(source.domain, [])
        kept.extend(ids[p * body:(p + 1) * body] for p in free[:max(0, per_domain - len(kept))])
    return [(domain, _windowed(prefix, torch.stack(rows))) for domain, rows in by_domain.items() if rows]


def usable_sources(tokenizer, sources: Sequence[TextSource]) -> list[TextSource]:
    """The sources a model can read: shipped chat text is for models with a chat template, and left out for others."""
    if has_chat_template(tokenizer):
        return list(sources)
    kept = [s for s in sources if not (s.is_chat and not s.text and Path(s.path).resolve() in _SHIPPED_DOMAINS)]
    for source in kept:
        if source.is_chat:
            raise UsageError(f"{source.path} holds chat conversations, but the model's tokenizer has no chat template")
    return kept


TRAIN_SAMPLE_CHARS = 2_000_000
_TEXT_PIECE_CHARS = 1_000_000


@dataclass(frozen=True)
class TrainingData:
    """``train_data=``: the distillation corpus, read as a stream when training; at plan time only each file's hash and
    the opening rows of each (up to 2 MB of text, for the overlap check against evaluation and the domains it
    covers)."""

    specs: list[DataSpec]
    sha256: list[str]
    sample: list[TextSource]

    @classmethod
    def read(cls, specs: Sequence[DataSpec]) -> TrainingData:
        if not specs:
            raise UsageError("train_data= names no file")
        sample: list[TextSource] = []
        for spec in specs:
            by_domain: dict[str, list[Record]] = {}
            chars = 0
            for record in training_records(spec):
                by_domain.setdefault(record.domain, []).append(record)
                chars += len(record.text) + sum(len(m["content"]) for m in record.messages)
                if chars >= TRAIN_SAMPLE_CHARS:
                    break
            if not by_domain:
                raise UsageError(f"training data {spec} has no rows")
            sample += [
                TextSource(
                    spec.path,
                    "",
                    "\n\n".join(r.text for r in rows if r.text),
                    domain,
                    whole_file=False,
                    conversations=tuple(r.messages for r in rows if r.messages),
                )
                for domain, rows in by_domain.items()
            ]
        return cls(list(specs), [sha256_path(spec.path, cached_sha256) for spec in specs], sample)


def training_records(spec: DataSpec) -> Iterator[Record]:
    """The rows of a training file as a stream; a plain-text file comes in pieces of about a megabyte, cut at a line
    break."""
    if not spec.is_plain_text:
        yield from iter_records(spec, "training", streaming=True)
        return
    require_readable_file(spec.path, "training text")
    with open(spec.path, encoding="utf-8", errors="strict") as handle:
        carry, number = "", 0
        while True:
            try:
                chunk = handle.read(_TEXT_PIECE_CHARS)
            except UnicodeDecodeError as exc:
                raise UsageError(
                    f"training text {spec.path} is not UTF-8 near character {number * _TEXT_PIECE_CHARS}"
                ) from exc
            if not chunk:
                break
            number += 1
            text, _, carry = (carry + chunk).rpartition("\n")
            if text.strip():
                yield Record(number, domain_of(spec.path), text=text)
        if carry.strip():
            yield Record(number + 1, domain_of(spec.path), text=carry)


def packed_windows(
    tokenizer, specs: Sequence[DataSpec], window: int, n_windows: int, progress: bool = False
) -> torch.Tensor:
    """The first ``n_windows`` training windows of a corpus read as a stream: documents tokenized one at a time (chat
    rows rendered by the template), joined with the end-of-sequence token, packed into windows each led by the window
    prefix.

    Only the windows are held, never the corpus; too little text is a usage error.
    """
    prefix = window_prefix(tokenizer)
    body = window - len(prefix)
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    rows: list[torch.Tensor] = []
    pending: list[int] = []
    for spec in specs:
        for record in training_records(spec):
            if record.messages:
                ids = tokenizer(
                    rendered_conversation(tokenizer, record.messages, spec.path), add_special_tokens=False
                ).input_ids
                ids = ids[len(prefix):] if prefix and ids[:len(prefix)] == prefix else ids
            else:
                ids = tokenizer(record.text, add_special_tokens=False).input_ids
            pending += ids + separator
            while len(pending) >= body and len(rows) < n_windows:
                rows.append(torch.tensor(pending[:body], dtype=torch.long))
                pending = pending[body:]
            if len(rows) == n_windows:
                return _windowed(prefix, torch.stack(rows))
    raise UsageError(
        f"too little training text in {', '.join(map(str, specs))}: {len(rows)} windows of {window} tokens; "
        f"need {n_windows}"
    )


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'”’)]*\s+")


def text_sentences(text: str, limit: int, min_chars: int = 20, max_chars: int = 400, skip_chars: int = 0) -> list[str]:
    """Up to ``limit`` sentences of ``text`` (after ``skip_chars``), whitespace-joined, between ``min_chars`` and
    ``max_chars``."""
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
    return [(s.domain, text_sentences(s.words, per_domain, skip_chars=eval_skip(s)))
            for s in sources]


def calibration_batches(
    tokenizer, sources: Sequence[TextSource], total: int, batch_size: int, max_length: int, seed: int | None = None
) -> list[dict]:
    """About ``total`` tokenised calibration sentences, as many from each source, batch by batch, each padded to its
    longest; with a ``seed``, the sentences shuffled first (every batch mixes the domains: what training wants)."""
    sources = usable_sources(tokenizer, sources)
    per_domain = -(-total // len(sources))
    sentences = [s for _, found in domain_sentences(sources, per_domain) for s in found]
    if not sentences:
        raise UsageError("the calibration text has no sentences of 20 to 400 characters")
    if seed is not None:
        random.Random(seed).shuffle(sentences)
    return [
        dict(
            tokenizer(
                sentences[i : i + batch_size], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
            )
        )
        for i in range(0, len(sentences), batch_size)
    ]


def domain_windows(tokenizer, sources: list[TextSource], windows: int) -> torch.Tensor | None:
    """``windows`` windows of 512 tokens spread over ``sources`` (the first windows of each domain in turn)."""
    if not sources:
        return None
    per_domain = -(-windows // len(sources))
    picked = [token_windows(tokenizer, s, 512, per_domain * 512, skip_chars=eval_skip(s))
              for s in usable_sources(tokenizer, sources)]
    rows = [w[i] for i in range(per_domain) for w in picked if i < w.shape[0]]
    return torch.stack(rows[:windows])
