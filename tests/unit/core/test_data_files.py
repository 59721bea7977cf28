"""Data from the files teams keep it in: every format read through `datasets`, errors naming file and row, chat text
rendered with the model's template, and windows led by the tokenizer's own BOS rule."""

from __future__ import annotations

import json

import pytest
import torch

from compress.cli.main import main
from compress.core.data_files import parse_spec
from compress.core.errors import UsageError
from compress.core.files import sha256_file
from compress.core.text import (
    TrainingData,
    calibration_windows,
    check_disjoint,
    load_calibration,
    load_evaluation,
    packed_windows,
    prefix_tokens,
    read_source,
    source_ids,
    token_windows,
    window_prefix,
)
from tests.conftest import CALIB, build_tokenizer

PARAGRAPHS = [p for p in CALIB.read_text(encoding="utf-8")[20_000:60_000].split("\n\n") if len(p) > 200][:24]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _table(rows):
    import datasets

    return datasets.Dataset.from_list(rows)


def _bos_tokenizer():
    """The test tokenizer with a post-processor that puts <|endoftext|> before every text, as Llama 3 and Gemma put
    BOS."""
    from tokenizers import processors

    tokenizer = build_tokenizer(chat_template=True)
    eos = tokenizer.eos_token
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{eos} $A", pair=f"{eos} $A $B", special_tokens=[(eos, tokenizer.eos_token_id)])
    return tokenizer


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "datasets"])
def test_every_format_yields_the_same_domains_and_text(tmp_path, kind):
    rows = [{"body": p, "domain": "manual" if i % 2 else "faq"} for i, p in enumerate(PARAGRAPHS)]
    name = tmp_path / f"notes.{kind}"
    if kind == "jsonl":
        spec = f"{_jsonl(name, rows)}:body"
    elif kind == "json":
        name.write_text(json.dumps(rows), encoding="utf-8")
        spec = f"{name}:body"
    elif kind == "csv":
        _table(rows).to_csv(str(name), index=False)
        spec = f"{name}:body"
    elif kind == "parquet":
        _table(rows).to_parquet(str(name))
        spec = f"{name}:body"
    else:
        _table(rows).save_to_disk(str(name))
        spec = f"{name}:body"
    sources = load_evaluation([parse_spec(spec)])
    assert [s.domain for s in sources] == ["faq", "manual"]
    assert sources[0].text == "\n\n".join(PARAGRAPHS[0::2]) and sources[1].text == "\n\n".join(PARAGRAPHS[1::2])
    assert not sources[0].whole_file and sources[0].sha256 != sources[1].path  # hashed content, not a path


def test_a_file_without_a_domain_column_is_one_domain_named_by_its_stem(tmp_path):
    path = _jsonl(tmp_path / "robot_logs.jsonl", [{"text": p} for p in PARAGRAPHS[:3]])
    (source,) = read_source(parse_spec(str(path)), "calibration")
    assert source.domain == "robot_logs" and source.text.count("\n\n") == 2


