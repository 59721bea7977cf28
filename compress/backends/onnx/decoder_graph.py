"""A decoder's ONNX graph traced from a weightless skeleton, its weights then written one tensor at a time.

Tracing needs a model's parameters only for their shapes: the skeleton is the model ``config.json``
describes with every parameter a float32 scalar broadcast to its shape (no memory), traced with the
parameters passed as named graph inputs (no constant folding, so the exporter neither computes on, copies
nor merges them). :func:`write_weights` then turns each parameter input into an initializer read
from the checkpoint, one tensor at a time, its bytes appended to the graph's external data file:

- a quantized linear (the quantize stage's levels and scales, read block by block) becomes its grid
  values and ``DequantizeLinear`` nodes in the ``MatMul`` layout, with its input's quantizer
  (:class:`~compress.backends.onnx.qdq.QdqRewrite`), the ``Transpose`` the exporter put in front of
  the ``MatMul`` dropped;
- a float linear is stored transposed in the checkpoint's own dtype (the ``Transpose`` dropped); every
  other parameter (embeddings, norms, biases) as it is. A 16-bit tensor is stored in its own dtype
  with a ``Cast`` to float32 after it, which runtimes fold when the session is built: the file holds
  the checkpoint's bytes, and the graph computes in float32 as before;
- a ``Gather`` of a 16-bit table (the token embedding) picks its rows in their own dtype and casts only
  them, so a runtime folds no float32 copy of the table for it;
- a tied embedding is one initializer read by the ``Gather`` and, through a ``Transpose`` of its
  16-bit values and the ``Cast`` after it, by the LM head.

So the export of a large model holds at most one block's levels and one tensor at a time; the float
model is never built.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from compress.backends.onnx.graph import EXTERNAL_DATA_SUFFIX, ExternalDataWriter
from compress.backends.onnx.qdq import LinearForExport, QdqRewrite, apply_kv_cache_qdq
from compress.backends.onnx.runtime import DecoderLayout, past_names, present_names
from compress.core.errors import StageError
from compress.models.families import decoder_blocks
from compress.models.loading import load_causal_lm
from compress.models.weights import CheckpointReader, empty_causal_lm, module_prefix, set_parameter
from compress.transforms.quantize.saved import (
    LinearQuant,
    dequantized_weight,
    load_quantization,
    quantization_meta,
)

log = logging.getLogger(__name__)

PARAMETER_PREFIX = "model."  # the traced wrapper's attribute: a parameter input is named "model.<state-dict name>"

_ONNX_TYPES = {
    torch.float32: TensorProto.FLOAT,
    torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16,
}


def skeleton_causal_lm(folder: Path, trust_remote_code: bool = False):
    """The causal LM ``folder``'s config describes, each parameter a float32 scalar broadcast to its shape (ties
    kept)."""
    model = empty_causal_lm(folder, trust_remote_code=trust_remote_code)
    for name, parameter in list(model.named_parameters(remove_duplicate=False)):
        set_parameter(model, name, torch.zeros((), dtype=torch.float32).expand(parameter.shape))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def trace_decoder(wrapper: torch.nn.Module, layout: DecoderLayout, example: tuple, path: Path, opset: int) -> None:
    """Trace ``wrapper`` (flat tensors in and out) to ``path`` with its parameters as graph inputs, each named
    ``PARAMETER_PREFIX`` + its state-dict name (a tied table once)."""
    parameters = dict(wrapper.named_parameters())
    inputs = ["input_ids", "attention_mask", "position_ids", *past_names(layout.num_layers)]
    outputs = ["logits", *present_names(layout.num_layers)]
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total"},
            "position_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}}
    sliding = {index for index in range(2 * layout.num_layers) if index // 2 in layout.sliding_layers}
    axes.update(
        {name: {0: "batch", 2: "window_past" if index in sliding else "past"} for index, name in enumerate(inputs[3:])}
    )
    axes.update(
        {name: {0: "batch", 2: "window" if index in sliding else "total"} for index, name in enumerate(outputs[1:])}
    )
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(_WeightsAsInputs(wrapper, list(parameters)), (*example, *parameters.values()), str(path),
                          input_names=[*inputs, *parameters], output_names=outputs, dynamic_axes=axes, dynamo=False,
                          opset_version=opset, do_constant_folding=False)


class _WeightsAsInputs(torch.nn.Module):
    """``wrapper`` with its parameters passed as trailing inputs, so that the exporter sees a module with none.

    The exporter's ONNX shape inference takes a module's parameters as constants and computes on them: with the
    skeleton's broadcast scalars, a float32 copy of the whole model at once (the Qwen3-0.6B shape's trace peaked at
    3.4 GB). Inputs it only types. Inputs are also never merged, as parameters of equal value (every placeholder) are.
    (``torch.func.functional_call`` does this swap, but refuses to run under the tracer.)"""

    def __init__(self, wrapper: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.__dict__["inner"] = wrapper  # not a submodule: its parameters must not be the exporter's
        self.names = names
        canonical = {id(parameter): name for name, parameter in wrapper.named_parameters()}
        self.aliases = [
            (name, canonical[id(parameter)]) for name, parameter in wrapper.named_parameters(remove_duplicate=False)
        ]

    def forward(self, *args):
        count = len(args) - len(self.names)
        given = dict(zip(self.names, args[count:], strict=True))
        saved = []
        for name, canonical in self.aliases:  # each parameter (a tied one under each of its names) becomes its input
            owner, _, leaf = name.rpartition(".")
            module = self.inner.get_submodule(owner)
            saved.append((module, leaf, module._parameters.pop(leaf)))
            module.__dict__[leaf] = given[canonical]
        try:
            return self.inner(*args[:count])
        finally:
            for module, leaf, parameter in saved:
                del module.__dict__[leaf]
                module._parameters[leaf] = parameter


class _FloatTensors:
    """A folder's float tensors by state-dict name: read from its safetensors files, or, where names differ from the
    model's (a checkpoint transformers renames on load), from the model loaded in its own dtype."""

    def __init__(self, folder: Path, names: list[str], left_out: frozenset[str], trust_remote_code: bool) -> None:
        self.reader = CheckpointReader(folder)
        self.state: dict[str, torch.Tensor] | None = None
        if any(name not in self.reader for name in names):
            log.info(
                "%s names its tensors otherwise than the model: reading them from the model held in its own dtype",
                folder,
            )
            model = load_causal_lm(folder, trust_remote_code=trust_remote_code, own_dtype=True, left_out=left_out)
            self.state = {name: tensor.detach() for name, tensor in model.state_dict(keep_vars=False).items()}

    def read(self, name: str) -> torch.Tensor:
        if self.state is not None:
            return self.state[name]
        return self.reader.read([name])[name]


class _BlockLevels:
    """The quantize stage's linears, read one block at a time (a block's levels are let go when the next is read)."""

    def __init__(self, folder: Path, model) -> None:
        self.folder = folder
        self.meta = quantization_meta(folder)
        self.names = sorted(self.meta.linears) if self.meta else []
        self.prefixes = [module_prefix(model, block) + "." for block in decoder_blocks(model)]
        self._prefix: str | None = None
        self._linears: dict[str, LinearQuant] = {}

    def get(self, linear: str) -> LinearQuant:
        prefix = next((p for p in self.prefixes if linear.startswith(p)), "")
        if prefix != self._prefix:
            self._linears = {}  # let the previous block's levels go before reading the next
            _, self._linears = load_quantization(self.folder, prefix or None)
            self._prefix = prefix
        return self._linears[linear]


def write_weights(graph_model: onnx.ModelProto, model, folder: Path, path: Path,
                  trust_remote_code: bool = False) -> dict[str, int]:
    """Fill the traced ``graph_model`` (parameters as inputs) with ``folder``'s weights, Q/DQ for its quantized linears,
    the bytes in ``<path>.data``; returns the Q/DQ counts (empty for a float model)."""
    graph = graph_model.graph
    parameters = {i.name[len(PARAMETER_PREFIX):]: i for i in graph.input if i.name.startswith(PARAMETER_PREFIX)}
    levels = _BlockLevels(folder, model)
    quantized = {f"{name}.weight": name for name in levels.names}
    floats = _FloatTensors(
        folder, [n for n in parameters if n not in quantized], frozenset(quantized), trust_remote_code
    )
    with ExternalDataWriter(path.parent / (path.name + EXTERNAL_DATA_SUFFIX)) as writer:
        rewrite = QdqRewrite(graph_model, writer.store)
        for name, graph_input in parameters.items():
            if name in quantized:
                linear = levels.get(quantized[name])
                _add_quantized(rewrite, graph_input.name, _for_export(quantized[name], linear))
            else:
                _add_float(rewrite, graph_input.name, floats.read(name))
        stats = rewrite.finish(levels.names)
    if not levels.names:
        stats = {}
    kept = [i for i in graph.input if not i.name.startswith(PARAMETER_PREFIX)]
    del graph.input[:]
    graph.input.extend(kept)
    scales = levels.meta.kv_cache_scales() if levels.meta else None
    if scales:
        stats["kv_cache_qdq_pairs"] = apply_kv_cache_qdq(graph_model, scales)
    return stats


