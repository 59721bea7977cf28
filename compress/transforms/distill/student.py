"""Building a smaller student from a teacher (Minitron-style depth and width pruning), and sizing it without weights.

Drop whole decoder layers that change their input least (block influence, ``1 - cos(h_in, h_out)``
on calibration text, scored through the shared block walker), narrow the MLP to the intermediate
channels with the largest mean activation ``|act(gate) * up|``, and optionally prune query heads
with :mod:`compress.transforms.prune.heads`. The result loads with plain transformers.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch
import torch.nn.functional as F

from compress.core.errors import UsageError
from compress.models.config_file import ModelConfig
from compress.models.families import attention_geometry, decoder_blocks, decoder_shape, family_of
from compress.models.surgery import drop_layers, narrow_mlp, prune_heads
from compress.transforms.distill.config import DistillConfig
from compress.transforms.prune.heads import head_importance, plan_heads
from compress.transforms.walk import BlockInputs, BlockVisitor, walk_blocks


class StudentShape(TypedDict):
    """The student's depth, MLP width and query heads."""

    num_layers: int
    intermediate_size: int
    num_attention_heads: int


class BuiltStudent(TypedDict):
    """What pruning the teacher to the student's shape kept: layers, their influence scores, heads per layer."""

    kept_layers: list[int]
    layer_influence: list[float]
    heads_kept: list[list[int]] | None


class StudentPlan(TypedDict):
    """The student and its training's memory, from the teacher's config alone (``--dry-run``)."""

    teacher_parameters: int
    student_shape: StudentShape
    student_parameters: int
    gpus: int
    distributed: bool
    memory_per_gpu_gb: float
    fits: bool | None
    launch: str



def decoder_parameters(cfg: dict[str, Any], layers: int | None = None, intermediate: int | None = None,
                       heads: int | None = None) -> int:
    """Parameters of a decoder config with optional new depth, MLP width and query heads."""
    shape = decoder_shape(cfg)
    hidden = shape.hidden
    heads = heads or shape.heads
    layers = layers or shape.layers
    intermediate = intermediate or shape.intermediate
    attention = hidden * shape.head_dim * (2 * heads + 2 * shape.kv_heads)
    mlp = 3 * hidden * intermediate
    embed = shape.vocab * hidden * (1 if shape.tied else 2)
    return layers * (attention + mlp + 2 * hidden) + embed + hidden


def student_shape(cfg: ModelConfig, config: DistillConfig) -> StudentShape:
    """The student's depth, MLP width and query heads for the configured goal."""
    n_heads, kv, _ = attention_geometry(cfg)
    if config.target_parameters is None and config.target_fraction is None:
        heads = kv * config.heads_per_group if config.heads_per_group else n_heads
        shape = {
            "num_layers": config.num_layers or cfg["num_hidden_layers"],
            "intermediate_size": config.intermediate_size or cfg["intermediate_size"],
            "num_attention_heads": heads,
        }
        _check_not_larger(shape, cfg)
        return shape
    target = config.target_parameters or config.target_fraction * decoder_parameters(cfg)
    floor = _round64(cfg["intermediate_size"] * config.min_width_fraction)
    # Width first (Minitron found width pruning cheaper to recover), down to min_width_fraction; then depth.
    for layers in range(cfg["num_hidden_layers"], 0, -1):
        per_channel = layers * 3 * cfg["hidden_size"]
        rest = decoder_parameters(cfg, layers, 1) - per_channel
        width = _round64_down((target - rest) / per_channel) if target > rest else 0
        if width >= floor:
            return {
                "num_layers": layers,
                "intermediate_size": min(width, cfg["intermediate_size"]),
                "num_attention_heads": n_heads,
            }
    raise UsageError(
        f"target of {target:,.0f} parameters is below what one layer at {config.min_width_fraction:.0%} MLP width gives"
    )


def _check_not_larger(shape: dict[str, int], cfg: dict[str, Any]) -> None:
    teacher = {"num_layers": cfg["num_hidden_layers"], "intermediate_size": cfg["intermediate_size"],
               "num_attention_heads": cfg["num_attention_heads"]}
    larger = [f"{key} {shape[key]} > {teacher[key]}" for key in teacher if shape[key] > teacher[key]]
    if larger:
        raise UsageError(f"the student cannot be larger than the teacher: {', '.join(larger)}")


def _round64(value: float) -> int:
    return max(64, int(round(value / 64)) * 64)


