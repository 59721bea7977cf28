"""The multiple-choice knapsack a mixed-precision plan is solved by: one option per group, least total cost, summed
weight (predicted KL) within a budget.

Solved exactly by dynamic programming over the budget in ``KL_STEPS`` steps, each option's KL rounded *up* to a step,
so a plan within budget in steps is within budget in the true figures too.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

KL_STEPS = 2000  # the budget's resolution


@dataclass(frozen=True)
class Choice:
    """One way a group may ship: its format, the KL it is predicted to add per token, and what it costs."""

    format: str
    kl: float
    cost: float


Choices = dict[Hashable, list[Choice]]


def solve(choices: Choices, budget: float) -> dict[Hashable, Choice]:
    """The choice per group of least total cost whose summed KL stays within ``budget``; every group must offer a choice
    of zero KL (its float format), so a solution exists."""
    if budget <= 0:
        return {
            group: min((c for c in options if c.kl == 0), key=lambda c: c.cost) for group, options in choices.items()
        }
    unit = budget / KL_STEPS
    groups = list(choices)
    best = [0.0] * (KL_STEPS + 1)  # best[w]: the least cost so far with total weight at most w
    picks: list[list[int]] = []  # per group, the option picked at each weight (back-pointers)
    for group in groups:
        best, pick = _add_group(best, choices[group], unit)
        picks.append(pick)
    chosen: dict[Hashable, Choice] = {}
    w = min(range(KL_STEPS + 1), key=lambda i: (best[i], i))
    for group, pick in zip(reversed(groups), reversed(picks), strict=True):
        option = choices[group][pick[w]]
        chosen[group] = option
        w -= _steps(option, unit)
    return {group: chosen[group] for group in groups}


def _steps(option: Choice, unit: float) -> int:
    return math.ceil(option.kl / unit - 1e-9) if option.kl > 0 else 0


def _add_group(best: list[float], options: list[Choice], unit: float) -> tuple[list[float], list[int]]:
    """The table after one more group, and which of its options each weight picked."""
    weights = [_steps(option, unit) for option in options]
    new = [math.inf] * (KL_STEPS + 1)
    pick = [-1] * (KL_STEPS + 1)
    for w in range(KL_STEPS + 1):
        for k, (option, weight) in enumerate(zip(options, weights, strict=True)):
            if weight <= w and best[w - weight] + option.cost < new[w]:
                new[w] = best[w - weight] + option.cost
                pick[w] = k
    return new, pick


def solve_apart(choices: Choices, budget: float, format_sets: Sequence[Iterable[str]] | None = None,
                always: str = "fp16") -> dict[Hashable, Choice]:
    """:func:`solve` where one plan may only use formats of one of ``format_sets`` (those a deployment can hold side by
    side, each with the ``always`` format; ``None``: any): solved within each set, the cheapest plan wins (the smaller
    KL on a tie)."""
    if not format_sets:
        return solve(choices, budget)
    best: dict[Hashable, Choice] | None = None
    for allowed in format_sets:
        kept = {*allowed, always}
        chosen = solve({group: [c for c in options if c.format in kept] for group, options in choices.items()}, budget)
        if best is None or _totals(chosen) < _totals(best):
            best = chosen
    return best


def _totals(chosen: dict[Hashable, Choice]) -> tuple[float, float]:
    return sum(c.cost for c in chosen.values()), sum(c.kl for c in chosen.values())
