"""How to decode: the options every generator takes, checked once."""

from __future__ import annotations

from dataclasses import dataclass, replace

from compress.core.errors import UsageError


@dataclass(frozen=True)
class GenerationOptions:
    """How to decode."""

    max_new_tokens: int = 64
    greedy: bool = True
    temperature: float = 0.7
    top_k: int = 50
    top_p: float = 0.9
    seed: int | None = None
    stop: tuple[str, ...] = ()
    chat: bool = True


def parse_options(options: dict) -> GenerationOptions:
    """The :class:`GenerationOptions` of a generator call's keyword arguments; an unknown one is a usage error."""
    unknown = set(options) - set(GenerationOptions.__dataclass_fields__)
    if unknown:
        raise UsageError(f"unknown generation option {sorted(unknown)[0]!r}")
    if "stop" in options and isinstance(options["stop"], str):
        options = {**options, "stop": (options["stop"],)}
    return replace(GenerationOptions(), **{k: tuple(v) if k == "stop" else v for k, v in options.items()})
