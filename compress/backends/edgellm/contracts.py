"""What the pinned TensorRT Edge-LLM release's kernels take: the contract table, and the checks that hold plans and
bundles to it.

A bundle can hold exactly our numbers and still fail to build, or build and be misread, when the
runtime's kernels do not take its shapes or formats: Edge-LLM 0.11's exporter passes an INT4
``group_size`` through as a plugin attribute without checking it, and its INT4 kernels read
scales at a stride of 128. So every rule below is checked twice: when the plan is built, before any
work (:func:`check_model_type` ... :func:`check_quantization`), and on the exported bundle, by
reading its plugin nodes (:func:`check_kernel_nodes`). Each rule cites the file it was read from;
the 0.11.0 wheel ships the C++ compiled, so those sources are NVIDIA/TensorRT-Edge-LLM's, checked
against the strings and symbols of the wheel's ``libNvInfer_edgellm_plugin.so``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypedDict

from compress.backends.edgellm.env import EDGELLM_VERSION
from compress.core.config import Target
from compress.core.errors import UsageError
from compress.models.config_file import ModelConfig
from compress.models.families import attention_geometry, attention_window, linear_shapes


@dataclass(frozen=True)
class KernelRule:
    """One thing the pinned Edge-LLM's kernels require, and where that was read."""

    name: str
    rule: str
    source: str

    def __str__(self) -> str:
        return f"{self.rule} ({self.source})"


EXPORTER = "tensorrt_edgellm 0.11.0"
PLUGIN_SOURCES = "NVIDIA/TensorRT-Edge-LLM cpp/"

INT4_GROUP_SIZE = 128
INT4_ALIGNMENT = 64
INT4_PLUGINS = ("Int4GroupwiseGemmPluginV2", "Int4GroupwiseGemmPlugin")  # the exporter's default (V2), and V1
HEAD_DIMS = (64, 128, 256, 512)


class KernelNode(TypedDict):
    """A plugin node of the exported graph as the custody check reads it: its scalar attributes and the shapes of its
    initializer inputs (by input position)."""

    name: str
    op_type: str
    domain: str
    attributes: dict[str, int | float | str]
    initializer_shapes: dict[str, list[int]]
    weight: str | None
SUPPORTED_MODEL_TYPES = ("llama", "phi3", "qwen2", "qwen3")
LM_HEAD_QUANTIZATIONS = ("fp8", "int4_awq", "nvfp4", "mxfp8")
# compress's formats among them (a target runs those its GPU has: Orin INT4 only)
LM_HEAD_FORMATS = ("fp8", "int4", "nvfp4")

