"""recipe=auto end to end on tiny models: legal formats only, a MIXED_PRECISION bundle proven linear by linear, the
search in the report; and the search's back-off on its own."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from compress.algorithms.knapsack import Choice
from compress.backends.edgellm.contracts import mixed_conflict
from compress.cli.main import main
from compress.core.errors import StageError
from compress.pipeline.plan_search import BACKOFF_SAFETY, SearchLimits, search
from compress.transforms.quantize.mixed import FLOAT, HEAD
from tests.conftest import TINY_SMOKE, build_tiny_llama

SMALL = [
    "quantize.calib_window=128",
    "quantize.min_calib_tokens=512",
    "quantize.calib_windows=6",
    "quantize.sample_tokens=256",
    "quantize.fisher_windows=2",
    "quantize.selection_windows=4",
    "quantize.selection_prompts=12",
    "quantize.expect_prompts=8",
    "quantize.answer_tokens=6",
    "validate.prompt_new_tokens=6",
]


def _run(tmp_path: Path, target: str, **shape) -> tuple[int, Path]:
    heads = shape.pop("heads", 2)  # head size 64, a size Edge-LLM's attention kernels take
    model = build_tiny_llama(tmp_path / "model", layers=2, heads=heads, kv_heads=1, chat_template=True, **shape)
    out = tmp_path / "run"
    return main(
        ["run", f"target={target}", "recipe=auto", f"model={model}", f"out={out}", "--no-progress", *SMALL, *TINY_SMOKE]
    ), out


def _shipped_meta(out: Path) -> dict:
    """What the quantize stage's artifact says of how it ships (what validation reads)."""
    return json.loads((out / "02_quantize" / "stage.json").read_text())["output"]["meta"]


def _stage(out: Path, name: str) -> dict:
    return next(s for s in json.loads((out / "report.json").read_text())["stages"] if s["name"] == name)


def test_auto_on_orin_keeps_int4_to_the_widths_its_kernels_take_and_ships_a_checked_bundle(tmp_path):
    # hidden 64: only down_proj (input 128) is wide enough for INT4 in groups of 128.
    code, out = _run(tmp_path, "jetson-orin", hidden=64, heads=1, intermediate=128)
    report = json.loads((out / "report.json").read_text())
    assert code == report["exit_code"]
    quantize = _stage(out, "quantize")["metrics"]
    assert quantize["method"] == "auto" and quantize["search"]["formats"] == ["int8", "int4"]
    for groups in quantize["search"]["plan"].values():
        assert groups["attn_in"] != "int4" and groups["attn_out"] != "int4" and groups["mlp_in"] != "int4"
    for row in quantize["search"]["sensitivity"]:
        assert ("int4" in row["kl"]) == (row["point"] == "mlp_hidden") and row["kl"][FLOAT] == 0.0
    assert sum(quantize["mix"].values()) == pytest.approx(1.0)
    peaks = quantize["search"]["phase_peak_rss_mb"]  # which phase of the search holds the most
    assert set(peaks) == {"fisher", "sensitivity", "teacher", "plans"} and all(v > 0 for v in peaks.values())
    (accepted,) = [c for c in quantize["search"]["candidates"] if c["chosen"]]
    assert accepted["passed"] and not any(c["passed"] for c in quantize["search"]["candidates"]
                                          if c["predicted_cost"] < accepted["predicted_cost"])  # the fastest that held
    for candidate in quantize["search"]["candidates"]:  # a chat model: each plan's answers, and its expected answers
        measured = candidate["measured"]
        assert 0.0 <= measured["answer_prefix_agreement"] <= 1.0
        assert measured["expect_pass_drop_pct"] == pytest.approx(
            100 * (measured["expect_pass_teacher"] - measured["expect_pass_model"])
        )
    bundle = _stage(out, "export_edgellm")["metrics"]
    if quantize["formats_chosen"].keys() - {FLOAT}:
        assert bundle["checkpoint"]["quant_algo"] == "MIXED_PRECISION" and bundle["custody"]["mismatches"] == 0
    validate = json.loads((out / "06_validate" / "validation.json").read_text())
    chosen = validate["predictions"]["chosen"]
    assert validate["precision"] == "mixed" and chosen["precision"] == "mixed"
    # Each plan's memory and energy per token, as the gate predicts them for the plan it ships.
    assert accepted["predicted_memory_gb"] == pytest.approx(chosen["memory_gb"], abs=6e-5)  # to_json keeps 4 decimals
    assert accepted["predicted_joules_per_token"] == pytest.approx(chosen["joules_per_token"], abs=6e-5)
    references = {r["name"]: r for r in quantize["search"]["references"]}
    assert references["uniform fp16"]["predicted_memory_gb"] > references["uniform int8"]["predicted_memory_gb"]
    markdown = (out / "report.md").read_text()
    assert (
        "## Precision search (quantize.method=auto)" in markdown
        and "uniform int8" in markdown
        and "| answer prefix |" in markdown
    )
    assert "| predicted J/token |" in markdown
    assert (out / report["plots"]["precision_search"]).is_file()
    code = main(["validate", str(out), "target=jetson-agx-thor"])  # re-gated elsewhere from the stored mix
    regated = json.loads(next(out.glob("validate-jetson-agx-thor-*.json")).read_text())
    assert regated["predictions"]["chosen"]["precision"] == "mixed" and code in (0, 1)


