"""The app's own prompts as a gate: greedy answers of the deployed model against the teacher's on the same prompts.

A prompt file is JSON lines, ``{"prompt": ..., "expect": optional regex, "id": optional}``. Each prompt is rendered
as the app sends it (a user turn in the model's chat template, the generation prompt added; raw text led by the window
prefix for a model without one), both models answer greedily, and the comparison gives: the share of identical
answers, the mean fraction of the teacher's answer the deployed model matches before it first differs, the share whose
first token matches, and, for prompts with ``expect``, how often each model's answer matches it (case-insensitive
regular expression). ``prompts=`` names the file; chat models get the shipped set by default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import regex
import torch
from tqdm import tqdm

from compress.catalog import TEXT, catalog_dir
from compress.core.data_files import DataSpec, opened_rows
from compress.core.errors import UsageError
from compress.core.text import has_chat_template, window_prefix
from compress.eval.figures import AnswerPair
from compress.eval.gate import Check, lower_bound_check, upper_bound_check

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = catalog_dir(TEXT) / "chat" / "prompts_evaluation.jsonl"
# The chat calibration set's prompts (one per line): never the gate's, so a search may choose by them.
SELECTION_PROMPTS = catalog_dir(TEXT) / "chat" / "prompts_calibration.txt"
# Prompts with an expected answer that neither the gate nor calibration uses: what a search checks expected answers on.
SELECTION_EXPECT_PROMPTS = catalog_dir(TEXT) / "chat" / "prompts_selection.jsonl"
PROMPTS_OFF = "off"
Generate = Callable[[list[int], int], list[int]]  # one prompt's ids, new tokens -> the greedy answer's ids
BatchGenerate = Callable[[list[list[int]], int], list[list[int]]]  # the same for a list of prompts at once
# prompts decoded together by a batched generator (one pass over the weights per token for all of them)
PROMPT_BATCH = 16


@dataclass(frozen=True)
class PromptCase:
    """One prompt of the app, what a right answer contains (a regex) when the file says, and its id."""

    id: str
    prompt: str
    expect: str | None = None


def load_prompts(path: Path) -> list[PromptCase]:
    """Read and check a prompt file; every problem names the file and the row."""
    path = Path(path)
    if path.suffix.lower() not in (".jsonl", ".json"):
        raise UsageError(f"prompts={path}: expected a JSON-lines file of {{\"prompt\": ..., \"expect\": ...}}")
    cases, seen = [], set()
    with opened_rows(DataSpec(path), "prompts") as rows:
        if "prompt" not in (rows.column_names or []):
            raise UsageError(f"prompts {path}: no 'prompt' field (fields: {', '.join(rows.column_names or [])})")
        for number, row in enumerate(rows, start=1):
            cases.append(_case(row, number, path))
            if cases[-1].id in seen:
                raise UsageError(f"prompts {path} row {number}: id {cases[-1].id!r} appears twice")
            seen.add(cases[-1].id)
    if not cases:
        raise UsageError(f"prompts {path} has no rows")
    return cases


def _case(row: dict[str, Any], number: int, path: Path) -> PromptCase:
    where = f"prompts {path} row {number}"
    prompt, expect = row.get("prompt"), row.get("expect")
    if not isinstance(prompt, str) or not prompt.strip():
        raise UsageError(f"{where}: 'prompt' must be non-empty text")
    if expect is not None:
        if not isinstance(expect, str) or not expect:
            raise UsageError(f"{where}: 'expect' must be text (a regular expression)")
        try:
            regex.compile(expect)
        except regex.error as exc:
            raise UsageError(f"{where}: 'expect' is not a regular expression ({exc})") from exc
    return PromptCase(str(row.get("id") or number), prompt, expect)


def resolve_prompts(value: str | None, tokenizer) -> tuple[list[PromptCase], str]:
    """The prompts a validation uses and why: ``prompts=FILE``; ``off``; or the shipped set for a model with a chat
    template."""
    if value == PROMPTS_OFF:
        return [], "prompts=off"
    if value:
        return load_prompts(Path(value)), str(value)
    if has_chat_template(tokenizer):
        return load_prompts(DEFAULT_PROMPTS), "the shipped assistant prompts (the model has a chat template)"
    return [], "none: the model has no chat template and no prompts= file was given"


def check_prompt_lengths(cases: list[PromptCase], tokenizer, new_tokens: int, context_length: int) -> None:
    """Refuse a prompt that, with the answer's ``new_tokens``, does not fit the target's context (the device could not
    take it, so a verdict on it would say nothing), naming the prompt and both lengths."""
    for case in cases:
        length = len(prompt_ids(tokenizer, case.prompt))
        if length + new_tokens > context_length:
            raise UsageError(
                f"prompt {case.id!r} is {length} tokens, which with {new_tokens} new tokens exceeds the target's "
                f"context_length {context_length}; shorten it, or set budgets.context_length if the device takes more"
            )


def selection_prompts(count: int) -> list[PromptCase]:
    """The first ``count`` of the shipped chat calibration prompts (:data:`SELECTION_PROMPTS`)."""
    lines = [line.strip() for line in SELECTION_PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [PromptCase(f"calibration-{number}", text) for number, text in enumerate(lines[:count], start=1)]


def selection_expect_prompts(count: int) -> list[PromptCase]:
    """The first ``count`` of the shipped held-out prompts with an expected answer
    (:data:`SELECTION_EXPECT_PROMPTS`)."""
    cases = load_prompts(SELECTION_EXPECT_PROMPTS)[:count]
    return [PromptCase(f"selection-{number}", case.prompt, case.expect) for number, case in enumerate(cases, start=1)]


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt as the app sends it: a user turn in the chat template with the generation prompt, else the prefixed
    text."""
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False).input_ids
    return window_prefix(tokenizer) + tokenizer(prompt, add_special_tokens=False).input_ids


