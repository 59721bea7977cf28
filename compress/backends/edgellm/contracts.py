"""What the pinned TensorRT Edge-LLM release deploys: its model types, attention kernels and quantized linears.

A bundle can hold exactly our numbers and still fail to build, or build and be misread, when the
runtime's kernels do not take its shapes or formats; these rules are checked when the plan is
checked, before any work. Each names the rule and the way out.
"""

from __future__ import annotations

from typing import Any

from compress.backends.edgellm.env import EDGELLM_VERSION
from compress.core.config import Target
from compress.core.errors import UsageError
from compress.models.families import linear_shapes

# Decoder families the pinned Edge-LLM exports and compress's quantize -> export path is tested on (Gemma 3 and
# Mistral are not in Edge-LLM 0.11's model list).
SUPPORTED_MODEL_TYPES = ("llama", "phi3", "qwen2", "qwen3")
# Edge-LLM 0.11's INT4 GEMM plugin (V2, the default) tiles weights in blocks of 64 in both dimensions.
INT4_ALIGNMENT = 64
# Head sizes the pinned Edge-LLM's attention plugin has prefill kernels for (fmha_v2_d64/d128/d256/d512
# in the 0.11.0 wheel's libNvInfer_edgellm_plugin.so); any other size fails the engine build or runs decode only.
HEAD_DIMS = (64, 128, 256, 512)


def check_model_type(model_config: dict[str, Any]) -> None:
    """Refuse a decoder family the pinned Edge-LLM does not export."""
    model_type = model_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UsageError(f"export_edgellm: model_type {model_type!r} is not supported for Edge-LLM deployment "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); a recipe that ends at export_onnx "
                         "(recipe=int8 or recipe=int4) gives the portable Q/DQ ONNX")


def check_attention_shape(model_config: dict[str, Any]) -> None:
    """Refuse attention shapes the pinned Edge-LLM's attention plugin has no kernels for, and mixed layer types."""
    heads = model_config["num_attention_heads"]
    kv_heads = model_config.get("num_key_value_heads") or heads
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    if heads % kv_heads:
        raise UsageError(f"export_edgellm: {heads} query heads cannot share {kv_heads} KV heads evenly; Edge-LLM's attention "
                         "plugin takes MHA or GQA with a whole number of query heads per KV head")
    if head_dim not in HEAD_DIMS:
        raise UsageError(f"export_edgellm: head_dim {head_dim} has no prefill attention kernel in Edge-LLM {EDGELLM_VERSION} "
                         f"(it has {', '.join(map(str, HEAD_DIMS))}); deploy through export_onnx instead")
    layer_types = model_config.get("layer_types")
    if layer_types and len(set(layer_types)) > 1:
        raise UsageError("export_edgellm: the model mixes layer types (" + ", ".join(sorted(set(layer_types))) + "); "
                         "compress deploys uniform decoder stacks only")


def check_precision_on_target(edgellm_precision: str, target: Target) -> None:
    """Refuse a precision the pinned Edge-LLM does not run on the target."""
    if edgellm_precision not in target.edgellm.precisions:
        raise UsageError(f"export_edgellm: Edge-LLM {target.edgellm.version} on {target.name} runs "
                         f"{', '.join(target.edgellm.precisions)}, not {edgellm_precision}; choose another quantize.method")


def check_no_online_rotation(quantize) -> None:
    """Refuse the Hadamard rotation of down_proj inputs, which the unified checkpoint has no slot for."""
    if quantize.rotation_limit():
        raise UsageError("export_edgellm: quantize.hadamard_block rotates down_proj inputs online, which Edge-LLM's checkpoint "
                         "format cannot express; set quantize.hadamard_block=0 (SmoothQuant only)")


def check_quantization(quantize, model_config: dict[str, Any]) -> None:
    """Refuse a quantize configuration whose checkpoint the pinned Edge-LLM cannot read or its kernels cannot run."""
    precision = quantize.precision()
    if getattr(quantize, "fp8_weight_scale", "tensor") == "channel":
        raise UsageError("export_edgellm: Edge-LLM's FP8 linears take one weight scale per tensor; set quantize.fp8_weight_scale=tensor "
                         "(per-channel FP8 stays in the portable ONNX: end the recipe at export_onnx)")
    if quantize.kv_cache == "fp8" and precision.name == "int4":
        raise UsageError("export_edgellm: Edge-LLM 0.11 reads no FP8 KV cache from a W4A16_AWQ checkpoint; drop quantize.kv_cache=fp8 "
                         "or quantize with method fp8 or nvfp4")
    if precision.name == "int4":
        group = quantize.scheme()[2]
        for name, (out_features, in_features) in linear_shapes(model_config).items():
            if out_features % INT4_ALIGNMENT or in_features % INT4_ALIGNMENT or in_features % group:
                raise UsageError(f"export_edgellm: {name} is {out_features} x {in_features}; Edge-LLM {EDGELLM_VERSION}'s INT4 "
                                 f"GEMM needs both multiples of {INT4_ALIGNMENT} and the input width a multiple of the group "
                                 f"size {group}")
