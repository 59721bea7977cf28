"""Mixed precision: a format for each group of linears, chosen by measured sensitivity against a latency cost.

The unit of choice is an activation point of a block (:class:`~compress.models.families.ActivationPoint`):
the linears reading one input share its format, so q/k/v share one, gate/up share one, o_proj and
down_proj have their own. That is also what a deployment needs: Edge-LLM fuses q/k/v and gate/up
into one GEMM behind one activation quantizer, and Model Optimizer's export wants one format per
fused group. The LM head is a group of its own (``HEAD`` at block ``HEAD_INDEX``), quantized on the
last block's outputs and shipped untied from the embedding table
(:func:`compress.transforms.quantize.decoder.quantize_head`).

* :class:`MixedPlan` says which format each point of each block ships in ("fp16" or a precision
  name); :func:`compress.transforms.quantize.decoder.quantize_model` quantizes a block point by
  point under it, each format with its own method (SmoothQuant + GPTQ for INT8 and FP8, AWQ + GPTQ
  for INT4 and NVFP4).
* :func:`output_fisher` measures how much each linear's output matters to the model's prediction:
  the diagonal Fisher information of the next-token distribution per output channel, from one
  backward pass over calibration windows with labels sampled from the model itself.
* :func:`sensitivity` quantizes every block once per candidate format (on a copy, fed float inputs)
  and turns each linear's output error into the KL divergence it adds, ``0.5 * sum_c F_c * mse_c``
  per token, summed over the point's linears.
* :func:`choices_from` turns the table into each group's options (format, predicted KL, cost) for the knapsack
  (:mod:`compress.algorithms.knapsack`) the search loop (:mod:`compress.pipeline.plan_search`) solves.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from compress.algorithms.knapsack import Choice
from compress.models.compute import Rebuild, computed_in_float32
from compress.models.families import decoder_blocks, family_of
from compress.models.weights import module_prefix
from compress.transforms.quantize.config import QuantizeConfig
from compress.transforms.quantize.decoder import LmHead, lm_head_of, quantize_block, quantize_head
from compress.transforms.quantize.plan import FLOAT, HEAD, HEAD_INDEX, MixedPlan
from compress.transforms.walk import BlockInputs, BlockVisitor, HeldBlocks, StreamedBlocks, walk_blocks

__all__ = [
    "FLOAT",
    "HEAD",
    "HEAD_INDEX",
    "MixedPlan",
    "SensitivityJob",
    "SensitivityTable",
    "choices_from",
    "output_fisher",
    "sensitivity",
]


@dataclass
class SensitivityTable:
    """Per block and point, the predicted KL each candidate format adds (``FLOAT`` adds none)."""

    kl: dict[tuple[int, str], dict[str, float]] = field(default_factory=dict)

    def add(self, index: int, point: str, name: str, value: float) -> None:
        self.kl.setdefault((index, point), {FLOAT: 0.0})[name] = value

    def to_json(self) -> list[dict[str, Any]]:
        return [{"block": index, "point": point, "kl": {name: round(value, 8) for name, value in values.items()}}
                for (index, point), values in sorted(self.kl.items())]


def output_fisher(model, windows: torch.Tensor, linears: Sequence[str], rebuilt: dict[str, Rebuild] | None = None,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """The diagonal Fisher information of each named linear's output channels, per token.

    One forward and backward pass per window of ``model`` (held in its own dtype, computed in float32
    part by part), the loss being the log-likelihood of next tokens sampled from the model's own
    distribution, so its squared gradient is an unbiased estimate of the Fisher information. The backward pass computes
    each block again from its inputs when it reaches it: it holds one block's activations, whatever the depth. It
    computes on the model's device; the labels are drawn on the CPU, so every device draws the same ones.
    """
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    sums: dict[str, torch.Tensor | None] = {name: None for name in linears}
    tokens = 0
    handles = []

    def add_squared(name: str, grad: torch.Tensor) -> None:
        squared = grad[0].pow(2).sum(0).detach()
        sums[name] = squared if sums[name] is None else sums[name] + squared

    def keep(name: str) -> Callable:
        def hook(_module, _args, output):
            if (
                output.requires_grad
            ):  # summed as the backward pass reaches it, never held (a recomputed block's copy is not)
                output.register_hook(lambda grad: add_squared(name, grad))
        return hook

    def differentiate_from_here(_module, _args, output):
        output.requires_grad_()

    for name in linears:
        handles.append(model.get_submodule(name).register_forward_hook(keep(name)))
    # gradients flow from the embeddings' output on, never into a weight: no weight's gradient is ever held
    handles.append(model.get_input_embeddings().register_forward_hook(differentiate_from_here))
    trainable = [p for p in model.parameters() if p.requires_grad]
    for parameter in trainable:
        parameter.requires_grad_(False)
    try:
        with computed_in_float32(model, rebuilt, recompute_blocks=True), torch.enable_grad():
            for row in windows:
                logits = model(row[None].to(device), use_cache=False).logits.float()[0, :-1]
                log_probs = torch.log_softmax(logits, dim=-1)
                labels = torch.multinomial(log_probs.detach().exp().cpu(), 1, generator=generator)[:, 0].to(device)
                log_probs.gather(1, labels[:, None]).sum().backward()
                tokens += logits.shape[0]
                del logits, log_probs
    finally:
        for handle in handles:
            handle.remove()
        for parameter in trainable:
            parameter.requires_grad_(True)
    return {name: (total / tokens).cpu() for name, total in sums.items()}


@dataclass(frozen=True)
class SensitivityJob:
    """What :func:`sensitivity` measures: each candidate format's config, which (block, point, format) are admitted, the
    output Fisher information weighing each linear's error, and the LM head to measure (``None``: the model's own, where
    any format is admitted for it)."""

    candidates: dict[str, QuantizeConfig]
    allowed: Callable[[int, str, str], bool]
    fisher: dict[str, torch.Tensor]
    head: LmHead | None = None


class _Sensitivity(BlockVisitor):
    """Quantizes a copy of each block once per candidate format and records the KL each point would add."""

    def __init__(self, model, job: SensitivityJob, table: SensitivityTable, head: LmHead | None) -> None:
        self.model_config = model.config
        self.last = len(decoder_blocks(model)) - 1
        self.head = head
        self.family = family_of(model.config)
        self.prefix = module_prefix(model, decoder_blocks(model))
        self.candidates = job.candidates
        self.allowed = job.allowed
        self.fisher = job.fisher
        self.table = table

    def visit(self, index: int, block, inputs: BlockInputs) -> None:
        for name, config in self.candidates.items():
            points = [p.name for p in self.family.points if self.allowed(index, p.name, name)]
            if not points:
                continue
            trial = copy.deepcopy(block)
            quantized = quantize_block(
                trial, inputs, config, self.model_config, f"{self.prefix}.{index}", points=points
            )
            del trial
            for point in points:
                kl = 0.0
                for linear in self.family.point(point).consumers:
                    full = f"{self.prefix}.{index}.{linear}"
                    quant = quantized.get(full)
                    if quant is not None and quant.output_mse is not None:
                        kl += 0.5 * float((self.fisher[full].to(quant.output_mse.device) * quant.output_mse).sum())
                self.table.add(index, point, name, kl)

    def after(self, index: int, block, inputs: BlockInputs, outputs: list[torch.Tensor]) -> None:
        if index != self.last or self.head is None:
            return
        for name, config in self.candidates.items():
            if self.allowed(HEAD_INDEX, HEAD, name):
                quant = quantize_head(self.head, outputs, config)
                fisher = self.fisher[self.head.name].to(quant.output_mse.device)
                self.table.add(HEAD_INDEX, HEAD, name, 0.5 * float((fisher * quant.output_mse).sum()))


def sensitivity(model, windows: torch.Tensor, job: SensitivityJob, device: torch.device | str | None = None,
                progress: bool = False, blocks: HeldBlocks | StreamedBlocks | None = None) -> SensitivityTable:
    """The predicted KL of every (block, point, candidate format) that ``job.allowed`` admits (see the module
    docstring), and of the LM head, as ``(HEAD_INDEX, HEAD)``, in each format it admits for it (``job.fisher`` must then
    hold its output's)."""
    table = SensitivityTable()
    for index, _ in enumerate(decoder_blocks(model)):
        for point in family_of(model.config).points:
            table.kl.setdefault((index, point.name), {FLOAT: 0.0})
    head = None
    if any(job.allowed(HEAD_INDEX, HEAD, name) for name in job.candidates):
        table.kl[(HEAD_INDEX, HEAD)] = {FLOAT: 0.0}
        head = job.head or lm_head_of(model)
    walk_blocks(model, windows, [_Sensitivity(model, job, table, head)], device=device, progress=progress,
                desc="sensitivity", blocks=blocks)
    return table


def choices_from(
    table: SensitivityTable, cost: Callable[[int, str, str], float]
) -> dict[tuple[int, str], list[Choice]]:
    """Every group's options: each measured format with its predicted KL and its cost."""
    return {group: [Choice(name, kl, cost(group[0], group[1], name)) for name, kl in values.items()]
            for group, values in table.kl.items()}