def torch_greedy(model, eos_ids: Sequence[int]) -> Generate:
    """Greedy decoding of a torch causal LM with its KV cache, stopping after an end-of-sequence token as the ONNX
    decoder does."""
    stop = set(eos_ids)

    @torch.no_grad()
    def generate(ids: list[int], new_tokens: int) -> list[int]:
        out = model(torch.tensor([ids]), use_cache=True)
        answer: list[int] = []
        for _ in range(new_tokens):
            token = int(out.logits[0, -1].argmax())
            answer.append(token)
            if token in stop:
                break
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        return answer

    return generate


def one_at_a_time(generate: Generate) -> BatchGenerate:
    """A single-prompt generator (ONNX Runtime's decoder) as a batch generator."""
    return lambda prompts, new_tokens: [generate(ids, new_tokens) for ids in prompts]


def torch_greedy_batched(model, eos_ids: Sequence[int], pad_id: int) -> BatchGenerate:
    """Greedy decoding of a torch causal LM over many prompts at once (left-padded, masked), each answer cut after its
    first end-of-sequence token.

    A model computed part by part (held in 16 bits, or as quantized levels) pays for each pass over its weights once per
    token for the whole batch instead of once per token per prompt; the answers are the one-prompt answers up to float
    summation order.
    """
    stop = set(eos_ids)

    @torch.no_grad()
    def generate(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(ids) for ids in prompts)
        device = next(model.parameters()).device  # where the model is held, so where it computes
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=sorted(stop) or None, pad_token_id=pad_id)
        answers = []
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, token in enumerate(row) if token in stop), len(row))
            answers.append(row[:cut])
        return answers

    return generate


def answer_pair(teacher: list[int], model: list[int]) -> dict[str, Any]:
    """How far the deployed answer follows the teacher's: the first differing position and the matched fraction."""
    diverges = next(
        (i for i, (a, b) in enumerate(zip(teacher, model, strict=False)) if a != b), min(len(teacher), len(model))
    )
    identical = teacher == model
    return {"identical": identical, "first_divergence": None if identical else diverges,
            "prefix_fraction": 1.0 if identical else diverges / max(1, len(teacher)),
            "first_token_match": bool(teacher and model and teacher[0] == model[0])}


