"""Versions of compress and of the libraries a result depends on, as runs and reports record them."""

from __future__ import annotations

import platform
from importlib import metadata

__version__ = "0.1.0"
TRACKED_LIBRARIES = ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "numpy", "safetensors", "tensorrt")


def library_versions() -> dict[str, str]:
    """Versions of compress, Python and the tracked libraries that are installed."""
    versions = {"compress": __version__, "python": platform.python_version()}
    for name in TRACKED_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions
