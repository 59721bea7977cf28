"""The generic TensorRT path against stand-ins for TensorRT and cuda-python (``tests/standins/trt_standin.py``).

These tests prove compress's code, not TensorRT: the stand-ins enforce the documented contracts
(typed builds and their flags, consistent optimization profiles, one profile per context,
``set_input_shape`` refusing out-of-range shapes, non-null distinct addresses, stream order,
engine version and architecture checks) and run the engine's ONNX graph in ONNX Runtime.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import compress.runtime
from compress.backends.onnx.runtime import LAYOUT_FILE, ONNX_FILE, OnnxDecoder
from compress.backends.tensorrt import builder as engine_builder
from compress.backends.tensorrt import cuda as cuda_api
from compress.backends.tensorrt.builder import cuda_device, local_build_support
from compress.cli.main import main
from compress.core.errors import StageError, UsageError
from compress.pipeline.device import check_engine_provenance
from compress.runtime.generate import ProvenanceError
from tests.conftest import REPO, TINY_SMOKE
from tests.standins.trt_standin import StandInCuda, engine_spec, install, swap_tensorrt

SMALL = ["budgets.context_length=48", "budgets.prompt_length=12", "build_engine.max_batch=2"]


def _smoke(model: Path, out: Path, *extra: str) -> Path:
    code = main(["run", "target=jetson-orin", "recipe=smoke", f"model={model}", f"out={out}", *TINY_SMOKE, *SMALL,
                 "quantize.calib_window=256", "quantize.min_calib_tokens=512", *extra])
    assert code in (0, 1)
    return out


@pytest.fixture(scope="module")
def decoder_run(tiny_llama, tmp_path_factory) -> Path:
    """A finished smoke run whose engine build was deferred (no GPU here): INT8 Q/DQ, prefill and decode profiles."""
    return _smoke(tiny_llama, tmp_path_factory.mktemp("trt") / "run")


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def _engine_dir(run: Path) -> Path:
    return next(run.glob("*_build_engine")) / "engine"


def _engine_graph_decoder(run: Path, tmp_path: Path) -> OnnxDecoder:
    """The engine's own FP16 graph in ONNX Runtime: what the engine must compute."""
    folder = tmp_path / "engine-graph"
    folder.mkdir()
    shutil.copy(_engine_dir(run) / "engine_input.onnx", folder / ONNX_FILE)
    shutil.copy(next(run.glob("*_export_onnx")) / "onnx" / LAYOUT_FILE, folder / LAYOUT_FILE)
    return OnnxDecoder(folder)


def _left_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return ids, mask


def test_cuda_comes_from_cuda_python_not_torch(monkeypatch):
    import torch

    install(monkeypatch, StandInCuda(sm=87, name="Jetson Orin Nano"))
    assert not torch.cuda.is_available()  # as with the PyPI torch wheel on a Jetson
    assert cuda_device() == ("Jetson Orin Nano", 87)
    assert local_build_support(87).can_build and not local_build_support(89).can_build


def test_a_venv_hiding_jetpacks_tensorrt_says_how_to_fix_it(monkeypatch, tmp_path):
    install(monkeypatch)
    monkeypatch.delitem(sys.modules, "tensorrt")
    system = tmp_path / "usr/lib/python3.10/dist-packages/tensorrt"
    system.mkdir(parents=True)
    (system / "__init__.py").write_text("")
    monkeypatch.setattr(engine_builder, "SYSTEM_TENSORRT_GLOBS", (str(system.relative_to("/") / "__init__.py"),))
    reason = local_build_support(87).reason
    assert reason.startswith("not run: TensorRT is installed system-wide") and "--system-site-packages" in reason


