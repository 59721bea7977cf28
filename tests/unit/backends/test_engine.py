"""Engine planning up to the TensorRT API boundary; the real build runs only where TensorRT and a GPU exist."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from compress.backends.onnx.runtime import LAYOUT_FILE, DecoderLayout
from compress.backends.tensorrt.builder import cuda_device, local_build_support, tensorrt_version
from compress.backends.tensorrt.plan import BuildPlan, make_plan
from compress.backends.tensorrt.static_check import check_onnx_for_target
from compress.cli.main import main
from compress.core.config import load_target
from compress.core.errors import UsageError
from tests.conftest import TINY_SMOKE

LAYOUT = DecoderLayout(num_layers=2, num_kv_heads=[3, 3], head_dim=64, eos_token_ids=[2])


def _graph(nodes, inits=(), opset=21):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _consistent(profile, layout=LAYOUT) -> bool:
    """Every point of a decoder profile is a real step: mask = past + new tokens, each layer's cache as long as the
    layout keeps after that past (a sliding layer's capped at its window), one batch size throughout."""
    shapes = {s.name: s for s in profile.shapes}
    for kind in ("min", "opt", "max"):
        ids, mask = getattr(shapes["input_ids"], kind), getattr(shapes["attention_mask"], kind)
        past = [
            getattr(shapes[f"past_key_values.{i}.{part}"], kind)
            for i in range(layout.num_layers)
            for part in ("key", "value")
        ]
        lengths = [layout.cache_length(i // 2, mask[1] - ids[1]) for i in range(2 * layout.num_layers)]
        if [p[2] for p in past] != lengths or len({ids[0], mask[0], *(p[0] for p in past)}) != 1:
            return False
    return True


def test_a_sliding_layers_cache_is_bounded_by_its_window_in_every_profile(tmp_path):
    sliding = DecoderLayout(num_layers=2, num_kv_heads=[3, 3], head_dim=64, eos_token_ids=[2], sliding_window=512,
                            sliding_layers=(0,))
    nano = load_target("jetson-orin-nano-8gb")
    plan = make_plan(nano, sliding, has_qdq=False, sparse_24=False)
    decode = {s.name: s for s in plan.profiles[1].shapes}
    context = nano.budgets.context_length
    assert context > 512 and decode["past_key_values.0.key"].max == (1, 3, 511, 64)
    assert decode["past_key_values.1.key"].max == (1, 3, context - 1, 64)
    assert all(_consistent(p, sliding) for p in (*plan.profiles, plan.trtexec_profile))
    assert not _consistent(make_plan(nano, LAYOUT, has_qdq=False, sparse_24=False).profiles[1], sliding)
    (tmp_path / LAYOUT_FILE).write_text(json.dumps(sliding.to_json()))
    assert DecoderLayout.load(tmp_path) == sliding


def test_plan_follows_the_target():
    nano, agx = load_target("jetson-orin-nano-8gb"), load_target("jetson-agx-orin-64gb")
    plan = make_plan(nano, LAYOUT, has_qdq=True, sparse_24=True, max_batch=2)
    assert plan.gpu_sm == 87 and plan.tensorrt_version == "10.3"
    assert plan.int8 and plan.precision == "fp16" and plan.sparse_weights and plan.strongly_typed
    assert plan.workspace_bytes == 2 * (1 << 30)  # a quarter of 8 GB
    assert make_plan(agx, LAYOUT, has_qdq=False, sparse_24=False).workspace_bytes > plan.workspace_bytes
    prefill, decode = plan.profiles
    assert (prefill.name, decode.name) == ("prefill", "decode")
    context = nano.budgets.context_length
    pre, dec = {s.name: s for s in prefill.shapes}, {s.name: s for s in decode.shapes}
    assert pre["input_ids"].max == (2, context) and pre["past_key_values.1.value"].max == (2, 3, 0, 64)
    assert dec["input_ids"].max == (2, 1) and dec["past_key_values.1.value"].max == (2, 3, context - 1, 64)
    assert dec["attention_mask"].max == (2, context) and dec["past_key_values.0.key"].min == (1, 3, 1, 64)
    assert all(_consistent(p) for p in (*plan.profiles, plan.trtexec_profile))
    assert BuildPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_the_old_single_profile_was_inconsistent_and_is_caught():
    """The profile compress used to write (mask and cache both at the prompt length at opt) is no real step."""
    from compress.backends.tensorrt.plan import Profile, ShapeRange

    context, prompt = 2048, 128
    old = [
        ShapeRange("input_ids", (1, 1), (1, prompt), (1, context)),
        ShapeRange("attention_mask", (1, 1), (1, prompt), (1, context)),
    ]
    old += [ShapeRange(f"past_key_values.{i}.{part}", (1, 3, 0, 64), (1, 3, prompt, 64), (1, 3, context - 1, 64))
            for i in range(2) for part in ("key", "value")]
    assert not _consistent(Profile("old", old))


def test_trtexec_command():
    plan = make_plan(load_target("jetson-orin"), LAYOUT, has_qdq=True, sparse_24=True)
    command = plan.trtexec_command()
    for flag in (
        "--onnx=engine_input.onnx",
        "--saveEngine=model.engine",
        "--stronglyTyped",
        "--sparsity=enable",
        "--memPoolSize=workspace:2048M",
        "--builderOptimizationLevel=3",
        "--minShapes=input_ids:1x1",
        "past_key_values.0.key:1x3x0x64",
        "--timingCacheFile=timing-jetson-orin-nano-8gb.cache",
        "--skipInference",
    ):
        assert flag in command
    assert "--fp16" not in command and "--int8" not in command  # strongly typed: the graph's types give the precision
    dense = make_plan(load_target("jetson-orin"), LAYOUT, has_qdq=False, sparse_24=False).trtexec_command()
    assert "--sparsity" not in dense
    weak = dataclasses.replace(plan, strongly_typed=False, int4=True).trtexec_command()
    assert "--fp16" in weak and "--int8" in weak and "--int4" in weak and "--stronglyTyped" not in weak


def test_static_check_rejects_unsupported_op():
    model = _graph(
        [
            helper.make_node("Relu", ["x"], ["h"], name="ok"),
            helper.make_node("NonMaxSuppression", ["h"], ["y"], name="nms1"),
        ]
    )
    with pytest.raises(UsageError, match="node nms1: operator NonMaxSuppression is not supported"):
        check_onnx_for_target(model, load_target("jetson-orin"))


def test_static_check_rejects_fp8_on_sm87_but_not_on_ada():
    scale = numpy_helper.from_array(np.array(0.1, dtype=np.float32), "s")
    zero = helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0.0])
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q_fp8"),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq_fp8")]
    model = _graph(nodes, [scale, zero])
    with pytest.raises(UsageError, match="FLOAT8E4M3FN is not supported on sm_87"):
        check_onnx_for_target(model, load_target("jetson-orin"))
    facts = check_onnx_for_target(model, load_target("rtx-4090"))
    assert facts.has_qdq


