"""``export_encoder``: an encoder as ONNX (FP16, FP32, or Q/DQ INT8 from the quantize_encoder stage), checked in ONNX Runtime.

After export the stage embeds (or classifies) the parity sentences in ONNX Runtime beside the torch
model it was exported from (with the quantized model's online smoothing and simulated activation
quantization attached) and fails when the two disagree beyond the configured tolerance.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Literal

from pydantic import Field

from compress.artifact import HF_MODEL, ONNX, Artifact
from compress.config import StrictModel
from compress.encoder_quantization import attach_encoder_quant, load_encoder_quantization, write_encoder_qdq
from compress.errors import StageError
from compress.eval.embeddings import cosines
from compress.fsutil import path_size
from compress.models import load_encoder, load_tokenizer
from compress.runtime.encoder import ENCODER_FILE, HIDDEN_OUTPUT, OnnxEncoder, export_encoder, torch_outputs
from compress.stages import StageDef, register

log = logging.getLogger(__name__)

PARITY_SENTENCES = ("The robot arm picks up the red block.", "Stop.",
                    "Navigate to the charging dock and wait for instructions from the operator.",
                    "Emma Woodhouse, handsome, clever, and rich, seemed to unite some of the best blessings of existence.")


class ExportEncoderConfig(StrictModel):
    """Options of the encoder export."""

    precision: Literal["fp16", "fp32"] = "fp16"  # of a float model; a quantized one exports Q/DQ INT8 with FP32 activations
    opset: int = 18
    min_parity_cosine: float = Field(0.999, gt=0.0, le=1.0)  # ONNX Runtime vs torch, per sentence (embeddings or logits)


def run_export_encoder(source: Artifact, config: ExportEncoderConfig, ctx) -> Artifact:
    folder = Path(source.path)
    tokenizer = load_tokenizer(folder)
    model = load_encoder(folder)
    quantized = load_encoder_quantization(folder)
    out = ctx.stage_dir / "onnx"
    out.mkdir(parents=True)
    path = out / ENCODER_FILE
    precision = "int8" if quantized else config.precision
    log.info("exporting the encoder to ONNX (%s)", precision)
    exported = model.half() if precision == "fp16" else model
    output = export_encoder(exported, path, config.opset)
    qdq = write_encoder_qdq(model, quantized, path) if quantized else {}
    tokenizer.save_pretrained(out)
    shutil.copy2(folder / "config.json", out / "config.json")
    reference = model if quantized else load_encoder(folder)  # a float model was exported in half precision
    if quantized:
        attach_encoder_quant(reference, quantized)
    expected = torch_outputs(reference, tokenizer, PARITY_SENTENCES, output)
    encoder = OnnxEncoder(out)
    got = encoder.embed(list(PARITY_SENTENCES)) if output == HIDDEN_OUTPUT else encoder.logits(list(PARITY_SENTENCES))
    cosine = float(cosines(got, expected).min())
    log.info("parity: ONNX Runtime vs torch, minimum cosine %.6f over %d sentences", cosine, len(PARITY_SENTENCES))
    if cosine < config.min_parity_cosine:
        raise StageError(f"ONNX Runtime and torch disagree: minimum cosine {cosine:.6f} < {config.min_parity_cosine}")
    metrics = {"precision": precision, "output": output, "onnx_size_bytes": path_size(path), "parity_min_cosine": round(cosine, 6),
               **qdq}
    meta = {**{k: v for k, v in source.meta.items() if k != "metrics"}, "precision": precision, "model_kind": "encoder",
            "metrics": metrics}
    return Artifact(ONNX, out, meta)


STAGE = register(StageDef(
    name="export_encoder",
    summary="export an encoder to ONNX (FP16, or Q/DQ INT8) and check it against torch in ONNX Runtime",
    input_kind=HF_MODEL,
    output_kind=ONNX,
    config_cls=ExportEncoderConfig,
    run=run_export_encoder,
    model_kinds=("encoder",),
))