def test_decoder_engine_steps_like_its_graph_with_a_batch_and_two_profiles(decoder_run, tmp_path, monkeypatch):
    run = _copy(decoder_run, tmp_path)
    install(monkeypatch)
    assert main(["build-engine", str(run)]) == 0
    engine_dir = _engine_dir(run)
    manifest = json.loads((engine_dir / "engine_manifest.json").read_text())
    assert (manifest["builder"], manifest["tensorrt_version"], manifest["sm"]) == ("tensorrt-python", "10.3.0", 87)
    spec = engine_spec(engine_dir / "model.engine")
    assert spec["strongly_typed"] and spec["flags"] == [] and len(spec["profiles"]) == 2
    report = json.loads((run / "report.json").read_text())
    assert report["artifacts"]["engine"].endswith("model.engine")

    generator = compress.runtime.load(run, backend="tensorrt")
    decoder, reference = generator.decoder, _engine_graph_decoder(run, tmp_path)
    assert generator.backend == "tensorrt" and len(decoder.session.contexts) == 2
    ids, mask = _left_padded([[5, 17, 33, 9, 41, 12, 7], [88, 3, 60]])
    got, past = decoder.forward(ids, mask, decoder.empty_past(2))
    want, want_past = reference.forward(ids, mask, reference.empty_past(2))
    scale = float(np.abs(want).max())
    assert decoder.session.profile_for({n: (2, 7) for n in ("input_ids", "attention_mask", "position_ids")} |
                                       {n: (2, 2, 0, 16) for n in decoder._past}) == 0
    for _ in range(6):
        np.testing.assert_allclose(got, want.astype(np.float32), atol=2e-2 * scale)
        token = want[:, -1:].argmax(-1)
        mask = np.concatenate([mask, np.ones((2, 1), dtype=np.int64)], axis=1)
        got, past = decoder.forward(token, mask, past)
        want, want_past = reference.forward(token, mask, want_past)
    assert past[0].shape == (2, 2, 13, 16)  # the cache stayed on the device and grew step by step
    assert decoder.max_batch == 2 and decoder.context_length == 48
    prompts = ["The robot", "Pick up the red block and", "Stop.", "Turn left at the door"]
    assert len(generator.generate(prompts, max_new_tokens=3)) == 4  # two engine batches of two


def test_a_decoder_engine_is_measured_on_device_within_its_profiles(decoder_run, tmp_path, monkeypatch):
    from compress.eval import on_device as device

    run = _copy(decoder_run, tmp_path)
    install(monkeypatch)
    assert main(["build-engine", str(run)]) == 0
    monkeypatch.setattr(device, "MIN_ITERATIONS", 80)  # enough to wrap the 48-token context twice
    assert main(["validate", str(run), "--on-device"]) in (0, 1)
    measured = json.loads(next(run.glob("validate-*.json")).read_text())["on_device"]
    assert measured["ran"] and measured["runtime"] == "tensorrt" and measured["iterations"] == 80
    assert measured["decode"]["p50_ms"] > 0 and measured["ttft_ms"] > 0
    checks = {c["name"]: c for c in json.loads(next(run.glob("validate-*.json")).read_text())["gate"]["checks"]}
    assert checks["decode_latency_ms"]["source"] == "measured"


def test_inputs_queued_on_another_stream_are_not_seen_without_a_wait(decoder_run, tmp_path, monkeypatch):
    """The stand-in runs streams in order and only when synchronized; compress queues copies on the engine's stream."""
    from compress.backends.tensorrt.cuda import DeviceArray, Stream
    from compress.backends.tensorrt.session import EngineSession

    run = _copy(decoder_run, tmp_path)
    install(monkeypatch)
    assert main(["build-engine", str(run)]) == 0
    session = EngineSession(_engine_dir(run) / "model.engine")
    ids = np.array([[5, 17, 33, 9]])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None]}
    feeds |= {n: np.zeros((1, 2, 0, 16), dtype=np.float16) for n in session.inputs if n.startswith("past")}
    good = session.run(feeds)["logits"].to_host(session.stream)
    other = Stream()
    elsewhere = {n: DeviceArray.from_host(np.asarray(v).astype(session.dtypes[n]), other) for n, v in feeds.items()}
    raced = session.run(elsewhere)["logits"].to_host(session.stream)
    assert not np.allclose(raced, good)  # the launch ran before the other stream's copies
    other.synchronize()
    np.testing.assert_array_equal(session.run(elsewhere)["logits"].to_host(session.stream), good)