def forced_answer_pairs(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                        logits_of: Callable[[int], Any]) -> list[AnswerPair]:
    """:func:`answer_pair` of a model's greedy answers without decoding them: greedy decoding follows the teacher's
    answer exactly as long as the model's most likely next token, given the prompt and the teacher's tokens so far, is
    the teacher's next one. So one pass over each prompt followed by the teacher's answer (``logits_of(i)``: row ``i``'s
    ``(tokens, vocab)`` logits, the row right-padded) gives where the model's answer would first differ, whether its
    first token matches, and whether it is identical (it also stops where the teacher stopped, or runs to the same
    length)."""
    pairs = []
    for index, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        logits = logits_of(index)
        start = len(prompt) - 1
        chosen = [int(logits[start + step].argmax()) for step in range(len(answer))]
        diverges = next(
            (step for step, (ours, theirs) in enumerate(zip(chosen, answer, strict=True)) if ours != theirs), None
        )
        identical = diverges is None
        pairs.append({"identical": identical, "first_divergence": diverges,
                      "prefix_fraction": 1.0 if identical else diverges / max(1, len(answer)),
                      "first_token_match": bool(answer) and chosen[0] == answer[0]})
    return pairs


def forced_rows(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """Each prompt followed by its answer, right-padded to one length (padding after a token does not change its
    logits)."""
    width = max(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))
    return torch.tensor(
        [[*p, *a] + [pad_id] * (width - len(p) - len(a)) for p, a in zip(prompts, answers, strict=True)]
    )


# The longest an ``expect`` pattern may take on one answer: a pattern that backtracks catastrophically is an error, not
# a hang (the ``regex`` engine takes a timeout; ``re`` does not).
EXPECT_TIMEOUT_S = 2.0


def passes_expect(expect: str | None, text: str) -> bool | None:
    """Whether an answer's text matches its prompt's ``expect`` regular expression (None: the prompt has none); a
    pattern that runs past :data:`EXPECT_TIMEOUT_S` on it is a usage error naming the pattern."""
    if expect is None:
        return None
    try:
        return regex.search(expect, text, regex.IGNORECASE, timeout=EXPECT_TIMEOUT_S) is not None
    except TimeoutError as exc:
        raise UsageError(
            f"the prompt's expect pattern {expect!r} ran past {EXPECT_TIMEOUT_S:g} s on a {len(text)}-character "
            "answer (it backtracks without bound): write it so it cannot"
        ) from exc


def answer_prompts(cases: list[PromptCase], tokenizer, generate: BatchGenerate, new_tokens: int, progress: bool = True,
                   desc: str = "answers") -> list[list[int]]:
    """One model's greedy answer (token ids) to every prompt, :data:`PROMPT_BATCH` prompts at a time."""
    return answer_ids([prompt_ids(tokenizer, case.prompt) for case in cases], generate, new_tokens, progress, desc)


def answer_ids(ids: list[list[int]], generate: BatchGenerate, new_tokens: int, progress: bool = False,
               desc: str = "answers") -> list[list[int]]:
    """One model's greedy answer to each prompt given as token ids, :data:`PROMPT_BATCH` prompts at a time."""
    answers: list[list[int]] = []
    for start in tqdm(
        range(0, len(ids), PROMPT_BATCH), desc=f"app prompts ({desc})", disable=not progress, leave=False
    ):
        answers += generate(ids[start:start + PROMPT_BATCH], new_tokens)
    return answers


