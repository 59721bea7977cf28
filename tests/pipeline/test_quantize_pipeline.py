"""The quantize stage through export: real Q/DQ ONNX that ONNX Runtime runs, on a tiny Llama."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from compress.backends.onnx.graph import onnx_files_size
from compress.cli.main import main
from compress.transforms.quantize.saved import load_quantization, load_quantized_causal_lm
from tests.conftest import TINY_SMOKE, cached_decode_logits

QUANT_SMALL = ["quantize.calib_windows=8", "quantize.calib_window=256", "quantize.min_calib_tokens=1024",
               "quantize.sample_tokens=256"]


def _run(tmp_path, model, recipe, *extra):
    out = tmp_path / recipe
    code = main(
        [
            "run",
            "target=jetson-orin",
            f"recipe={recipe}",
            f"model={model}",
            f"out={out}",
            *TINY_SMOKE,
            *QUANT_SMALL,
            *extra,
        ]
    )
    return code, out


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):
    base = tmp_path_factory.mktemp("quant")
    results = {}
    for recipe, extra in (("baseline", []), ("int8", []), ("int4", ["quantize.group_size=32"])):
        code, out = (
            _run(base, tiny_llama, recipe, *extra)
            if recipe != "baseline"
            else (
                main(
                    [
                        "run",
                        "target=jetson-orin",
                        "recipe=baseline",
                        f"model={tiny_llama}",
                        f"out={base / 'baseline'}",
                        *TINY_SMOKE,
                    ]
                ),
                base / "baseline",
            )
        )
        results[recipe] = (code, out)
    return results


def _graph(out):
    return onnx.load(str(out / "03_export_onnx" / "onnx" / "model.onnx"))


def test_int8_graph_has_per_channel_weights_and_per_tensor_activations(runs):
    code, out = runs["int8"]
    assert code in (0, 1), "the run must finish"
    graph = _graph(out)
    inits = {i.name: i for i in graph.graph.initializer}
    dq_weights = [n for n in graph.graph.node if n.op_type == "DequantizeLinear" and inits.get(n.input[0]) is not None
                  and inits[n.input[0]].data_type == onnx.TensorProto.INT8 and len(inits[n.input[0]].dims) == 2]
    assert len(dq_weights) == 2 * 7  # two layers x seven linears
    for node in dq_weights:
        scale = numpy_helper.to_array(inits[node.input[1]])
        assert scale.ndim == 1 and scale.shape[0] == inits[node.input[0]].dims[1]  # one scale per output channel
    quant_nodes = [n for n in graph.graph.node if n.op_type == "QuantizeLinear"]
    assert len(quant_nodes) == 2 * 7
    for node in quant_nodes:
        assert numpy_helper.to_array(inits[node.input[1]]).ndim == 0  # per-tensor activation scale
    assert all(o.version >= 21 for o in graph.opset_import if o.domain in ("", "ai.onnx"))
    _assert_no_float_copy(out, graph)


def _assert_no_float_copy(out, graph):
    folder = out / "02_quantize" / "model"
    _, linears = load_quantization(folder)
    model = load_quantized_causal_lm(folder)
    float_inits = {
        numpy_helper.to_array(i).tobytes() for i in graph.graph.initializer if i.data_type == onnx.TensorProto.FLOAT
    }
    for name in linears:
        tensor = model.get_submodule(name).weight.detach()
        assert tensor.T.contiguous().numpy().tobytes() not in float_inits, f"float copy of {name} left in the graph"


def test_rotated_down_proj_is_rotated_in_the_graph_and_exact_in_the_saved_folder(runs):
    from compress.algorithms.rotation import hadamard

    _, out = runs["int8"]
    rotated = json.loads((out / "02_quantize" / "stage.json").read_text())["metrics"]["rotated_linears"]
    assert rotated and all(name.endswith("mlp.down_proj") for name in rotated)
    assert f"{len(rotated)} inputs Hadamard-rotated" in (out / "report.md").read_text()
    graph = _graph(out)
    inits = {i.name: numpy_helper.to_array(i) for i in graph.graph.initializer}
    producers = {o: n for n in graph.graph.node for o in n.output}
    rotations = [n for n in graph.graph.node if n.op_type == "MatMul" and n.input[1].startswith("hadamard_")]
    assert len(rotations) == len(rotated)
    np.testing.assert_allclose(inits[rotations[0].input[1]], hadamard(128).numpy(), atol=1e-7)
    for node in rotations:
        merge = next(n for n in graph.graph.node if node.output[0] in n.input)
        quantize = next(n for n in graph.graph.node if merge.output[0] in n.input)
        assert (merge.op_type, quantize.op_type) == ("Reshape", "QuantizeLinear")
        dequantize = next(n for n in graph.graph.node if quantize.output[0] in n.input)
        matmul = next(n for n in graph.graph.node if dequantize.output[0] in n.input)
        weight_dq = producers[matmul.input[1]]
        assert matmul.op_type == "MatMul" and inits[weight_dq.input[0]].dtype == np.int8
    # The saved folder stores the rotated basis' integers; the weight it rebuilds is them times their scales, rotated
    # back.
    folder = out / "02_quantize" / "model"
    meta, linears = load_quantization(folder)
    name = rotated[0]
    levels = linears[name].levels
    assert levels.dtype == torch.int8 and linears[name].rotation == 128
    weight = load_quantized_causal_lm(folder).get_submodule(name).weight.detach().double()
    grid = (weight.reshape(weight.shape[0], -1, 128) @ hadamard(128)).reshape(weight.shape)
    torch.testing.assert_close(grid / linears[name].weight_scales.double()[:, None], levels.double(), atol=1e-3, rtol=0)


def test_int4_graph_is_blockwise_weight_only(runs):
    code, out = runs["int4"]
    assert code in (0, 1)
    graph = _graph(out)
    inits = {i.name: i for i in graph.graph.initializer}
    dq = [n for n in graph.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
          and inits[n.input[0]].data_type == onnx.TensorProto.INT4]
    assert len(dq) == 14
    for node in dq:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["block_size"] == 32 and attrs["axis"] == 0
    assert not [n for n in graph.graph.node if n.op_type == "QuantizeLinear"]
    _assert_no_float_copy(out, graph)


def test_onnx_size_reflects_bit_width(runs):
    sizes = {}
    for recipe in ("baseline", "int8", "int4"):
        out = runs[recipe][1]
        stage = "02_export_onnx" if recipe == "baseline" else "03_export_onnx"
        sizes[recipe] = onnx_files_size(out / stage / "onnx" / "model.onnx")  # the graph and its weights beside it
    # The int8 recipe's Hadamard rotation adds one float block matrix, shared by every rotated layer.
    sizes["int8"] -= sum(
        4 * int(np.prod(i.dims)) for i in _graph(runs["int8"][1]).graph.initializer if i.name.startswith("hadamard_")
    )
    linear_params = 2 * (4 * 64 * 64 - 2 * 64 * 32 + 3 * 64 * 128)  # q,o full; k,v GQA halves; gate, up, down
    assert sizes["baseline"] - sizes["int8"] > 0.7 * linear_params * 3  # ~3 bytes saved per weight
    assert sizes["int8"] - sizes["int4"] > 0.3 * linear_params  # ~half a byte more


def test_tied_embedding_is_stored_once(runs):
    for recipe, stage in (("baseline", "02_export_onnx"), ("int8", "03_export_onnx")):
        graph = onnx.load(str(runs[recipe][1] / stage / "onnx" / "model.onnx"))
        tables = [i for i in graph.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and 512 in i.dims]
        assert len(tables) == 1, recipe  # the (vocab, hidden) embedding, no (hidden, vocab) copy
        transpose = next(n for n in graph.graph.node if n.op_type == "Transpose" and n.input[0] == tables[0].name)
        head = next(n for n in graph.graph.node if n.op_type == "MatMul" and n.output[0] == "logits")
        assert head.input[1] == transpose.output[0]
        metrics = json.loads((runs[recipe][1] / stage / "stage.json").read_text())["metrics"]
        assert metrics["parity"]["max_abs_logit_diff"] < (1e-4 if recipe == "baseline" else 1e-2)


def test_onnx_runtime_perplexity_matches_torch_simulated_quant(runs):
    for recipe in ("int8", "int4"):
        out = runs[recipe][1]
        metrics = json.loads((out / "04_validate" / "validation.json").read_text())["metrics"]
        assert metrics["perplexity_torch_quantized"] is not None
        assert metrics["onnx_vs_torch_quantized_pct"] < 1.0, (recipe, metrics)
        report = json.loads((out / "report.json").read_text())
        names = [c["name"] for c in report["gate"]["checks"]]
        assert "onnx_vs_torch_quantized_pct" in names
        quant = report["stages"][1]["metrics"]
        assert len(quant["layer_sqnr_db"]) == 14 and quant["calibration_tokens"] >= 1024


def test_too_little_calibration_text_is_refused(tiny_llama, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("It is a truth universally acknowledged. " * 20)
    code = main(
        ["run", "target=jetson-orin", "recipe=int8", f"model={tiny_llama}", f"out={tmp_path / 'r'}", f"calib={short}"]
    )
    assert code == 2
    assert "too little calibration text" in capsys.readouterr().err


def test_group_size_must_divide_layer_width(tiny_llama, tmp_path, capsys):
    code, _ = _run(tmp_path, tiny_llama, "int4", "quantize.group_size=128")
    assert code == 2
    assert "group_size=128 does not divide" in capsys.readouterr().err


def test_target_without_int4_refuses_int4_recipe(tmp_path, capsys):
    import yaml

    from compress.core.config import available_targets

    data = yaml.safe_load(available_targets()["jetson-orin-nano-8gb"].read_text())
    data["gpu"]["precisions"] = ["fp32", "fp16", "int8"]
    data["aliases"] = []
    path = tmp_path / "no-int4.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["run", f"target={path}", "recipe=int4", "--dry-run"]) == 2
    assert "has no int4 tensor cores; its precisions are fp32, fp16, int8" in capsys.readouterr().err


def test_kv_cache_path_agrees_with_full_forward_on_quantized_graph(runs):
    from compress.backends.onnx.runtime import OnnxDecoder

    decoder = OnnxDecoder(runs["int4"][1] / "03_export_onnx" / "onnx")
    ids = np.arange(3, 15, dtype=np.int64)[None, :]
    np.testing.assert_allclose(cached_decode_logits(decoder, ids, 6), decoder.logits(ids), atol=1e-3)


def test_linears_below_the_sqnr_floor_keep_float_inputs_and_int8_weights(runs, tiny_llama, tmp_path):
    _, plain_out = runs["int8"]
    plain = json.loads((plain_out / "02_quantize" / "stage.json").read_text())["metrics"]
    assert plain["float_input_linears"] == []
    floor = plain["median_sqnr_db"]
    code, out = _run(tmp_path, tiny_llama, "int8", f"quantize.float_activations_below_db={floor}")
    assert code in (0, 1)
    metrics = json.loads((out / "02_quantize" / "stage.json").read_text())["metrics"]
    fallback = metrics["float_input_linears"]
    assert 0 < len(fallback) < 2 * 7
    layer0_below = {
        r["name"] for r in plain["layer_sqnr_db"] if r["name"].startswith("model.layers.0.") and r["sqnr_db"] < floor
    }
    assert {n for n in fallback if n.startswith("model.layers.0.")} == layer0_below
    graph = _graph(out)
    assert len([n for n in graph.graph.node if n.op_type == "QuantizeLinear"]) == 2 * 7 - len(fallback)
    inits = {i.name for i in graph.graph.initializer}
    int8_weights = [n for n in graph.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert len(int8_weights) == 2 * 7
