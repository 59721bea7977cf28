"""The Edge-LLM deploy bundle: unified checkpoint -> ``tensorrt-edgellm-export`` -> chain-of-custody check.

Three links, each checked:

1. the quantize stage's folder (the numbers validate measured) -> the unified checkpoint: the
   grid values (integers, FP8 or FP4 values) are recovered from the on-grid weights and must be exact;
2. the checkpoint -> the exported ONNX: ``custody_check.py`` (run by Edge-LLM's interpreter)
   compares every quantized linear's grid values, weight scales and activation scale, in the plugin
   layouts, with the initializers of the bundle's ``llm/model.onnx``, and that a weight-only
   linear's input is not quantized; and its plugin nodes' attributes (INT4 group size, GEMM shape,
   scale layout, attention head sizes) are held against the kernels' contract
   (:mod:`compress.backends.edgellm.contracts`), so numbers the kernels would read at the wrong
   stride fail here, naming the node;
3. the bundle's ``config.json`` against the model's: layers, heads, KV heads, head size, widths,
   vocabulary, RoPE base, norm epsilon, end-of-sequence tokens.

A mismatch is a :class:`StageError` naming the tensor or field.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, TypedDict

import torch
from safetensors.torch import save_file

from compress.backends.edgellm.checkpoint import NVFP4_WEIGHT_ONLY, grid_values, write_unified_checkpoint
from compress.backends.edgellm.contracts import KernelNode, check_kernel_nodes, check_mixed_plan
from compress.backends.edgellm.env import EDGELLM_VERSION, edgellm_python
from compress.core.errors import StageError
from compress.core.files import path_size, read_json
from compress.models.families import Family, decoder_shape, family_of, is_decoder_linear, part_rows
from compress.models.weights import CheckpointReader
from compress.transforms.quantize.saved import load_quantization, quantization_meta

log = logging.getLogger(__name__)

CUSTODY_SCRIPT = Path(__file__).with_name("custody_check.py")


class CustodyEntry(TypedDict, total=False):
    """One tensor the custody check compared; ``problem`` only where it differs."""

    tensor: str
    shape: list[int]
    dtype: str
    problem: str


class CustodyReport(TypedDict):
    """``custody.json``, written by the custody check in Edge-LLM's environment."""

    onnx: str
    int4_plugin_version: int
    kernel_nodes: list[KernelNode]
    compared: list[CustodyEntry]
    mismatches: list[CustodyEntry]


class CustodySummary(TypedDict):
    tensors_compared: int
    mismatches: int
    int4_plugin_version: int
    config_fields: list[str]
    kernel_nodes_checked: int


class BundleExport(TypedDict):
    """What the Edge-LLM export records: the unified checkpoint, the bundle, the exporter, the custody check."""

    checkpoint: dict[str, str | int | float | None]
    checkpoint_bytes: int
    checkpoint_kept: bool
    bundle_bytes: int
    export_seconds: float
    edgellm_version: str
    exporter_arguments: list[str]
    custody: CustodySummary
EXPORT_TIMEOUT_S = 3600


def expected_numbers(quantized_dir: Path) -> dict[str, torch.Tensor]:
    """What the quantize stage measured, per quantized linear: its grid values (``integers``, ``fp8_values`` or
    ``fp4_values``), weight scales (NVFP4: FP8 ``block_scale`` and ``global_scale``), the input scale where activations
    are quantized (``weight_only`` marks NVFP4 without), and its bias in FP16; per decoder linear left float, its weight
    in FP16; per layer with an FP8 KV cache, its ``kv_scales`` (k, v). A fused linear (Phi-3's ``qkv_proj``) is listed
    as the parts Edge-LLM splits it into (``q_proj``, ``k_proj``, ``v_proj``), each with its rows."""
    meta, linears = load_quantization(quantized_dir)
    config = read_json(Path(quantized_dir) / "config.json")
    family = family_of(config)
    numbers: dict[str, torch.Tensor] = {}
    source = CheckpointReader(quantized_dir)
    stored = set(source.names())
    for name, quant in linears.items():
        values = grid_values(name, quant)
        per_row, scalars = _linear_numbers(quant.format.weight_format, values, quant)
        if f"{name}.bias" in stored:
            per_row["bias"] = source.read([f"{name}.bias"])[f"{name}.bias"].half()
        for part_name, rows in _parts(family, config, name):
            numbers.update({f"{part_name}.{kind}": tensor[rows].contiguous() for kind, tensor in per_row.items()})
            numbers.update({f"{part_name}.{kind}": tensor for kind, tensor in scalars.items()})
    for layer, scales in (meta.kv_cache_scales() or {}).items():
        numbers[f"model.layers.{layer}.self_attn.kv_scales"] = torch.tensor(scales, dtype=torch.float32)
    for key in stored:
        module = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and module not in linears and is_decoder_linear(module, family):
            weight = source.read([key])[key].half()
            numbers.update({f"{part_name}.float_weight": weight[rows].contiguous()
                            for part_name, rows in _parts(family, config, module)})
    return numbers


