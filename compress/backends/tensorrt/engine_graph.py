"""The graph TensorRT builds from: the exported graph with FP16 in its types, for a strongly typed build.

TensorRT 10.12 deprecates weak typing (precision chosen by builder flags) and TensorRT 11 removes
those flags: a strongly typed network computes in the types the ONNX graph states. The exported
graph is FP32 with INT8/INT4 Q/DQ nodes (what ONNX Runtime validates on the host), so the engine's
input is derived from it: float weights, activations, KV cache and Q/DQ scales become FP16, and the
parts where FP16 loses the answer stay FP32, as Hugging Face keeps them in half precision:

- normalization statistics (the mean of squares of an RMSNorm, ``LayerNormalization``), whose
  sums of squares overflow FP16;
- rotary angles (position x inverse frequency before ``Cos``/``Sin``), which FP16 cannot resolve
  past a few thousand positions.

A ``Cast`` sits only where a tensor enters or leaves an island: converters that cast every
blocked node's output back to FP16 (ONNX Runtime's) would overflow the statistics between the
nodes of an island.
"""

from __future__ import annotations

import logging
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import TypedDict

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import load_external_data_for_model

from compress.backends.onnx.graph import save_graph
from compress.backends.onnx.runtime import thread_cap
from compress.core.errors import StageError


class GraphParity(TypedDict):
    """The FP16 engine graph against the exported graph in ONNX Runtime."""

    cosine_min: float
    relative_max_diff: float
    argmax_agreement: float


class WrittenGraph(TypedDict):
    engine_graph: str
    engine_graph_casts: int


class EngineInput(WrittenGraph):
    engine_graph_parity: GraphParity

log = logging.getLogger(__name__)

ALWAYS_FP32_OPS = ("LayerNormalization",)
FP16_MAX = 65504.0
_VARIANCE_CHAIN = ("ReduceMean", "Add", "Sqrt", "Reciprocal", "Div")


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    users: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            users[name].append(node)
    return users


def _variance_chains(graph: onnx.GraphProto) -> set[str]:
    """Pow(x, 2) -> ReduceMean -> Add(eps) -> Sqrt -> Reciprocal/Div: the statistics of an exported RMSNorm."""
    users = _consumers(graph)
    keep: set[str] = set()
    for node in graph.node:
        if node.op_type != "Pow":
            continue
        chain, current = [node], node
        while len(users[current.output[0]]) == 1 and users[current.output[0]][0].op_type in _VARIANCE_CHAIN:
            current = users[current.output[0]][0]
            chain.append(current)
        if any(n.op_type == "ReduceMean" for n in chain):
            keep.update(n.name for n in chain)
    return keep


def _rotary_angles(graph: onnx.GraphProto) -> set[str]:
    """Every node feeding a ``Cos`` or ``Sin`` (they depend on positions and constants only)."""
    producers = {output: node for node in graph.node for output in node.output}
    keep: set[str] = set()
    stack = [node for node in graph.node if node.op_type in ("Cos", "Sin")]
    while stack:
        node = stack.pop()
        if node.name in keep:
            continue
        keep.add(node.name)
        stack.extend(producers[name] for name in node.input if name in producers)
    return keep


def fp32_islands(graph: onnx.GraphProto) -> set[str]:
    """Names of the nodes kept in FP32 in the engine graph (with the constants only they read)."""
    islands = (
        _variance_chains(graph) | _rotary_angles(graph) | {n.name for n in graph.node if n.op_type in ALWAYS_FP32_OPS}
    )
    users = _consumers(graph)
    return islands | {n.name for n in graph.node if n.op_type == "Constant" and users[n.output[0]]
                      and all(u.name in islands for u in users[n.output[0]])}


