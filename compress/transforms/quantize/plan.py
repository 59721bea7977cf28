"""A mixed-precision plan: the format each activation point of each block ships in, and the LM head's (see
:mod:`.mixed`)."""

from __future__ import annotations

from dataclasses import dataclass

from compress.transforms.quantize.config import QuantizeConfig

FLOAT = "fp16"
# the LM head's group: its point name, at block index HEAD_INDEX, in a sensitivity table and a solution
HEAD = "lm_head"
HEAD_INDEX = -1


@dataclass(frozen=True)
class MixedPlan:
    """The format of every activation point of every block (``FLOAT`` or a candidate format), the LM head's, and each
    format's config."""

    formats: dict[int, dict[str, str]]
    configs: dict[str, QuantizeConfig]
    head: str = FLOAT

    @classmethod
    def from_groups(cls, chosen: dict[tuple[int, str], str], configs: dict[str, QuantizeConfig]) -> MixedPlan:
        """A plan from a format per group, keyed ``(block, point)``, the head as ``(HEAD_INDEX, HEAD)``."""
        formats: dict[int, dict[str, str]] = {}
        head = FLOAT
        for (index, point), name in chosen.items():
            if (index, point) == (HEAD_INDEX, HEAD):
                head = name
            else:
                formats.setdefault(index, {})[point] = name
        return cls(formats, configs, head)

    def block_runs(self, index: int, point_order: list[str]) -> list[tuple[str, list[str]]]:
        """Block ``index``'s quantized points as runs of one format, in ``point_order`` (the family's points).

        A point's migration scales fold into the linear producing its input (v_proj for o_proj, up_proj for down_proj),
        which another point consumes: that linear must not be quantized yet, or its saved levels would miss the fold.
        A family lists the points whose producer is a linear first, so taking the runs in its order keeps every fold
        ahead of the quantization of what it touches."""
        runs: list[tuple[str, list[str]]] = []
        points = self.formats.get(index, {})
        for point in point_order:
            name = points.get(point, FLOAT)
            if name == FLOAT:
                continue
            if runs and runs[-1][0] == name:
                runs[-1][1].append(point)
            else:
                runs.append((name, [point]))
        return runs

    def quantized_formats(self) -> set[str]:
        """Every format a group (a point or the head) is quantized in (none: the plan leaves the model float)."""
        names = {name for points in self.formats.values() for name in points.values()} | {self.head}
        return names - {FLOAT}

    def counts(self) -> dict[str, int]:
        """How many groups ship in each format: the points, and the head where it is quantized."""
        counts: dict[str, int] = {}
        head = [self.head] if self.head != FLOAT else []
        for name in [*(n for points in self.formats.values() for n in points.values()), *head]:
            counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items()))

    def to_json(self) -> dict[str, dict[str, str]]:
        """Per block (by index) each point's format (the head's is :attr:`head`, recorded beside it)."""
        return {str(index): dict(points) for index, points in sorted(self.formats.items())}