def compare_answers(
    cases: list[PromptCase],
    tokenizer,
    teacher: list[list[int]],
    deployed: list[list[int]],
    new_tokens: int,
    source: str = "",
) -> dict[str, Any]:
    """Compare the two models' answers: one row per prompt (worst first) and the summary the gate reads."""
    rows = []
    for order, (case, teacher_ids, model_ids) in enumerate(zip(cases, teacher, deployed, strict=True)):
        pair = answer_pair(teacher_ids, model_ids)
        teacher_text = tokenizer.decode(teacher_ids, skip_special_tokens=True)
        model_text = tokenizer.decode(model_ids, skip_special_tokens=True)
        common = (
            ""
            if pair["identical"]
            else tokenizer.decode(teacher_ids[: pair["first_divergence"]], skip_special_tokens=True)
        )
        rows.append(
            {
                "id": case.id,
                "order": order,
                "prompt": case.prompt,
                "expect": case.expect,
                "prompt_ids": prompt_ids(tokenizer, case.prompt),
                **pair,
                "teacher_ids": teacher_ids,
                "model_ids": model_ids,
                "teacher_answer": teacher_text,
                "model_answer": model_text,
                "common_prefix": common,
                "teacher_passes": passes_expect(case.expect, teacher_text),
                "model_passes": passes_expect(case.expect, model_text),
            }
        )
    rows.sort(key=lambda r: (r["prefix_fraction"], r["order"]))
    return {"source": source, "new_tokens": new_tokens, "rows": rows, **summary(rows)}


def compare_prompts(cases: list[PromptCase], tokenizer, teacher: Generate, deployed: Generate, new_tokens: int,
                    progress: bool = True, source: str = "") -> dict[str, Any]:
    """Answer every prompt with both models and compare them (:func:`compare_answers`)."""
    return compare_answers(
        cases,
        tokenizer,
        answer_prompts(cases, tokenizer, one_at_a_time(teacher), new_tokens, progress, "teacher"),
        answer_prompts(cases, tokenizer, one_at_a_time(deployed), new_tokens, progress, "deployed"),
        new_tokens,
        source,
    )


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The shares the gate checks, from the per-prompt rows."""
    count = len(rows)
    expected = [r for r in rows if r["expect"] is not None]
    return {
        "prompts": count,
        "identical_answers": sum(r["identical"] for r in rows) / count,
        "answer_prefix_agreement": sum(r["prefix_fraction"] for r in rows) / count,
        "first_token_agreement": sum(r["first_token_match"] for r in rows) / count,
        "prompts_with_expect": len(expected),
        "expect_pass_teacher": sum(r["teacher_passes"] for r in expected) / len(expected) if expected else None,
        "expect_pass_model": sum(r["model_passes"] for r in expected) / len(expected) if expected else None,
    }


def prompt_checks(measured: dict[str, Any] | None, budgets) -> list[Check]:
    """The gate's checks on the app prompts (none when no prompts were evaluated)."""
    if not measured:
        return []
    where = (
        f"{measured['prompts']} app prompts ({measured['source']}), "
        f"greedy {measured['new_tokens']} tokens vs the teacher"
    )
    checks = [
        lower_bound_check(
            "answer_prefix_agreement",
            measured["answer_prefix_agreement"],
            budgets.min_answer_prefix_agreement,
            "measured",
            "",
            f"mean share of the teacher's answer matched before the first difference; {where}",
        ),
        lower_bound_check(
            "first_token_agreement",
            measured["first_token_agreement"],
            budgets.min_first_token_agreement,
            "measured",
            "",
            f"share of answers whose first token is the teacher's; {where}",
        ),
        lower_bound_check(
            "identical_answers",
            measured["identical_answers"],
            budgets.min_identical_answers,
            "measured",
            "",
            f"share of answers identical to the teacher's; {where}",
        ),
    ]
    if measured.get("expect_pass_teacher") is not None:
        drop = 100.0 * (measured["expect_pass_teacher"] - measured["expect_pass_model"])
        checks.append(upper_bound_check(
            "expect_pass_drop_pct", drop, budgets.max_expect_pass_drop_pct, "measured", "points",
            f"answers matching 'expect': teacher {100 * measured['expect_pass_teacher']:.0f}%, model "
            f"{100 * measured['expect_pass_model']:.0f}% of {measured['prompts_with_expect']}"))
    return checks
