"""Running what a compress run produced: ``compress.runtime.load(RUN_DIR).generate("...")`` for a decoder,
``.embed([...])`` or ``.classify([...])`` for an encoder."""

from compress.backends.onnx.encoder import OnnxEncoder
from compress.backends.onnx.runtime import OnnxDecoder
from compress.core.errors import ProvenanceError
from compress.runtime.generate import TextGenerator, load
from compress.runtime.options import GenerationOptions

__all__ = ["GenerationOptions", "OnnxDecoder", "OnnxEncoder", "ProvenanceError", "TextGenerator", "load"]