def _for_export(name: str, quant: LinearQuant) -> LinearForExport:
    weight = dequantized_weight(quant)
    return LinearForExport(
        name,
        weight.numpy(),
        quant.weight_scales.numpy(),
        quant.format.weight_bits,
        quant.input_scale,
        quant.rotation,
        weight_format=quant.format.weight_format,
        global_scale=quant.global_scale,
        input_format=quant.input_format,
    )


def _lone_transpose(rewrite: QdqRewrite, name: str) -> int | None:
    """The position of the one ``Transpose`` (perm 1, 0) that is ``name``'s only reader, else None."""
    readers = rewrite.consumers.get(name, [])
    if len(readers) != 1:
        return None
    node = rewrite.nodes[readers[0]]
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    return readers[0] if node.op_type == "Transpose" and perm == [1, 0] else None


def _add_quantized(rewrite: QdqRewrite, input_name: str, linear: LinearForExport) -> None:
    position = _lone_transpose(rewrite, input_name)
    if position is None:
        raise StageError(
            f"{linear.name}: the exported graph does not read its weight through one Transpose into a MatMul"
        )
    rewrite.remove_node(position)
    rewrite.add_linear(linear, rewrite.nodes[position].output[0])


def _add_float(rewrite: QdqRewrite, input_name: str, tensor: torch.Tensor) -> None:
    position = _lone_transpose(rewrite, input_name)
    name = input_name
    if position is not None:  # a float linear: stored in the MatMul layout
        rewrite.remove_node(position)
        tensor, name = tensor.t(), rewrite.nodes[position].output[0]
    dtype = tensor.dtype
    if dtype not in _ONNX_TYPES:
        raise StageError(f"{input_name}: cannot store a {dtype} parameter in the graph")
    stored = name if dtype == torch.float32 else f"{name}_{str(dtype).removeprefix('torch.')}"
    rewrite.add_tensor(_tensor_proto(tensor, stored))
    if stored == name:
        return
    others = [p for p in rewrite.consumers.get(name, []) if not _moves_values_of(rewrite, p, name)]
    for position in set(rewrite.consumers.get(name, [])) - set(others):
        _move_then_cast(rewrite, position, stored)
    if others:
        rewrite.add_node(helper.make_node("Cast", [stored], [name], name=f"{stored}_Cast", to=TensorProto.FLOAT))


def _moves_values_of(rewrite: QdqRewrite, position: int, name: str) -> bool:
    """Whether the node at ``position`` only picks or moves ``name``'s values (a ``Gather`` of its rows, a
    ``Transpose``)."""
    node = rewrite.nodes[position]
    return node.op_type in ("Gather", "Transpose") and node.input[0] == name and list(node.input).count(name) == 1


def _move_then_cast(rewrite: QdqRewrite, position: int, stored: str) -> None:
    """The ``Gather`` or ``Transpose`` at ``position`` reads the 16-bit tensor ``stored`` and only its output is cast: a
    ``Gather`` of the embedding table then casts the rows it picks (runtimes keep no float32 copy of the table for it),
    and the ``Transpose`` a tied LM head reads the table through moves 16-bit values (a runtime folding it holds one
    float32 copy of the head at a time, not the cast table and its transpose). The numbers are the same either way."""
    node = rewrite.nodes[position]
    output = node.output[0]
    node.input[0], node.output[0] = stored, f"{output}_{stored.rsplit('_', 1)[-1]}"
    rewrite.add_node_after(position, helper.make_node("Cast", [node.output[0]], [output], name=f"{output}_Cast",
                                                      to=TensorProto.FLOAT))


def _tensor_proto(tensor: torch.Tensor, name: str) -> TensorProto:
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.float32:
        return numpy_helper.from_array(tensor.numpy(), name)
    proto = TensorProto(name=name, data_type=_ONNX_TYPES[tensor.dtype], dims=list(tensor.shape))
    proto.raw_data = tensor.view(torch.int16).numpy().tobytes()  # 16-bit floats, little-endian as ONNX stores them
    return proto