def test_auto_on_thor_may_choose_fp8_and_nvfp4(tmp_path):
    code, out = _run(tmp_path, "jetson-agx-thor", hidden=128, intermediate=256)
    quantize = _stage(out, "quantize")["metrics"]
    assert quantize["search"]["formats"] == ["int8", "int4", "fp8", "nvfp4"]
    measured = {name for row in quantize["search"]["sensitivity"] for name in row["kl"]}
    assert measured == {FLOAT, "int8", "int4", "fp8", "nvfp4"}
    assert quantize["search"]["format_sets"] == [["int8", "int4", "fp8"], ["fp8", "nvfp4"]]
    assert mixed_conflict(quantize["formats_chosen"]) is None  # one bundle holds no NVFP4 beside INT8 or INT4
    assert _stage(out, "export_edgellm")["metrics"]["custody"]["mismatches"] == 0
    assert code == json.loads((out / "report.json").read_text())["exit_code"]
    # The LM head is a group too, in the formats Edge-LLM quantizes a head in (never INT8), and the gate predicts what
    # ships.
    head = next(row for row in quantize["search"]["sensitivity"] if row["point"] == HEAD)
    assert set(head["kl"]) == {FLOAT, "int4", "fp8", "nvfp4"}
    (accepted,) = [c for c in quantize["search"]["candidates"] if c["chosen"]]
    assert accepted["lm_head"] == quantize["search"]["lm_head"] == _shipped_meta(out)["quantization"]["lm_head"]
    validate = json.loads((out / "06_validate" / "validation.json").read_text())
    assert accepted["predicted_memory_gb"] == pytest.approx(validate["predictions"]["chosen"]["memory_gb"], abs=6e-5)
    assert accepted["predicted_decode_ms"] == pytest.approx(
        validate["predictions"]["chosen"]["decode_latency_ms"], rel=1e-3
    )


def test_formats_the_bundle_would_misread_or_the_target_lacks_are_refused(capsys, tmp_path):
    assert (
        main(
            ["run", "target=jetson-orin", "recipe=auto", "quantize.formats=[fp8]", f"out={tmp_path / 'a'}", "--dry-run"]
        )
        == 2
    )
    assert "has no fp8 tensor cores" in capsys.readouterr().err
    assert (
        main(
            [
                "run",
                "target=jetson-agx-thor",
                "recipe=auto",
                "quantize.formats=[nvfp4_a16]",
                f"out={tmp_path / 'b'}",
                "--dry-run",
            ]
        )
        == 2
    )
    assert "W4A16_NVFP4 there is read as NVFP4 W4A4" in capsys.readouterr().err


def _choices():
    """Four groups: INT4 cheapest and riskiest, INT8 in between, FP16 free of error."""
    return {(index, "p"): [Choice(FLOAT, 0.0, 4.0), Choice("int8", 0.002, 2.0), Choice("int4", 0.006, 1.0)]
            for index in range(4)}


def _search(rounds, quantize, measure, work, refine_rounds=0):
    """The search over :func:`_choices` at a KL budget of 0.03: (the chosen quantization, its folder, the
    candidates)."""
    found = search(_choices(), {}, 0.03, quantize, measure, work, SearchLimits(rounds, refine_rounds))
    return found.quantization, found.folder, found.candidates


