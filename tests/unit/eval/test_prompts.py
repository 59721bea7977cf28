"""The app-prompt gate: prompt files checked row by row, answers compared token by token, and a broken model failing."""

from __future__ import annotations

import json

import pytest
import torch

from compress.core.config import load_target
from compress.core.errors import UsageError
from compress.eval.gate import FAIL, PASS
from compress.eval.prompts import (
    DEFAULT_PROMPTS,
    PromptCase,
    answer_pair,
    compare_prompts,
    load_prompts,
    prompt_checks,
    prompt_ids,
    resolve_prompts,
    torch_greedy,
)
from compress.models.loading import load_causal_lm, load_tokenizer
from tests.conftest import build_tiny_llama, build_tokenizer


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory):
    folder = build_tiny_llama(tmp_path_factory.mktemp("chat") / "m", chat_template=True, initializer_range=0.2)
    return folder


def test_the_shipped_prompts_load_and_their_expectations_compile():
    cases = load_prompts(DEFAULT_PROMPTS)
    assert len(cases) == 40 and len({c.id for c in cases}) == 40
    assert sum(c.expect is not None for c in cases) >= 15
    paris = next(c for c in cases if c.prompt == "What is the capital of France?")
    assert paris.expect == "Paris"


@pytest.mark.parametrize(("row", "problem"), [
    ({"prompt": ""}, "'prompt' must be non-empty"),
    ({"prompt": "Hi", "expect": "(unclosed"}, "'expect' is not a regular expression"),
    ({"prompt": "Hi", "expect": 3}, "'expect' must be text"),
])
def test_a_bad_prompt_row_is_named(tmp_path, row, problem):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(UsageError, match=rf"prompts {path} row 2: {problem}"):
        load_prompts(path)


def test_which_prompts_a_model_gets():
    chat, plain = build_tokenizer(chat_template=True), build_tokenizer()
    assert len(resolve_prompts(None, chat)[0]) == 40
    assert resolve_prompts(None, plain) == ([], "none: the model has no chat template and no prompts= file was given")
    assert resolve_prompts("off", chat)[0] == []
    text = chat.decode(prompt_ids(chat, "Where is the charger?"))
    assert text == "<|user|>Where is the charger?\n" and plain.decode(prompt_ids(plain, "Hi")) == "Hi"


def test_answer_pairs_measure_the_matched_prefix():
    assert answer_pair([1, 2, 3, 4], [1, 2, 3, 4]) == {
        "identical": True,
        "first_divergence": None,
        "prefix_fraction": 1.0,
        "first_token_match": True,
    }
    assert answer_pair([1, 2, 3, 4], [1, 2, 9, 9])["prefix_fraction"] == 0.5
    assert answer_pair([1, 2, 3, 4], [7, 2, 3, 4])["first_token_match"] is False
    assert (
        answer_pair([1, 2], [1, 2, 5])["first_divergence"] == 2
        and answer_pair([1, 2], [1, 2, 5])["prefix_fraction"] == 1.0
    )


def test_torch_greedy_matches_generate(chat_llama):
    model, tokenizer = load_causal_lm(chat_llama), load_tokenizer(chat_llama)
    ids = prompt_ids(tokenizer, "Tell me about the weather.")
    ours = torch_greedy(model, [])(ids, 12)
    theirs = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                            pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
    assert ours == theirs


def test_a_broken_model_fails_the_prompt_gate_and_the_teacher_passes(chat_llama):
    teacher, tokenizer = load_causal_lm(chat_llama), load_tokenizer(chat_llama)
    broken = load_causal_lm(chat_llama)
    with torch.no_grad():
        for layer in broken.model.layers:
            layer.mlp.down_proj.weight.mul_(-8.0)  # a sign flip and gain, as a mis-read scale would give
    cases = [PromptCase(str(i), p, expect) for i, (p, expect) in enumerate(
        [("What is the capital of France?", None), ("Name a colour.", None), ("Count to three.", None),
         ("Say hello.", None), ("Describe a robot.", None), ("What is rain?", None)])]
    teacher_generate = torch_greedy(teacher, [tokenizer.eos_token_id])
    same = compare_prompts(cases, tokenizer, teacher_generate, teacher_generate, 16, progress=False, source="test")
    target = load_target("jetson-orin")
    assert same["identical_answers"] == 1.0 and same["answer_prefix_agreement"] == 1.0
    assert {c.verdict for c in prompt_checks(same, target.budgets)} == {PASS}
    bad = compare_prompts(cases, tokenizer, teacher_generate, torch_greedy(broken, [tokenizer.eos_token_id]), 16,
                          progress=False, source="test")
    checks = {c.name: c for c in prompt_checks(bad, target.budgets)}
    assert checks["answer_prefix_agreement"].verdict == FAIL and bad["answer_prefix_agreement"] < 0.35
    # worst first
    assert [r["prefix_fraction"] for r in bad["rows"]] == sorted(
        r["prefix_fraction"] for r in bad["rows"]
    )


