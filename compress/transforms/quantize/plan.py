"""A mixed-precision plan: the format each activation point of each block ships in (see :mod:`.mixed`)."""

from __future__ import annotations

from dataclasses import dataclass

from compress.transforms.quantize.config import QuantizeConfig

FLOAT = "fp16"


@dataclass(frozen=True)
class MixedPlan:
    """The format of every activation point of every block (``FLOAT`` or a candidate format), and each format's config."""

    formats: dict[int, dict[str, str]]
    configs: dict[str, QuantizeConfig]

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

    def block_formats(self) -> set[str]:
        """Every format a point is quantized in (none: the plan leaves the model float)."""
        return {name for points in self.formats.values() for name in points.values() if name != FLOAT}

    def counts(self) -> dict[str, int]:
        """How many points ship in each format."""
        counts: dict[str, int] = {}
        for points in self.formats.values():
            for name in points.values():
                counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items()))

    def to_json(self) -> dict[str, dict[str, str]]:
        return {str(index): dict(points) for index, points in sorted(self.formats.items())}
