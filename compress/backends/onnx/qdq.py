"""Rewrite a float ONNX graph (decoder or encoder) into a Q/DQ graph from a quantized model's scales.

Each quantized linear appears in the exported graph as a ``MatMul`` whose weight initializer is
the transposed dequantized weight. The initializer is found by value (exporters rename
initializers freely), replaced by its grid values plus a ``DequantizeLinear`` (INT8 per output
channel, INT4 block-wise along the input dimension, FP8 per tensor or channel, opset 21; NVFP4 as
FP4 values under FP8 block scales dequantized by an FP32 global scale, opset 23), and for W8A8 the
activation input of the ``MatMul`` gets a ``QuantizeLinear``/``DequantizeLinear`` pair with the
static scale (INT8 or FP8); for NVFP4 W4A4, the dynamic block quantization in standard operators.
A linear whose input is smoothed online (an encoder's LayerNorm outputs, which also feed a
residual) gets a per-channel ``Mul`` in front of that pair. A linear quantized on a
Hadamard-rotated input gets the rotation in front of that pair (``Reshape`` to blocks, ``MatMul``
by the Hadamard block, ``Reshape`` back) and its integer weight in the rotated basis. No float copy
of a quantized weight is kept.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from compress.algorithms.formats import NVFP4_BLOCK, Fp8Grid, IntGrid, Nvfp4Grid, WeightGrid, levels_on_grid
from compress.algorithms.rotation import hadamard, rotate_numpy
from compress.core.errors import StageError

QDQ_OPSET = 21
FP4_OPSET = 23  # FLOAT4E2M1 tensors


@dataclass
class LinearForExport:
    """A quantized linear as the exporter sees it."""

    name: str
    dequantized: np.ndarray  # (out, in) float32, the weight on its grid
    scales: np.ndarray  # () or (out,) or (out, groups); NVFP4: the FP8 block scales (out, in / 16)
    bits: int
    input_scale: float | None
    rotation: int = 0  # Hadamard block size of the input rotation; ``dequantized`` is stored rotated back
    input_smoothing: np.ndarray | None = None  # per-channel divisor applied to the input online, before its quantizer
    weight_format: str = "int"  # "int", "fp8" or "nvfp4"
    global_scale: float | None = None  # NVFP4's per-tensor scale
    input_format: str = "int8"  # "int8", "fp8" or "nvfp4" (dynamic blocks of 16 under the global input_scale)

    def grid_weight(self) -> np.ndarray:
        """The weight on its quantization grid (in the rotated basis for a rotated linear)."""
        return rotate_numpy(self.dequantized, self.rotation) if self.rotation else self.dequantized

    def grid(self) -> WeightGrid:
        if self.weight_format == "nvfp4":
            return Nvfp4Grid(self.global_scale)
        if self.weight_format == "fp8":
            return Fp8Grid(per_channel=self.scales.ndim == 1)
        return IntGrid(self.bits, None if self.scales.ndim < 2 else self.dequantized.shape[1] // self.scales.shape[1])


def _digest(array: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def _levels(linear: LinearForExport) -> np.ndarray:
    """The grid values (out, in) of the linear's weight, as float32."""
    try:
        levels = levels_on_grid(torch.from_numpy(linear.grid_weight()), linear.grid(), torch.from_numpy(linear.scales))
    except ValueError as exc:
        raise StageError(f"{linear.name}: stored {exc}") from exc
    return levels.numpy()