RULES: dict[str, KernelRule] = {
    rule.name: rule
    for rule in (
        KernelRule(
            "int4-group-size",
            f"INT4 weights in groups of {INT4_GROUP_SIZE} input channels only",
            "V2: plugins/int4GroupwiseGemmPluginV2/cuteDslInt4Gemv.cpp bakes kGemvGroupSize = 128 and sizes the scale "
            "rows ceil(K/128), and int4GroupwiseGemmPluginV2.cpp launches its GEMV and GEMM with N and K only; V1: "
            'kernels/int4GroupwiseGemmKernels/int4WoQGemvCuda.cu throws "Unsupported group size" (in the 0.11.0 '
            'wheel\'s '
            "libNvInfer_edgellm_plugin.so)",
        ),
        KernelRule(
            "int4-alignment",
            f"INT4 linears with N and K multiples of {INT4_ALIGNMENT}, and K a multiple of the group size",
            f"{EXPORTER} checkpoint/repacking.py repack_to_cutedsl_fragment refuses other shapes; "
            "plugins/int4GroupwiseGemmPluginV2/int4GroupwiseGemmPluginV2.cpp enqueue returns -1 unless K % 64 == 0",
        ),
        KernelRule(
            "int4-scale-layout",
            "INT4 scales as FP16 [K / group size, N] and weights in the plugin's packed layout",
            "plugins/int4GroupwiseGemmPluginV2/int4GroupwiseGemmPluginV2.cpp supportsFormatCombination (inputs 1 and "
            "2)",
        ),
        KernelRule(
            "int4-plugin",
            f"INT4 linears run on {' or '.join(INT4_PLUGINS)} (the exporter's --int4-gemm-plugin-version, "
            "2 by default)",
            f"{EXPORTER} scripts/export.py, models/ops.py int4_gemm_plugin_version",
        ),
        KernelRule(
            "fp8-weight-scale",
            "FP8 linears with one weight scale per tensor",
            f"{EXPORTER} models/linear.py (an FP8 linear's weight_scale is one scalar), checkpoint/repacking.py "
            "_cast_fp8_linear_scales (cast to FP16)",
        ),
        KernelRule(
            "int4-kv-cache",
            "no FP8 KV cache read from a W4A16_AWQ checkpoint",
            f"{EXPORTER} config.py (kv_cache_quant_algo)",
        ),
        KernelRule(
            "online-rotation",
            "no online input rotation: the unified checkpoint has no slot for one",
            f"{EXPORTER} checkpoint/loader.py (the tensors a linear may have)",
        ),
        KernelRule(
            "head-size",
            f"attention head sizes {', '.join(map(str, HEAD_DIMS))}",
            "fmha_v2_d64/d128/d256/d512 prefill kernels in the 0.11.0 wheel's libNvInfer_edgellm_plugin.so",
        ),
        KernelRule(
            "gqa",
            "a whole number of query heads per KV head",
            f"{EXPORTER} models/ops.py (AttentionPlugin's num_q_heads and num_kv_heads)",
        ),
        KernelRule(
            "one-head-count",
            "one num_attention_heads for every layer (the bundle's config.json holds one)",
            f"{EXPORTER} config.py (num_attention_heads, head_dim)",
        ),
        KernelRule(
            "uniform-layers",
            "one attention kind for every layer",
            f"{EXPORTER} config.py (_VALID_ATTENTION_LAYER_TYPES); compress deploys uniform stacks only",
        ),
        KernelRule(
            "sliding-window",
            "a sliding window no shorter than the context: compress has not checked Edge-LLM's sliding-window "
            "attention against transformers (the portable ONNX computes each sliding layer's banded mask and is "
            "checked)",
            f"{EXPORTER} config.py (sliding_window_size, read when use_sliding_window or a sliding layer type is set)",
        ),
        KernelRule(
            "model-type",
            f"decoder families {', '.join(SUPPORTED_MODEL_TYPES)}",
            f"{EXPORTER} models/default/modeling_default.py, and compress's tests of each through the exporter",
        ),
        KernelRule(
            "mixed-precision",
            "a MIXED_PRECISION checkpoint lists each quantized linear with its quant_algo (and group_size); "
            "W4A16_NVFP4 there is read as NVFP4 W4A4 except on Nemotron-H",
            f"{EXPORTER} config.py _parse_mixed_precision and _algo_to_quant_type",
        ),
        KernelRule(
            "mixed-nvfp4-integers",
            "no NVFP4 linear beside INT8 or INT4 ones in one MIXED_PRECISION checkpoint: once any linear "
            "is NVFP4 the exporter reinterprets every int8 weight initializer as packed FP4 (an INT8 [N, K] weight "
            "becomes "
            "FP4 [N, 2K]), so the INT8 and INT4 linears would be misread",
            f"{EXPORTER} onnx/export.py _fix_nvfp4_weight_dtype, run when config.quant.uses_nvfp4_weights",
        ),
        KernelRule(
            "lm-head",
            f"lm_head quantization {', '.join(LM_HEAD_QUANTIZATIONS)} (on Orin int4_awq only); a MIXED_PRECISION "
            "checkpoint lists lm_head with its own quant_algo and tensors, and a tied head that is quantized is built "
            "from them "
            "(not cloned from the embedding table); compress quantizes it only in quantize.method=auto",
            f"{EXPORTER} scripts/quantize.py --lm_head_quantization; config.py module_quant_type; checkpoint/loader.py "
            "load_weights (tie_weights only for an FP16 lm_head)",
        ),
    )
}


