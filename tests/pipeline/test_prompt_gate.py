"""The app-prompt gate in a run: measured in validate, in report.json's gate, in report.md, re-gated from stored
answers; and the data options a run accepts (JSON lines, chat rows, train_data=) reaching the stages."""

from __future__ import annotations

import json

import pytest

from compress.cli.main import main
from tests.conftest import TINY_SMOKE, build_tiny_llama

PROMPT_CHECKS = {"answer_prefix_agreement", "first_token_agreement", "identical_answers", "expect_pass_drop_pct"}


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("promptrun")
    model = build_tiny_llama(root / "model", chat_template=True, initializer_range=0.2)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in [
        {"prompt": "Where is the charging dock?", "expect": "."}, {"prompt": "Say hello to the visitor."},
        {"prompt": "What is the capital of France?", "id": "capital"}]), encoding="utf-8")
    chat = root / "chat_calib.jsonl"
    chat.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Question {i}?"},
                        {"role": "assistant", "content": "An answer that runs on. " * 30},
                    ]
                }
            )
            + "\n"
            for i in range(8)
        ),
        encoding="utf-8",
    )
    out = root / "run"
    code = main(["run", "target=jetson-orin", "recipe=int8", f"model={model}", f"out={out}", f"prompts={prompts}",
                 f"calib={chat}", *TINY_SMOKE, "validate.prompt_new_tokens=12", "quantize.calib_windows=4",
                 "quantize.calib_window=64", "quantize.min_calib_tokens=256"])
    return code, out


def test_the_prompt_checks_are_in_the_gate_and_the_report(chat_run):
    code, out = chat_run
    report = json.loads((out / "report.json").read_text())
    assert code == report["exit_code"]
    checks = {c["name"]: c for c in report["gate"]["checks"]}
    assert set(checks) >= PROMPT_CHECKS
    measured = next(s for s in report["stages"] if s["name"] == "validate")["metrics"]["prompts"]
    assert measured["prompts"] == 3 and measured["prompts_with_expect"] == 1 and measured["new_tokens"] == 12
    assert checks["answer_prefix_agreement"]["value"] == measured["answer_prefix_agreement"]
    assert {r["id"] for r in measured["rows"]} == {"1", "2", "capital"}
    for row in measured["rows"]:
        assert 1 <= len(row["teacher_ids"]) <= 12 and 1 <= len(row["model_ids"]) <= 12
        assert row["identical"] == (row["teacher_ids"] == row["model_ids"])
    markdown = (out / "report.md").read_text()
    assert "## The app's prompts" in markdown and "Where is the charging dock?" in markdown
    assert "Nothing is put before a window" in markdown  # the tiny tokenizer starts a text with no special token
    quantize = next(s for s in report["stages"] if s["name"] == "quantize")
    assert quantize["status"] == "done"
    assert report["data"]["calibration"][0]["path"].endswith("chat_calib.jsonl") and report["data"]["prompts"].endswith(
        ".jsonl"
    )


def test_a_finished_run_is_regated_from_its_stored_answers(chat_run):
    _, out = chat_run
    stored = next(s for s in json.loads((out / "report.json").read_text())["stages"] if s["name"] == "validate")
    value = stored["metrics"]["prompts"]["answer_prefix_agreement"]
    limit = min(1.0, round(value + 0.01, 6)) if value < 1.0 else 1.0
    code = main(["validate", str(out), "target=jetson-agx-thor", f"budgets.min_answer_prefix_agreement={limit}"])
    regated = json.loads(next(out.glob("validate-jetson-agx-thor-*.json")).read_text())
    check = next(c for c in regated["gate"]["checks"] if c["name"] == "answer_prefix_agreement")
    assert check["value"] == value and check["limit"] == limit
    assert check["verdict"] == ("PASS" if value >= limit else "FAIL")
    assert (code == 1) == (regated["gate"]["verdict"] == "FAIL")


def test_prompts_off_leaves_the_checks_out_and_a_bad_file_is_refused(tmp_path, capsys):
    model = build_tiny_llama(tmp_path / "model", chat_template=True)
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "x", "expect": "(("}\n', encoding="utf-8")
    assert (
        main(
            [
                "run",
                "target=jetson-orin",
                "recipe=baseline",
                f"model={model}",
                f"out={tmp_path / 'r'}",
                f"prompts={bad}",
                "--dry-run",
            ]
        )
        == 2
    )
    assert f"prompts {bad} row 2" in capsys.readouterr().err
    out = tmp_path / "off"
    main(["run", "target=jetson-orin", "recipe=baseline", f"model={model}", f"out={out}", "prompts=off", *TINY_SMOKE])
    report = json.loads((out / "report.json").read_text())
    assert not PROMPT_CHECKS & {c["name"] for c in report["gate"]["checks"]}
    validate = next(s for s in report["stages"] if s["name"] == "validate")["metrics"]
    assert (
        validate["prompts"] is None and validate["prompts_source"] == "prompts=off" and validate["window_prefix"] == []
    )


def test_train_data_is_for_recipes_that_train(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "some training text"}\n', encoding="utf-8")
    assert (
        main(["run", "target=jetson-orin", "recipe=int8", f"train_data={corpus}", f"out={tmp_path / 'r'}", "--dry-run"])
        == 2
    )
    assert "the recipe has no distill stage" in capsys.readouterr().err