def _weight_dq(linear: LinearForExport, weight_name: str) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto]]:
    """The weight as grid values and scales, and the ``DequantizeLinear`` nodes that give it back in the MatMul layout
    (in, out)."""
    levels_t = np.ascontiguousarray(_levels(linear).T)
    q_name, s_name = f"{weight_name}_quantized", f"{weight_name}_scale"
    if linear.weight_format == "nvfp4":
        # TensorRT's NVFP4 pattern: DQ(FP8 block scales, FP32 global) -> scales; DQ(FP4 weight, scales) blockwise.
        q = numpy_helper.from_array(levels_t.astype(ml_dtypes.float4_e2m1fn), q_name)
        block_scales = numpy_helper.from_array(
            np.ascontiguousarray(linear.scales.T).astype(ml_dtypes.float8_e4m3fn), f"{s_name}_fp8"
        )
        global_scale = numpy_helper.from_array(np.array(linear.global_scale, dtype=np.float32), f"{s_name}_global")
        nodes = [
            helper.make_node(
                "DequantizeLinear", [block_scales.name, global_scale.name], [s_name], name=f"{weight_name}_scale_DQ"
            ),
            helper.make_node(
                "DequantizeLinear",
                [q.name, s_name],
                [weight_name],
                name=f"{weight_name}_DQ",
                axis=0,
                block_size=NVFP4_BLOCK,
            ),
        ]
        return [q, block_scales, global_scale], nodes
    scales = numpy_helper.from_array(np.ascontiguousarray(linear.scales.T).astype(np.float32), s_name)
    if linear.weight_format == "fp8":
        q = numpy_helper.from_array(levels_t.astype(ml_dtypes.float8_e4m3fn), q_name)
        attributes = {"axis": 1} if linear.scales.ndim == 1 else {}
    elif linear.bits == 8:
        q = numpy_helper.from_array(levels_t.astype(np.int8), q_name)
        attributes = {"axis": 1}
    else:
        q = numpy_helper.from_array(levels_t.astype(ml_dtypes.int4), q_name)
        attributes = {"axis": 0, "block_size": levels_t.shape[0] // linear.scales.shape[1]}
    return [q, scales], [
        helper.make_node(
            "DequantizeLinear", [q.name, scales.name], [weight_name], name=f"{weight_name}_DQ", **attributes
        )
    ]


def _activation_qdq(input_name: str, scale: float, tag: str, input_format: str = "int8"
                    ) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto], str]:
    """Static per-tensor Q/DQ of an input (INT8 or FP8), or NVFP4's dynamic block quantization."""
    if input_format == "nvfp4":
        return _nvfp4_activation(input_name, scale, tag)
    s = numpy_helper.from_array(np.array(scale, dtype=np.float32), f"{tag}_act_scale")
    zero = np.array(0, dtype=ml_dtypes.float8_e4m3fn if input_format == "fp8" else np.int8)
    z = numpy_helper.from_array(zero, f"{tag}_act_zero")
    quantized, dequantized = f"{tag}_act_q", f"{tag}_act_dq"
    nodes = [helper.make_node("QuantizeLinear", [input_name, s.name, z.name], [quantized], name=f"{tag}_act_Q"),
             helper.make_node("DequantizeLinear", [quantized, s.name, z.name], [dequantized], name=f"{tag}_act_DQ")]
    return [s, z], nodes, dequantized


def _nvfp4_activation(
    input_name: str, scale: float, tag: str
) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto], str]:
    """NVFP4 activation fake quantization in standard operators, as TensorRT's FP4 dynamic quantization computes it.

    Per block of 16 along the last axis: block scale ``amax / 6`` over the (power-of-two) global
    scale, rounded to FP8 (a QuantizeLinear / DequantizeLinear pair, saturating); values divided by
    (FP8 scale x global), rounded to E2M1 (half to even in each of the grid's three spacings) and
    multiplied back. Equal, value for value, to :meth:`compress.algorithms.formats.Nvfp4Activation.fake_quantize`.
    """
    t = f"{tag}_nvfp4"
    values = {"global": (scale, np.float32), **_NVFP4_CONSTANTS}
    consts = [
        numpy_helper.from_array(np.array(value, dtype=dtype), f"{t}_{name}") for name, (value, dtype) in values.items()
    ]
    c = {name: f"{t}_{name}" for name in values}

    def node(op: str, inputs: list[str], output: str, **attributes) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [f"{t}_{output}"], name=f"{t}_{output}_{op}", **attributes)

    return consts, _nvfp4_scale_nodes(node, t, c, input_name) + _e2m1_nodes(node, t, c), f"{t}_dq"


_NVFP4_CONSTANTS = {
    "blocks": ([-1, NVFP4_BLOCK], np.int64), "axis": ([-1], np.int64), "six": (6.0, np.float32),
    "one": (1.0, np.float32), "zero": (0.0, np.float32), "tiny": (1e-20, np.float32),
    "fp8_zero": (0, ml_dtypes.float8_e4m3fn), "two": (2.0, np.float32), "four": (4.0, np.float32),
    "half": (0.5, np.float32),
}