def check_model_type(model_config: ModelConfig) -> None:
    """Refuse a decoder family the pinned Edge-LLM does not export."""
    model_type = model_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UsageError(
            f"export_edgellm: model_type {model_type!r} is not supported for Edge-LLM deployment "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}): the pinned exporter takes {RULES['model-type']}; a "
            "recipe that ends at export_onnx (recipe=int8 or recipe=int4) gives the portable Q/DQ ONNX"
        )


def check_attention_shape(model_config: ModelConfig) -> None:
    """Refuse attention shapes the pinned Edge-LLM's attention plugin has no kernels for, and mixed layer types."""
    heads, kv_heads, head_dim = attention_geometry(model_config)
    if heads % kv_heads:
        raise UsageError(
            f"export_edgellm: {heads} query heads cannot share {kv_heads} KV heads evenly; Edge-LLM's attention "
            f"plugin takes {RULES['gqa']}"
        )
    if head_dim not in HEAD_DIMS:
        raise UsageError(
            f"export_edgellm: head_dim {head_dim} has no prefill attention kernel in Edge-LLM {EDGELLM_VERSION}, "
            f"which takes {RULES['head-size']}; deploy through export_onnx instead"
        )
    layer_types = model_config.get("layer_types")
    if layer_types and len(set(layer_types)) > 1:
        raise UsageError("export_edgellm: the model mixes layer types (" + ", ".join(sorted(set(layer_types))) + "); "
                         f"a bundle takes {RULES['uniform-layers']}")


def check_attention_window(model_config: ModelConfig, target: Target) -> None:
    """Refuse a bundle of a model whose sliding window is shorter than the target's context, where the bundle's
    attention would differ from full attention and nothing here has checked it."""
    window = attention_window(model_config)
    context = target.budgets.context_length
    if window is not None and window < context:
        raise UsageError(
            f"export_edgellm: sliding_window={window} is shorter than the target's context_length {context}; a bundle "
            f"takes {RULES['sliding-window']}; end the recipe at export_onnx (recipe=int8 or recipe=int4), or set "
            f"budgets.context_length={window} or below"
        )


def check_precision_on_target(edgellm_precision: str, target: Target) -> None:
    """Refuse a precision the pinned Edge-LLM does not run on the target (the target's ``edgellm.precisions``, from
    Edge-LLM's support matrix)."""
    if edgellm_precision not in target.edgellm.precisions:
        raise UsageError(
            f"export_edgellm: Edge-LLM {target.edgellm.version} on {target.name} runs "
            f"{', '.join(target.edgellm.precisions)}, not {edgellm_precision}; choose another quantize.method"
        )


def check_no_online_rotation(quantize) -> None:
    """Refuse the Hadamard rotation of down_proj inputs, which the unified checkpoint has no slot for."""
    if quantize.rotation_limit():
        raise UsageError("export_edgellm: quantize.hadamard_block rotates down_proj inputs online, and Edge-LLM takes "
                         f"{RULES['online-rotation']}; set quantize.hadamard_block=0 (SmoothQuant only)")


# The formats a mixed-precision plan may give a group of linears in a bundle (W4A16_NVFP4 is read as W4A4 there).
MIXED_FORMATS = ("int8", "int4", "fp8", "nvfp4")


