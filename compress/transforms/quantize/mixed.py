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
* :func:`solve` picks the assignment of least cost (predicted decode milliseconds, which the
  caller supplies) whose predicted KL stays within a budget: a multiple-choice knapsack, solved
  exactly by dynamic programming over the budget in small steps (each KL rounded up, so the plan
  is within budget in the true figures too). Where a deployment cannot hold some formats side by side,
  :func:`solve_apart` solves within each set of formats it can and keeps the cheapest plan.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compress.core.errors import StageError
from compress.models.compute import computed_in_float32
from compress.models.families import decoder_blocks, family_of
from compress.models.weights import module_prefix
from compress.transforms.quantize.config import QUANTIZE_CONFIG, QuantizeConfig
from compress.transforms.quantize.decoder import LmHead, lm_head_of, quantize_block, quantize_head
from compress.transforms.quantize.plan import FLOAT, HEAD, HEAD_INDEX, MixedPlan
from compress.transforms.walk import BlockInputs, BlockVisitor, HeldBlocks, StreamedBlocks, walk_blocks

__all__ = ["FLOAT", "HEAD", "HEAD_INDEX", "Candidate", "Choice", "MixedPlan", "SensitivityTable", "candidate_configs", "choices_from",
           "output_fisher", "search", "sensitivity", "solve", "solve_apart"]
# Each candidate format's method and options (the shared calibration options are added by the caller).
CANDIDATE_METHODS: dict[str, dict[str, Any]] = {
    "int8": {"method": "int8", "alpha": "auto", "weight_algorithm": "gptq", "hadamard_block": 0},
    "int4": {"method": "int4", "group_size": 128, "algorithm": "awq+gptq"},
    "fp8": {"method": "fp8", "alpha": "auto", "weight_algorithm": "gptq", "fp8_weight_scale": "tensor"},
    "nvfp4": {"method": "nvfp4", "activations": "nvfp4"},
    "nvfp4_a16": {"method": "nvfp4", "activations": "float"},
}


def candidate_configs(formats: Iterable[str], shared: dict[str, Any]) -> dict[str, QuantizeConfig]:
    """The quantize config of each candidate format, with the ``shared`` calibration options."""
    return {name: QUANTIZE_CONFIG.validate_python({**CANDIDATE_METHODS[name], **shared}) for name in formats}


@dataclass(frozen=True)
class Choice:
    """One way a point of a block may ship: its format, the KL it is predicted to add per token, and what it costs."""

    format: str
    kl: float
    cost: float


@dataclass
class SensitivityTable:
    """Per block and point, the predicted KL each candidate format adds (``FLOAT`` adds none)."""

    kl: dict[tuple[int, str], dict[str, float]] = field(default_factory=dict)

    def add(self, index: int, point: str, name: str, value: float) -> None:
        self.kl.setdefault((index, point), {FLOAT: 0.0})[name] = value

    def to_json(self) -> list[dict[str, Any]]:
        return [{"block": index, "point": point, "kl": {name: round(value, 8) for name, value in values.items()}}
                for (index, point), values in sorted(self.kl.items())]


