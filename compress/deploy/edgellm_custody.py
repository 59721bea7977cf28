"""Chain of custody, the Edge-LLM side: does the exported bundle hold exactly our integers and scales?

Run by the interpreter that has ``tensorrt-edgellm`` (it imports nothing from ``compress``):

    python edgellm_custody.py BUNDLE_DIR EXPECTED.safetensors REPORT.json

``EXPECTED.safetensors`` holds, per quantized linear ``<name>``, what the quantize stage measured:
``<name>.integers`` (int8 values, INT4 ones in [-8, 7]), ``<name>.weight_scale`` (float32),
for W8A8 ``<name>.input_scale``, and ``<name>.bias`` (float16) for linears with a bias (Qwen2's q/k/v);
per decoder linear left float, ``<name>.float_weight`` (float16), found by value because the exporter
folds it into a renamed, transposed constant. The others are compared with the initializer of the same name in
``BUNDLE_DIR/llm/model.onnx`` (Edge-LLM names them ``_model.<checkpoint name>``). INT4 weights
sit in the INT4 GEMM plugin's packed layout, so our integers are laid out with Edge-LLM's own
repacking function for the plugin version the bundle uses and compared byte for byte; its
scales are stored transposed in float16. The report lists every comparison and every mismatch.
"""

import json
import sys

import numpy as np
import onnx
from onnx import numpy_helper
from safetensors.numpy import load_file

_PREFIX = "_model."
_PASS_THROUGH = {"Cast", "Transpose", "Reshape"}


class Graph:
    """Initializers and node links of an exported graph."""

    def __init__(self, model_path: str):
        model = onnx.load(model_path, load_external_data=True)
        self.initializers = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
        self.producer = {out: node for node in model.graph.node for out in node.output}
        self.consumers: dict = {}
        for node in model.graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.plugin_version = 2 if any(n.op_type == "Int4GroupwiseGemmPluginV2" for n in model.graph.node) else 1

    def activation_scale(self, weight: str):
        """The name of the QuantizeLinear scale on the activation that meets ``weight`` in its MatMul, or None.

        Edge-LLM quantizes an activation once for every linear that reads it (q, k and v share one), and
        identical scales may share one initializer, so the scale is found by following the graph.
        """
        node = next((n for n in self.consumers.get(weight, []) if n.op_type == "DequantizeLinear"), None)
        while node is not None and node.op_type != "MatMul":
            node = next(iter(self.consumers.get(node.output[0], [])), None)
            if node is not None and node.op_type not in _PASS_THROUGH | {"MatMul"}:
                return None
        if node is None:
            return None
        weight_side = self._upstream(node.input[1])
        activation = node.input[0] if weight_side is not None and weight_side.input[0] == weight else node.input[1]
        source = self._upstream(activation)
        return source.input[1] if source is not None else None

    def bias_of(self, weight: str):
        """The initializer added to the output of the product ``weight`` takes part in, or None.

        Identical biases may share one initializer, so it is found by following the graph from the weight.
        """
        node = next(iter(self.consumers.get(weight, [])), None)
        while node is not None and node.op_type in _PASS_THROUGH | {"DequantizeLinear"}:
            node = next(iter(self.consumers.get(node.output[0], [])), None)
        after = next(iter(self.consumers.get(node.output[0], [])), None) if node is not None else None
        if after is None or after.op_type != "Add":
            return None
        return next((name for name in after.input if name in self.initializers), None)

    def _upstream(self, tensor: str):
        node = self.producer.get(tensor)
        while node is not None and node.op_type in _PASS_THROUGH:
            node = self.producer.get(node.input[0])
        return node if node is not None and node.op_type == "DequantizeLinear" else None


def _int4_layout(integers: np.ndarray, version: int) -> np.ndarray:
    from tensorrt_edgellm.checkpoint import repacking

    nibbles = ((integers.astype(np.int16) + 8) % 16).astype(np.int16)  # the plugin reads (nibble - 8) * scale
    if version == 2:
        return repacking.repack_to_cutedsl_fragment(nibbles)
    packed = repacking._pack_intweights(nibbles)
    return packed.view(np.int8).reshape(packed.shape[0] * 2, packed.shape[1])


def _compare(report: dict, name: str, found, expected: np.ndarray) -> None:
    entry = {"tensor": name, "shape": list(expected.shape), "dtype": str(expected.dtype)}
    if found is None:
        entry["problem"] = "missing from the exported graph"
    elif tuple(found.shape) != tuple(expected.shape):
        entry["problem"] = f"shape {list(found.shape)} instead of {list(expected.shape)}"
    elif not np.array_equal(found.astype(expected.dtype), expected):
        differing = int(np.count_nonzero(found.astype(expected.dtype) != expected))
        entry["problem"] = f"{differing} of {expected.size} values differ"
    report["compared"].append(entry)
    if "problem" in entry:
        report["mismatches"].append(entry)


def check(bundle: str, expected_path: str) -> dict:
    model_path = f"{bundle}/llm/model.onnx"
    graph = Graph(model_path)
    inits = graph.initializers
    expected = load_file(expected_path)
    report = {"onnx": model_path, "int4_plugin_version": graph.plugin_version, "compared": [], "mismatches": []}
    for key in sorted(k for k in expected if k.endswith(".float_weight")):
        name = key.rsplit(".", 1)[0]
        target = expected.pop(key)
        match = next((n for n, a in inits.items() if a.dtype == np.float16 and a.shape in (target.shape, target.T.shape)
                      and np.array_equal(a if a.shape == target.shape else a.T, target)), None)
        _compare(report, f"{_PREFIX}{name}.weight (FP16, {match or 'no initializer holds it'})",
                 inits[match] if match else None, target if match is None or inits[match].shape == target.shape else target.T)
    names = sorted({key.rsplit(".", 1)[0] for key in expected})
    for name in names:
        integers = expected[f"{name}.integers"]
        scale = expected[f"{name}.weight_scale"]
        if scale.ndim == 2:  # INT4 group-wise
            _compare(report, f"{_PREFIX}{name}.weight", inits.get(f"{_PREFIX}{name}.weight"),
                     _int4_layout(integers, graph.plugin_version))
            _compare(report, f"{_PREFIX}{name}.weight_scale", inits.get(f"{_PREFIX}{name}.weight_scale"),
                     np.ascontiguousarray(scale.T).astype(np.float16))
        else:
            _compare(report, f"{_PREFIX}{name}.weight", inits.get(f"{_PREFIX}{name}.weight"), integers)
            _compare(report, f"{_PREFIX}{name}.weight_scale", inits.get(f"{_PREFIX}{name}.weight_scale"), scale)
            scale_name = graph.activation_scale(f"{_PREFIX}{name}.weight")
            _compare(report, f"{_PREFIX}{name} activation scale ({scale_name})", inits.get(scale_name) if scale_name else None,
                     expected[f"{name}.input_scale"].reshape(()))
        if f"{name}.bias" in expected:
            bias_name = graph.bias_of(f"{_PREFIX}{name}.weight")
            _compare(report, f"{_PREFIX}{name} bias ({bias_name})", inits.get(bias_name) if bias_name else None,
                     expected[f"{name}.bias"])
    return report


if __name__ == "__main__":
    result = check(sys.argv[1], sys.argv[2])
    with open(sys.argv[3], "w") as handle:
        json.dump(result, handle, indent=2)
    sys.exit(1 if result["mismatches"] else 0)
