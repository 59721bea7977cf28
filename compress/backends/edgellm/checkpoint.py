"""A real quantized checkpoint: the quantize stage's result as a Model Optimizer "unified" Hugging Face checkpoint.

Integers on disk, in the layout NVIDIA's tools read (TensorRT Edge-LLM's exporter among them;
its ``config.py``, ``checkpoint/loader.py`` and ``models/linear.py`` are the specification):

* ``hf_quant_config.json`` (and ``quantization_config`` in ``config.json``) names the algorithm:
  ``W8A8_SQ_PER_CHANNEL``, ``W4A16_AWQ`` (with its ``group_size``), ``FP8``, ``NVFP4`` (W4A4) or
  ``W4A16_NVFP4`` (weight-only; ``group_size`` 16); ``lm_head`` and any decoder linear the quantize
  stage left float (``quantize.float_linears``) stay FP16 and are listed in ``exclude_modules``
  (Edge-LLM also treats a linear with no ``weight_scale`` as FP16). A mixed-precision plan
  (``quantize.method=auto``) is ``MIXED_PRECISION`` with ``quantized_layers``: each quantized
  linear by name with its own ``quant_algo`` (and ``group_size`` for INT4); a linear not listed is FP16.
  A plan may quantize ``lm_head`` too: it is then listed there with its tensors, and the model is
  written untied (Edge-LLM builds a quantized head from its own tensors, never from the embedding).
* W8A8 linear: ``weight`` int8 ``[out, in]``, ``weight_scale`` float32 ``[out]``, ``input_scale``
  float32 ``[]`` (the QuantizeLinear scale, amax / 127), ``pre_quant_scale`` float16 ``[in]``.
* W4A16 linear: ``weight`` uint8 ``[out / 2, in]``, two's-complement nibbles (even output rows in
  the low nibble, odd rows in the high one), ``weight_scale`` float32 ``[out, in / group]``.
* FP8 linear: ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` and ``input_scale`` float32
  ``[]`` (FP16 numbers: Edge-LLM casts FP8 scales to FP16).
* NVFP4 linear: ``weight`` uint8 ``[out, in / 2]``, E2M1 codes (even inputs in the low nibble),
  ``weight_scale`` float8_e4m3fn ``[out, in / 16]`` (block scales), ``weight_scale_2`` float32 ``[]``
  (the per-tensor scale), and for W4A4 ``input_scale`` float32 ``[]`` (the activations' global scale).
* An FP8 KV cache: ``kv_cache_quant_algo: FP8`` and per layer ``self_attn.k_proj.k_scale`` and
  ``self_attn.v_proj.v_scale``, float32 ``[]`` (the cache's dequantization scales, amax / 448).
* Every other tensor (embedding, norms) in float16, ``torch_dtype: float16``.

SmoothQuant and AWQ scales are already folded into the norms and producer linears of the
quantized folder, so ``pre_quant_scale`` is all ones. The integers and E4M3 / E2M1 values are
the ones the quantize stage stored; a linear whose input is rotated online (a ``down_proj``
quantized in a Hadamard basis) is refused: the format has no slot for an online rotation.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from compress.algorithms.formats import PRECISIONS, e2m1_codes, pack_fp4
from compress.core.errors import UsageError
from compress.core.versions import __version__
from compress.models.families import Family, family_of, is_decoder_linear
from compress.models.weights import SAFETENSORS_INDEX, CheckpointReader
from compress.transforms.quantize.saved import (
    LinearQuant,
    level_values,
    load_quantization,
    quantization_meta,
)

NVFP4_WEIGHT_ONLY = PRECISIONS["nvfp4_a16"].quant_algo
HF_QUANT_CONFIG = "hf_quant_config.json"
MIXED_PRECISION = "MIXED_PRECISION"  # a plan's checkpoint: quantized_layers names each linear's own quant_algo
_COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class CheckpointSummary:
    """What was written: algorithm, quantized and FP16 decoder linears, their bytes as written and as all-FP16."""

    quant_algo: str
    group_size: int | None
    linears: int
    quantized_bytes: int
    fp16_bytes: int
    float_linears: int = 0

    def to_json(self) -> dict[str, str | int | float | None]:
        return {"quant_algo": self.quant_algo, "group_size": self.group_size, "linears": self.linears,
                "float_linears": self.float_linears, "quantized_linear_bytes": self.quantized_bytes,
                "fp16_linear_bytes": self.fp16_bytes, "ratio_vs_fp16": round(self.quantized_bytes / self.fp16_bytes, 4)}


def grid_values(name: str, quant: LinearQuant) -> torch.Tensor:
    """The grid values the quantize stage stored for a linear: integers (int8), E4M3 values (FP8) or E2M1 values (NVFP4,
    float32); refuses a linear whose input is rotated online (the format has no slot for it)."""
    if quant.rotation:
        raise UsageError(
            f"{name}: its input is Hadamard-rotated online (block {quant.rotation}), which the unified checkpoint "
            "cannot express; quantize with quantize.hadamard_block=0"
        )
    values = level_values(quant)
    if quant.format.weight_format != "int":
        return values
    bits = quant.format.weight_bits
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if not torch.equal(values, values.round()) or values.min() < low or values.max() > high:
        raise UsageError(f"{name}: its stored levels are not {bits}-bit integers; the quantized folder is damaged")
    return values.to(torch.int8)


def pack_int4(integers: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` int4 values in int8 -> ``[out / 2, in]`` uint8, even rows low nibble, odd rows high (two's
    complement)."""
    if integers.shape[0] % 2:
        raise UsageError(f"INT4 packing needs an even number of output channels, got {integers.shape[0]}")
    low = integers[0::2].to(torch.int16) & 0xF
    high = integers[1::2].to(torch.int16) & 0xF
    return ((high << 4) | low).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[out / 2, in]`` uint8 -> ``[out, in]`` int8 in [-8, 7]."""
    values = torch.empty(packed.shape[0] * 2, packed.shape[1], dtype=torch.int16)
    wide = packed.to(torch.int16)
    values[0::2] = wide & 0xF
    values[1::2] = (wide >> 4) & 0xF
    return torch.where(values > 7, values - 16, values).to(torch.int8)


def _linear_tensors(name: str, quant: LinearQuant) -> dict[str, torch.Tensor]:
    values = grid_values(name, quant)
    weight_format, bits = quant.format.weight_format, quant.format.weight_bits
    if weight_format == "fp8":
        if quant.input_scale is None:
            raise UsageError(f"{name}: FP8 needs a calibrated input scale")
        return {
            f"{name}.weight": values.to(torch.float8_e4m3fn),
            f"{name}.weight_scale": quant.weight_scales.float().reshape(()),
            f"{name}.input_scale": torch.tensor(quant.input_scale, dtype=torch.float32),
        }
    if weight_format == "nvfp4":
        tensors = {
            f"{name}.weight": pack_fp4(e2m1_codes(values)),
            f"{name}.weight_scale": quant.weight_scales.to(torch.float8_e4m3fn),
            f"{name}.weight_scale_2": torch.tensor(quant.global_scale, dtype=torch.float32),
        }
        if quant.input_scale is not None:
            tensors[f"{name}.input_scale"] = torch.tensor(quant.input_scale, dtype=torch.float32)
        return tensors
    integers = values
    if bits == 8:
        if quant.input_scale is None:
            raise UsageError(f"{name}: W8A8 needs a calibrated input scale")
        return {f"{name}.weight": integers, f"{name}.weight_scale": quant.weight_scales.float().contiguous(),
                f"{name}.input_scale": torch.tensor(quant.input_scale, dtype=torch.float32),
                f"{name}.pre_quant_scale": torch.ones(values.shape[1], dtype=torch.float16)}
    return {f"{name}.weight": pack_int4(integers), f"{name}.weight_scale": quant.weight_scales.float().contiguous()}


@dataclass
class _Shards:
    """What the shards written so far hold: each quantized linear's algorithm, where each tensor is, the decoder linears
    left float, and the bytes quantized, as FP16, and written."""

    quantized_layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    weight_map: dict[str, str] = field(default_factory=dict)
    float_linears: list[str] = field(default_factory=list)
    quantized_bytes: int = 0
    fp16_bytes: int = 0
    written_bytes: int = 0


def write_unified_checkpoint(quantized_dir: Path, out: Path) -> CheckpointSummary:
    """Write the quantized folder ``quantized_dir`` (weights on their grid + scales) as a unified checkpoint in ``out``,
    one shard per decoder block (and one for the rest) named by ``model.safetensors.index.json``: one block's tensors in
    memory at a time."""
    quantized_dir, out = Path(quantized_dir), Path(out)
    meta = quantization_meta(quantized_dir)
    if meta is None:
        raise UsageError(f"{quantized_dir} holds no quantization to write (run a quantize stage first)")
    if meta.weight_bits == 8 and meta.activations == "float":
        raise UsageError("INT8 weight-only has no unified-checkpoint format that Edge-LLM reads; use W8A8 or INT4")
    config = json.loads((quantized_dir / "config.json").read_text(encoding="utf-8"))
    kv_scales = meta.kv_cache_scales()
    layers = int(config["num_hidden_layers"])
    prefixes = [f"model.layers.{layer}." for layer in range(layers)]
    shards = _Shards()
    out.mkdir(parents=True, exist_ok=True)
    outside = [name for name in meta.linears if not any(name.startswith(p) for p in prefixes)]  # a quantized LM head
    source, family = CheckpointReader(quantized_dir), family_of(config)
    for number, prefix in enumerate([*prefixes, None], start=1):
        linears = load_quantization(quantized_dir, prefix)[1] if prefix else _outside_blocks(quantized_dir, outside)
        tensors = _quantized_tensors(linears, meta.format, shards)
        keys = [
            k
            for k in source.names()
            if (k.startswith(prefix) if prefix else not any(k.startswith(p) for p in prefixes))
        ]
        tensors.update(_float_tensors(source.read(keys), linears, family, shards))
        if prefix and kv_scales:
            tensors[f"{prefix}self_attn.k_proj.k_scale"] = torch.tensor(kv_scales[number - 1][0], dtype=torch.float32)
            tensors[f"{prefix}self_attn.v_proj.v_scale"] = torch.tensor(kv_scales[number - 1][1], dtype=torch.float32)
        shard = f"model-{number:05d}-of-{layers + 1:05d}.safetensors"
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        shards.weight_map.update(dict.fromkeys(tensors, shard))
        shards.written_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
    (out / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {"total_size": shards.written_bytes},
                                                     "weight_map": shards.weight_map}, indent=2) + "\n")
    quant_block = _quantization_block(meta, bool(kv_scales), outside, shards)
    _write_configs(quantized_dir, out, config, quant_block)
    group = meta.group_size if meta.weight_bits == 4 else None
    return CheckpointSummary(quant_block["quant_algo"], group, len(meta.linears), shards.quantized_bytes,
                             shards.fp16_bytes, len(shards.float_linears))


def _quantized_tensors(linears: dict[str, LinearQuant], weight_format: str, shards: _Shards) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one shard's quantized linears, each linear's algorithm recorded in ``shards``."""
    if weight_format == "fp8" and any(q.weight_scales.dim() for q in linears.values()):
        raise UsageError(
            "per-channel FP8 weight scales have no unified-checkpoint format that Edge-LLM's FP8 linears read "
            "(one scale per tensor); quantize with quantize.fp8_weight_scale=tensor"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name, quant in linears.items():
        grouped = quant.format.weight_format == "int" and quant.group_size
        shards.quantized_layers[name] = {"quant_algo": quant.format.quant_algo,
                                         **({"group_size": quant.group_size} if grouped else {})}
        written = _linear_tensors(name, quant)
        shards.quantized_bytes += sum(t.numel() * t.element_size() for t in written.values())
        shards.fp16_bytes += quant.levels.numel() * 2
        tensors.update(written)
    return tensors


def _float_tensors(read: dict[str, torch.Tensor], linears: dict[str, LinearQuant], family: Family,
                   shards: _Shards) -> dict[str, torch.Tensor]:
    """The shard's other tensors in FP16; a decoder linear the quantize stage left float is recorded as excluded."""
    tensors = {}
    for key, tensor in read.items():
        module = key.rsplit(".", 1)[0]
        tensors[key] = tensor.half() if tensor.is_floating_point() else tensor
        if key.endswith(".weight") and is_decoder_linear(module, family) and module not in linears:
            shards.float_linears.append(module)
            shards.quantized_bytes += tensor.numel() * 2
            shards.fp16_bytes += tensor.numel() * 2
    return tensors


def _quantization_block(
    meta: dict[str, Any], fp8_kv_cache: bool, outside: list[str], shards: _Shards
) -> dict[str, Any]:
    """The ``quantization`` block of ``hf_quant_config.json`` (and of ``config.json``'s ``quantization_config``)."""
    block = {"quant_algo": quant_algorithm(meta), "kv_cache_quant_algo": "FP8" if fp8_kv_cache else None,
             "exclude_modules": [*(["lm_head"] if "lm_head" not in outside else []), *sorted(shards.float_linears)]}
    if meta.is_mixed():  # each quantized linear with its own algorithm; any linear not listed is FP16
        block["quantized_layers"] = shards.quantized_layers
    elif meta.weight_bits == 4:
        block["group_size"] = meta.group_size
    return block


def _write_configs(quantized_dir: Path, out: Path, config: dict[str, Any], quant_block: dict[str, Any]) -> None:
    """``hf_quant_config.json``, ``config.json`` in FP16 with its ``quantization_config``, and the tokenizer's files."""
    (out / HF_QUANT_CONFIG).write_text(json.dumps(
        {"producer": {"name": "compress", "version": __version__}, "quantization": quant_block}, indent=2) + "\n")
    config["torch_dtype"] = "float16"
    config.pop("dtype", None)
    config["quantization_config"] = {"quant_method": "modelopt", **quant_block}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _COPIED:
        if (quantized_dir / name).is_file():
            shutil.copy2(quantized_dir / name, out / name)



def _outside_blocks(quantized_dir: Path, names: list[str]) -> dict[str, LinearQuant]:
    """The quantized linears outside the decoder blocks (the LM head, where a plan quantized it), read by name."""
    linears: dict[str, LinearQuant] = {}
    for name in names:
        linears.update({key: quant for key, quant in load_quantization(quantized_dir, name)[1].items() if key == name})
    return linears


def quant_algorithm(meta: dict[str, Any]) -> str:
    """The unified checkpoint's ``quant_algo`` for a saved quantization's metadata (``MIXED_PRECISION`` for a plan)."""
    return MIXED_PRECISION if meta.is_mixed() else PRECISIONS[meta.precision].quant_algo