def _nvfp4_scale_nodes(node, t: str, c: dict[str, str], input_name: str) -> list[onnx.NodeProto]:
    """The input in blocks of 16, each block's FP8 scale times the global scale, and the blocks divided by it."""
    return [
        node("Shape", [input_name], "shape"),
        node("Reshape", [input_name, c["blocks"]], "x"),
        node("Abs", [f"{t}_x"], "abs"),
        node("ReduceMax", [f"{t}_abs", c["axis"]], "amax", keepdims=1),
        node("Div", [f"{t}_amax", c["six"]], "per_block"),
        node("Div", [f"{t}_per_block", c["global"]], "ratio"),
        node("QuantizeLinear", [f"{t}_ratio", c["one"], c["fp8_zero"]], "ratio_fp8"),
        node("DequantizeLinear", [f"{t}_ratio_fp8", c["one"], c["fp8_zero"]], "block_fp8"),
        node("Equal", [f"{t}_per_block", c["zero"]], "empty"),
        node("Where", [f"{t}_empty", c["one"], f"{t}_block_fp8"], "block"),
        node("Mul", [f"{t}_block", c["global"]], "scale_raw"),
        node("Max", [f"{t}_scale_raw", c["tiny"]], "scale"),
        node("Div", [f"{t}_x", f"{t}_scale"], "scaled"),
    ]


def _e2m1_nodes(node, t: str, c: dict[str, str]) -> list[onnx.NodeProto]:
    """The scaled blocks rounded to E2M1 (half to even in each spacing), multiplied back and reshaped to the input."""
    return [
        node("Abs", [f"{t}_scaled"], "magnitude"),
        node("Mul", [f"{t}_magnitude", c["two"]], "doubled"),
        node("Round", [f"{t}_doubled"], "doubled_round"),
        node("Mul", [f"{t}_doubled_round", c["half"]], "halves"),
        node("Round", [f"{t}_magnitude"], "units"),
        node("Mul", [f"{t}_magnitude", c["half"]], "halved"),
        node("Round", [f"{t}_halved"], "halved_round"),
        node("Mul", [f"{t}_halved_round", c["two"]], "twos_raw"),
        node("Min", [f"{t}_twos_raw", c["six"]], "twos"),
        node("Less", [f"{t}_magnitude", c["two"]], "below_two"),
        node("Less", [f"{t}_magnitude", c["four"]], "below_four"),
        node("Where", [f"{t}_below_four", f"{t}_units", f"{t}_twos"], "upper"),
        node("Where", [f"{t}_below_two", f"{t}_halves", f"{t}_upper"], "rounded"),
        node("Sign", [f"{t}_scaled"], "sign"),
        node("Mul", [f"{t}_rounded", f"{t}_sign"], "levels"),
        node("Mul", [f"{t}_levels", f"{t}_scale"], "dq_blocks"),
        node("Reshape", [f"{t}_dq_blocks", f"{t}_shape"], "dq"),
    ]


