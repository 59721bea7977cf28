"""A decoder engine in TensorRT, stepped like :class:`compress.runtime.onnx_decoder.OnnxDecoder`.

Token ids and the attention mask are numpy arrays, logits come back as float32 numpy; the KV
cache stays on the device between steps (the ``present`` outputs of one step are the ``past``
inputs of the next). A batch of prompts runs as one batch up to the engine's ``max_batch``
(``TextGenerator.generate`` splits a larger one).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from compress.backends.onnx.runtime import DecoderLayout, past_names, present_names
from compress.backends.tensorrt.cuda import DeviceArray
from compress.backends.tensorrt.session import EngineSession


class TrtDecoder:
    """Run a serialized decoder engine step by step."""

    def __init__(self, engine_path: Path, layout: DecoderLayout, host_code_allowed: bool = False) -> None:
        self.session = EngineSession(engine_path, host_code_allowed)
        self.layout = layout
        self._past = past_names(layout.num_layers)
        self._present = present_names(layout.num_layers)
        self.max_batch = max(ranges["input_ids"][2][0] for ranges in self.session.profile_ranges)
        # the longest cache a profile's largest step follows, plus that step's one token (a sliding layer's cache is
        # shorter)
        self.context_length = max(ranges["attention_mask"][2][1] - ranges["input_ids"][2][1] + 1
                                  for ranges in self.session.profile_ranges)

    def empty_past(self, batch: int) -> list[DeviceArray]:
        """An empty cache for ``batch`` sequences (each tensor still has its own device address)."""
        return [
            DeviceArray((batch, self.layout.num_kv_heads[i // 2], 0, self.layout.head_dim), self.session.dtypes[name])
            for i, name in enumerate(self._past)
        ]

    def forward(self, input_ids, attention_mask, past: list[DeviceArray]) -> tuple[np.ndarray, list[DeviceArray]]:
        """One step: new tokens ``(batch, seq)``, the mask over cache and new tokens; returns logits and the grown
        cache."""
        input_ids = np.asarray(input_ids, dtype=np.int64)
        attention_mask = np.asarray(attention_mask, dtype=np.int64)
        past_len = attention_mask.shape[1] - input_ids.shape[1]  # a sliding layer's cache holds fewer
        positions = np.clip(attention_mask.cumsum(-1) - 1, 0, None)[:, past_len:]
        outputs = self.session.run({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": positions,
                                    **dict(zip(self._past, past, strict=True))})
        logits = outputs["logits"].to_host(self.session.stream).astype(np.float32)
        return logits, [outputs[name] for name in self._present]
