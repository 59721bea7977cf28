"""``compress predict``: latency, memory and energy of a decoder config on a target, without weights."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from compress.algorithms.formats import PRECISIONS
from compress.core.config import load_target, parse_override_value, select_power_mode
from compress.core.errors import UsageError
from compress.eval.perf_model import (
    KV_CACHE_ELEMENT_BYTES,
    Lengths,
    ModelShape,
    Storage,
    lowest_power_mode_meeting_budget,
    mode_tops,
    predict_all_modes,
)
from compress.models.config_file import ModelConfig
from compress.models.families import check_model_dimensions

PREDICT_KEYS = ("target", "model_config", "precision", "power", "prompt_len", "context", "group_size", "kv_cache")


def read_model_config(path: str | Path) -> dict[str, Any]:
    """A Hugging Face ``config.json`` (or the folder holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(f"model config not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is not a JSON config: {exc}") from exc


def _positive_int(pairs: dict[str, str], key: str) -> int | None:
    if key not in pairs:
        return None
    value = parse_override_value(pairs[key])
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"{key}={pairs[key]!r}: expected a positive integer")
    return value


def predict_command(pairs: dict[str, str]) -> dict[str, Any]:
    """The JSON printed by ``compress predict``."""
    unknown = sorted(set(pairs) - set(PREDICT_KEYS))
    if unknown:
        raise UsageError(f"unknown key {unknown[0]!r} (known: {', '.join(PREDICT_KEYS)})")
    for required in ("target", "model_config"):
        if required not in pairs:
            raise UsageError(f"missing {required}=")
    target = load_target(pairs["target"])
    config = read_model_config(pairs["model_config"])
    check_model_dimensions(config, f"model_config={pairs['model_config']}")
    shape = ModelShape.from_config(ModelConfig(config))
    precision = pairs.get("precision", "fp16")
    if precision not in PRECISIONS:
        raise UsageError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
    kv_cache = pairs.get("kv_cache", "fp16")
    if kv_cache not in KV_CACHE_ELEMENT_BYTES:
        raise UsageError(f"kv_cache={kv_cache!r}: expected one of {', '.join(KV_CACHE_ELEMENT_BYTES)}")
    if kv_cache == "fp8":
        mode_tops(target, target.power_mode(), "fp8")  # refuses a target without FP8, naming its precisions
    shape = replace(shape, kv_cache_bytes=KV_CACHE_ELEMENT_BYTES[kv_cache])
    lengths = Lengths(_positive_int(pairs, "prompt_len"), _positive_int(pairs, "context"))
    storage = Storage(group_size=_positive_int(pairs, "group_size") or 128)
    modes = predict_all_modes(target, shape, precision, lengths, storage)
    result: dict[str, Any] = {
        "target": target.name,
        "precision": precision,
        "kv_cache": kv_cache,
        "parameters": shape.total_params(),
        "budgets": target.budgets.model_dump(),
        "modes": [m.to_json() for m in modes],
    }
    if "power" in pairs:
        mode = select_power_mode(target, pairs["power"])
        result["selected"] = next(m.to_json() for m in modes if m.power_mode == mode.name)
    else:
        best = lowest_power_mode_meeting_budget(modes, target.budgets.max_decode_latency_ms)
        result["lowest_power_mode_meeting_latency_budget"] = best.to_json() if best else None
    return result
