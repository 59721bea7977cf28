"""Check an ONNX graph against what a target's TensorRT and GPU can run, before any build.

Every problem names the node or tensor: an operator the target's TensorRT parser does not take,
a data type the GPU lacks (no FP8/FP4 on sm_87; INT4 only as weight-only), an opset the parser
does not know, or a fixed dimension outside the optimization profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx

from compress.backends.onnx.qdq import FP4_OPSET
from compress.core.config import Target
from compress.core.errors import UsageError

# ONNX operators the TensorRT 10 ONNX parser supports (onnx-tensorrt operators.md), limited to
# those a transformer export can produce; anything else is reported rather than guessed.
TRT10_OPS = frozenset({
    "Abs", "Add", "And", "ArgMax", "ArgMin", "AveragePool", "BatchNormalization", "Cast", "Ceil", "Clip", "Concat",
    "Constant", "ConstantOfShape", "Conv", "ConvTranspose", "Cos", "CumSum", "DequantizeLinear", "Div", "Einsum",
    "Elu", "Equal", "Erf", "Exp", "Expand", "Flatten", "Floor", "Gather", "GatherElements", "GatherND", "Gelu",
    "Gemm", "GlobalAveragePool", "Greater", "GreaterOrEqual", "GroupNormalization", "HardSigmoid", "Identity", "If",
    "InstanceNormalization", "IsInf", "IsNaN", "LayerNormalization", "LeakyRelu", "Less", "LessOrEqual", "Log",
    "LogSoftmax", "MatMul", "Max", "MaxPool", "Mean", "Min", "Mod", "Mul", "Neg", "Not", "OneHot", "Or", "Pad",
    "Pow", "PRelu", "QuantizeLinear", "Range", "Reciprocal", "ReduceL2", "ReduceMax", "ReduceMean", "ReduceMin",
    "ReduceProd", "ReduceSum", "Relu", "Reshape", "Resize", "ScatterElements", "ScatterND", "Shape",
    "Sigmoid", "Sign", "Sin", "Slice", "Softmax", "Softplus", "Split", "Sqrt", "Squeeze", "Sub", "Sum", "Tanh",
    "Tile", "TopK", "Transpose", "Trilu", "Unsqueeze", "Where", "Xor",
})

MAX_OPSET = {"10": 21, "11": 22}
FP8_TYPES = {onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E4M3FNUZ, onnx.TensorProto.FLOAT8E5M2,
             onnx.TensorProto.FLOAT8E5M2FNUZ}
FP4_TYPES = {getattr(onnx.TensorProto, "FLOAT4E2M1", -1)}
INT4_TYPES = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4}


@dataclass(frozen=True)
class GraphFacts:
    """What the builder needs to know of a graph."""

    opset: int
    has_qdq: bool
    has_int4: bool
    num_nodes: int


def _type_name(data_type: int) -> str:
    return onnx.TensorProto.DataType.Name(data_type)


def check_onnx_for_target(model: onnx.ModelProto, target: Target, max_batch: int = 1) -> GraphFacts:
    """Raise a :class:`UsageError` naming the first node or tensor the target cannot run."""
    major = target.tensorrt_version.split(".")[0]
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset > MAX_OPSET.get(major, 21):
        raise UsageError(
            f"ONNX opset {opset} is newer than TensorRT {target.tensorrt_version} takes ({MAX_OPSET.get(major, 21)})"
        )
    graph = model.graph
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            raise UsageError(
                f"node {node.name or node.op_type}: custom-domain operator {node.domain}::{node.op_type} needs a plugin"
            )
        if node.op_type not in TRT10_OPS:
            raise UsageError(f"node {node.name or node.op_type}: operator {node.op_type} is not supported "
                             f"by TensorRT {target.tensorrt_version}")
    initializers = {init.name: init for init in graph.initializer}
    allowed_fp8 = "fp8" in target.gpu.precisions
    allowed_fp4 = "fp4" in target.gpu.precisions
    for tensor in list(graph.initializer) + [vi for vi in graph.value_info] + list(graph.input) + list(graph.output):
        data_type = tensor.data_type if isinstance(tensor, onnx.TensorProto) else tensor.type.tensor_type.elem_type
        if data_type in FP8_TYPES and not allowed_fp8:
            raise UsageError(
                f"tensor {tensor.name}: {_type_name(data_type)} is not supported on sm_{target.gpu.sm} ({target.name})"
            )
        if data_type in FP4_TYPES and not allowed_fp4:
            raise UsageError(
                f"tensor {tensor.name}: {_type_name(data_type)} is not supported on sm_{target.gpu.sm} ({target.name})"
            )
    has_int4 = False
    for node in graph.node:
        if node.op_type == "QuantizeLinear" and len(node.input) > 2 and node.input[2] in initializers:
            zero_type = initializers[node.input[2]].data_type
            if zero_type in INT4_TYPES:
                raise UsageError(
                    f"node {node.name}: INT4 activations are not supported; INT4 is weight-only on {target.name}"
                )
            if zero_type in FP8_TYPES and not allowed_fp8:
                raise UsageError(
                    f"node {node.name}: FP8 quantization is not supported on sm_{target.gpu.sm} ({target.name})"
                )
        is_weight_dq = node.op_type == "DequantizeLinear" and node.input[0] in initializers
        if is_weight_dq and initializers[node.input[0]].data_type in INT4_TYPES:
            has_int4 = True
            if "int4" not in target.gpu.precisions:
                raise UsageError(f"node {node.name}: INT4 weights are not supported on {target.name}")
    for graph_input in graph.input:
        if graph_input.name in initializers:
            continue
        dims = graph_input.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value > max_batch:
            raise UsageError(
                f"input {graph_input.name}: fixed batch {dims[0].dim_value} exceeds the profile's maximum {max_batch}"
            )
    has_qdq = any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in graph.node)
    return GraphFacts(opset, has_qdq, has_int4, len(graph.node))


def check_onnx_file(path: Path, target: Target, max_batch: int = 1) -> GraphFacts:
    """Load a graph without its weights' data and check it."""
    model = onnx.load(str(path), load_external_data=False)
    return check_onnx_for_target(model, target, max_batch)


def check_parses_fp4(target: Target) -> None:
    """Refuse a generic TensorRT build of an NVFP4 graph where the target's ONNX parser cannot read FP4 tensors."""
    major = target.tensorrt_version.split(".")[0]
    if MAX_OPSET.get(major, 21) < FP4_OPSET:
        raise UsageError(
            f"build_engine: an NVFP4 graph stores FP4 weights (FLOAT4E2M1, ONNX opset {FP4_OPSET}), and the ONNX "
            "parser "
            f"of TensorRT {target.tensorrt_version} on {target.name} reads opset {MAX_OPSET.get(major, 21)} at most; "
            "deploy NVFP4 through export_edgellm (recipe=thor-nvfp4), or end the recipe at export_onnx"
        )