def _round64_down(value: float) -> int:
    return max(0, int(value // 64) * 64)


class _BlockInfluence(BlockVisitor):
    """The walker's visitor that scores each block by how much it changes its input."""

    def __init__(self) -> None:
        self.scores: list[float] = []

    def after(self, index: int, block, inputs: BlockInputs, outputs: list[torch.Tensor]) -> None:
        cos = [
            F.cosine_similarity(a.flatten(0, 1), b.flatten(0, 1), dim=-1).mean()
            for a, b in zip(inputs.hidden, outputs, strict=True)
        ]
        self.scores.append(float(1 - torch.stack(cos).mean()))


def layer_influence(model, windows: torch.Tensor, device: torch.device | str | None = None) -> list[float]:
    """Block influence per layer: ``1 - mean cos(input, output)`` of its hidden states (higher = more important)."""
    influence = _BlockInfluence()
    walk_blocks(model, windows, [influence], device=device)
    return influence.scores


def mlp_channel_importance(model, windows: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, mean ``|act(gate(x)) * up(x)|`` of every intermediate channel (the MLP output projection's input)."""
    output = family_of(model.config).mlp_output
    sums = [
        torch.zeros(block.get_submodule(output).in_features, dtype=torch.float64) for block in decoder_blocks(model)
    ]
    handles = []
    for index, block in enumerate(decoder_blocks(model)):
        def hook(_module, args, index=index):
            sums[index] += args[0].detach().abs().reshape(-1, args[0].shape[-1]).sum(dim=0).double()
        handles.append(block.get_submodule(output).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for row in windows:
                model(row[None], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return sums


def build_student(
    model, windows: torch.Tensor, shape: StudentShape, device: torch.device | str | None = None
) -> BuiltStudent:
    """Prune ``model`` in place to ``shape`` (the layers scored on ``device``); returns what was kept and the scores."""
    influence = layer_influence(model, windows, device)
    order = sorted(range(len(influence)), key=lambda i: -influence[i])
    kept_layers = sorted(order[: shape["num_layers"]])
    drop_layers(model, kept_layers)
    width = shape["intermediate_size"]
    if width < model.config.intermediate_size:
        narrow_mlp(model, mlp_channel_importance(model, windows), width)
    heads, kv, _ = attention_geometry(model.config)
    head_plan = None
    if shape["num_attention_heads"] < heads:
        scores = head_importance(model, windows[: max(1, len(windows) // 2)], "taylor")
        head_plan = plan_heads(scores, kv, shape["num_attention_heads"] // kv)
        prune_heads(model, head_plan)
    return {"kept_layers": kept_layers, "layer_influence": [round(v, 5) for v in influence], "heads_kept": head_plan}


def plan_from_config(
    cfg: ModelConfig, config: DistillConfig, gpus: int | None = None, gpu_memory_gb: float | None = None
) -> StudentPlan:
    """Student shape, parameter counts, memory per GPU under FSDP, and the launch command, from a config alone."""
    shape = student_shape(cfg, config)
    with torch.device("meta"):
        from transformers import AutoConfig, AutoModelForCausalLM

        student_cfg = AutoConfig.for_model(**{**cfg, "num_hidden_layers": shape["num_layers"],
                                              "intermediate_size": shape["intermediate_size"],
                                              "num_attention_heads": shape["num_attention_heads"],
                                              "head_dim": attention_geometry(cfg)[2]})
        student = AutoModelForCausalLM.from_config(student_cfg)
    student_params = sum(p.numel() for p in student.parameters())
    teacher_params = decoder_parameters(cfg)
    gpus = gpus or config.processes
    bytes_param = 2 if config.precision == "bf16" else 4
    # Per student parameter: weights + gradients at training precision, fp32 master copy (bf16 only) and
    # two fp32 Adam moments; the frozen teacher holds weights only. FSDP shards all of it across GPUs.
    student_bytes = student_params * (2 * bytes_param + (4 if config.precision == "bf16" else 0) + 8)
    teacher_bytes = teacher_params * bytes_param
    activations = (
        config.seq_len
        * cfg["hidden_size"]
        * shape["num_layers"]
        * bytes_param
        * (2 if config.activation_checkpointing else 34)
    )
    logits = 3 * config.seq_len * cfg["vocab_size"] * 4  # student, teacher and softmax buffers, fp32
    micro_batch = max(1, config.batch_size // gpus // config.grad_accumulation)
    per_gpu = (student_bytes + teacher_bytes) / gpus + micro_batch * (activations + logits)
    return {
        "teacher_parameters": teacher_params,
        "student_shape": shape,
        "student_parameters": student_params,
        "gpus": gpus,
        "distributed": config.distributed,
        "memory_per_gpu_gb": round(per_gpu / 1e9, 2),
        "fits": None if gpu_memory_gb is None else per_gpu / 1e9 <= gpu_memory_gb,
        "launch": f"torchrun --standalone --nproc_per_node={gpus} -m compress.transforms.distill.worker --job JOB.json",
    }
