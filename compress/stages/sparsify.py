"""``sparsify``: 2:4 semi-structured or unstructured sparsity (magnitude, Wanda, SparseGPT).

The output model stores the zeros; its metadata says whether the 2:4 pattern holds so the engine
build asks TensorRT for sparse weights.
"""

from __future__ import annotations

import logging

from compress.artifact import HF_MODEL, Artifact
from compress.data import calibration_windows
from compress.models import count_parameters, load_causal_lm, load_tokenizer, save_model_folder
from compress.sparsity import SparsifyConfig, sparsify_model
from compress.stages import StageDef, register

log = logging.getLogger(__name__)

PATTERN_COMPLETE = 0.999999


def run_sparsify(source: Artifact, config: SparsifyConfig, ctx) -> Artifact:
    tokenizer = load_tokenizer(source.path)
    windows = calibration_windows(tokenizer, ctx.plan.calibration, config.calib_window, config.calib_windows,
                                  min_tokens=config.min_calib_tokens)
    model = load_causal_lm(source.path)
    log.info("sparsifying (%s, %s) on %d calibration tokens", config.pattern, config.method, windows.numel())
    result = sparsify_model(model, windows, config, progress=ctx.progress)
    out = ctx.stage_dir / "model"
    save_model_folder(model, tokenizer, source.path, out)
    fraction = result["pattern_fraction"]
    sparse_24 = fraction is not None and fraction >= PATTERN_COMPLETE
    zeros = sum(float((p == 0).sum()) for n, p in model.named_parameters() if n.endswith("_proj.weight"))
    linear = sum(p.numel() for n, p in model.named_parameters() if n.endswith("_proj.weight"))
    meta = {
        **{k: v for k, v in source.meta.items() if k != "metrics"},
        "sparse_24": sparse_24,
        "metrics": {"pattern": config.pattern, "method": config.method, "pattern_24_fraction": fraction,
                    "linear_sparsity": zeros / linear, "parameters": count_parameters(model),
                    "nonzero_parameters": int(count_parameters(model) - zeros), "calibration_tokens": int(windows.numel()),
                    "seconds": round(result["seconds"], 2), "layers": result["layers"]},
    }
    return Artifact(HF_MODEL, out, meta)


STAGE = register(StageDef(
    name="sparsify",
    summary="2:4 or unstructured sparsity by magnitude, Wanda or SparseGPT",
    input_kind=HF_MODEL,
    output_kind=HF_MODEL,
    config_cls=SparsifyConfig,
    run=run_sparsify,
))
