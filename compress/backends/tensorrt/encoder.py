"""An encoder's TensorRT engine behind :class:`~compress.backends.onnx.encoder.OnnxEncoder`'s API."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from compress.backends.onnx.encoder import OnnxEncoder
from compress.backends.tensorrt.session import EngineSession


class TrtEncoder(OnnxEncoder):
    """The same API on the run's TensorRT engine (built on the device); tokenizer and labels from the exported
    folder."""

    backend = "tensorrt"

    def __init__(self, folder: Path, engine_path: Path, host_code_allowed: bool = False) -> None:
        self.engine = EngineSession(engine_path, host_code_allowed)
        self._setup(folder, list(self.engine.inputs), self.engine.outputs[0])

    def _forward(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        outputs = self.engine.run(feed)
        return outputs[self.output].to_host(self.engine.stream).astype(np.float32)
