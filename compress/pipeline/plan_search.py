"""The search loop of ``quantize.method=auto``: solve a plan under a KL budget, quantize it, measure it, back off.

The plans come from :func:`compress.algorithms.knapsack.solve_apart` over the options
:func:`compress.transforms.quantize.mixed.choices_from` builds; what quantizing and measuring a plan means is the
caller's (:mod:`compress.pipeline.auto_precision`). Each plan is measured once; rejected plans' folders are removed, the
fastest accepted one is kept.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from compress.algorithms.knapsack import Choice, solve_apart
from compress.core.errors import StageError
from compress.transforms.quantize.config import QuantizeConfig
from compress.transforms.quantize.plan import FLOAT, MixedPlan

# A quantized folder -> (within the budgets?, its figures); the figures may hold "overshoot", how many times over its
# limits the plan measured (the largest ratio of a figure to its limit), which sizes the back-off.
Measure = Callable[[Path], tuple[bool, dict[str, Any]]]
Quantize = Callable[[MixedPlan, Path], Any]  # a plan, a folder to write it to -> the quantization result
SOLVES_PER_PLAN = 4  # solves (each cheap) the search may spend per measured plan looking for an unmeasured one
BACKOFF_SAFETY = 0.8  # a failed plan's next budget: this share of the budget its overshoot says would have held
REFINE_RESOLUTION = 0.02  # bisection stops when the failed and accepted budgets are this close (relative)


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


class Solved(Enum):
    """What solving at one budget came to."""

    MEASURED = "measured"  # a new plan, quantized and measured
    NOTHING_QUANTIZED = "nothing quantized"  # the plan keeps every group float: nothing to measure
    MEASURED_BEFORE = "measured before"  # the same plan as an earlier budget's
    NO_FASTER = "no faster"  # predicted no faster than the plan to beat: not worth measuring


@dataclass(frozen=True)
class Attempt:
    """One budget's outcome: the candidate where one was measured; otherwise whether the plan counts as held (its
    earlier verdict, or held where it was never measured)."""

    solved: Solved
    held: bool
    candidate: Candidate | None = None


@dataclass(frozen=True)
class SearchLimits:
    """How far the search goes: plans measured before giving up, plans spent refining after a back-off, and the sets of
    formats one plan may hold side by side (``None``: any)."""

    rounds: int
    refine_rounds: int = 0
    format_sets: Sequence[Iterable[str]] | None = None


@dataclass(frozen=True)
class SearchResult:
    """The chosen plan's quantization, its folder, and every candidate measured (the chosen one marked)."""

    quantization: Any
    folder: Path
    candidates: list[Candidate]


def search(choices: dict[tuple[int, str], list[Choice]], configs: dict[str, QuantizeConfig], budget: float,
           quantize: Quantize, measure: Measure, work: Path, limits: SearchLimits) -> SearchResult:
    """The fastest plan the measurement accepts: solve under ``budget`` (within one of the limits' format sets),
    quantize, measure; on a failure shrink the budget (the groups that spend most of it for least gain go back to a
    wider format first) and try again, at most ``limits.rounds`` plans. The budget shrinks in proportion to how far over
    its limits the plan measured (``BACKOFF_SAFETY / overshoot``: the predictions undercount by about that much), by
    half when the measurement does not say; a back-off so deep that nothing would be quantized backs up halfway
    (geometrically) towards the failed budget instead of giving up. A back-off can overshoot: with
    ``limits.refine_rounds`` more plans the search then bisects between the accepted budget and the last failed one,
    keeping any faster plan that holds."""
    trials = _Trials(choices, configs, quantize, measure, work, limits.format_sets)
    budget, failed_budget = _back_off_until_held(trials, budget, limits.rounds)
    if trials.chosen is None:
        candidates = trials.candidates
        raise StageError(
            f"no mixed-precision plan held the budgets in {len(candidates)} measured plans (the last quantized "
            f"{_describe(candidates[-1]) if candidates else 'nothing'}); use a uniform recipe or a larger margin"
        )
    if failed_budget is not None:
        _refine(trials, budget, failed_budget, limits.refine_rounds)
    chosen = trials.chosen
    chosen.candidate.chosen = True
    return SearchResult(chosen.quantization, chosen.folder, trials.candidates)