def output_fisher(model, windows: torch.Tensor, linears: Sequence[str], rebuilt: dict | None = None,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """The diagonal Fisher information of each named linear's output channels, per token.

    One forward and backward pass per window of ``model`` (held in its own dtype, computed in float32
    part by part), the loss being the log-likelihood of next tokens sampled from the model's own
    distribution, so its squared gradient is an unbiased estimate of the Fisher information. The backward pass computes
    each block again from its inputs when it reaches it: it holds one block's activations, whatever the depth. It computes
    on the model's device; the labels are drawn on the CPU, so every device draws the same ones.
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
            if output.requires_grad:  # summed as the backward pass reaches it, never held (a recomputed block's copy is not)
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


class _Sensitivity(BlockVisitor):
    """Quantizes a copy of each block once per candidate format and records the KL each point would add."""

    def __init__(self, model, candidates: dict[str, QuantizeConfig], allowed: Callable[[int, str, str], bool],
                 fisher: dict[str, torch.Tensor], table: SensitivityTable, head: LmHead | None) -> None:
        self.model_config = model.config
        self.last = len(decoder_blocks(model)) - 1
        self.head = head
        self.family = family_of(model.config)
        self.prefix = module_prefix(model, decoder_blocks(model))
        self.candidates = candidates
        self.allowed = allowed
        self.fisher = fisher
        self.table = table

    def visit(self, index: int, block, inputs: BlockInputs) -> None:
        for name, config in self.candidates.items():
            points = [p.name for p in self.family.points if self.allowed(index, p.name, name)]
            if not points:
                continue
            trial = copy.deepcopy(block)
            quantized = quantize_block(trial, inputs, config, self.model_config, f"{self.prefix}.{index}", points=points)
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


def sensitivity(model, windows: torch.Tensor, candidates: dict[str, QuantizeConfig], allowed: Callable[[int, str, str], bool],
                fisher: dict[str, torch.Tensor], device: torch.device | str | None = None, progress: bool = False,
                blocks: HeldBlocks | StreamedBlocks | None = None, head: LmHead | None = None) -> SensitivityTable:
    """The predicted KL of every (block, point, candidate format) that ``allowed`` admits (see the module docstring), and
    of the LM head, as ``(HEAD_INDEX, HEAD)``, in each format ``allowed`` admits for it (``head``: where it comes from, by
    default the model's own; ``fisher`` must then hold its output's)."""
    table = SensitivityTable()
    for index, _ in enumerate(decoder_blocks(model)):
        for point in family_of(model.config).points:
            table.kl.setdefault((index, point.name), {FLOAT: 0.0})
    if any(allowed(HEAD_INDEX, HEAD, name) for name in candidates):
        table.kl[(HEAD_INDEX, HEAD)] = {FLOAT: 0.0}
        head = head or lm_head_of(model)
    else:
        head = None
    walk_blocks(model, windows, [_Sensitivity(model, candidates, allowed, fisher, table, head)], device=device, progress=progress,
                desc="sensitivity", blocks=blocks)
    return table


KL_STEPS = 2000  # the budget's resolution in the knapsack


def solve(choices: dict[tuple[int, str], list[Choice]], budget: float) -> dict[tuple[int, str], Choice]:
    """The choice per group of least total cost whose summed KL stays within ``budget`` (exact over the KL rounded up to
    ``budget / KL_STEPS``); every group must offer a choice of zero KL (its float format), so a solution exists."""
    if budget <= 0:
        return {group: min((c for c in options if c.kl == 0), key=lambda c: c.cost) for group, options in choices.items()}
    unit = budget / KL_STEPS
    groups = list(choices)
    # best[w] = (least cost with total weight exactly <= w so far); keep back-pointers per group.
    best = [0.0] * (KL_STEPS + 1)
    picks: list[list[int]] = []
    for group in groups:
        options = choices[group]
        weights = [math.ceil(c.kl / unit - 1e-9) if c.kl > 0 else 0 for c in options]
        new = [math.inf] * (KL_STEPS + 1)
        pick = [-1] * (KL_STEPS + 1)
        for w in range(KL_STEPS + 1):
            for k, (option, weight) in enumerate(zip(options, weights, strict=True)):
                if weight <= w and best[w - weight] + option.cost < new[w]:
                    new[w] = best[w - weight] + option.cost
                    pick[w] = k
        best = new
        picks.append(pick)
    chosen: dict[tuple[int, str], Choice] = {}
    w = min(range(KL_STEPS + 1), key=lambda i: (best[i], i))
    for group, pick in zip(reversed(groups), reversed(picks), strict=True):
        option = choices[group][pick[w]]
        chosen[group] = option
        w -= math.ceil(option.kl / unit - 1e-9) if option.kl > 0 else 0
    return {group: chosen[group] for group in groups}


@dataclass
class Candidate:
    """A plan the search quantized and measured."""

    round: int
    budget: float
    plan: MixedPlan
    predicted_kl: float
    predicted_cost: float
    measured: dict[str, Any]
    passed: bool
    chosen: bool = False  # the plan the search returned (the fastest that passed)

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "budget_kl": self.budget, "predicted_kl": self.predicted_kl,
                "predicted_cost": self.predicted_cost, "formats": self.plan.counts(), "measured": self.measured,
                "passed": self.passed, "chosen": self.chosen, "plan": self.plan.to_json(), "lm_head": self.plan.head}


# A quantized folder -> (within the budgets?, its figures); the figures may hold "overshoot", how many times over its
# limits the plan measured (the largest ratio of a figure to its limit), which sizes the back-off.
Measure = Callable[[Path], tuple[bool, dict[str, Any]]]
SOLVES_PER_PLAN = 4  # solves (each cheap) the search may spend per measured plan looking for an unmeasured one
BACKOFF_SAFETY = 0.8  # a failed plan's next budget: this share of the budget its overshoot says would have held
Quantize = Callable[[MixedPlan, Path], Any]  # a plan, a folder to write it to -> the quantization result


def choices_from(table: SensitivityTable, cost: Callable[[int, str, str], float]) -> dict[tuple[int, str], list[Choice]]:
    """Every group's options: each measured format with its predicted KL and its cost."""
    return {group: [Choice(name, kl, cost(group[0], group[1], name)) for name, kl in values.items()]
            for group, values in table.kl.items()}


def solve_apart(choices: dict[tuple[int, str], list[Choice]], budget: float,
                format_sets: Sequence[Iterable[str]] | None = None) -> dict[tuple[int, str], Choice]:
    """:func:`solve` where one plan may only use formats of one of ``format_sets`` (those a deployment can hold side by
    side; ``None``: any): solved within each set, the cheapest plan wins (the smaller KL on a tie)."""
    if not format_sets:
        return solve(choices, budget)
    best: dict[tuple[int, str], Choice] | None = None
    for allowed in format_sets:
        kept = {*allowed, FLOAT}
        chosen = solve({group: [c for c in options if c.format in kept] for group, options in choices.items()}, budget)
        key = (sum(c.cost for c in chosen.values()), sum(c.kl for c in chosen.values()))
        if best is None or key < (sum(c.cost for c in best.values()), sum(c.kl for c in best.values())):
            best = chosen
    return best


def search(choices: dict[tuple[int, str], list[Choice]], configs: dict[str, QuantizeConfig], budget: float, rounds: int,
           quantize: Quantize, measure: Measure, work: Path, format_sets: Sequence[Iterable[str]] | None = None,
           refine_rounds: int = 0) -> tuple[Any, Path, list[Candidate]]:
    """The fastest plan the measurement accepts: solve under ``budget`` (within one of ``format_sets``, see
    :func:`solve_apart`), quantize, measure; on a failure shrink the budget (the groups that spend most of it for least
    gain go back to a wider format first) and try again, at most ``rounds`` plans. The budget shrinks in proportion to
    how far over its limits the plan measured (``BACKOFF_SAFETY / overshoot``: the predictions undercount by about that
    much), by half when the measurement does not say; a back-off so deep that nothing would be quantized backs up halfway
    (geometrically) towards the failed budget instead of giving up. A back-off can overshoot: with ``refine_rounds`` more plans the
    search then bisects between the accepted budget and the last failed one, keeping any faster plan that holds.
    Returns the chosen plan's quantization, its folder (under ``work``) and every candidate measured (the chosen one
    marked)."""
    trials = _Trials(choices, configs, quantize, measure, work, format_sets)
    failed_budget: float | None = None  # the smallest budget whose plan failed
    empty_budget = 0.0  # the largest budget whose plan quantizes nothing
    measured = 0
    for _ in range(SOLVES_PER_PLAN * rounds):
        if measured >= rounds:
            break
        outcome = trials.measure_at(budget)
        if outcome is not None:
            measured += 1
            if outcome.passed:
                break
            failed_budget = budget
            budget *= _backoff(outcome.measured)
            continue
        if trials.last_plan_quantizes:  # a plan that failed before
            failed_budget = budget if failed_budget is None else min(failed_budget, budget)
        elif failed_budget is None:  # the first plan quantizes nothing: nothing to search
            break
        else:  # the back-off overshot past every format: back up between the two
            empty_budget = max(empty_budget, budget)
        if failed_budget <= empty_budget * (1 + REFINE_RESOLUTION):
            break
        budget = math.sqrt(empty_budget * failed_budget) if empty_budget else failed_budget / 2
    if trials.chosen is None:
        candidates = trials.candidates
        raise StageError(f"no mixed-precision plan held the budgets in {len(candidates)} measured plans (the last quantized "
                         f"{_describe(candidates[-1]) if candidates else 'nothing'}); use a uniform recipe or a larger margin")
    if failed_budget is not None:
        _refine(trials, budget, failed_budget, refine_rounds)
    chosen = trials.chosen
    chosen.candidate.chosen = True
    return chosen.result, chosen.folder, trials.candidates


REFINE_RESOLUTION = 0.02  # bisection stops when the failed and accepted budgets are this close (relative)


def _refine(trials: _Trials, accepted_budget: float, failed_budget: float, rounds: int) -> None:
    """Bisect between a budget whose plan held and a larger one whose plan did not, for a faster plan that holds: at most
    ``rounds`` plans measured. A plan already measured moves the bound it measured as; one no faster than the chosen plan
    moves the lower bound."""
    low, high = accepted_budget, failed_budget
    measured = 0
    while measured < rounds and high - low > REFINE_RESOLUTION * high:
        middle = (low + high) / 2
        outcome = trials.measure_at(middle, faster_than=trials.chosen.candidate.predicted_cost)
        if outcome is None:
            passed = trials.last_verdict
        else:
            measured += 1
            passed = outcome.passed
        if passed:
            low = middle
        else:
            high = middle


@dataclass
class _Accepted:
    candidate: Candidate
    result: Any
    folder: Path


class _Trials:
    """The plans a search has solved, quantized and measured: each plan measured once, rejected folders removed, the
    fastest accepted one kept."""

    def __init__(self, choices: dict[tuple[int, str], list[Choice]], configs: dict[str, QuantizeConfig], quantize: Quantize,
                 measure: Measure, work: Path, format_sets: Sequence[Iterable[str]] | None) -> None:
        self.choices, self.configs, self.format_sets = choices, configs, format_sets
        self.quantize, self.measure, self.work = quantize, measure, work
        self.candidates: list[Candidate] = []
        self.verdicts: dict[str, bool] = {}  # a plan's key -> whether it held
        self.chosen: _Accepted | None = None
        self.last_plan_quantizes = True
        self.last_verdict = False
        self.attempts = 0

    def measure_at(self, budget: float, faster_than: float | None = None) -> Candidate | None:
        """Solve under ``budget`` and measure the plan; ``None`` when it quantizes nothing, was measured before (then
        ``last_verdict`` says how it measured) or is predicted no faster than ``faster_than`` (then it counts as held)."""
        self.attempts += 1
        chosen = solve_apart(self.choices, budget, self.format_sets)
        plan = MixedPlan.from_groups({group: choice.format for group, choice in chosen.items()}, self.configs)
        key = json.dumps([plan.to_json(), plan.head], sort_keys=True)
        cost = sum(c.cost for c in chosen.values())
        self.last_plan_quantizes = bool(plan.quantized_formats())
        if not self.last_plan_quantizes or key in self.verdicts or (faster_than is not None and cost >= faster_than):
            self.last_verdict = self.verdicts.get(key, True)
            return None
        folder = self.work / f"candidate-{self.attempts}"
        result = self.quantize(plan, folder)
        passed, figures = self.measure(folder)
        candidate = Candidate(self.attempts, budget, plan, sum(c.kl for c in chosen.values()), cost, figures, passed)
        self.candidates.append(candidate)
        self.verdicts[key] = passed
        if passed and (self.chosen is None or cost < self.chosen.candidate.predicted_cost):
            if self.chosen is not None:
                shutil.rmtree(self.chosen.folder)
            self.chosen = _Accepted(candidate, result, folder)
        else:
            shutil.rmtree(folder)
        return candidate


def _backoff(figures: dict[str, Any]) -> float:
    """The factor a failed plan's budget is multiplied by (always below one)."""
    overshoot = figures.get("overshoot")
    if overshoot is None or not math.isfinite(overshoot) or overshoot <= 1.0:
        return 0.5
    return BACKOFF_SAFETY / overshoot


def _describe(candidate: Candidate) -> str:
    return ", ".join(f"{count} groups {name}" for name, count in candidate.plan.counts().items())