def _name_nodes(graph: onnx.GraphProto) -> None:
    for index, node in enumerate(graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{index}"


def _fp16_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """A float32 tensor in float16: finite values beyond FP16's range clipped to it, infinities kept (masks use
    -inf)."""
    values = numpy_helper.to_array(tensor)
    clipped = np.where(np.isfinite(values), np.clip(values, -FP16_MAX, FP16_MAX), values)
    return numpy_helper.from_array(clipped.astype(np.float16), tensor.name)


def _float_tensors(model: onnx.ModelProto) -> set[str]:
    """Names of every float32 tensor of the graph (inputs, outputs, initializers and, by type inference, the rest)."""
    graph = model.graph
    values = list(graph.input) + list(graph.output) + list(graph.value_info)
    names = {v.name for v in values if v.type.tensor_type.elem_type == TensorProto.FLOAT}
    return names | {i.name for i in graph.initializer if i.data_type == TensorProto.FLOAT}


def _convert_node_types(node: onnx.NodeProto) -> None:
    """Attributes that state a float32 output type or value, restated in float16."""
    for attribute in node.attribute:
        if node.op_type == "Cast" and attribute.name == "to" and attribute.i == TensorProto.FLOAT:
            attribute.i = TensorProto.FLOAT16
        elif attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == TensorProto.FLOAT:
            attribute.t.CopyFrom(_fp16_tensor(attribute.t))


def _retype_values(values, floats: set[str], fp32: set[str]) -> None:
    for value in values:
        if value.name in floats and value.name not in fp32:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16


def to_engine_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """The FP16 engine graph of an exported FP32 graph (``model`` carries inferred types), Q/DQ nodes kept.

    Every float32 tensor becomes float16 except those produced inside an FP32 island; a ``Cast``
    is inserted only where a tensor crosses an island's boundary, so the statistics computed in an
    island never pass through FP16 on the way.
    """
    graph = model.graph
    _name_nodes(graph)
    islands = fp32_islands(graph)
    floats = _float_tensors(model)
    initializers, fp32, renamed = _split_initializers(graph, islands, floats)
    casts: dict[tuple[str, int], str] = {}
    nodes = []
    for node in graph.node:
        in_island = node.name in islands
        if not in_island:
            _convert_node_types(node)
        for index, name in enumerate(node.input):
            if in_island and name in renamed:
                node.input[index] = renamed[name]
            elif name in floats and (name in fp32) != in_island:
                node.input[index] = _cast(name, in_island, casts, nodes)
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    _retype_values(list(graph.input) + list(graph.output), floats, fp32)
    del graph.value_info[:]
    log.info("engine graph: FP16 with %d nodes kept in FP32 (normalization statistics, rotary angles), %d casts",
             len(islands), len(casts))
    return model


def _split_initializers(graph, islands: set[str], floats: set[str]
                        ) -> tuple[list[onnx.TensorProto], set[str], dict[str, str]]:
    """The initializers in FP16 where ordinary nodes read them and kept in FP32 where islands do (a copy named
    ``<name>_fp32`` where both do); the tensors that stay FP32; the island inputs renamed to their copies."""
    island_consumed = {name for node in graph.node if node.name in islands for name in node.input}
    other_consumed = {name for node in graph.node if node.name not in islands for name in node.input}
    fp32 = {out for node in graph.node if node.name in islands for out in node.output if out in floats}
    initializers = []
    for init in graph.initializer:
        if init.name not in floats:
            initializers.append(init)
            continue
        if init.name in other_consumed:
            initializers.append(_fp16_tensor(init))
        if init.name in island_consumed:
            kept = onnx.TensorProto()
            kept.CopyFrom(init)
            kept.name = init.name if init.name not in other_consumed else f"{init.name}_fp32"
            initializers.append(kept)
            fp32.add(kept.name)
    renamed = {i.name: f"{i.name}_fp32" for i in graph.initializer if i.name in floats and i.name in island_consumed
               and i.name in other_consumed}
    return initializers, fp32, renamed


def _cast(name: str, to_fp32: bool, casts: dict[tuple[str, int], str], nodes: list[onnx.NodeProto]) -> str:
    """The name of ``name`` cast into (or out of) an FP32 island, adding the ``Cast`` node once."""
    to = TensorProto.FLOAT if to_fp32 else TensorProto.FLOAT16
    if (name, to) not in casts:
        casts[(name, to)] = f"{name}_to_{'fp32' if to_fp32 else 'fp16'}"
        nodes.append(helper.make_node("Cast", [name], [casts[(name, to)]], name=f"{casts[(name, to)]}_Cast", to=to))
    return casts[(name, to)]


def write_engine_graph(source: Path, destination: Path) -> WrittenGraph:
    """Convert the exported graph at ``source`` and save it at ``destination`` (weights beside it when over 2 GB).

    Types are inferred from the file (``infer_shapes_path`` works past the 2 GB limit that in-memory
    inference has); the converter reads them from the graph's value_info.
    """
    with tempfile.TemporaryDirectory(dir=destination.parent) as work:
        inferred = Path(work) / "inferred.onnx"
        onnx.shape_inference.infer_shapes_path(str(source), str(inferred))
        model = onnx.load(str(inferred), load_external_data=False)
    load_external_data_for_model(model, str(source.parent))
    model = to_engine_graph(model)
    save_graph(model, destination)
    kept = sum(1 for n in model.graph.node if n.op_type == "Cast")
    return {"engine_graph": destination.name, "engine_graph_casts": kept}


def _run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    threads = thread_cap()
    if threads:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    typed = {}
    for entry in session.get_inputs():
        value = feeds[entry.name]
        typed[entry.name] = value.astype(np.float16) if entry.type == "tensor(float16)" else value
    return session.run(None, typed)


def engine_graph_parity(exported: Path, engine_graph: Path, feeds: dict[str, np.ndarray]) -> GraphParity:
    """Run both graphs in ONNX Runtime on the same inputs and compare their first output position by position:
    the lowest cosine, the largest difference relative to the output's range, and argmax agreement.

    ONNX Runtime's CPU kernels compute some FP16 nodes in FP32, so this checks the conversion (the
    graph, its casts and its FP16 weights), not TensorRT's FP16 arithmetic. NaN or infinity is an error.
    """
    reference = _run(exported, feeds)[0].astype(np.float32)
    converted = _run(engine_graph, feeds)[0].astype(np.float32)
    if not np.isfinite(converted).all():
        raise StageError(f"{engine_graph.name} computes NaN or infinity in FP16 where {exported.name} does not")
    flat_ref = reference.reshape(-1, reference.shape[-1])
    flat_new = converted.reshape(-1, converted.shape[-1])
    norms = np.linalg.norm(flat_ref, axis=1) * np.linalg.norm(flat_new, axis=1)
    cosine = (flat_ref * flat_new).sum(axis=1) / np.clip(norms, 1e-12, None)
    scale = float(np.abs(reference).max()) or 1.0
    return {"cosine_min": round(float(cosine.min()), 6),
            "relative_max_diff": round(float(np.abs(converted - reference).max()) / scale, 6),
            "argmax_agreement": round(float((flat_new.argmax(-1) == flat_ref.argmax(-1)).mean()), 4)}


def write_engine_input(onnx_path: Path, engine_onnx: Path, feeds: dict[str, np.ndarray], min_cosine: float
                       ) -> EngineInput:
    """The FP16 engine graph at ``engine_onnx``, checked against the exported graph in ONNX Runtime on ``feeds``."""
    written = write_engine_graph(onnx_path, engine_onnx)
    parity = engine_graph_parity(onnx_path, engine_onnx, feeds)
    log.info("engine graph (FP16) vs exported graph in ONNX Runtime: cosine %.5f, relative max difference %.4f",
             parity["cosine_min"], parity["relative_max_diff"])
    if parity["cosine_min"] < min_cosine:
        raise StageError(
            f"the FP16 engine graph departs from the exported graph: cosine {parity['cosine_min']:.5f} < {min_cosine}"
        )
    return {**written, "engine_graph_parity": parity}
