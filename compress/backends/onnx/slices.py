"""An exported decoder run in consecutive slices of whole blocks, one ONNX Runtime session at a time.

ONNX Runtime's CPU session of a whole decoder holds its weights in float32 (the 16-bit tensors'
``Cast`` folded, the integer levels prepacked): about twice the graph's bytes, more than the
block-by-block torch passes need. Cut between blocks, the same graph runs as a chain of smaller
graphs, each opened, run over every window and closed before the next: the nodes are the graph's
own (read from its file in place, its weights referenced where they lie), so the numbers are the
graph's.

A cut is the one tensor carrying the hidden state from one block to the next. It is found from the
graph alone: in the nodes' (topological) order, the cut after block ``i`` is the last point before
block ``i + 1`` reads its cache's values where exactly one tensor that depends on the tokens' values
is alive for what the later blocks and the head compute (shapes do not count: the causal mask and
the rotary tables are computed from the graph's inputs in every slice; a finished block's cache
output does not count either). A slice reads the hidden state entering its first block
(the token ids for the first slice) and writes the one leaving its last (the logits for the last);
a cache input of another slice's block that it reads only the shape of is fed zeros of that shape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compress.backends.onnx.runtime import ONNX_FILE, DecoderLayout, past_names, present_names, session_options
from compress.core.errors import StageError
from compress.transforms.walk import release_freed_memory

log = logging.getLogger(__name__)

_SHAPE_ONLY = frozenset({"Shape", "Size"})  # outputs that depend on their input's shape, not its values


@dataclass(frozen=True)
class GraphSlice:
    """Blocks ``blocks`` of a decoder as a graph of their own (serialized, weights referenced in the original's
    folder)."""

    blocks: range
    entering: str  # the tensor it reads the hidden state from ("input_ids" for the first slice)
    leaving: str  # the tensor it writes ("logits" for the last slice)
    inputs: tuple[str, ...]
    graph: bytes
    weight_bytes: int


def tensor_bytes(init) -> int:
    """Bytes an initializer stores, inline or in the external data file."""
    for entry in init.external_data:
        if entry.key == "length":
            return int(entry.value)
    return len(init.raw_data)


def graph_weight_bytes(folder: Path) -> int:
    """Bytes of the weights of the graph in ``folder``, read from its file without them."""
    import onnx

    return sum(
        tensor_bytes(init)
        for init in onnx.load(str(Path(folder) / ONNX_FILE), load_external_data=False).graph.initializer
    )


def block_cuts(graph, num_layers: int) -> list[str]:
    """The tensor leaving each block but the last (``cuts[i]``: from block ``i`` to ``i + 1``) of a decoder graph."""
    nodes = list(graph.node)
    producer = {name: position for position, node in enumerate(nodes) for name in node.output}
    valued = {"input_ids", *past_names(num_layers)}  # tensors whose values depend on the tokens or the cache
    first_use: dict[str, int] = {}  # the first node reading a tensor's values
    for position, node in enumerate(nodes):
        if node.op_type in _SHAPE_ONLY:
            continue
        for name in node.input:
            first_use.setdefault(name, position)
        if valued.intersection(node.input):
            valued.update(name for name in node.output if name)
    cuts: list[str] = []
    start = min(first_use.get(name, len(nodes)) for name in ("input_ids", *past_names(num_layers)[:2]))
    for block in range(num_layers - 1):
        stop = min(first_use.get(name, len(nodes)) for name in past_names(num_layers)[2 * block + 2:2 * block + 4])
        later = [*present_names(num_layers)[2 * block + 2:], "logits"]
        gap, tensor = _last_single_gap(nodes, producer, first_use, valued, later, start, stop)
        if tensor is None:
            raise StageError(
                f"no single tensor carries the hidden state from block {block} to block {block + 1} in the graph"
            )
        cuts.append(tensor)
        start = gap + 1
    return cuts


def _last_single_gap(nodes, producer: dict[str, int], first_use: dict[str, int], valued: set[str], later: list[str],
                     start: int, stop: int) -> tuple[int, str | None]:
    """The last gap after a node in ``[start, stop)`` where one valued tensor alone is alive for the nodes computing
    ``later`` (a tensor only a finished block's cache output still reads is not), and that tensor."""
    needed_nodes: set[int] = set()
    pending = [producer[name] for name in later if name in producer]
    while pending:
        position = pending.pop()
        if position in needed_nodes:
            continue
        needed_nodes.add(position)
        pending.extend(producer[name] for name in nodes[position].input if name in producer)
    last_use: dict[str, int] = {}
    for position in sorted(needed_nodes):
        for name in nodes[position].input:
            if name in valued:
                last_use[name] = position
    found: tuple[int, str | None] = (start, None)
    alive = {name for name, dies in last_use.items() if producer.get(name, first_use.get(name, 0)) < start <= dies}
    for position in range(start, stop):
        alive = {name for name in alive if last_use[name] > position}
        alive.update(name for name in nodes[position].output if last_use.get(name, position) > position)
        if len(alive) == 1:
            found = (position, next(iter(alive)))
    return found


def plan_slices(folder: Path, layout: DecoderLayout, max_weight_bytes: int) -> list[GraphSlice]:
    """The graph in ``folder`` cut into consecutive slices of whole blocks, each holding at most ``max_weight_bytes`` of
    weights where a block allows it (one block per slice at least); the last slice also holds the final norm and LM
    head.
    """
    import onnx

    model = onnx.load(str(Path(folder) / ONNX_FILE), load_external_data=False)
    graph = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        raise StageError("the graph has control-flow subgraphs; it is not cut into slices")
    cuts = block_cuts(graph, layout.num_layers)
    producers = {name: node for node in graph.node for name in node.output}
    sizes = {init.name: tensor_bytes(init) for init in graph.initializer}
    groups = _group_blocks(
        [_block_bytes(producers, sizes, cuts, b, layout.num_layers) for b in range(layout.num_layers)], max_weight_bytes
    )
    inferred = onnx.shape_inference.infer_shapes(model)  # the weights' types and shapes only: none of their data
    types = {v.name: v for v in list(inferred.graph.value_info) + list(graph.input) + list(graph.output)}
    slices = []
    for blocks in groups:
        entering = "input_ids" if blocks.start == 0 else cuts[blocks.start - 1]
        leaving = "logits" if blocks.stop == layout.num_layers else cuts[blocks.stop - 1]
        outputs = [leaving] + present_names(layout.num_layers)[2 * blocks.start:2 * blocks.stop]
        slices.append(_extract(model, producers, types, entering, outputs, blocks, sizes))
    return slices


def slices_over(folder: Path, layout: DecoderLayout, limit_bytes: int | None) -> list[GraphSlice] | None:
    """The graph's slices of at most ``limit_bytes`` of weights, or None where it runs whole: no limit, its weights fit
    one session, its NVFP4 weights are read through a converted copy of the whole graph, or it cannot be cut."""
    if limit_bytes is None or layout.fp4_weights or graph_weight_bytes(folder) <= limit_bytes:
        return None
    try:
        return plan_slices(folder, layout, limit_bytes)
    except StageError as exc:
        log.warning("ONNX Runtime runs the whole graph in one session: %s", exc)
        return None


def _block_bytes(producers, sizes, cuts, block: int, num_layers: int) -> int:
    """Weight bytes the nodes between the hidden state entering ``block`` and the one leaving it read."""
    entering = "input_ids" if block == 0 else cuts[block - 1]
    leaving = "logits" if block == num_layers - 1 else cuts[block]
    return held_bytes(
        _closure(producers, [leaving] + present_names(num_layers)[2 * block : 2 * block + 2], {entering}), sizes
    )


def held_bytes(nodes, sizes: dict[str, int]) -> int:
    """Weight bytes a session of ``nodes`` holds: every weight they read but a table only ``Gather`` reads (its rows are
    picked where it lies; every slice gathers the token embedding again for the causal mask's shape)."""
    computed = {name for node in nodes if node.op_type != "Gather" for name in node.input}
    computed.update(node.input[1] for node in nodes if node.op_type == "Gather" and len(node.input) > 1)
    return sum(sizes.get(name, 0) for name in computed)


def _group_blocks(block_bytes: list[int], limit: int) -> list[range]:
    """Consecutive blocks in groups of at most ``limit`` bytes (a block larger than it alone)."""
    groups, start, total = [], 0, 0
    for block, size in enumerate(block_bytes):
        if block > start and total + size > limit:
            groups.append(range(start, block))
            start, total = block, 0
        total += size
    groups.append(range(start, len(block_bytes)))
    return groups


def _closure(producers: dict, outputs: list[str], stop: set[str]) -> list:
    """The nodes computing ``outputs`` from ``stop`` (and the graph's inputs and weights), in no particular order."""
    seen: dict[int, object] = {}
    pending = list(outputs)
    reached = set(stop)
    while pending:
        name = pending.pop()
        if name in reached:
            continue
        reached.add(name)
        node = producers.get(name)
        if node is not None and id(node) not in seen:
            seen[id(node)] = node
            pending.extend(node.input)
    return list(seen.values())


def _extract(
    model, producers, types, entering: str, outputs: list[str], blocks: range, sizes: dict[str, int]
) -> GraphSlice:
    """One slice as a serialized graph: the nodes computing ``outputs`` from ``entering``, in the graph's order."""
    import onnx

    graph = model.graph
    wanted = {id(node) for node in _closure(producers, outputs, {entering})}
    nodes = [node for node in graph.node if id(node) in wanted]
    read = {name for node in nodes for name in node.input if name}
    graph_inputs = [i for i in graph.input if i.name in read or i.name == entering]
    if entering not in {i.name for i in graph_inputs}:
        graph_inputs = [types[entering]] + graph_inputs  # a cut: typed as the slice before it wrote it
    own = {name.replace("present.", "past_key_values.", 1) for name in outputs}
    borrowed = {name for name in read if name.startswith("past_key_values.") and name not in own}
    for node in nodes:  # another block's cache may be read for its shape, never for its values
        if node.op_type not in _SHAPE_ONLY and borrowed.intersection(node.input):
            borrowed.update(node.output)
    if borrowed.intersection(outputs):
        raise StageError(
            f"blocks {blocks.start}-{blocks.stop - 1} compute with another block's cache; the graph is not cut there"
        )
    missing = [name for name in outputs if name not in types or not types[name].type.tensor_type.elem_type]
    if missing:
        raise StageError(f"the type of {missing[0]!r} is unknown; the graph is not cut there")
    initializers = [init for init in graph.initializer if init.name in read]
    sliced = onnx.helper.make_graph(nodes, f"blocks {blocks.start}-{blocks.stop - 1}", graph_inputs,
                                    [types[name] for name in outputs], initializers)
    proto = onnx.helper.make_model(sliced, opset_imports=model.opset_import, ir_version=model.ir_version)
    return GraphSlice(blocks, entering, outputs[0], tuple(i.name for i in graph_inputs), proto.SerializeToString(),
                      held_bytes(nodes, sizes))


class SlicedDecoder:
    """Logits of whole sequences from a decoder's slices, each slice's session opened once and alone in memory."""

    def __init__(self, folder: Path, slices: list[GraphSlice], threads: int | None = None) -> None:
        self.folder = Path(folder)
        self.layout = DecoderLayout.load(self.folder)
        self.slices = slices
        self.threads = threads

    def _session(self, piece: GraphSlice):
        import onnxruntime as ort

        options = session_options(self.threads, self.layout.int8_activations)
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(self.folder))
        # Without its arena a session's buffers go back after each run: the arena kept a float32 LM head per cache
        # length it had seen (a second window's first chunk added 1.2 GiB at Qwen3-1.7B's shape); chunks of many tokens
        # run as fast either way.
        options.enable_cpu_mem_arena = False
        return ort.InferenceSession(piece.graph, options, providers=["CPUExecutionProvider"])

    def sequences_in_chunks(self, sequences: list[np.ndarray], chunk: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """Each sequence's logits ``chunk`` tokens at a time through each slice's KV cache: ``(sequence, first position,
        logits[1, chunk, vocab])``, every sequence's chunks in order once the last slice runs."""
        carried: dict[tuple[int, int], np.ndarray] = {}
        for piece in self.slices:
            session = self._session(piece)
            past_type = {i.name: i.type for i in session.get_inputs()}
            for index, ids in enumerate(sequences):
                own_past = {name: self._empty(name, 0, past_type) for name in self._own_cache(piece)}
                for start in range(0, len(ids), chunk):
                    tokens = ids[None, start:start + chunk].astype(np.int64)
                    feed = self._feed(piece, tokens, start, carried.pop((index, start), None), own_past, past_type)
                    results = session.run([piece.leaving, *self._own_present(piece)], feed)
                    own_past = dict(zip(own_past, results[1:], strict=True))
                    if piece.leaving == "logits":
                        yield index, start, results[0]
                    else:
                        carried[(index, start)] = results[0]
            del session
            release_freed_memory()  # the session's memory back to the system before the next is opened

    def _own_cache(self, piece: GraphSlice) -> list[str]:
        return past_names(self.layout.num_layers)[2 * piece.blocks.start:2 * piece.blocks.stop]

    def _own_present(self, piece: GraphSlice) -> list[str]:
        return present_names(self.layout.num_layers)[2 * piece.blocks.start:2 * piece.blocks.stop]

    def _feed(self, piece: GraphSlice, tokens: np.ndarray, past: int, hidden: np.ndarray | None, own_past: dict,
              types: dict) -> dict[str, np.ndarray]:
        mask = np.ones((1, past + tokens.shape[1]), dtype=np.int64)
        given = {"input_ids": tokens, "attention_mask": mask,
                 "position_ids": np.arange(past, past + tokens.shape[1], dtype=np.int64)[None]}
        feed = {}
        for name in piece.inputs:
            if name == piece.entering and hidden is not None:
                feed[name] = hidden
            elif name in given:
                feed[name] = given[name]
            elif name in own_past:
                feed[name] = own_past[name]
            else:  # another slice's cache, read for its shape only
                feed[name] = self._empty(name, past, types)
        return feed

    def _empty(self, name: str, past: int, types: dict) -> np.ndarray:
        layer = int(name.split(".")[1])
        dtype = np.float16 if types.get(name) == "tensor(float16)" else np.float32
        return np.zeros(
            (1, self.layout.num_kv_heads[layer], self.layout.cache_length(layer, past), self.layout.head_dim), dtype
        )