def test_a_malformed_row_is_refused_naming_file_and_row(tmp_path, capsys):
    path = tmp_path / "calib.jsonl"
    path.write_text('{"text": "one fine line of text"}\n{"text": "two"}\n{"text": broken}\n', encoding="utf-8")
    code = main(["run", "target=jetson-orin", "recipe=int8", f"calib={path}", f"out={tmp_path / 'run'}", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2
    assert str(path) in err and "row 3" in err


@pytest.mark.parametrize(("row", "problem"), [
    ({"text": ""}, "'text' holds"),
    ({"text": 7}, "'text' holds int"),
    ({"messages": [{"role": "user"}]}, "message 1 must have"),
    ({"messages": "hello"}, "non-empty list"),
])
def test_a_row_without_usable_text_is_named(tmp_path, row, problem):
    path = _jsonl(tmp_path / "eval.jsonl", [{"text": "fine"}, row] if "text" in row else [{"messages": [
        {"role": "user", "content": "hi"}]}, row])
    with pytest.raises(UsageError, match=rf"{path} row 2: .*{problem}"):
        load_evaluation([parse_spec(str(path))])


def test_a_missing_column_and_an_unknown_format_are_named(tmp_path):
    path = tmp_path / "t.parquet"
    _table([{"body": "x"}]).to_parquet(str(path))
    with pytest.raises(UsageError, match=r"no column 'text_col' \(columns: body\)"):
        load_calibration([parse_spec(f"{path}:text_col")])
    with pytest.raises(UsageError, match=r"no 'text' or 'messages' column .*name one as"):
        load_calibration([parse_spec(str(path))])
    other = tmp_path / "t.xml"
    other.write_text("<a/>")
    with pytest.raises(UsageError, match=r"t.xml: unknown format .xml"):
        load_calibration([parse_spec(str(other))])


def test_chat_rows_are_rendered_with_the_model_template(tmp_path):
    conversations = [[{"role": "user", "content": f"Question {i}: {p[:80]}"}, {"role": "assistant", "content": p}]
                     for i, p in enumerate(PARAGRAPHS[:6])]
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])
    (source,) = load_calibration([parse_spec(str(path))])
    assert source.is_chat and source.text == ""
    tokenizer = build_tokenizer(chat_template=True)
    ids = source_ids(tokenizer, source)
    expected = "".join(tokenizer.apply_chat_template(c, tokenize=False) for c in conversations)
    assert tokenizer.decode(ids) == expected and "<|user|>Question 0" in expected
    with pytest.raises(
        UsageError, match="chat.jsonl holds chat conversations, but the model's tokenizer has no chat template"
    ):
        calibration_windows(build_tokenizer(), [source], 64, 2)


def test_overlap_checks_read_chat_contents(tmp_path):
    shared = [
        {"messages": [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": p}]} for p in PARAGRAPHS
    ]
    calibration = load_calibration([parse_spec(str(_jsonl(tmp_path / "a.jsonl", shared)))])
    evaluation = load_evaluation([parse_spec(str(_jsonl(tmp_path / "b.jsonl", [{"text": p} for p in PARAGRAPHS])))])
    with pytest.raises(UsageError, match="must not overlap"):
        check_disjoint(calibration, evaluation)


def test_windows_follow_the_tokenizer_bos_rule():
    plain, with_bos = build_tokenizer(), _bos_tokenizer()
    source = read_source(CALIB, "calibration")[0]
    assert window_prefix(plain) == [] and prefix_tokens(plain) == []
    assert window_prefix(with_bos) == [with_bos.eos_token_id] and prefix_tokens(with_bos) == ["<|endoftext|>"]
    windows = token_windows(with_bos, source, 64, 256)
    assert windows.shape == (4, 64)
    assert (windows[:, 0] == with_bos.eos_token_id).all() and not (windows[:, 1:] == with_bos.eos_token_id).any()
    body = source_ids(plain, source)[:4 * 63].view(4, 63)
    assert torch.equal(windows[:, 1:], body)  # the same text, one token shorter per window, none lost between them
    unchanged = token_windows(plain, source, 64, 256)
    assert torch.equal(unchanged, source_ids(plain, source)[:256].view(4, 64))
    calib = calibration_windows(with_bos, [source], 64, 3)
    assert (calib[:, 0] == with_bos.eos_token_id).all()


def test_a_chat_template_that_writes_bos_is_not_doubled(tmp_path):
    tokenizer = _bos_tokenizer()
    tokenizer.chat_template = "{{ eos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": p}]} for p in PARAGRAPHS[:4]])
    (source,) = load_calibration([parse_spec(str(path))])
    windows = calibration_windows(tokenizer, [source], 32, 2)
    assert (windows[:, 0] == tokenizer.eos_token_id).all() and (windows[:, 1] != tokenizer.eos_token_id).all()