def test_an_empty_cache_is_bound_to_real_addresses_and_refused_shapes_are_errors(decoder_run, tmp_path, monkeypatch):
    run = _copy(decoder_run, tmp_path)
    _, trt = install(monkeypatch)
    assert main(["build-engine", str(run)]) == 0
    decoder = compress.runtime.load(run, backend="tensorrt").decoder
    empty = decoder.empty_past(1)
    assert all(p.ptr for p in empty) and len({p.ptr for p in empty}) == len(empty)
    ids = np.array([[5, 17, 33]])
    with pytest.raises(UsageError, match="no optimization profile"):
        # max_batch 2
        decoder.forward(
            np.zeros((3, 4), dtype=np.int64), np.ones((3, 4), dtype=np.int64), decoder.empty_past(3)
        )
    for ranges in decoder.session.profile_ranges:  # ranges wider than the engine's: TensorRT's refusal must surface
        for name, (low, opt, high) in list(ranges.items()):
            ranges[name] = (low, opt, (3, *high[1:]))
    with pytest.raises(StageError, match="TensorRT refused the shape"):
        decoder.forward(np.zeros((3, 3), dtype=np.int64), np.ones((3, 3), dtype=np.int64), decoder.empty_past(3))
    monkeypatch.setattr(cuda_api, "MIN_ALLOCATION", 0)  # binding cudaMalloc(0)'s null pointer, as the torch code did
    with pytest.raises(StageError, match="could not launch"):
        decoder.forward(ids, np.ones_like(ids), decoder.empty_past(1))
    assert "non-null" in trt.log[-1]


def test_tensorrt_11_builds_strongly_typed_and_old_tensorrt_weakly_with_the_flags_the_graph_needs(decoder_run, tmp_path,
                                                                                                   monkeypatch):
    run = _copy(decoder_run, tmp_path)
    install(monkeypatch, version="11.0.0")  # no BuilderFlag.FP16/INT8/INT4 at all
    assert main(["build-engine", str(run)]) == 0
    assert engine_spec(_engine_dir(run) / "model.engine")["strongly_typed"]
    _, trt = install(monkeypatch, version="10.3.0")
    trt.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", {"EXPLICIT_BATCH": 0})
    assert main(["build-engine", str(run)]) == 0
    spec = engine_spec(_engine_dir(run) / "model.engine")
    assert not spec["strongly_typed"] and {"FP16", "INT8"} <= set(spec["flags"])


def test_int4_weights_build_with_fp16_scales_and_the_int4_flag_where_weakly_typed(tiny_llama, tmp_path, monkeypatch):
    run = _smoke(tiny_llama, tmp_path / "int4", "quantize.method=int4", "quantize.algorithm=awq")
    plan = json.loads((_engine_dir(run) / "build_plan.json").read_text())
    assert plan["int4"]
    _, trt = install(monkeypatch)
    trt.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", {"EXPLICIT_BATCH": 0})
    assert main(["build-engine", str(run)]) == 0  # the stand-in refuses INT4 without the flag or with FP32 scales
    assert "INT4" in engine_spec(_engine_dir(run) / "model.engine")["flags"]
    assert compress.runtime.load(run, backend="tensorrt").generate("The robot", max_new_tokens=2) is not None


def test_version_compatible_engines_run_on_later_tensorrt_with_host_code_allowed(
    decoder_run, tiny_llama, tmp_path, monkeypatch
):
    fixed = _copy(decoder_run, tmp_path)
    compatible = _smoke(tiny_llama, tmp_path / "compatible", "build_engine.version_compatible=true")
    cuda, _ = install(monkeypatch, version="10.3.0")
    assert main(["build-engine", str(fixed)]) == 0 and main(["build-engine", str(compatible)]) == 0
    swap_tensorrt(monkeypatch, cuda, "10.7.0")
    assert check_engine_provenance(_engine_dir(compatible))["version_compatible"]
    assert compress.runtime.load(compatible, backend="tensorrt").generate("The robot", max_new_tokens=2) is not None
    with pytest.raises(ProvenanceError, match="needs TensorRT 10.3.0 on sm_87.*rebuild it here"):
        compress.runtime.load(fixed, backend="tensorrt")
    swap_tensorrt(monkeypatch, cuda, "10.2.0")
    with pytest.raises(UsageError, match="needs TensorRT 10.3.0 or later"):
        check_engine_provenance(_engine_dir(compatible))


def _standin_trtexec(folder: Path) -> Path:
    tool = folder / "trtexec"
    tool.write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'tests' / 'standins' / 'standin_trtexec.py'} \"$@\"\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return tool