def test_a_plan_the_measurement_rejects_is_backed_off_and_its_folder_removed(tmp_path):
    written = []  # (plan, folder) in the order the search quantized them

    def quantize(plan, folder):
        folder.mkdir(parents=True)
        written.append((plan, folder))
        return plan

    def measure(folder):  # this model cannot take INT4 anywhere
        plan = next(p for p, f in written if f == folder)
        return "int4" not in plan.quantized_formats(), {"formats": sorted(plan.quantized_formats())}

    plan, folder, candidates = _search(rounds=5, quantize=quantize, measure=measure, work=tmp_path)
    assert "int4" in candidates[0].plan.quantized_formats() and not candidates[0].passed
    assert candidates[-1].passed and candidates[-1].chosen and "int4" not in plan.quantized_formats()
    # each back-off halves it
    assert [c.budget for c in candidates] == sorted(
        (c.budget for c in candidates), reverse=True
    )
    assert folder.is_dir() and not any(f.exists() for _, f in written[:-1])  # rejected plans leave nothing behind


def test_the_back_off_is_sized_by_how_far_over_its_limits_a_plan_measured(tmp_path):
    """A plan measured at 4x its limits shrinks the budget to BACKOFF_SAFETY / 4 of itself, not by half."""
    def measure(folder):
        overshoot = 4.0 if "int4" in (folder / "formats").read_text() else 0.5
        return overshoot <= 1, {"overshoot": overshoot}

    def quantize(plan, folder):
        folder.mkdir(parents=True)
        (folder / "formats").write_text(" ".join(sorted(plan.quantized_formats())))

    _, _, candidates = _search(rounds=5, quantize=quantize, measure=measure, work=tmp_path)
    assert not candidates[0].passed and candidates[-1].passed
    assert candidates[1].budget == pytest.approx(0.03 * BACKOFF_SAFETY / 4)
    assert "int4" not in candidates[1].plan.quantized_formats() and candidates[1].plan.quantized_formats() == {"int8"}


def test_a_back_off_past_every_format_backs_up_instead_of_giving_up(tmp_path):
    """A plan measured far over its limits (a floor missed by 100x) shrinks the budget below the cheapest INT8 group:
    the search does not stop at a plan that quantizes nothing, it tries the budget halfway (geometrically) back and
    finds the INT8 plan that holds."""
    def quantize(plan, folder):
        folder.mkdir(parents=True)
        (folder / "formats").write_text(" ".join(sorted(plan.quantized_formats())))
        return plan

    def measure(folder):
        overshoot = 100.0 if "int4" in (folder / "formats").read_text() else 0.5
        return overshoot <= 1, {"overshoot": overshoot}

    plan, _, candidates = _search(rounds=5, quantize=quantize, measure=measure, work=tmp_path)
    assert 0.03 * BACKOFF_SAFETY / 100 < 0.002  # the back-off alone leaves even the cheapest INT8 group out
    assert [c.passed for c in candidates] == [False, True]
    assert candidates[1].budget == pytest.approx(math.sqrt(0.03 * 0.03 * BACKOFF_SAFETY / 100))
    assert plan.quantized_formats() == {"int8"} and candidates[1].chosen


def test_an_overshooting_back_off_is_refined_to_the_fastest_plan_that_holds(tmp_path):
    """INT4 fails anywhere past two groups; a back-off to a quarter of the budget lands on INT8 everywhere, which holds;
    bisecting between the two budgets finds the plan with two INT4 groups, faster and held, and the search returns
    it."""

    def quantize(plan, folder):
        folder.mkdir(parents=True)
        (folder / "int4").write_text(str(sum(f == "int4" for groups in plan.formats.values() for f in groups.values())))
        return plan

    def measure(folder):
        overshoot = 5.0 if int((folder / "int4").read_text()) > 2 else 0.5
        return overshoot <= 1, {"overshoot": overshoot}

    plan, folder, candidates = _search(rounds=5, quantize=quantize, measure=measure,
                                      work=tmp_path, refine_rounds=2)
    first_pass = next(c for c in candidates if c.passed)
    assert first_pass.plan.quantized_formats() == {"int8"} and not first_pass.chosen
    (chosen,) = [c for c in candidates if c.chosen]
    assert chosen.passed and chosen.predicted_cost < first_pass.predicted_cost and plan is chosen.plan
    assert sum(f == "int4" for groups in plan.formats.values() for f in groups.values()) == 2
    assert sum(not c.passed for c in candidates) <= 3 and len(candidates) <= 2 + 2  # two refinements at most
    assert [f.name for f in tmp_path.iterdir()] == [folder.name]  # the slower accepted plan's folder is gone too
    _, _, unrefined = _search(rounds=5, quantize=quantize, measure=measure,
                             work=tmp_path / "unrefined")
    assert unrefined[-1].chosen and unrefined[-1].plan.quantized_formats() == {"int8"}


