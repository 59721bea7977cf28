"""Chain of custody, the Edge-LLM side: does the exported bundle hold exactly our integers and scales?

Run by the interpreter that has ``tensorrt-edgellm`` (it imports nothing from ``compress``):

    python edgellm_custody.py BUNDLE_DIR EXPECTED.safetensors REPORT.json

``EXPECTED.safetensors`` holds, per quantized linear ``<name>``, what the quantize stage measured:
``<name>.integers`` (int8 values, INT4 ones in [-8, 7]) and ``<name>.weight_scale`` (float32); or
``<name>.fp8_values`` and the per-tensor ``<name>.weight_scale`` (FP8); or ``<name>.fp4_values``,
``<name>.block_scale`` and ``<name>.global_scale`` (NVFP4, ``<name>.weight_only`` when its input stays
FP16); ``<name>.input_scale`` where the input is quantized, and ``<name>.bias`` (float16) for linears
with a bias (Qwen2's q/k/v); per attention ``<layer>.self_attn.kv_scales`` (float32 k and v scales) for an
FP8 KV cache, compared with the layer's AttentionPlugin attributes;
per decoder linear left float, ``<name>.float_weight`` (float16), found by value because the exporter
folds it into a renamed, transposed constant. The others are compared with the initializer of the same name in
``BUNDLE_DIR/llm/model.onnx`` (Edge-LLM names them ``_model.<checkpoint name>``). INT4 weights
sit in the INT4 GEMM plugin's packed layout, so our integers are laid out with Edge-LLM's own
repacking function for the plugin version the bundle uses and compared byte for byte; its
scales are stored transposed in float16. FP8 and NVFP4 tensors are compared by value (FP8 scales
in FP16, as Edge-LLM stores them); where Edge-LLM fused q, k and v into one ``qkv_proj_fused``
linear (NVFP4 with equal per-tensor scales), each projection is compared with its rows of the fused
tensors. Scales are found by following the graph from the weight, because Edge-LLM deduplicates
equal initializers. The report lists every comparison and every mismatch, and the plugin nodes (INT4
GEMMs, attention) with their attributes, which compress holds against the kernels' contract.
"""

import json
import sys

import numpy as np
import onnx
from onnx import numpy_helper
from safetensors.numpy import load_file

_PREFIX = "_model."
_PASS_THROUGH = {"Cast", "Transpose", "Reshape"}
_FUSED_QKV = ("q_proj", "k_proj", "v_proj")
_PRODUCTS = {"MatMul", "Gemm"}  # the decoder linears are MatMuls; Edge-LLM writes a quantized lm_head as a Gemm
_QUANTIZERS = {"QuantizeLinear", "TRT_FP4DynamicQuantize"}
# The plugin nodes whose attributes say how the runtime's kernels will read the tensors (held against compress's
# contract table).
_KERNEL_OPS = {"Int4GroupwiseGemmPlugin", "Int4GroupwiseGemmPluginV2", "AttentionPlugin"}


def _kernel_node(node, initializers: dict) -> dict:
    """A plugin node as compress's contract check reads it: its scalar attributes and the shapes of its initializer
    inputs."""
    attributes = {}
    for attribute in node.attribute:
        value = onnx.helper.get_attribute_value(attribute)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, (int, float, str)):
            attributes[attribute.name] = value
    shapes = {str(i): list(initializers[name].shape) for i, name in enumerate(node.input) if name in initializers}
    weight = node.input[1] if len(node.input) > 1 else None
    return {"name": node.name, "op_type": node.op_type, "domain": node.domain, "attributes": attributes,
            "initializer_shapes": shapes, "weight": weight}


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
        self.kernel_nodes = [
            _kernel_node(node, self.initializers) for node in model.graph.node if node.op_type in _KERNEL_OPS
        ]

    def activation_scale(self, weight: str):
        """The name of the QuantizeLinear scale on the activation that meets ``weight`` in its MatMul, or None.

        Edge-LLM quantizes an activation once for every linear that reads it (q, k and v share one), and
        identical scales may share one initializer, so the scale is found by following the graph.
        """
        activation = self.activation_input(weight)
        source = self._upstream(activation) if activation is not None else None
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

    def weight_dequantizer(self, weight: str):
        """The DequantizeLinear node reading ``weight``, or None."""
        return next((n for n in self.consumers.get(weight, []) if n.op_type == "DequantizeLinear"), None)

    def matmul_of(self, weight: str):
        """The MatMul (or Gemm) the dequantized ``weight`` feeds (through casts, transposes and reshapes), or None."""
        node = self.weight_dequantizer(weight)
        while node is not None and node.op_type not in _PRODUCTS:
            node = next(iter(self.consumers.get(node.output[0], [])), None)
            if node is not None and node.op_type not in _PASS_THROUGH | _PRODUCTS:
                return None
        return node

    def activation_input(self, weight: str):
        """The other input of the MatMul (or Gemm) ``weight`` takes part in, or None."""
        matmul, dequantizer = self.matmul_of(weight), self.weight_dequantizer(weight)
        if matmul is None:
            return None
        weight_side = 1 if any(n is dequantizer for n in self._chain_up(matmul.input[1])) else 0
        return matmul.input[1 - weight_side]

    def activation_quantizers(self, weight: str) -> list:
        """The quantize nodes feeding the activation side of ``weight``'s MatMul (none for an FP16 input)."""
        activation = self.activation_input(weight)
        if activation is None:
            return []
        return [n for n in self._chain_up(activation, through_quantizers=True) if n.op_type in _QUANTIZERS]

    def _chain_up(self, tensor: str, through_quantizers: bool = False) -> list:
        """``tensor``'s producers back through pass-through nodes (and quantize / dequantize nodes when asked), ending
        with the first other node."""
        chain, node = [], self.producer.get(tensor)
        while node is not None:
            chain.append(node)
            if node.op_type not in _PASS_THROUGH and not (
                through_quantizers and node.op_type in _QUANTIZERS | {"DequantizeLinear"}
            ):
                break
            node = self.producer.get(node.input[0])
        return chain

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


