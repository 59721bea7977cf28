"""Build the shipped chat set: the project's own prompts, answered by the embedded teacher.

Reads ``calib_data/chat/prompts_calibration.txt`` (one prompt per line) and
``calib_data/chat/prompts_evaluation.jsonl`` (the app-prompt gate's default set; no prompt in both),
answers each greedily (at most 96 new tokens, fp32 torch, the tokenizer's chat template with its
default system turn) with SmolLM2-135M-Instruct, and writes ``calib_data/chat/calibration.jsonl``
and ``calib_data/chat/evaluation.jsonl``: one ``{"domain": "chat", "messages": [user, assistant]}``
per prompt. Greedy decoding has no seed to set; the answers are reproducible on this model.

    .venv/bin/python bench/make_chat_set.py
"""

from __future__ import annotations

import json
from pathlib import Path

from compress.core.files import atomic_write_text
from compress.eval.prompts import DEFAULT_PROMPTS, load_prompts, prompt_ids, torch_greedy
from compress.models.loading import load_causal_lm, load_tokenizer
from compress.models.sources import DEFAULT_MODEL, materialize, resolve_model

CHAT = DEFAULT_PROMPTS.parent
NEW_TOKENS = 96


def answers(prompts: list[str]) -> list[dict]:
    folder = materialize(resolve_model(DEFAULT_MODEL))
    model, tokenizer = load_causal_lm(folder), load_tokenizer(folder)
    eos = [i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if i is not None]
    generate = torch_greedy(model, eos)
    rows = []
    for number, prompt in enumerate(prompts, start=1):
        answer = tokenizer.decode(generate(prompt_ids(tokenizer, prompt), NEW_TOKENS), skip_special_tokens=True).strip()
        rows.append(
            {
                "domain": "chat",
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
            }
        )
        print(f"{number:3d}/{len(prompts)} {prompt[:50]!r} -> {answer[:60]!r}", flush=True)
    return rows


def main() -> None:
    calibration = [
        line.strip()
        for line in (CHAT / "prompts_calibration.txt").read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    evaluation = [case.prompt for case in load_prompts(DEFAULT_PROMPTS)]
    shared = set(calibration) & set(evaluation)
    if shared:
        raise SystemExit(f"prompts in both parts: {sorted(shared)}")
    for name, prompts in (("calibration.jsonl", calibration), ("evaluation.jsonl", evaluation)):
        lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in answers(prompts))
        atomic_write_text(Path(CHAT / name), lines)
        print(f"wrote {CHAT / name}")


if __name__ == "__main__":
    main()
