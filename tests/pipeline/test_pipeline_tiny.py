"""The whole pipeline on a tiny Llama built from a config: run directory, report, resume, parity."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from compress.backends.onnx.runtime import OnnxDecoder
from compress.cli.main import main
from compress.eval.decoder import ValidateConfig
from tests.conftest import TINY_SMOKE, cached_decode_logits, smoke_overrides


def _run(tmp_path, model, *extra, recipe="baseline"):
    out = tmp_path / "run"
    code = main(
        ["run", "target=jetson-orin", f"recipe={recipe}", f"model={model}", f"out={out}", *smoke_overrides(*extra)]
    )
    return code, out


@pytest.fixture(scope="module")
def tiny_run(tiny_llama, tmp_path_factory):
    code, out = _run(tmp_path_factory.mktemp("tinyrun"), tiny_llama)
    return code, out


def test_run_writes_report_and_stage_records(tiny_run):
    code, out = tiny_run
    report = json.loads((out / "report.json").read_text())
    assert code == report["exit_code"]
    assert report["schema_version"] == "1.0"
    assert report["target"]["name"] == "jetson-orin-nano-8gb"
    assert [s["name"] for s in report["stages"]] == ["load", "export_onnx", "validate"]
    assert {s["status"] for s in report["stages"]} == {"done"}
    assert report["artifacts"]["onnx"] == "02_export_onnx/onnx"
    assert report["gate"]["verdict"] in ("PASS", "FAIL", "NOT_MEASURED")
    names = {c["name"]: c for c in report["gate"]["checks"]}
    # The tiny tokenizer has no chat template, so no app prompts; the ONNX is checked against torch on a sample.
    assert set(names) == {
        "perplexity_increase_pct",
        "top1_agreement",
        "mean_kl",
        "decode_latency_ms",
        "ttft_ms",
        "memory_gb",
        "onnx_vs_torch_quantized_pct",
    }
    assert names["perplexity_increase_pct"]["source"] == "measured"
    assert names["top1_agreement"]["bound"] == "lower" and names["mean_kl"]["bound"] == "upper"
    validate = next(s for s in report["stages"] if s["name"] == "validate")["metrics"]
    assert set(validate["domains"]) == {"austen", "press", "fiction", "learned", "government", "religion"}
    assert validate["unseen_domains"] == ["learned", "government", "religion"]
    worst = validate["worst_domain"]
    assert validate["perplexity_increase_pct"] == max(
        d["perplexity_increase_pct"] for d in validate["domains"].values()
    )
    assert validate["perplexity_increase_pct"] == validate["domains"][worst]["perplexity_increase_pct"]
    assert "## Quality per evaluation domain" in (out / "report.md").read_text()
    # Validation's peak memory by phase (no app prompts here), and the stage's peak is the largest of them.
    phases = validate["phase_peak_rss_mb"]
    assert set(phases) == {"passes", "onnx_runtime"} and min(phases.values()) > 0
    assert json.loads((out / "03_validate" / "stage.json").read_text())["peak_rss_mb"] >= max(phases.values())
    export = json.loads((out / "02_export_onnx" / "stage.json").read_text())
    export_phases = export["metrics"]["phase_peak_rss_mb"]
    assert set(export_phases) == {"graph", "torch_reference", "onnx_runtime"} and min(export_phases.values()) > 0
    assert export["peak_rss_mb"] >= max(export_phases.values())
    assert names["decode_latency_ms"]["source"] == "predicted"
    for stage_dir in ("01_load", "02_export_onnx", "03_validate"):
        record = json.loads((out / stage_dir / "stage.json").read_text())
        for key in ("config", "input", "output", "duration_s", "peak_rss_mb", "metrics", "versions", "fingerprint"):
            assert key in record, (stage_dir, key)
        assert len(record["output"]["sha256"]) == 64
        assert record["versions"]["torch"].startswith("2.13")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "finished"
    assert (out / "report.md").read_text().startswith("# compress report")
    assert (out / "run.log").stat().st_size > 0


def test_onnx_matches_torch_on_tiny_model(tiny_run, tiny_llama):
    _, out = tiny_run
    record = json.loads((out / "02_export_onnx" / "stage.json").read_text())
    parity = record["metrics"]["parity"]
    assert parity["greedy_match"] is True
    assert parity["max_abs_logit_diff"] < 1e-3
    onnx_dir = out / "02_export_onnx" / "onnx"
    for name in ("model.onnx", "compress_onnx.json", "tokenizer.json", "config.json"):
        assert (onnx_dir / name).is_file()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    decoder = OnnxDecoder(onnx_dir)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(3, 11))
    with torch.no_grad():
        reference = model(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(decoder.logits(ids), reference, atol=1e-4)


def test_kv_cache_decoding_matches_full_forward(tiny_run):
    _, out = tiny_run
    decoder = OnnxDecoder(out / "02_export_onnx" / "onnx")
    ids = np.arange(5, 17, dtype=np.int64)[None, :]
    np.testing.assert_allclose(cached_decode_logits(decoder, ids, 8), decoder.logits(ids), atol=1e-4)


def test_validate_measures_identical_perplexity_for_baseline(tiny_run):
    _, out = tiny_run
    metrics = json.loads((out / "03_validate" / "validation.json").read_text())["metrics"]
    assert metrics["perplexity_teacher"] > 1
    assert metrics["perplexity_model"] == metrics["perplexity_teacher"]  # a float export is the teacher itself
    parity = metrics["onnx_parity"]  # ONNX Runtime on the first windows of each of the six domains
    sampled = 6 * ValidateConfig().onnx_parity_windows
    assert parity["windows"] == sampled and parity["tokens"] == sampled * 63 and parity["top1_agreement"] == 1.0
    assert parity["difference_pct"] < 1e-2 and metrics["onnx_vs_torch_quantized_pct"] == parity["difference_pct"]
    lat = metrics["host_latency"]
    assert lat["decode"]["p50_ms"] <= lat["decode"]["p90_ms"] <= lat["decode"]["p99_ms"]
    assert lat["ttft_ms"] > 0 and lat["tokens_per_s"] > 0


def test_rerun_reuses_finished_stages_and_changed_option_redoes_only_later_stages(tiny_llama, tmp_path, capsys):
    code, out = _run(tmp_path, tiny_llama)
    first = json.loads((out / "manifest.json").read_text())
    capsys.readouterr()
    code2, _ = _run(tmp_path, tiny_llama)
    assert code2 == code
    statuses = [s["status"] for s in json.loads((out / "report.json").read_text())["stages"]]
    assert statuses == ["reused", "reused", "reused"]
    assert "reused" in capsys.readouterr().err
    _run(tmp_path, tiny_llama, "validate.latency_new_tokens=3")
    statuses = [s["status"] for s in json.loads((out / "report.json").read_text())["stages"]]
    assert statuses == ["reused", "reused", "done"]
    second = json.loads((out / "manifest.json").read_text())
    assert second["stages"][1]["output_sha256"] == first["stages"][1]["output_sha256"]


def test_budget_override_turns_gate_to_fail_with_exit_1(tiny_llama, tmp_path):
    code, out = _run(tmp_path, tiny_llama, "budgets.max_decode_latency_ms=0.001")
    report = json.loads((out / "report.json").read_text())
    assert report["gate"]["verdict"] == "FAIL"
    assert code == 1


def test_require_measured_makes_predicted_checks_not_measured(tiny_llama, tmp_path):
    out = tmp_path / "run"
    code = main(["run", "target=jetson-orin", "recipe=baseline", f"model={tiny_llama}", f"out={out}", *TINY_SMOKE,
                 "--require-measured"])
    report = json.loads((out / "report.json").read_text())
    assert report["gate"]["verdict"] == "NOT_MEASURED"
    assert code == 3


def test_dynamo_exporter_matches_torch(tiny_llama, tmp_path):
    code, out = _run(tmp_path, tiny_llama, "export_onnx.exporter=dynamo")
    parity = json.loads((out / "02_export_onnx" / "stage.json").read_text())["metrics"]["parity"]
    assert parity["greedy_match"] and parity["max_abs_logit_diff"] < 1e-3


def test_dry_run_prints_plan_and_does_no_work(tiny_llama, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["run", "target=jetson-orin", "recipe=int8", f"model={tiny_llama}", f"out={out}", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in plan["stages"]] == ["load", "quantize", "export_onnx", "validate"]
    assert plan["target"] == "jetson-orin-nano-8gb"
    assert not out.exists()


def test_show_and_revalidate_against_another_target(tiny_run, capsys):
    _, out = tiny_run
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "jetson-orin-nano-8gb" in shown and "03_validate" in shown
    code = main(["validate", str(out), "target=jetson-agx-orin-64gb"])
    revalidated = json.loads((out / "validate-jetson-agx-orin-64gb-MAXN.json").read_text())
    assert revalidated["target"]["name"] == "jetson-agx-orin-64gb"
    assert revalidated["exit_code"] == code
    original = json.loads((out / "report.json").read_text())
    assert original["target"]["name"] == "jetson-orin-nano-8gb"
    agx = revalidated["predictions"]["chosen"]["decode_tokens_per_s"]
    nano = original["predictions"]["chosen"]["decode_tokens_per_s"]
    assert agx > nano


def test_a_graph_past_the_protobuf_limit_keeps_its_weights_in_one_side_file(tiny_run, tmp_path):
    """The export writes the weights in ``model.onnx.data`` beside the graph; saved again under the limit the graph is
    one file, and with the limit lowered to a few bytes it is saved as a >2 GB one would be: weights in
    ``model.onnx.data``, earlier external files removed, and ONNX Runtime computes the same logits."""
    import shutil

    import onnx

    from compress.backends.onnx.graph import external_files, onnx_files_size, save_graph

    _, run = tiny_run
    exported = run / "02_export_onnx" / "onnx" / "model.onnx"
    onnx_dir = tmp_path / "onnx"
    shutil.copytree(exported.parent, onnx_dir)
    path = onnx_dir / "model.onnx"
    ids = np.array([[5, 17, 42, 7]], dtype=np.int64)
    before, _ = OnnxDecoder(onnx_dir).forward(ids, np.ones_like(ids), OnnxDecoder(onnx_dir).empty_past(1))
    assert external_files(path) == [onnx_dir / "model.onnx.data"]  # the export writes the weights beside the graph
    save_graph(onnx.load(str(path)), path)  # under the limit: one self-contained file, the side file removed
    assert external_files(path) == [] and not (onnx_dir / "model.onnx.data").exists()
    graph = onnx.load(str(path))
    save_graph(graph, path, limit_bytes=16)
    assert external_files(path) == [onnx_dir / "model.onnx.data"]
    assert path.stat().st_size < (onnx_dir / "model.onnx.data").stat().st_size
    after, _ = OnnxDecoder(onnx_dir).forward(ids, np.ones_like(ids), OnnxDecoder(onnx_dir).empty_past(1))
    np.testing.assert_allclose(after, before, atol=1e-6)
    assert onnx_files_size(path) > path.stat().st_size
    save_graph(onnx.load(str(path)), path)  # back under the limit: one self-contained file, no stale side file
    assert external_files(path) == [] and not (onnx_dir / "model.onnx.data").exists()