def _fused_rows(inits: dict, name: str, expected: dict) -> tuple[str, slice] | None:
    """Where Edge-LLM fused q, k and v: the fused linear's name and ``name``'s rows in it."""
    parent, _, projection = name.rpartition(".")
    if projection not in _FUSED_QKV or f"{_PREFIX}{parent}.qkv_proj_fused.weight" not in inits:
        return None
    start = 0
    for part in _FUSED_QKV:
        rows = expected[f"{parent}.{part}.fp4_values"].shape[0]
        if part == projection:
            return f"{parent}.qkv_proj_fused", slice(start, start + rows)
        start += rows
    return None


def _values(array):
    return None if array is None else np.asarray(array).astype(np.float32)


def _check_fp8(report: dict, graph: Graph, name: str, expected: dict) -> None:
    inits = graph.initializers
    weight = f"{_PREFIX}{name}.weight"
    _compare(report, f"{weight} (FP8)", _values(inits.get(weight)), expected[f"{name}.fp8_values"])
    dequantize = graph.weight_dequantizer(weight)
    scale = inits.get(dequantize.input[1]) if dequantize is not None else None
    _compare(report, f"{_PREFIX}{name} weight scale (FP16)", None if scale is None else scale.reshape(()),
             expected[f"{name}.weight_scale"].astype(np.float16).reshape(()))
    scale_name = graph.activation_scale(weight)
    _compare(
        report,
        f"{_PREFIX}{name} activation scale ({scale_name}, FP16)",
        inits.get(scale_name) if scale_name else None,
        expected[f"{name}.input_scale"].astype(np.float16).reshape(()),
    )


def _check_nvfp4(report: dict, graph: Graph, name: str, expected: dict) -> None:
    inits = graph.initializers
    fused = _fused_rows(inits, name, expected)
    linear, rows = fused if fused else (name, slice(None))
    weight = f"{_PREFIX}{linear}.weight"
    found = _values(inits.get(weight))
    label = f"{weight}[{rows.start}:{rows.stop}]" if fused else weight
    _compare(report, f"{label} (FP4)", None if found is None else found[rows], expected[f"{name}.fp4_values"])
    dequantize = graph.weight_dequantizer(weight)
    scales = graph.producer.get(dequantize.input[1]) if dequantize is not None else None
    block = inits.get(scales.input[0]) if scales is not None else None
    rows_note = f"[{rows.start}:{rows.stop}]" if fused else ""
    _compare(
        report,
        f"{_PREFIX}{linear} block scales{rows_note} (FP8)",
        None if block is None else _values(block)[rows],
        expected[f"{name}.block_scale"],
    )
    global_scale = inits.get(scales.input[1]) if scales is not None else None
    _compare(report, f"{_PREFIX}{linear} global scale", None if global_scale is None else global_scale.reshape(()),
             expected[f"{name}.global_scale"].reshape(()))
    quantizers = graph.activation_quantizers(weight)
    if f"{name}.weight_only" in expected:
        entry = {"tensor": f"{_PREFIX}{linear} input (FP16, weight-only)", "shape": [], "dtype": "float16"}
        if quantizers:
            entry["problem"] = (
                f"the input is quantized ({quantizers[0].op_type}) although the checkpoint is weight-only"
            )
            report["mismatches"].append(entry)
        report["compared"].append(entry)
        return
    dynamic = next((n for n in quantizers if n.op_type == "TRT_FP4DynamicQuantize"), None)
    _compare(
        report,
        f"{_PREFIX}{linear} activation global scale",
        None if dynamic is None else inits.get(dynamic.input[1]).reshape(()),
        expected[f"{name}.input_scale"].reshape(()),
    )


