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

    def block(self, index: int) -> dict[str, list[str]]:
        """Block ``index``'s quantized points by format."""
        by_format: dict[str, list[str]] = {}
        for point, name in self.formats.get(index, {}).items():
            if name != FLOAT:
                by_format.setdefault(name, []).append(point)
        return by_format

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
