"""The device half of the Edge-LLM path: engine build with ``llm_build``, measurement with ``llm_inference``.

Without a CUDA device both are deferred or "not run" (exit 3), with the exact commands written for the
device. The glue itself (commands, request file, parsing of responses and profile, greedy agreement,
gate checks, ``compress.runtime.load``) is run against stand-ins of Edge-LLM's two programs in
``tests/standins/edgellm`` that enforce their documented command lines and file formats: this proves
compress's code, not TensorRT or Edge-LLM.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import compress.runtime
from compress.backends.edgellm import tools as edgellm_tools
from compress.cli.main import main
from compress.core.config import load_target
from compress.core.errors import UsageError
from compress.eval.prompts import DEFAULT_PROMPTS, load_prompts
from tests.conftest import REPO, TINY_SMOKE, build_tiny_llama

STANDIN = REPO / "tests" / "standins" / "edgellm"
QUANTIZE_SMALL = ["quantize.calib_window=256", "quantize.min_calib_tokens=1024", "quantize.calib_windows=8"]


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory) -> Path:
    tiny = build_tiny_llama(tmp_path_factory.mktemp("wide") / "model", layers=2, hidden=128, heads=2, kv_heads=1,
                            intermediate=256, chat_template=True)
    out = tmp_path_factory.mktemp("edgellm8") / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "compress",
            "run",
            "target=jetson-orin",
            "recipe=edgellm-int8",
            f"model={tiny}",
            f"out={out}",
            *QUANTIZE_SMALL,
            *TINY_SMOKE,
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return out


def test_the_engine_build_is_deferred_with_edgellm_commands_sized_by_the_target(int8_run):
    report = json.loads((int8_run / "report.json").read_text())
    stage = next(s for s in report["stages"] if s["name"] == "build_engine")
    assert stage["status"] == "deferred" and stage["metrics"]["reason"] == "not run: no CUDA device"
    assert (
        report["artifacts"]["engine"] is None and report["artifacts"]["engine_build_plan"] == "05_build_engine/engine"
    )
    engine = int8_run / "05_build_engine" / "engine"
    plan = json.loads((engine / "edgellm_build.json").read_text())
    budgets = load_target("jetson-orin").budgets
    assert plan["profile"] == {"max_batch_size": 1, "max_input_len": budgets.prompt_length,
                               "max_kv_cache_capacity": budgets.context_length}
    assert plan["stack"]["jetpack"] == "7.2" and plan["edgellm_version"] == "0.11.0"
    script = (engine / "build_on_device.sh").read_text()
    assert (
        '"${EDGELLM_TOOLS}/llm_build" --onnxDir ../../04_export_edgellm/bundle/llm --engineDir engines --maxBatchSize '
        '1 '
        f"--maxInputLen {budgets.prompt_length} --maxKVCacheCapacity {budgets.context_length}"
    ) in script
    assert "JetPack 7.2" in script and "-DEMBEDDED_TARGET=jetson-orin" in script
    assert not list(engine.rglob("*.engine"))
    reference = json.loads((int8_run / "06_validate" / "device_reference.json").read_text())
    domains = ["austen", "press", "fiction", "learned", "government", "religion"]
    assert [p["domain"] for p in reference["prompts"][:6]] == domains
    shipped = load_prompts(DEFAULT_PROMPTS)  # the model has a chat template: its app prompts follow the domains
    assert [p["domain"] for p in reference["prompts"][6:]] == [f"prompt {c.id}" for c in shipped]
    assert all(0 < len(ids) <= reference["max_new_tokens"] for ids in reference["host_output_ids"])


def test_build_and_on_device_validation_say_not_run_without_a_device(int8_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(int8_run, run)
    assert main(["build-engine", str(run)]) == 3
    assert "not run: no CUDA device" in capsys.readouterr().err
    assert main(["validate", str(run), "--on-device"]) == 3
    assert "not run: no CUDA device" in capsys.readouterr().out
    assert "Not measured: not run: no CUDA device" in (run / "validate-jetson-orin-nano-8gb-MAXN_SUPER.md").read_text()


@pytest.fixture
def standin_device(monkeypatch, tmp_path):
    """Edge-LLM's tools replaced by the stand-ins, a CUDA device reported, and an ``nvpmodel`` that reads 25W."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvpmodel").write_text("#!/bin/sh\necho 'NV Power Mode: 25W'\necho 2\n")
    (bin_dir / "nvpmodel").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(edgellm_tools.TOOLS_ENV, str(STANDIN))
    monkeypatch.setattr(edgellm_tools, "cuda_device_count", lambda: 1)
    profile = {"prefill": {"total_runs": 6, "average_time_per_run_ms": 41.5},
               "generation": {"total_runs": 6, "generated_tokens": 144, "tokens_per_second": 80.0},
               "peak_gpu_memory_bytes": 1_500_000_000}
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    monkeypatch.setenv("STANDIN_PROFILE", str(tmp_path / "profile.json"))
    return tmp_path


