"""Running what a compress run produced: ``compress.runtime.load(RUN_DIR).generate("...")`` for a decoder,
``.embed([...])`` or ``.classify([...])`` for an encoder."""

from compress.runtime.encoder import OnnxEncoder
from compress.runtime.generate import GenerationOptions, ProvenanceError, TextGenerator, load
from compress.runtime.onnx_decoder import OnnxDecoder

__all__ = ["GenerationOptions", "OnnxDecoder", "OnnxEncoder", "ProvenanceError", "TextGenerator", "load"]