def _linear_numbers(
    weight_format: str, values: torch.Tensor, quant
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One linear's numbers split into those with a row per output channel and the per-tensor scalars."""
    scalars: dict[str, torch.Tensor] = {}
    if quant.input_scale is not None:
        scalars["input_scale"] = torch.tensor([quant.input_scale], dtype=torch.float32)
    if weight_format == "fp8":
        scalars["weight_scale"] = quant.weight_scales.float().reshape(1)
        return {"fp8_values": values.float()}, scalars
    if weight_format == "nvfp4":
        scalars["global_scale"] = torch.tensor([quant.global_scale], dtype=torch.float32)
        if quant.input_scale is None:
            scalars["weight_only"] = torch.ones(1, dtype=torch.uint8)
        return {"fp4_values": values.float(), "block_scale": quant.weight_scales.float()}, scalars
    return {"integers": values, "weight_scale": quant.weight_scales.float()}, scalars


def _parts(family: Family, config: dict[str, Any], module: str) -> list[tuple[str, slice]]:
    """A checkpoint linear as the separate linears Edge-LLM loads it into, with their rows."""
    prefix, _, linear = module.partition(".layers.")
    layer, _, path = linear.partition(".")
    parts = family.parts(path)
    if len(parts) == 1:
        return [(module, slice(None))]
    parent = path.rsplit(".", 1)[0]
    return [(f"{prefix}.layers.{layer}.{parent}.{part}_proj", part_rows(family, config, path, part)) for part in parts]


def exporter_arguments(quant_algo: str) -> list[str]:
    """The ``tensorrt-edgellm-export`` options a checkpoint needs.

    A weight-only NVFP4 checkpoint is exported with ``--no-quantize-activations``: Edge-LLM 0.11
    reads a dense NVFP4 checkpoint of a Llama-style model as W4A4 otherwise. (``--target-sm`` is not
    needed: it selects plugins for Nemotron-H's and the NVFP4-A16 linears only, which these bundles
    do not use.)
    """
    return ["--no-quantize-activations"] if quant_algo == NVFP4_WEIGHT_ONLY else []


def run_export(checkpoint: Path, bundle: Path, log_file: Path, arguments: list[str] | None = None) -> float:
    """``tensorrt-edgellm-export CHECKPOINT BUNDLE [ARGUMENTS]`` in Edge-LLM's environment; returns seconds taken."""
    exporter = edgellm_python().parent / "tensorrt-edgellm-export"
    command = [str(exporter), str(checkpoint), str(bundle), *(arguments or [])]
    log.info("exporting the Edge-LLM bundle: %s", " ".join(command))
    started = time.perf_counter()
    with open(log_file, "w", encoding="utf-8") as output:
        code = subprocess.run(
            command, stdout=output, stderr=subprocess.STDOUT, timeout=EXPORT_TIMEOUT_S, check=False
        ).returncode
    if code != 0:
        last = [line for line in log_file.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()][
            -1:
        ]
        raise StageError(f"tensorrt-edgellm-export failed (exit {code}): {last[0] if last else ''} (log: {log_file})")
    return time.perf_counter() - started


def check_custody(quantized_dir: Path, bundle: Path, work: Path) -> CustodyReport:
    """Compare the bundle's ONNX initializers with the quantize stage's numbers; raises naming the first mismatch."""
    expected = work / "expected_numbers.safetensors"
    save_file(expected_numbers(quantized_dir), str(expected))
    report_path = work / "custody.json"
    proc = subprocess.run([str(edgellm_python()), str(CUSTODY_SCRIPT), str(bundle), str(expected), str(report_path)],
                          capture_output=True, text=True, timeout=EXPORT_TIMEOUT_S, check=False)
    expected.unlink()
    if not report_path.is_file():
        raise StageError(
            f"the chain-of-custody check did not run: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
        )
    report = read_json(report_path)
    if report["mismatches"]:
        first = report["mismatches"][0]
        raise StageError(
            f"the Edge-LLM bundle does not hold the measured numbers: {first['tensor']}: {first['problem']} "
            f"({len(report['mismatches'])} mismatches; see {report_path})"
        )
    misread = check_kernel_nodes(report["kernel_nodes"])
    if misread:
        raise StageError(
            f"the Edge-LLM bundle holds the measured numbers in a form its kernels would misread: {misread[0]} "
            f"({len(misread)} problems; see {report_path})"
        )
    return report


def _model_facts(config: dict[str, Any]) -> dict[str, Any]:
    shape = decoder_shape(config)
    rope = config.get("rope_parameters") or {}
    eos = config.get("eos_token_id")
    return {
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "rope_theta": float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        "rope_type": rope.get("rope_type") or rope.get("type") or "default",
        "partial_rotary_factor": float(config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0),
        "rms_norm_eps": float(config["rms_norm_eps"]),
        "eos_token_id": sorted(eos if isinstance(eos, list) else [eos]),
    }


def check_bundle_config(bundle: Path, model_config: dict[str, Any]) -> dict[str, Any]:
    """The bundle's ``llm/config.json`` describes the model it was made from; raises naming the first field that does
    not."""
    bundled = read_json(bundle / "llm" / "config.json")
    ours = _model_facts(model_config)
    theirs = _model_facts({**bundled, "rope_parameters": bundled.get("rope_scaling") or {}})
    for field, value in ours.items():
        if theirs[field] != value:
            raise StageError(f"the Edge-LLM bundle's config.json says {field} = {theirs[field]}, the model has {value}")
    return {"fields": sorted(ours), "edgellm_version": bundled.get("edgellm_version")}


def export_bundle(quantized_dir: Path, work: Path, keep_checkpoint: bool = False) -> BundleExport:
    """Checkpoint, export and check; returns the metrics the stage records. The unified checkpoint (written into
    ``work`` for the exporter) is removed once the bundle is checked unless ``keep_checkpoint``: it holds the quantized
    folder's numbers again, and :func:`write_unified_checkpoint` makes it again from that folder."""
    checkpoint, bundle = work / "checkpoint", work / "bundle"
    meta = quantization_meta(quantized_dir)
    if meta is not None:
        plan = meta.plan or {}
        check_mixed_plan([*(name for points in plan.values() for name in points.values()), meta.lm_head or "fp16"])
    summary = write_unified_checkpoint(quantized_dir, checkpoint)
    arguments = exporter_arguments(summary.quant_algo)
    seconds = run_export(checkpoint, bundle, work / "export.log", arguments)
    custody = check_custody(quantized_dir, bundle, work)
    config = check_bundle_config(bundle, json.loads((Path(quantized_dir) / "config.json").read_text(encoding="utf-8")))
    if config["edgellm_version"] != EDGELLM_VERSION:
        raise StageError(
            f"the bundle was written by Edge-LLM {config['edgellm_version']}, this toolkit pins {EDGELLM_VERSION}"
        )
    log.info("Edge-LLM bundle: %s, %d tensors compared, all equal; config.json matches the model", summary.quant_algo,
             len(custody["compared"]))
    checkpoint_bytes = path_size(checkpoint)
    if not keep_checkpoint:
        shutil.rmtree(checkpoint)
    return {"checkpoint": summary.to_json(), "checkpoint_bytes": checkpoint_bytes, "checkpoint_kept": keep_checkpoint,
            "bundle_bytes": path_size(bundle),
            "export_seconds": round(seconds, 1), "edgellm_version": EDGELLM_VERSION, "exporter_arguments": arguments,
            "custody": {"tensors_compared": len(custody["compared"]), "mismatches": 0,
                        "int4_plugin_version": custody["int4_plugin_version"], "config_fields": config["fields"],
                        "kernel_nodes_checked": len(custody["kernel_nodes"])}}