def test_trtexec_builds_one_consistent_profile_and_writes_the_engine_manifest(decoder_run, tmp_path, monkeypatch):
    tool = _standin_trtexec(tmp_path)
    by_compress = _copy(decoder_run, tmp_path / "a")
    install(monkeypatch)
    monkeypatch.delitem(sys.modules, "tensorrt")  # no TensorRT Python API: compress falls back to trtexec
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert main(["build-engine", str(by_compress)]) == 0
    assert json.loads((_engine_dir(by_compress) / "engine_manifest.json").read_text())["builder"] == "trtexec"

    by_script = _copy(decoder_run, tmp_path / "b")
    proc = subprocess.run(
        ["bash", str(_engine_dir(by_script) / "build_on_device.sh")],
        env={**os.environ, "TRTEXEC": str(tool)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    manifest = json.loads((_engine_dir(by_script) / "engine_manifest.json").read_text())
    assert (manifest["builder"], manifest["tensorrt_version"], manifest["sm"]) == ("trtexec", "10.3.0", 87)
    assert len(engine_spec(_engine_dir(by_script) / "model.engine")["profiles"]) == 1
    install(monkeypatch)  # the Python API is back: the script's engine is visible to the runtime
    generator = compress.runtime.load(by_script, backend="tensorrt")
    reference = _engine_graph_decoder(by_script, tmp_path)
    ids, mask = _left_padded([[5, 17, 33, 9], [88, 3]])
    got, past = generator.decoder.forward(ids, mask, generator.decoder.empty_past(2))
    want, want_past = reference.forward(ids, mask, reference.empty_past(2))
    mask = np.concatenate([mask, np.ones((2, 1), dtype=np.int64)], axis=1)
    token = want[:, -1:].argmax(-1)
    got, _ = generator.decoder.forward(token, mask, past)
    want, _ = reference.forward(token, mask, want_past)
    np.testing.assert_allclose(got, want.astype(np.float32), atol=2e-2 * float(np.abs(want).max()))


def test_encoder_engine_builds_runs_and_is_measured_on_device(tmp_path, monkeypatch, capsys):
    from tests.pipeline.test_encoder_pipeline import FAST, _tiny_classifier

    folder = _tiny_classifier(tmp_path / "roberta", "roberta")
    run = tmp_path / "run"
    assert main(["run", "target=jetson-orin", f"model={folder}", "recipe=encoder-int8", f"out={run}", *FAST]) in (0, 1)
    plan = json.loads((_engine_dir(run) / "build_plan.json").read_text())
    assert plan["model_kind"] == "encoder" and plan["profiles"][0]["shapes"][0]["max"] == [32, 128]
    install(monkeypatch)
    assert main(["build-engine", str(run)]) == 0
    on_engine = compress.runtime.load(run, backend="tensorrt")
    on_host = compress.runtime.load(run, backend="onnxruntime")
    sentences = ["Stop.", "The robot moved 3 blocks to the bin.", "Navigate to the charging dock."]
    assert on_engine.backend == "tensorrt" and on_engine.classify(sentences) == on_host.classify(sentences)
    np.testing.assert_allclose(on_engine.logits(sentences), on_host.logits(sentences), atol=5e-2)
    capsys.readouterr()
    assert main(["validate", str(run), "--on-device"]) in (0, 1)
    report = json.loads(next(run.glob("validate-*.json")).read_text())
    assert report["on_device"]["ran"] and {r["batch"] for r in report["on_device"]["batches"]} >= {1, 8, 32}
    latency = next(c for c in report["gate"]["checks"] if c["name"] == "encoder_batch_ms")
    assert latency["source"] == "measured" and "TensorRT engine on this device" in latency["detail"]


def test_the_engine_graph_is_written_from_a_graph_with_external_weights(decoder_run, tmp_path):
    import onnx

    from compress.backends.onnx.graph import external_files, save_graph
    from compress.backends.tensorrt.engine_graph import engine_graph_parity, write_engine_graph

    exported = next(decoder_run.glob("*_export_onnx")) / "onnx" / ONNX_FILE
    source = tmp_path / "external" / ONNX_FILE
    source.parent.mkdir()
    save_graph(onnx.load(str(exported)), source, limit_bytes=1024)  # as a > 2 GB graph is saved
    assert external_files(source)
    write_engine_graph(source, tmp_path / "engine_input.onnx")
    ids = np.array([[5, 17, 33, 9]])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None]}
    feeds |= {
        f"past_key_values.{i}.{p}": np.zeros((1, 2, 0, 16), dtype=np.float32)
        for i in range(2)
        for p in ("key", "value")
    }
    assert engine_graph_parity(exported, tmp_path / "engine_input.onnx", feeds)["cosine_min"] > 0.999
