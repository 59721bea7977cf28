"""A model's Hugging Face ``config.json`` as one type: what the family table, the Edge-LLM contracts, distillation and
the latency model read a model's facts from."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from compress.core.files import read_json

CONFIG_FILE = "config.json"


class ModelConfig(Mapping[str, Any]):
    """A read-only Hugging Face model config (its keys are the model family's: the family table knows which it reads).

    Built from a mapping (``transformers``' ``config.to_dict()``) or read from a model folder; it is a
    ``Mapping``, so the family table's readers take it as they take the parsed file.
    """

    def __init__(self, values: Mapping[str, Any]):
        self._values = dict(values)

    @classmethod
    def read(cls, folder: Path | str) -> ModelConfig:
        """The ``config.json`` of the model folder ``folder``."""
        return cls(read_json(Path(folder) / CONFIG_FILE))

    @classmethod
    def of(cls, model: ModelConfig | Mapping[str, Any] | Path | str) -> ModelConfig:
        """``model`` as a config: itself, a mapping's copy, or a folder's ``config.json``."""
        if isinstance(model, ModelConfig):
            return model
        return cls(model) if isinstance(model, Mapping) else cls.read(model)

    @property
    def model_type(self) -> str | None:
        return self._values.get("model_type")

    def to_json(self) -> dict[str, Any]:
        """A copy to write as JSON."""
        return dict(self._values)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"ModelConfig(model_type={self.model_type!r}, {len(self)} keys)"
