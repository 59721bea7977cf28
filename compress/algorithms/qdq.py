"""Rewrite a float ONNX graph (decoder or encoder) into a Q/DQ graph from a quantized model's scales.

Each quantized linear appears in the exported graph as a ``MatMul`` whose weight initializer is
the transposed dequantized weight. The initializer is found by value (exporters rename
initializers freely), replaced by integer levels plus a ``DequantizeLinear`` (INT8 per output
channel, or INT4 block-wise along the input dimension, opset 21), and for W8A8 the activation
input of the ``MatMul`` gets a ``QuantizeLinear``/``DequantizeLinear`` pair with the static scale.
A linear whose input is smoothed online (an encoder's LayerNorm outputs, which also feed a
residual) gets a per-channel ``Mul`` in front of that pair. A linear quantized on a
Hadamard-rotated input gets the rotation in front of that pair (``Reshape`` to blocks, ``MatMul``
by the Hadamard block, ``Reshape`` back) and its integer weight in the rotated basis. No float copy
of a quantized weight is kept.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper

from compress.algorithms.rotation import hadamard, rotate_numpy
from compress.errors import StageError

QDQ_OPSET = 21


@dataclass
class LinearForExport:
    """A quantized linear as the exporter sees it."""

    name: str
    dequantized: np.ndarray  # (out, in) float32, equal to levels * scales
    scales: np.ndarray  # (out,) or (out, groups)
    bits: int
    input_scale: float | None
    rotation: int = 0  # Hadamard block size of the input rotation; ``dequantized`` is stored rotated back
    input_smoothing: np.ndarray | None = None  # per-channel divisor applied to the input online, before its quantizer

    def grid_weight(self) -> np.ndarray:
        """The weight on its quantization grid (in the rotated basis for a rotated linear)."""
        return rotate_numpy(self.dequantized, self.rotation) if self.rotation else self.dequantized


def _digest(array: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def _levels(linear: LinearForExport) -> np.ndarray:
    weight = linear.grid_weight()
    scales = linear.scales if linear.scales.ndim == 2 else linear.scales[:, None]
    expanded = np.repeat(scales, weight.shape[1] // scales.shape[1], axis=1)
    levels = np.round(weight / expanded)
    limit = 2 ** (linear.bits - 1)
    if np.abs(levels * expanded - weight).max() > 1e-5 * max(1.0, np.abs(weight).max()):
        raise StageError(f"{linear.name}: stored weight is not on its quantization grid")
    return np.clip(levels, -limit, limit - 1).astype(np.int8)


def _weight_dq(linear: LinearForExport, weight_name: str) -> tuple[list[onnx.TensorProto], onnx.NodeProto]:
    levels_t = _levels(linear).T  # (in, out), the MatMul layout
    if linear.bits == 8:
        q = numpy_helper.from_array(np.ascontiguousarray(levels_t), f"{weight_name}_quantized")
        s = numpy_helper.from_array(linear.scales.astype(np.float32), f"{weight_name}_scale")
        node = helper.make_node("DequantizeLinear", [q.name, s.name], [weight_name], name=f"{weight_name}_DQ", axis=1)
    else:
        block = levels_t.shape[0] // linear.scales.shape[1]
        q = numpy_helper.from_array(np.ascontiguousarray(levels_t).astype(ml_dtypes.int4), f"{weight_name}_quantized")
        s = numpy_helper.from_array(np.ascontiguousarray(linear.scales.T.astype(np.float32)), f"{weight_name}_scale")
        node = helper.make_node("DequantizeLinear", [q.name, s.name], [weight_name], name=f"{weight_name}_DQ", axis=0,
                                block_size=block)
    return [q, s], node


def _activation_qdq(input_name: str, scale: float, tag: str) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto], str]:
    s = numpy_helper.from_array(np.array(scale, dtype=np.float32), f"{tag}_act_scale")
    z = numpy_helper.from_array(np.array(0, dtype=np.int8), f"{tag}_act_zero")
    quantized, dequantized = f"{tag}_act_q", f"{tag}_act_dq"
    nodes = [helper.make_node("QuantizeLinear", [input_name, s.name, z.name], [quantized], name=f"{tag}_act_Q"),
             helper.make_node("DequantizeLinear", [quantized, s.name, z.name], [dequantized], name=f"{tag}_act_DQ")]
    return [s, z], nodes, dequantized


def _rotation(input_name: str, linear: LinearForExport, tag: str, shared: dict[str, onnx.TensorProto]
              ) -> tuple[list[onnx.NodeProto], str]:
    """Nodes rotating ``input_name`` (any rank, last axis = in_features) by the block-diagonal Hadamard matrix."""
    block, width = linear.rotation, linear.dequantized.shape[1]
    matrix = f"hadamard_{block}"
    if matrix not in shared:
        shared[matrix] = numpy_helper.from_array(hadamard(block).numpy().astype(np.float32), matrix)
    blocks_shape = f"hadamard_{block}_blocks_of_{width}"
    if blocks_shape not in shared:
        shared[blocks_shape] = numpy_helper.from_array(np.array([-1, width // block, block], dtype=np.int64), blocks_shape)
    shape, blocks, rotated, out = f"{tag}_rot_shape", f"{tag}_rot_blocks", f"{tag}_rot_rotated", f"{tag}_rot"
    nodes = [helper.make_node("Shape", [input_name], [shape], name=f"{tag}_rot_Shape"),
             helper.make_node("Reshape", [input_name, blocks_shape], [blocks], name=f"{tag}_rot_split"),
             helper.make_node("MatMul", [blocks, matrix], [rotated], name=f"{tag}_rot_MatMul"),
             helper.make_node("Reshape", [rotated, shape], [out], name=f"{tag}_rot_merge")]
    return nodes, out


def apply_qdq(model: onnx.ModelProto, linears: list[LinearForExport]) -> dict[str, int]:
    """Rewrite ``model`` in place; every linear must be found exactly once."""
    by_digest = {_digest(lin.dequantized.T): lin for lin in linears}
    graph = model.graph
    original_nodes = list(graph.node)
    consumers: dict[str, list[int]] = {}
    for position, node in enumerate(original_nodes):
        for name in node.input:
            consumers.setdefault(name, []).append(position)
    found: dict[str, str] = {}
    replaced: list[int] = []
    new_inits: list[onnx.TensorProto] = []
    new_nodes: list[onnx.NodeProto] = []
    before: dict[int, list[onnx.NodeProto]] = {}  # node position -> nodes to insert before it
    shared: dict[str, onnx.TensorProto] = {}
    activation_pairs = rotations = 0
    for init_index, init in enumerate(graph.initializer):
        is_matrix = init.data_type == onnx.TensorProto.FLOAT and len(init.dims) == 2
        linear = by_digest.get(_digest(numpy_helper.to_array(init))) if is_matrix else None
        if linear is None or linear.name in found:
            continue
        replaced.append(init_index)
        found[linear.name] = init.name
        tensors, dq = _weight_dq(linear, init.name)
        new_inits.extend(tensors)
        new_nodes.append(dq)
        matmuls = [p for p in consumers.get(init.name, []) if original_nodes[p].op_type == "MatMul"]
        rewrites_input = linear.input_scale is not None or linear.rotation or linear.input_smoothing is not None
        for index, position in enumerate(matmuls if rewrites_input else []):
            node = original_nodes[position]
            tag = f"{init.name}_{index}"
            source = node.input[0]
            if linear.input_smoothing is not None:
                inverse = numpy_helper.from_array((1.0 / linear.input_smoothing).astype(np.float32), f"{tag}_smooth_inv")
                new_inits.append(inverse)
                before.setdefault(position, []).append(
                    helper.make_node("Mul", [source, inverse.name], [f"{tag}_smoothed"], name=f"{tag}_smooth_Mul"))
                source = f"{tag}_smoothed"
            if linear.rotation:
                nodes, source = _rotation(source, linear, tag, shared)
                before.setdefault(position, []).extend(nodes)
                rotations += 1
            if linear.input_scale is not None:
                tensors, nodes, source = _activation_qdq(source, linear.input_scale, tag)
                new_inits.extend(tensors)
                before.setdefault(position, []).extend(nodes)
                activation_pairs += 1
            node.input[0] = source
    missing = sorted({lin.name for lin in linears} - set(found))
    if missing:
        raise StageError(f"quantized linears not found in the exported graph: {', '.join(missing[:5])}")
    for init_index in reversed(replaced):
        del graph.initializer[init_index]
    graph.initializer.extend(new_inits)
    graph.initializer.extend(shared.values())
    nodes = list(new_nodes)
    for position, node in enumerate(original_nodes):
        nodes.extend(before.get(position, []))
        detached = onnx.NodeProto()
        detached.CopyFrom(node)
        nodes.append(detached)
    del graph.node[:]
    graph.node.extend(nodes)
    _set_opset(model, QDQ_OPSET)
    return {"quantized_linears": len(found), "activation_qdq_pairs": activation_pairs, "hadamard_rotations": rotations}


def _set_opset(model: onnx.ModelProto, version: int) -> None:
    # Between opsets 18 and 21 the operators this exporter emits changed only in accepted types
    # (and Q/DQ gained int4 and block_size), so the import is raised without rewriting nodes.
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version < version:
            opset.version = version
    model.ir_version = max(model.ir_version, 10)