def test_engine_built_measured_and_loaded_through_the_edgellm_tools(
    int8_run, tmp_path, standin_device, capsys, monkeypatch
):
    run = tmp_path / "run"
    shutil.copytree(int8_run, run)
    assert main(["build-engine", str(run)]) == 0
    manifest = json.loads((run / "05_build_engine" / "engine" / "engine_manifest.json").read_text())
    assert manifest["runtime"] == "edgellm" and manifest["power_mode"] == "25W"
    assert list(manifest["engine_sha256"]) == ["engines/llm.engine"]
    assert json.loads((run / "report.json").read_text())["artifacts"]["engine"] == "05_build_engine/engine/engines"

    reference = json.loads((run / "06_validate" / "device_reference.json").read_text())
    outputs = {p["text"]: ids for p, ids in zip(reference["prompts"], reference["host_output_ids"], strict=True)}
    second = reference["prompts"][1]["text"]
    diverged = list(outputs[second])
    diverged[len(diverged) // 2] += 1  # the device leaves the host's greedy path halfway through one prompt
    outputs[second] = diverged
    (tmp_path / "outputs.json").write_text(json.dumps(outputs))
    monkeypatch.setenv("STANDIN_OUTPUTS", str(tmp_path / "outputs.json"))
    capsys.readouterr()
    code = main(["validate", str(run), "--on-device"])
    result = json.loads((run / "validate-jetson-orin-nano-8gb-MAXN_SUPER.json").read_text())
    assert code == result["exit_code"] and code in (0, 1)
    device = result["on_device"]
    prompts = len(reference["prompts"])
    expected_prefix = (prompts - 1 + (len(diverged) // 2) / len(diverged)) / prompts
    assert device["greedy_prefix_agreement"] == pytest.approx(expected_prefix)
    assert device["greedy_sequences_identical"] == pytest.approx((prompts - 1) / prompts)
    assert device["power_mode_read"] == "25W" and device["runtime"] == "edgellm"
    checks = {c["name"]: c for c in result["gate"]["checks"]}
    assert (
        checks["decode_latency_ms"]["value"] == pytest.approx(12.5)
        and checks["decode_latency_ms"]["source"] == "measured"
    )
    assert checks["ttft_ms"]["value"] == pytest.approx(41.5) and checks["memory_gb"]["value"] == pytest.approx(1.5)
    assert "nvpmodel mode 25W" in checks["ttft_ms"]["detail"]

    generator = compress.runtime.load(run)
    assert generator.backend == "edgellm"
    assert generator.generate(["one", "two"]) == ["stand-in answer 0", "stand-in answer 1"]
    engine = run / "05_build_engine" / "engine" / "engines" / "llm.engine"
    swapped = bytearray(engine.read_bytes())
    swapped[0] ^= 0xFF  # same size, other content: only the hash can tell
    engine.write_bytes(bytes(swapped))
    with pytest.raises(compress.runtime.ProvenanceError, match="llm.engine does not hold the content compress wrote"):
        compress.runtime.load(run)


def test_a_failed_request_is_an_error_not_a_figure():
    with pytest.raises(UsageError, match="no tokens for request 1 of 2"):
        edgellm_tools.output_ids({"responses": [{"request_idx": 0, "batch_idx": 0, "output_ids": [5]},
                                                 {"request_idx": 1, "batch_idx": 0, "output_ids": []}]}, 2)
    figures = edgellm_tools.profile_figures({"prefill": {"average_time_per_run_ms": 20.0}})
    assert (
        figures["decode_tokens_per_s"] is None
        and figures["peak_device_memory_gb"] is None
        and figures["ttft_ms"] == 20.0
    )


def test_a_target_whose_context_leaves_no_room_to_generate_is_refused():
    target = load_target("jetson-orin")
    target = target.model_copy(update={"budgets": target.budgets.model_copy(update={"context_length": 128})})
    with pytest.raises(UsageError, match="context_length \\(128\\) must exceed budgets.prompt_length \\(128\\)"):
        edgellm_tools.engine_profile(target)


def test_the_manifest_records_the_pinned_edgellm_and_the_device_stack(int8_run):
    versions = json.loads((int8_run / "manifest.json").read_text())["versions"]
    assert versions["tensorrt-edgellm"] == "0.11.0" and versions["edgellm-device-stack"] == "JetPack 7.2, CUDA 13.2"