def _check_kv_cache(report: dict, attention: dict, name: str, scales: np.ndarray) -> None:
    """The layer's attention plugin stores an FP8 cache with our (k, v) dequantization scales."""
    layer = name.split(".layers.", 1)[1].split(".", 1)[0]
    node = attention.get(f"present_key_values_{layer}")
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} if node is not None else {}
    found = None
    if attributes.get("enable_fp8_kv_cache") == 1:
        found = np.asarray(attributes.get("qkv_scales", [])[1:3], dtype=np.float32)
    _compare(report, f"layer {layer} AttentionPlugin FP8 KV cache (k_scale, v_scale)", found, scales.astype(np.float32))


def check(bundle: str, expected_path: str) -> dict:
    model_path = f"{bundle}/llm/model.onnx"
    graph = Graph(model_path)
    inits = graph.initializers
    expected = load_file(expected_path)
    report = {"onnx": model_path, "int4_plugin_version": graph.plugin_version, "kernel_nodes": graph.kernel_nodes,
              "compared": [], "mismatches": []}
    _check_float_weights(
        report, inits, {k.rsplit(".", 1)[0]: expected.pop(k) for k in sorted(expected) if k.endswith(".float_weight")}
    )
    names = sorted({key.rsplit(".", 1)[0] for key in expected})
    attention = {
        out: node for node in graph.producer.values() if node.op_type == "AttentionPlugin" for out in node.output
    }
    for name in names:
        if f"{name}.kv_scales" in expected:
            _check_kv_cache(report, attention, name, expected[f"{name}.kv_scales"])
            continue
        if f"{name}.fp8_values" in expected:
            _check_fp8(report, graph, name, expected)
        elif f"{name}.fp4_values" in expected:
            _check_nvfp4(report, graph, name, expected)
        else:
            _check_integers(report, graph, name, expected)
        if f"{name}.bias" in expected:
            bias_name = graph.bias_of(f"{_PREFIX}{name}.weight")
            _compare(report, f"{_PREFIX}{name} bias ({bias_name})", inits.get(bias_name) if bias_name else None,
                     expected[f"{name}.bias"])
    return report


def _float_initializer(inits: dict, target: np.ndarray):
    """The FP16 initializer holding ``target`` as it is or transposed (the exporter stores ``x @ W.T`` weights as
    ``W.T``), and the array to compare it with; (None, target) when none does."""
    for name, array in inits.items():
        if array.dtype != np.float16:
            continue
        if array.shape == target.shape and np.array_equal(array, target):
            return name, target
        if array.shape == target.T.shape and np.array_equal(array, target.T):
            return name, target.T
    return None, target


def _check_float_weights(report: dict, inits: dict, weights: dict) -> None:
    """Decoder linears left float, found by value; q, k and v left float are fused by the exporter into one constant,
    so a projection not found alone is looked for among its rows of the fused q|k|v."""
    for name in sorted(weights):
        match, compared = _float_initializer(inits, weights[name])
        parent, _, projection = name.rpartition(".")
        parts = [weights.get(f"{parent}.{p}") for p in _FUSED_QKV]
        if match is None and projection in _FUSED_QKV and all(p is not None for p in parts):
            joined = np.concatenate(parts)
            fused, fused_compared = _float_initializer(inits, joined)
            if fused is not None:
                start = sum(p.shape[0] for p in parts[:_FUSED_QKV.index(projection)])
                rows = slice(start, start + weights[name].shape[0])
                found = inits[fused] if fused_compared is joined else inits[fused].T
                _compare(report, f"{_PREFIX}{name}.weight (FP16, rows {rows.start}:{rows.stop} of fused q|k|v {fused})",
                         np.ascontiguousarray(found)[rows], weights[name])
                continue
        _compare(report, f"{_PREFIX}{name}.weight (FP16, {match or 'no initializer holds it'})",
                 inits[match] if match else None, compared)


def _check_integers(report: dict, graph: Graph, name: str, expected: dict) -> None:
    inits = graph.initializers
    integers = expected[f"{name}.integers"]
    scale = expected[f"{name}.weight_scale"]
    if scale.ndim == 2:  # INT4 group-wise
        _compare(
            report,
            f"{_PREFIX}{name}.weight",
            inits.get(f"{_PREFIX}{name}.weight"),
            _int4_layout(integers, graph.plugin_version),
        )
        _compare(report, f"{_PREFIX}{name}.weight_scale", inits.get(f"{_PREFIX}{name}.weight_scale"),
                 np.ascontiguousarray(scale.T).astype(np.float16))
        return
    _compare(report, f"{_PREFIX}{name}.weight", inits.get(f"{_PREFIX}{name}.weight"), integers)
    _compare(report, f"{_PREFIX}{name}.weight_scale", inits.get(f"{_PREFIX}{name}.weight_scale"), scale)
    scale_name = graph.activation_scale(f"{_PREFIX}{name}.weight")
    _compare(report, f"{_PREFIX}{name} activation scale ({scale_name})", inits.get(scale_name) if scale_name else None,
             expected[f"{name}.input_scale"].reshape(()))


if __name__ == "__main__":
    result = check(sys.argv[1], sys.argv[2])
    with open(sys.argv[3], "w") as handle:
        json.dump(result, handle, indent=2)
    sys.exit(1 if result["mismatches"] else 0)
