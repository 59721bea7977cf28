"""Running what a compress run produced: ``compress.runtime.load(RUN_DIR).generate("...")``."""

from compress.runtime.generate import GenerationOptions, ProvenanceError, TextGenerator, load
from compress.runtime.onnx_decoder import OnnxDecoder

__all__ = ["GenerationOptions", "OnnxDecoder", "ProvenanceError", "TextGenerator", "load"]