def _back_off_until_held(trials: _Trials, budget: float, rounds: int) -> tuple[float, float | None]:
    """Measure plans under shrinking budgets until one holds (or ``rounds`` are spent); returns the last budget tried
    and the smallest budget whose plan failed."""
    failed_budget: float | None = None
    empty_budget = 0.0  # the largest budget whose plan quantizes nothing
    measured = 0
    for _ in range(SOLVES_PER_PLAN * rounds):
        if measured >= rounds:
            break
        attempt = trials.measure_at(budget)
        if attempt.solved is Solved.MEASURED:
            measured += 1
            if attempt.candidate.passed:
                break
            failed_budget = budget
            budget *= _backoff(attempt.candidate.measured)
            continue
        if attempt.solved is not Solved.NOTHING_QUANTIZED:  # a plan that failed before
            failed_budget = budget if failed_budget is None else min(failed_budget, budget)
        elif failed_budget is None:  # the first plan quantizes nothing: nothing to search
            break
        else:  # the back-off overshot past every format: back up between the two
            empty_budget = max(empty_budget, budget)
        if failed_budget <= empty_budget * (1 + REFINE_RESOLUTION):
            break
        budget = math.sqrt(empty_budget * failed_budget) if empty_budget else failed_budget / 2
    return budget, failed_budget


def _refine(trials: _Trials, accepted_budget: float, failed_budget: float, rounds: int) -> None:
    """Bisect between a budget whose plan held and a larger one whose plan did not, for a faster plan that holds: at
    most ``rounds`` plans measured. A plan already measured moves the bound it measured as; one no faster than the
    chosen plan moves the lower bound."""
    low, high = accepted_budget, failed_budget
    measured = 0
    while measured < rounds and high - low > REFINE_RESOLUTION * high:
        middle = (low + high) / 2
        attempt = trials.measure_at(middle, faster_than=trials.chosen.candidate.predicted_cost)
        measured += attempt.solved is Solved.MEASURED
        if attempt.held:
            low = middle
        else:
            high = middle


@dataclass
class _Accepted:
    candidate: Candidate
    quantization: Any
    folder: Path


class _Trials:
    """The plans a search has solved, quantized and measured: each plan measured once, rejected folders removed, the
    fastest accepted one kept."""

    def __init__(
        self,
        choices: dict[tuple[int, str], list[Choice]],
        configs: dict[str, QuantizeConfig],
        quantize: Quantize,
        measure: Measure,
        work: Path,
        format_sets: Sequence[Iterable[str]] | None,
    ) -> None:
        self.choices, self.configs, self.format_sets = choices, configs, format_sets
        self.quantize, self.measure, self.work = quantize, measure, work
        self.candidates: list[Candidate] = []
        self.verdicts: dict[str, bool] = {}  # a plan's key -> whether it held
        self.chosen: _Accepted | None = None
        self.attempts = 0

    def measure_at(self, budget: float, faster_than: float | None = None) -> Attempt:
        """Solve under ``budget`` and measure the plan, unless it quantizes nothing, was measured before or is predicted
        no faster than ``faster_than``."""
        self.attempts += 1
        chosen = solve_apart(self.choices, budget, self.format_sets, always=FLOAT)
        plan = MixedPlan.from_groups({group: choice.format for group, choice in chosen.items()}, self.configs)
        key = json.dumps([plan.to_json(), plan.head], sort_keys=True)
        cost = sum(c.cost for c in chosen.values())
        if not plan.quantized_formats():
            return Attempt(Solved.NOTHING_QUANTIZED, self.verdicts.get(key, True))
        if key in self.verdicts:
            return Attempt(Solved.MEASURED_BEFORE, self.verdicts[key])
        if faster_than is not None and cost >= faster_than:
            return Attempt(Solved.NO_FASTER, True)
        folder = self.work / f"candidate-{self.attempts}"
        quantization = self.quantize(plan, folder)
        passed, figures = self.measure(folder)
        candidate = Candidate(self.attempts, budget, plan, sum(c.kl for c in chosen.values()), cost, figures, passed)
        self.candidates.append(candidate)
        self.verdicts[key] = passed
        self._keep_if_fastest(candidate, quantization, folder)
        return Attempt(Solved.MEASURED, passed, candidate)

    def _keep_if_fastest(self, candidate: Candidate, quantization: Any, folder: Path) -> None:
        if candidate.passed and (
            self.chosen is None or candidate.predicted_cost < self.chosen.candidate.predicted_cost
        ):
            if self.chosen is not None:
                shutil.rmtree(self.chosen.folder)
            self.chosen = _Accepted(candidate, quantization, folder)
        else:
            shutil.rmtree(folder)


def _backoff(figures: dict[str, Any]) -> float:
    """The factor a failed plan's budget is multiplied by (always below one)."""
    overshoot = figures.get("overshoot")
    if overshoot is None or not math.isfinite(overshoot) or overshoot <= 1.0:
        return 0.5
    return BACKOFF_SAFETY / overshoot


def _describe(candidate: Candidate) -> str:
    return ", ".join(f"{count} groups {name}" for name, count in candidate.plan.counts().items())
