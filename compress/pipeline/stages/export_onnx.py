"""``export_onnx``: a decoder with an explicit KV cache as ONNX (Q/DQ where quantized), or an encoder as ONNX (FP16,
FP32 or Q/DQ INT8; ``export_encoder``), each checked against torch in ONNX Runtime before the stage finishes."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from compress.algorithms.sparse import onnx_24_fraction
from compress.backends.onnx.encoder import (
    ENCODER_FILE,
    HIDDEN_OUTPUT,
    PARITY_SENTENCES,
    OnnxEncoder,
    export_encoder,
    torch_outputs,
    write_encoder_qdq,
)
from compress.backends.onnx.export import ParityCheck, export_decoder_folder
from compress.backends.onnx.runtime import ONNX_FILE
from compress.core.artifact import HF_MODEL, ONNX, Artifact
from compress.core.config import StrictModel
from compress.core.errors import StageError
from compress.core.files import path_size, read_json
from compress.eval.embeddings import cosines
from compress.models.loading import load_encoder, load_tokenizer
from compress.pipeline.stage import DECODER, ENCODER, RunContext, StageDef, StageResult, StageVariant, register
from compress.report.figures import SIZE_MB
from compress.transforms.quantize.encoder import attach_encoder_quant, load_encoder_quantization
from compress.transforms.sparsify import PATTERN_COMPLETE

log = logging.getLogger(__name__)


class ExportOnnxConfig(StrictModel):
    """Options of the decoder export."""

    exporter: Literal["torchscript", "dynamo"] = "torchscript"
    opset: int = 18
    parity_prompt: str = "What is the capital of France?"
    parity_new_tokens: PositiveInt = 16
    max_logit_diff: PositiveFloat = 1e-2
    max_logit_diff_quantized: PositiveFloat = 20.0
    # Quantized graphs flip activation roundings on ~1e-6 input differences, so their parity is
    # judged by perplexity in validate; greedy tokens are still recorded.
    require_greedy_match: Literal["always", "float-only", "never"] = "float-only"
    # The most graph weights (MiB, as stored) ONNX Runtime's parity check holds in one session (about twice that in
    # float32): a larger graph is run in slices of whole blocks over torch's greedy continuation.
    session_mb: PositiveInt = 1024


def run_export(source: Artifact, config: ExportOnnxConfig, ctx: RunContext) -> StageResult:
    out = ctx.stage_dir / "onnx"
    check = ParityCheck(config.parity_prompt, config.parity_new_tokens)
    exported = export_decoder_folder(Path(source.path), out, config.exporter, config.opset, check,
                                     ctx.trust_remote_code, session_limit_bytes=config.session_mb * 2**20)
    parity = exported.parity
    tolerance = config.max_logit_diff_quantized if exported.quantized else config.max_logit_diff
    if parity["max_abs_logit_diff"] > tolerance:
        raise StageError(f"ONNX logits differ from torch by {parity['max_abs_logit_diff']:.3g} (> {tolerance})")
    must_match = config.require_greedy_match == "always" or (
        config.require_greedy_match == "float-only" and not exported.quantized
    )
    if must_match and not parity["greedy_match"]:
        raise StageError(
            f"ONNX greedy tokens {parity['greedy_tokens_onnx']} differ from torch {parity['greedy_tokens_torch']}"
        )
    qdq_stats = dict(exported.qdq)
    if source.meta.sparse_24:
        vocab = int(read_json(out / "config.json")["vocab_size"])
        qdq_stats["onnx_pattern_24_fraction"] = onnx_24_fraction(out / ONNX_FILE, skip_output_dim=vocab)
        log.info(
            "2:4 pattern holds for %.4f%% of the exported linear weights", 100 * qdq_stats["onnx_pattern_24_fraction"]
        )
    meta = source.meta.carried(
        sparse_24=source.meta.sparse_24 and qdq_stats.get("onnx_pattern_24_fraction", 0) >= PATTERN_COMPLETE,
        layout=exported.layout.to_json(),
        opset=config.opset,
        metrics={
            "onnx_size_bytes": exported.onnx_size_bytes,
            "parity": parity,
            **qdq_stats,
            "phase_peak_rss_mb": exported.phase_peak_rss_mb,
        },
    )
    line = (f"ONNX {exported.onnx_size_bytes / 1e6:.1f} MB; max logit diff {parity['max_abs_logit_diff']:.2e}, "
            f"greedy {'identical' if parity['greedy_match'] else 'DIFFERENT'}")
    return StageResult(Artifact(ONNX, out, meta), line, {SIZE_MB: exported.onnx_size_bytes / 1e6})


class ExportEncoderConfig(StrictModel):
    """Options of the encoder export."""

    # of a float model; a quantized one exports Q/DQ INT8 with FP32 activations
    precision: Literal["fp16", "fp32"] = "fp16"
    opset: int = 18
    # ONNX Runtime vs torch, per sentence (embeddings or logits)
    min_parity_cosine: float = Field(0.999, gt=0.0, le=1.0)


def run_export_encoder(source: Artifact, config: ExportEncoderConfig, ctx: RunContext) -> StageResult:
    folder = Path(source.path)
    tokenizer = load_tokenizer(folder)
    model = load_encoder(folder)
    quantized = load_encoder_quantization(folder)
    out = ctx.stage_dir / "onnx"
    out.mkdir(parents=True)
    path = out / ENCODER_FILE
    precision = "int8" if quantized else config.precision
    log.info("exporting the encoder to ONNX (%s)", precision)
    output = export_encoder(model.half() if precision == "fp16" else model, path, config.opset)
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
    size = path_size(path)
    metrics = {
        "precision": precision,
        "output": output,
        "onnx_size_bytes": size,
        "parity_min_cosine": round(cosine, 6),
        **qdq,
    }
    meta = source.meta.carried(precision=precision, model_kind="encoder", metrics=metrics)
    line = f"ONNX {size / 1e6:.1f} MB; {precision}, parity minimum cosine {cosine:.6f}"
    return StageResult(Artifact(ONNX, out, meta), line, {SIZE_MB: size / 1e6})


STAGE = register(
    StageDef(
        name="export_onnx",
        summary="export a decoder with KV cache (Q/DQ where quantized) or an encoder to ONNX and check it in ONNX "
            "Runtime",
        input_kind=HF_MODEL,
        output_kind=ONNX,
        optional=True,  # the portable artifact: a recipe whose Edge-LLM bundle ships may leave it out (export_onnx=off)
        variants={
            DECODER: StageVariant(ExportOnnxConfig, run_export),
            ENCODER: StageVariant(ExportEncoderConfig, run_export_encoder),
        },
    ),
    aliases={"export_encoder": ENCODER},
)
