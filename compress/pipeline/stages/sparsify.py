"""``sparsify``: 2:4 semi-structured or unstructured sparsity (magnitude, Wanda, SparseGPT).

The model is held in its checkpoint's own dtype (each block computed in float32 while the walker
visits it) and saved in it. The output model stores the zeros; its metadata says whether the 2:4 pattern holds so the
engine build asks TensorRT for sparse weights.
"""

from __future__ import annotations

import logging

from compress.core.artifact import HF_MODEL, Artifact
from compress.core.text import calibration_windows
from compress.models.loading import count_parameters, load_causal_lm, load_tokenizer, save_model_folder
from compress.pipeline.stage import DECODER, RunContext, StageDef, StageResult, StageVariant, register
from compress.transforms.sparsify import PATTERN_COMPLETE, SparsifyConfig, sparse_linears, sparsify_model

log = logging.getLogger(__name__)


def run_sparsify(source: Artifact, config: SparsifyConfig, ctx: RunContext) -> StageResult:
    tokenizer = load_tokenizer(source.path)
    windows = calibration_windows(tokenizer, ctx.calibration, config.calib_window, config.calib_windows,
                                  min_tokens=config.min_calib_tokens)
    model = load_causal_lm(source.path, own_dtype=True)  # each block computes in float32 while the walker holds it
    log.info("sparsifying (%s, %s) on %d calibration tokens", config.pattern, config.method, windows.numel())
    result = sparsify_model(model, windows, config, progress=ctx.progress, device=ctx.device)
    out = ctx.stage_dir / "model"
    save_model_folder(model, tokenizer, source.path, out)
    fraction = result["pattern_fraction"]
    sparse_24 = fraction is not None and fraction >= PATTERN_COMPLETE
    weights = sparse_linears(model).values()
    zeros = sum(float((w == 0).sum()) for w in weights)
    linear = sum(w.numel() for w in weights)
    parameters = count_parameters(model)
    metrics = {"pattern": config.pattern, "method": config.method, "pattern_24_fraction": fraction,
               "linear_sparsity": zeros / linear, "parameters": parameters,
               "nonzero_parameters": int(parameters - zeros), "calibration_tokens": int(windows.numel()),
               "seconds": round(result["seconds"], 2), "layers": result["layers"]}
    meta = source.meta.carried(sparse_24=sparse_24, metrics=metrics)
    line = f"{parameters:,} parameters"
    if fraction is not None:
        line += f"; 2:4 pattern {100 * fraction:.2f}% ({config.method})"
    return StageResult(Artifact(HF_MODEL, out, meta), line)


STAGE = register(StageDef(
    name="sparsify",
    summary="2:4 or unstructured sparsity by magnitude, Wanda or SparseGPT",
    input_kind=HF_MODEL,
    output_kind=HF_MODEL,
    variants={DECODER: StageVariant(SparsifyConfig, run_sparsify)},
))