def test_expectations_are_checked_on_both_answers():
    class Echo:
        """A 'tokenizer' whose ids are characters, so answers can be written directly."""

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    cases = [PromptCase("a", "capital?", "paris"), PromptCase("b", "colour?", "green")]
    answers = {"capital?": ("Paris.", "Rome."), "colour?": ("Green!", "green")}

    def model_of(which):
        return lambda ids, n: [ord(c) for c in answers["".join(chr(i) for i in ids)][which]]

    import compress.eval.prompts as prompts_module

    original = prompts_module.prompt_ids
    prompts_module.prompt_ids = lambda tokenizer, prompt: [ord(c) for c in prompt]
    try:
        measured = compare_prompts(cases, Echo(), model_of(0), model_of(1), 8, progress=False)
    finally:
        prompts_module.prompt_ids = original
    assert measured["expect_pass_teacher"] == 1.0 and measured["expect_pass_model"] == 0.5
    drop = next(
        c for c in prompt_checks(measured, load_target("jetson-orin").budgets) if c.name == "expect_pass_drop_pct"
    )
    assert drop.value == 50.0 and drop.verdict == FAIL


def test_prompts_decoded_together_get_the_answers_they_get_alone(chat_llama):
    """Left-padded and masked, a batch of prompts of different lengths answers as each prompt does on its own (a model
    held in bf16 and computed in float32, as validation holds the teacher)."""
    from compress.eval.prompts import torch_greedy_batched
    from compress.models.compute import computed_in_float32

    model, tokenizer = load_causal_lm(chat_llama).to(torch.bfloat16), load_tokenizer(chat_llama)
    prompts = [
        prompt_ids(tokenizer, text)
        for text in ("Hi.", "Tell me about the weather on the coast today.", "Count to ten.")
    ]
    eos = [tokenizer.eos_token_id]
    with computed_in_float32(model):
        alone = [torch_greedy(model, eos)(ids, 10) for ids in prompts]
        together = torch_greedy_batched(model, eos, tokenizer.pad_token_id)(prompts, 10)
    assert together == alone


def test_answers_read_in_one_pass_are_what_greedy_decoding_gives(chat_llama):
    """forced_answer_pairs (the prompt and the teacher's answer in one pass) against the deployed model's own greedy
    answers, prompt by prompt: where they first part, whether the first token matches, whether the answer is
    identical."""
    from compress.eval.prompts import forced_answer_pairs, forced_rows

    teacher, tokenizer = load_causal_lm(chat_llama), load_tokenizer(chat_llama)
    eos = [tokenizer.eos_token_id]
    prompts = [
        prompt_ids(tokenizer, text)
        for text in (
            "Hi.",
            "Tell me about the weather on the coast today.",
            "Count to ten.",
            "Name a colour.",
            "What is rain?",
            "Describe a robot in a few words.",
        )
    ]
    answers = [torch_greedy(teacher, eos)(ids, 12) for ids in prompts]
    parted = []
    for scale in (0.02, 0.1, 0.4):
        deployed = load_causal_lm(chat_llama)
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for layer in deployed.model.layers:
                weight = layer.mlp.down_proj.weight
                weight.add_(scale * weight.std() * torch.randn(weight.shape, generator=generator))
            logits = deployed(forced_rows(prompts, answers, tokenizer.pad_token_id)).logits
        forced = forced_answer_pairs(prompts, answers, lambda i, logits=logits: logits[i])
        decoded = [
            answer_pair(answer, torch_greedy(deployed, eos)(ids, 12))
            for ids, answer in zip(prompts, answers, strict=True)
        ]
        for ours, theirs in zip(forced, decoded, strict=True):
            assert {k: ours[k] for k in ("identical", "prefix_fraction", "first_token_match")} == \
                   {k: theirs[k] for k in ("identical", "prefix_fraction", "first_token_match")}
        parted += [pair["prefix_fraction"] for pair in forced]
    assert any(0 < fraction < 1 for fraction in parted) and 1.0 in parted  # answers that part midway and whole ones