def check_quantization(quantize, model_config: ModelConfig) -> None:
    """Refuse a quantize configuration whose checkpoint the pinned Edge-LLM cannot read or its kernels cannot run."""
    if quantize.is_mixed():
        check_mixed_formats(quantize.candidate_precisions() or [])
        return
    precision = quantize.precision()
    if getattr(quantize, "fp8_weight_scale", "tensor") == "channel":
        raise UsageError(
            f"export_edgellm: quantize.fp8_weight_scale=channel, and Edge-LLM takes {RULES['fp8-weight-scale']}; set "
            "quantize.fp8_weight_scale=tensor (per-channel FP8 stays in the portable ONNX: end the recipe at "
            "export_onnx)"
        )
    if quantize.kv_cache == "fp8" and precision == "int4":
        raise UsageError(
            f"export_edgellm: quantize.kv_cache=fp8 with INT4 weights, and Edge-LLM {EDGELLM_VERSION} takes "
            f"{RULES['int4-kv-cache']}; drop quantize.kv_cache=fp8 or quantize with method fp8 or nvfp4"
        )
    if precision == "int4":
        check_int4_shapes(quantize, model_config)


def check_int4_shapes(quantize, model_config: ModelConfig) -> None:
    """The INT4 kernels take the group size and every INT4 linear's shape; the message names the linears they do not."""
    group = quantize.scheme()[2]
    if group != INT4_GROUP_SIZE:
        raise UsageError(
            f"export_edgellm: quantize.group_size={group}, and Edge-LLM {EDGELLM_VERSION} takes "
            f"{RULES['int4-group-size']}; "
            f"set quantize.group_size={INT4_GROUP_SIZE} (other group sizes stay in the portable ONNX: end the recipe "
            "at export_onnx)"
        )
    illegal = {name: shape for name, shape in linear_shapes(model_config).items()
               if not quantize.is_float(name) and not int4_shape_ok(*shape)}
    if illegal:
        shapes = ", ".join(f"{name} {n} x {k}" for name, (n, k) in illegal.items())
        raise UsageError(
            f"export_edgellm: {shapes} (out x in): Edge-LLM {EDGELLM_VERSION} takes {RULES['int4-alignment']}, "
            f"in groups of {INT4_GROUP_SIZE}; keep those linears FP16 with "
            f"quantize.float_linears=[{','.join(sorted({*quantize.float_linears, *illegal}))}] or end the recipe at "
            "export_onnx"
        )


def check_mixed_formats(formats: list[str]) -> None:
    """Refuse a candidate format a MIXED_PRECISION checkpoint would be misread in."""
    wrong = [name for name in formats if name not in MIXED_FORMATS]
    if wrong:
        raise UsageError(
            f"export_edgellm: quantize.formats has {', '.join(wrong)}, and Edge-LLM {EDGELLM_VERSION} takes "
            f"{RULES['mixed-precision']}; choose among {', '.join(MIXED_FORMATS)}"
        )


# Formats one MIXED_PRECISION bundle cannot hold side by side (RULES["mixed-nvfp4-integers"]).
MIXED_CONFLICTS = (frozenset({"nvfp4", "int8"}), frozenset({"nvfp4", "int4"}))


def mixed_conflict(formats: Iterable[str]) -> frozenset[str] | None:
    """A pair of ``formats`` the pinned exporter cannot put in one bundle, or None."""
    present = set(formats)
    return next((pair for pair in MIXED_CONFLICTS if pair <= present), None)


def mixed_format_sets(formats: Sequence[str]) -> list[tuple[str, ...]]:
    """The largest subsets of ``formats`` (in their order) that one bundle may hold together."""
    subsets = [
        tuple(name for bit, name in enumerate(formats) if mask >> bit & 1) for mask in range(1, 1 << len(formats))
    ]
    legal = [subset for subset in subsets if mixed_conflict(subset) is None]
    return [subset for subset in legal if not any(set(subset) < set(other) for other in legal)]