def test_static_check_rejects_int4_activations_and_new_opsets():
    scale = numpy_helper.from_array(np.array(0.1, dtype=np.float32), "s")
    zero = helper.make_tensor("z", TensorProto.INT4, [], [0])
    model = _graph([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q_int4"),
                    helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq_int4")], [scale, zero])
    with pytest.raises(UsageError, match="INT4 activations are not supported"):
        check_onnx_for_target(model, load_target("jetson-orin"))
    with pytest.raises(UsageError, match="opset 23 is newer"):
        check_onnx_for_target(_graph([helper.make_node("Relu", ["x"], ["y"])], opset=23), load_target("jetson-orin"))


def test_no_local_build_without_cuda():
    support = local_build_support(87)
    if cuda_device() is None:
        assert not support.can_build and support.reason == "not run: no CUDA device"


def test_deferred_build_writes_plan_and_never_an_engine(tiny_llama, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "target=jetson-orin", "recipe=smoke", f"model={tiny_llama}", f"out={out}", *TINY_SMOKE,
                 "quantize.calib_window=256", "quantize.min_calib_tokens=512"])
    assert code in (0, 1)
    report = json.loads((out / "report.json").read_text())
    stage = next(s for s in report["stages"] if s["name"] == "build_engine")
    engine_dir = out / "04_build_engine" / "engine"
    if local_build_support(87).can_build:
        assert stage["status"] == "done"
        return
    assert stage["status"] == "deferred"
    assert stage["metrics"]["reason"].startswith("not run:")
    assert report["artifacts"]["engine"] is None
    assert not list(engine_dir.glob("*.engine"))
    plan = json.loads((engine_dir / "build_plan.json").read_text())
    assert plan["int8"] is True and plan["target"] == "jetson-orin-nano-8gb"
    assert "--onnx=engine_input.onnx" in (engine_dir / "build_on_device.sh").read_text()
    assert "deferred" in (out / "report.md").read_text()
    capsys.readouterr()
    assert main(["build-engine", str(out)]) == 3
    assert "not run:" in capsys.readouterr().err
    assert main(["validate", str(out), "--on-device"]) == 3
    captured = capsys.readouterr()
    assert "not run:" in captured.out


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device() is None or tensorrt_version() is None, reason="needs a CUDA device and TensorRT")
def test_builds_and_runs_a_tiny_engine(tiny_llama, tmp_path):
    from compress.pipeline.device import measure_on_device

    device = cuda_device()
    target = load_target("rtx-4090").model_copy(
        update={"gpu": load_target("rtx-4090").gpu.model_copy(update={"sm": device[1]})}
    )
    path = tmp_path / "local.yaml"
    path.write_text(json.dumps(target.model_dump(mode="json")))
    out = tmp_path / "run"
    assert main(["run", f"target={path}", "recipe=smoke", f"model={tiny_llama}", f"out={out}", *TINY_SMOKE,
                 "quantize.calib_window=256", "quantize.min_calib_tokens=512"]) in (0, 1)
    assert list((out / "04_build_engine" / "engine").glob("*.engine"))
    measured = measure_on_device(out, 16)
    assert measured["iterations"] > 0 and measured["decode"]["p50_ms"] > 0


def test_onnx_runtime_sessions_keep_to_the_thread_cap_torch_follows(tmp_path, monkeypatch):
    from compress.backends.onnx.runtime import make_session

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = tmp_path / "relu.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert make_session(path).get_session_options().intra_op_num_threads == 1
    assert make_session(path, threads=3).get_session_options().intra_op_num_threads == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert make_session(path).get_session_options().intra_op_num_threads == 0  # ONNX Runtime's own default: every core