def test_a_search_that_never_passes_says_so(tmp_path):
    with pytest.raises(StageError, match="no mixed-precision plan held the budgets"):
        _search(rounds=3, quantize=lambda plan, folder: folder.mkdir(parents=True),
               measure=lambda folder: (False, {}), work=tmp_path)


def test_a_plan_s_expected_answers_are_those_of_its_own_greedy_answers(tmp_path):
    """The search reads a plan's answers in one forced pass and decodes only those that leave the teacher's: the
    verdicts must be those of the plan's full greedy answers, decoded with its deployed numbers."""
    import torch

    from compress.core.config import load_target
    from compress.eval.decoder import deployed_generator
    from compress.models.loading import load_tokenizer
    from compress.pipeline.auto_precision import HeldOutAnswers, _answer_figures
    from compress.transforms.quantize.config import QUANTIZE_CONFIG
    from compress.transforms.quantize.decoder import quantize_folder

    teacher = build_tiny_llama(tmp_path / "teacher", chat_template=True, initializer_range=0.3)
    config = QUANTIZE_CONFIG.validate_python(
        {
            "method": "int4",
            "group_size": 32,
            "calib_windows": 3,
            "calib_window": 24,
            "min_calib_tokens": 1,
            "sample_tokens": 64,
        }
    )
    windows = torch.randint(0, 400, (3, 24), generator=torch.Generator().manual_seed(0))
    # answers differently
    other = build_tiny_llama(
        tmp_path / "other", chat_template=True, seed=1, initializer_range=0.3
    )
    quantize_folder(other, tmp_path / "plan", windows, config)
    tokenizer = load_tokenizer(teacher)
    prompts = [tokenizer(text).input_ids for text in ("the sea", "a house", "one two", "we went", "she said", "in the")]
    with deployed_generator(teacher, [], 0) as generate:
        teacher_ids = generate(prompts, 6)
    with deployed_generator(tmp_path / "plan", [], 0) as generate:
        plan_ids = generate(prompts, 6)
    teacher_text = [tokenizer.decode(ids, skip_special_tokens=True) for ids in teacher_ids]
    plan_text = [tokenizer.decode(ids, skip_special_tokens=True) for ids in plan_ids]
    # Expect each of the teacher's first words, and for the last prompt the plan's own, so verdicts go both ways.
    words = [text.split()[0] if text.split() else "x" for text in teacher_text[:-1]] + [plan_text[-1].split()[0]]
    expect = [re.escape(word) for word in words]
    # The first prompt's "teacher" answer is the plan's own: the forced pass finds it identical and keeps that verdict.
    answers, texts = [plan_ids[0], *teacher_ids[1:]], [plan_text[0], *teacher_text[1:]]
    held_out = HeldOutAnswers(
        prompts,
        answers,
        0,
        [],
        expect,
        [re.search(e, t) is not None for e, t in zip(expect, texts, strict=True)],
        tokenizer,
        6,
    )
    figures, _ = _answer_figures(tmp_path / "plan", held_out, load_target("jetson-orin").budgets, "cpu", progress=False)
    own = [re.search(e, t) is not None for e, t in zip(expect, plan_text, strict=True)]
    assert figures["expect_pass_model"] == pytest.approx(sum(own) / len(own))
    assert figures["expect_pass_teacher"] == pytest.approx(sum(held_out.teacher_passes) / len(own))
    assert plan_ids[1:] != teacher_ids[1:]  # the plan answers differently elsewhere: the decoded path was taken