def check_mixed_plan(formats: Iterable[str]) -> None:
    """Refuse a plan whose formats the pinned exporter cannot put in one bundle."""
    pair = mixed_conflict(formats)
    if pair is not None:
        raise UsageError(
            f"export_edgellm: the plan mixes {' and '.join(sorted(pair))}, and Edge-LLM {EDGELLM_VERSION} takes "
            f"{RULES['mixed-nvfp4-integers']}; quantize.method=auto keeps them apart, or end the recipe at export_onnx"
        )


def mixed_format_fits(name: str, shapes: list[tuple[int, int]]) -> bool:
    """Whether a group of linears of these (out, in) shapes may ship in format ``name`` in a bundle."""
    if name == "int4":
        return all(int4_shape_ok(*shape) for shape in shapes)
    if name in ("nvfp4", "nvfp4_a16"):
        return all(k % 16 == 0 for _, k in shapes)
    return True


def int4_shape_ok(out_features: int, in_features: int) -> bool:
    """Whether the INT4 kernels take a linear of this shape in groups of 128."""
    return (
        out_features % INT4_ALIGNMENT == 0 and in_features % INT4_ALIGNMENT == 0 and in_features % INT4_GROUP_SIZE == 0
    )


def check_kernel_nodes(nodes: list[KernelNode]) -> list[str]:
    """What the exported graph's plugin nodes (as the custody check reads them) do that the kernels would misread.

    Each problem names the node and the rule: an INT4 GEMM with another group size, a shape the
    kernels do not tile, scales of another layout; an attention plugin with a head size that has no
    kernel or with head counts that differ between layers.
    """
    problems = []
    head_counts = set()
    for node in nodes:
        attributes, shapes = node["attributes"], node.get("initializer_shapes", {})
        label = f"node {node['name']} ({node['op_type']}"
        if node["op_type"] in INT4_PLUGINS:
            n, k, group = attributes.get("gemm_n"), attributes.get("gemm_k"), attributes.get("group_size")
            label += f", {node.get('weight', '?')})"
            if group != INT4_GROUP_SIZE:
                problems.append(f"{label}: group_size={group}; the kernels take {RULES['int4-group-size']}")
            elif not (isinstance(n, int) and isinstance(k, int) and int4_shape_ok(n, k)):
                problems.append(f"{label}: gemm_n={n}, gemm_k={k}; the kernels take {RULES['int4-alignment']}")
            elif shapes.get("2") not in (None, [k // INT4_GROUP_SIZE, n]):
                problems.append(
                    f"{label}: scales {shapes.get('2')}, not [{k // INT4_GROUP_SIZE}, {n}]; "
                    f"{RULES['int4-scale-layout']}"
                )
            elif node["op_type"] == INT4_PLUGINS[0] and shapes.get("1") not in (
                None,
                [math.ceil(n / 128) * math.ceil(k / 64) * 8, 512],
            ):
                problems.append(
                    f"{label}: weights {shapes.get('1')}, not the fragment layout; {RULES['int4-scale-layout']}"
                )
        elif node["op_type"] == "AttentionPlugin":
            head_size, q_heads, kv_heads = (attributes.get(key) for key in ("head_size", "num_q_heads", "num_kv_heads"))
            head_counts.add(q_heads)
            if head_size not in HEAD_DIMS:
                problems.append(f"{label}): head_size={head_size}; the kernels take {RULES['head-size']}")
            elif not kv_heads or q_heads % kv_heads:
                problems.append(
                    f"{label}): {q_heads} query heads over {kv_heads} KV heads; the kernels take {RULES['gqa']}"
                )
    if len(head_counts) > 1:
        problems.append(
            f"attention plugins with {sorted(head_counts)} query heads; Edge-LLM takes {RULES['one-head-count']}"
        )
    return problems


def contract_table() -> list[dict[str, str]]:
    """The contract of the pinned release, one row per rule, as the README and ``docs/`` show it."""
    return [{"rule": rule.rule, "source": rule.source} for rule in RULES.values()]
