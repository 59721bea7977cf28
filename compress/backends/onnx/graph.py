"""ONNX files on disk: graphs past protobuf's 2 GB limit, their side files, their hashes and sizes, and one copy of a
tied embedding."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np

from compress.core.files import path_size, sha256_file

log = logging.getLogger(__name__)


def share_tied_embedding(graph_model) -> bool:
    """Store a tied embedding once: the LM head reads the transposed embedding table instead of a copy.

    The exporter writes the tied matrix twice (the ``Gather`` table and the head's ``(hidden, vocab)``
    ``MatMul`` weight). The copy is replaced by a ``Transpose`` of the table, which runtimes fold
    when the session is built. Returns whether a copy was removed.
    """
    from onnx import helper, numpy_helper

    graph = graph_model.graph
    initializers = {init.name: init for init in graph.initializer}
    tables = {n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[0] in initializers
              and len(initializers[n.input[0]].dims) == 2}
    for table_name in tables:
        table = numpy_helper.to_array(initializers[table_name])
        for node in graph.node:
            weight = initializers.get(node.input[1]) if node.op_type == "MatMul" else None
            if weight is None or list(weight.dims) != list(table.shape[::-1]):
                continue
            if not np.array_equal(numpy_helper.to_array(weight), table.T):
                continue
            transposed = f"{table_name}_transposed"
            graph.node.insert(
                0,
                helper.make_node("Transpose", [table_name], [transposed], name=f"{table_name}_Transpose", perm=[1, 0]),
            )
            copy_name, node.input[1] = node.input[1], transposed
            if not any(copy_name in n.input for n in graph.node):
                graph.initializer.remove(weight)
            return True
    return False


# A protobuf message cannot exceed 2 GiB; graphs whose weights come near it keep them in a side file.
PROTOBUF_LIMIT_BYTES = 2 ** 31 - 2 ** 26
EXTERNAL_DATA_SUFFIX = ".data"


def external_files(path: Path) -> list[Path]:
    """The files holding ``path``'s externally stored tensors (none for a self-contained graph)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False)
    locations = {entry.value for init in graph.graph.initializer if init.data_location == onnx.TensorProto.EXTERNAL
                 for entry in init.external_data if entry.key == "location"}
    return sorted(path.parent / location for location in locations)


def save_graph(graph_model, path: Path, limit_bytes: int = PROTOBUF_LIMIT_BYTES) -> None:
    """Save a graph, its weights in one ``<name>.data`` file beside it when they would pass the protobuf limit.

    Files an earlier save (or the exporter) wrote for externally stored tensors are removed first, so the
    folder holds exactly what the graph references.
    """
    import onnx

    weight_bytes = sum(len(init.raw_data) for init in graph_model.graph.initializer)
    for stale in external_files(path) if path.is_file() else []:
        stale.unlink(missing_ok=True)
    if weight_bytes < limit_bytes:
        onnx.save(graph_model, str(path))
        return
    log.info("graph weights are %.2f GB: saved beside it in %s%s", weight_bytes / 1e9, path.name, EXTERNAL_DATA_SUFFIX)
    onnx.save(graph_model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=path.name + EXTERNAL_DATA_SUFFIX, size_threshold=1024)


class ExternalDataWriter:
    """Tensors' bytes appended to one external data file as they are made, so a large graph's weights are never held
    together: :meth:`store` moves a tensor's bytes to the file and leaves the tensor pointing at them.

    Each large tensor starts at a multiple of the page size, so runtimes can map it in place; small tensors and shapes
    stay in the graph.
    """

    ALIGNMENT = 4096
    ALIGN_FROM_BYTES = 2 ** 20  # tensors this large start on a page; smaller ones follow each other
    INLINE_BYTES = 1024  # smaller tensors (scales, shapes, which shape inference reads) stay in the graph

    def __init__(self, path: Path) -> None:
        self.path = path
        self.location = path.name
        self._file = open(path, "wb")  # noqa: SIM115 (held open across calls; closed by close())
        self.bytes_written = 0

    def store(self, tensor):
        from onnx import TensorProto
        from onnx.external_data_helper import set_external_data

        data = tensor.raw_data
        if len(data) < self.INLINE_BYTES or tensor.data_type == TensorProto.INT64:
            return tensor
        padding = -self.bytes_written % self.ALIGNMENT if len(data) >= self.ALIGN_FROM_BYTES else 0
        self._file.write(b"\0" * padding)
        offset = self.bytes_written + padding
        self._file.write(data)
        self.bytes_written = offset + len(data)
        set_external_data(tensor, self.location, offset, len(data))
        tensor.data_location = TensorProto.EXTERNAL
        tensor.ClearField("raw_data")
        return tensor

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ExternalDataWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def onnx_files_sha256(path: Path) -> str:
    """SHA-256 of a graph file, or of its file and external data files' hashes when it has any."""
    files = external_files(path)
    if not files:
        return sha256_file(path)
    return hashlib.sha256("".join(sha256_file(f) for f in [path, *files]).encode()).hexdigest()


def onnx_files_size(path: Path) -> int:
    """Bytes of a graph file and the external data files it references."""
    return path_size(path) + sum(path_size(f) for f in external_files(path))