def _rotation(input_name: str, linear: LinearForExport, tag: str, shared: dict[str, onnx.TensorProto]
              ) -> tuple[list[onnx.NodeProto], str]:
    """Nodes rotating ``input_name`` (any rank, last axis = in_features) by the block-diagonal Hadamard matrix."""
    block, width = linear.rotation, linear.dequantized.shape[1]
    matrix = f"hadamard_{block}"
    if matrix not in shared:
        shared[matrix] = numpy_helper.from_array(hadamard(block).numpy().astype(np.float32), matrix)
    blocks_shape = f"hadamard_{block}_blocks_of_{width}"
    if blocks_shape not in shared:
        shared[blocks_shape] = numpy_helper.from_array(
            np.array([-1, width // block, block], dtype=np.int64), blocks_shape
        )
    shape, blocks, rotated, out = f"{tag}_rot_shape", f"{tag}_rot_blocks", f"{tag}_rot_rotated", f"{tag}_rot"
    nodes = [helper.make_node("Shape", [input_name], [shape], name=f"{tag}_rot_Shape"),
             helper.make_node("Reshape", [input_name, blocks_shape], [blocks], name=f"{tag}_rot_split"),
             helper.make_node("MatMul", [blocks, matrix], [rotated], name=f"{tag}_rot_MatMul"),
             helper.make_node("Reshape", [rotated, shape], [out], name=f"{tag}_rot_merge")]
    return nodes, out


class QdqRewrite:
    """A graph's Q/DQ rewrite, collected one linear at a time and applied by :meth:`finish` (node positions stay those
    of the graph as it was when the rewrite began).

    ``store`` is called on every tensor the rewrite creates, before the rewrite keeps it (the streamed export moves each
    one's bytes to the external data file there, so the levels of a large model are never held together).
    """

    def __init__(
        self, model: onnx.ModelProto, store: Callable[[onnx.TensorProto], onnx.TensorProto] = lambda t: t
    ) -> None:
        self.model = model
        self.nodes = list(model.graph.node)
        self.consumers: dict[str, list[int]] = {}
        for position, node in enumerate(self.nodes):
            for name in node.input:
                self.consumers.setdefault(name, []).append(position)
        self.store = store
        self.found: dict[str, str] = {}
        self.removed: set[int] = set()
        self.new_inits: list[onnx.TensorProto] = []
        self.new_nodes: list[onnx.NodeProto] = []
        self.before: dict[int, list[onnx.NodeProto]] = {}  # node position -> nodes to insert before it
        self.after: dict[int, list[onnx.NodeProto]] = {}  # node position -> nodes to insert after it
        self.shared: dict[str, onnx.TensorProto] = {}
        self.activation_pairs = self.rotations = 0
        self.fp4 = False

    def add_tensor(self, tensor: onnx.TensorProto) -> None:
        """An initializer of the rewritten graph."""
        self.new_inits.append(self.store(tensor))

    def add_node(self, node: onnx.NodeProto) -> None:
        """A node at the front of the rewritten graph (it reads initializers only)."""
        self.new_nodes.append(node)

    def add_node_after(self, position: int, node: onnx.NodeProto) -> None:
        """A node right after the node at ``position`` (it reads that node's outputs)."""
        self.after.setdefault(position, []).append(node)

    def remove_node(self, position: int) -> None:
        self.removed.add(position)

    def add_linear(self, linear: LinearForExport, weight_name: str) -> None:
        """``linear``'s weight becomes its grid values and ``DequantizeLinear`` nodes producing ``weight_name`` (the
        ``(in, out)`` tensor its ``MatMul`` reads), and each such ``MatMul``'s input gets its quantizer."""
        self.found[linear.name] = weight_name
        self.fp4 = self.fp4 or linear.weight_format == "nvfp4"
        tensors, dq_nodes = _weight_dq(linear, weight_name)
        for tensor in tensors:
            self.add_tensor(tensor)
        self.new_nodes.extend(dq_nodes)
        matmuls = [p for p in self.consumers.get(weight_name, []) if self.nodes[p].op_type == "MatMul"]
        rewrites_input = linear.input_scale is not None or linear.rotation or linear.input_smoothing is not None
        for index, position in enumerate(matmuls if rewrites_input else []):
            self._rewrite_input(linear, position, f"{weight_name}_{index}")

    def _rewrite_input(self, linear: LinearForExport, position: int, tag: str) -> None:
        node = self.nodes[position]
        source = node.input[0]
        before = self.before.setdefault(position, [])
        if linear.input_smoothing is not None:
            inverse = numpy_helper.from_array((1.0 / linear.input_smoothing).astype(np.float32), f"{tag}_smooth_inv")
            self.add_tensor(inverse)
            before.append(
                helper.make_node("Mul", [source, inverse.name], [f"{tag}_smoothed"], name=f"{tag}_smooth_Mul")
            )
            source = f"{tag}_smoothed"
        if linear.rotation:
            nodes, source = _rotation(source, linear, tag, self.shared)
            before.extend(nodes)
            self.rotations += 1
        if linear.input_scale is not None:
            tensors, nodes, source = _activation_qdq(source, linear.input_scale, tag, linear.input_format)
            for tensor in tensors:
                self.add_tensor(tensor)
            before.extend(nodes)
            self.activation_pairs += 1
        node.input[0] = source

    def finish(self, expected: list[str], removed_initializers: list[int] = ()) -> dict[str, int]:
        """Apply the rewrite; every linear named in ``expected`` must have been added."""
        missing = sorted(set(expected) - set(self.found))
        if missing:
            raise StageError(f"quantized linears not found in the exported graph: {', '.join(missing[:5])}")
        graph = self.model.graph
        for init_index in sorted(removed_initializers, reverse=True):
            del graph.initializer[init_index]
        graph.initializer.extend(self.new_inits)
        graph.initializer.extend(self.store(tensor) for tensor in self.shared.values())
        nodes = list(self.new_nodes)
        for position, node in enumerate(self.nodes):
            if position in self.removed:
                continue
            nodes.extend(self.before.get(position, []))
            detached = onnx.NodeProto()
            detached.CopyFrom(node)
            nodes.append(detached)
            nodes.extend(self.after.get(position, []))
        del graph.node[:]
        graph.node.extend(nodes)
        if self.found:
            _set_opset(self.model, FP4_OPSET if self.fp4 else QDQ_OPSET)
        return {"quantized_linears": len(self.found), "activation_qdq_pairs": self.activation_pairs,
                "hadamard_rotations": self.rotations}


def apply_qdq(model: onnx.ModelProto, linears: list[LinearForExport]) -> dict[str, int]:
    """Rewrite ``model`` in place, each linear's weight initializer found by its value; every linear must be found
    exactly once."""
    by_digest = {_digest(lin.dequantized.T): lin for lin in linears}
    rewrite = QdqRewrite(model)
    replaced: list[int] = []
    for init_index, init in enumerate(model.graph.initializer):
        is_matrix = init.data_type == onnx.TensorProto.FLOAT and len(init.dims) == 2
        linear = by_digest.get(_digest(numpy_helper.to_array(init))) if is_matrix else None
        if linear is None or linear.name in rewrite.found:
            continue
        replaced.append(init_index)
        rewrite.add_linear(linear, init.name)
    return rewrite.finish([lin.name for lin in linears], replaced)


def apply_kv_cache_qdq(model: onnx.ModelProto, scales: dict[int, tuple[float, float]]) -> int:
    """Round each layer's new keys and values to FP8 under its ``(k_scale, v_scale)`` before they join the cache.

    ``present.{i}.key`` is the concatenation of the past (already rounded by the step that produced
    it) and the new tokens' keys (a sliding layer's, its last positions sliced from it); a FP8 Q/DQ pair on
    the new part makes every cached value, and what attention reads, an FP8 value times the scale.
    Returns the number of pairs written.
    """
    graph = model.graph
    nodes = []
    for node in graph.node:  # detached copies: the graph's node list is rebuilt below
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        nodes.append(copy)
    producer = {out: position for position, node in enumerate(nodes) for out in node.output}
    inits, before = [], {}
    for layer, layer_scales in sorted(scales.items()):
        for part, scale in zip(("key", "value"), layer_scales, strict=True):
            position = producer.get(f"present.{layer}.{part}")
            while position is not None and nodes[position].op_type in ("Identity", "Slice"):
                position = producer.get(nodes[position].input[0])
            concat = nodes[position] if position is not None else None
            if concat is None or concat.op_type != "Concat" or len(concat.input) != 2:
                raise StageError(
                    f"present.{layer}.{part} is not the concatenation of the past and new {part}s in the exported graph"
                )
            tensors, qdq_nodes, quantized = _activation_qdq(concat.input[1], scale, f"kv_{layer}_{part}", "fp8")
            inits.extend(tensors)
            before.setdefault(position, []).extend(qdq_nodes)
            concat.input[1] = quantized
    del graph.node[:]
    for position, node in enumerate(nodes):
        graph.node.extend(before.get(position, []))
        graph.node.append(node)
    graph.initializer.extend(inits)
    return 2 * len(scales)


def _set_opset(model: onnx.ModelProto, version: int) -> None:
    # Between opsets 18 and 21 the operators this exporter emits changed only in accepted types
    # (and Q/DQ gained int4 and block_size), so the import is raised without rewriting nodes.
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version < version:
            opset.version = version
    model.ir_version = max(model.ir_version, 10)