def _corpus(tmp_path, kind, rows):
    """``rows`` ({"text": ...}) written as a training file of ``kind``; its spec."""
    name = tmp_path / f"corpus.{kind}"
    if kind == "jsonl":
        _jsonl(name, rows)
    elif kind == "txt":
        name.write_text("\n".join(r["text"] for r in rows), encoding="utf-8")
    elif kind == "json":
        name.write_text(json.dumps(rows), encoding="utf-8")
    elif kind == "csv":
        _table(rows).to_csv(str(name), index=False)
    elif kind == "parquet":
        _table(rows).to_parquet(str(name))
    else:
        _table(rows).save_to_disk(str(name))
    return parse_spec(str(name))


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "datasets"])
def test_training_data_is_packed_from_a_stream_in_every_format(tmp_path, kind):
    tokenizer = build_tokenizer()
    rows = [{"text": p} for p in PARAGRAPHS]
    windows = packed_windows(tokenizer, [_corpus(tmp_path, kind, rows)], 64, 5)
    stream = [
        i for r in rows for i in tokenizer(r["text"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    ]
    assert windows.shape == (5, 64)
    assert windows.flatten().tolist() == stream[:5 * 64]  # documents in order, each ended by EOS, no token dropped


def test_training_data_from_plain_text_and_its_errors(tmp_path):
    tokenizer = _bos_tokenizer()
    spec = _corpus(tmp_path, "txt", [{"text": p} for p in PARAGRAPHS])
    windows = packed_windows(tokenizer, [spec], 64, 3)
    assert (windows[:, 0] == tokenizer.eos_token_id).all()  # each window led by the tokenizer's BOS rule
    with pytest.raises(UsageError, match="too little training text"):
        packed_windows(tokenizer, [spec], 64, 10_000)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": 3}\n', encoding="utf-8")
    with pytest.raises(UsageError, match=f"{broken} row 2"):
        packed_windows(tokenizer, [parse_spec(str(broken))], 64, 1)
    sample = TrainingData.read([spec])
    assert sample.sample[0].domain == "corpus" and sample.sha256[0] == sha256_file(spec.path)


def test_held_out_windows_are_calibration_text_calibration_does_not_read():
    """What recipe=auto measures its plans on: windows of the calibration domains, none of them a calibration window."""
    from compress.core.text import held_out_windows

    tokenizer = build_tokenizer()
    sources = load_calibration([parse_spec(str(CALIB))])
    calibration = calibration_windows(tokenizer, sources, 64, 8)
    held_out = held_out_windows(tokenizer, sources, 64, 8, per_domain=5)
    assert [domain for domain, _ in held_out] == ["austen"] and held_out[0][1].shape == (5, 64)
    read = {tuple(row.tolist()) for row in calibration}
    assert not read & {tuple(row.tolist()) for row in held_out[0][1]}


def test_the_shipped_chat_set_calibrates_and_evaluates_on_prompts_it_does_not_share():
    """The chat set's two parts: calibration on its own 60 prompts, evaluation (and the app-prompt gate) on 40 others,
    each conversation the prompt of its list with an answer."""
    from compress.catalog import TEXT, catalog_dir

    chat = catalog_dir(TEXT) / "chat"

    def conversations(name: str) -> list[list[dict]]:
        return [
            json.loads(line)["messages"]
            for line in (chat / name).read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]

    calibration, evaluation = conversations("calibration.jsonl"), conversations("evaluation.jsonl")
    calib_prompts = [c[0]["content"] for c in calibration]
    eval_prompts = [c[0]["content"] for c in evaluation]
    assert calib_prompts == [
        p for p in (chat / "prompts_calibration.txt").read_text(encoding="utf-8").splitlines() if p.strip()
    ]
    gate = [
        json.loads(line)["prompt"]
        for line in (chat / "prompts_evaluation.jsonl").read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    assert eval_prompts == gate
    assert (len(set(calib_prompts)), len(set(eval_prompts))) == (60, 40)
    assert not {p.casefold() for p in calib_prompts} & {p.casefold() for p in eval_prompts}
    from compress.eval.prompts import selection_expect_prompts

    # what a search checks expected answers on: in neither set, each with one
    selection = selection_expect_prompts(
        1000
    )
    assert len(selection) == 32 and all(case.expect for case in selection)
    assert not {c.prompt.casefold() for c in selection} & {p.casefold() for p in calib_prompts + eval_prompts}
    for conversation in calibration + evaluation:
        assert [m["role"] for m in conversation] == ["user", "assistant"] and conversation[1]["content"].strip()
