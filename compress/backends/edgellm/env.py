"""Where TensorRT Edge-LLM's Python tools live: a virtual environment of their own.

Edge-LLM's exporter pins its own transformers, onnx and numpy, so it is installed beside ours
(``setup.sh`` creates ``.venv-edgellm`` beside ``.venv``) and always run as a subprocess of that
interpreter: by default the ``.venv-edgellm`` next to the environment compress runs in (so an
installed wheel finds it as an editable checkout does). ``$COMPRESS_EDGELLM_PYTHON`` points at
another interpreter that has ``tensorrt-edgellm[export]``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from compress.core.errors import MissingBackendError

EDGELLM_VERSION = "0.11.0"
DEFAULT_VENV = Path(sys.prefix).parent / ".venv-edgellm"


def edgellm_python() -> Path:
    """The interpreter that has ``tensorrt-edgellm`` installed, or a clear error saying how to get one."""
    configured = os.environ.get("COMPRESS_EDGELLM_PYTHON")
    python = Path(configured) if configured else DEFAULT_VENV / "bin" / "python"
    if not python.is_file():
        raise MissingBackendError(
            f"TensorRT Edge-LLM {EDGELLM_VERSION} is not installed ({python} not found); `bash setup.sh` creates "
            ".venv-edgellm, or set COMPRESS_EDGELLM_PYTHON to an interpreter with tensorrt-edgellm[export]"
        )
    return python
