"""``load``: bring the source model into the run directory as a safetensors Hugging Face folder."""

from __future__ import annotations

import logging

from compress.core.artifact import HF_MODEL, SOURCE, Artifact
from compress.core.config import StrictModel
from compress.core.errors import UsageError
from compress.core.files import read_json
from compress.models.families import model_kind
from compress.models.loading import copy_model_folder, count_parameters, load_causal_lm, load_encoder, load_tokenizer
from compress.models.sources import materialize, model_files
from compress.pipeline.stage import DECODER, ENCODER, RunContext, StageDef, StageResult, StageVariant, register
from compress.report.figures import SIZE_MB

log = logging.getLogger(__name__)


class LoadConfig(StrictModel):
    """Options of the load stage."""

    smoke_test_prompt: str = "What is the capital of France?"


def run_load(source: Artifact, config: LoadConfig, ctx: RunContext) -> StageResult:
    folder = materialize(ctx.model_source)
    out = ctx.stage_dir / "model"
    skipped = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if skipped:
        log.info("not copying sub-folders of %s (not part of the model): %s", folder, ", ".join(skipped))
    copy_model_folder(model_files(folder), out)
    kind = model_kind(read_json(out / "config.json"))
    if kind == ENCODER:
        model = load_encoder(out, trust_remote_code=ctx.trust_remote_code, name=f"model={ctx.model_spec}")
    else:  # read in its own dtype: the stage only checks and counts it
        model = load_causal_lm(out, trust_remote_code=ctx.trust_remote_code, name=f"model={ctx.model_spec}", own_dtype=True)
    cfg = model.config
    rows, tokens = model.get_input_embeddings().num_embeddings, len(load_tokenizer(out, trust_remote_code=ctx.trust_remote_code))
    if tokens > rows:
        raise UsageError(f"model={ctx.model_spec}: the tokenizer makes {tokens:,} token ids but the embedding has {rows:,} rows; "
                         "the model cannot read its own tokens")
    parameters = count_parameters(model)
    meta = {
        "architecture": (cfg.architectures or [type(model).__name__])[0],
        "model_type": cfg.model_type,
        "model_kind": kind,
        "license": ctx.model_source.license,
        "source": ctx.model_spec,
        "precision": "fp32",
        "metrics": {
            "parameters": parameters,
            "layers": cfg.num_hidden_layers,
            "attention_heads": cfg.num_attention_heads,
            "kv_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
        },
    }
    log.info("loaded %s: %s parameters", meta["architecture"], f"{parameters:,}")
    return StageResult(Artifact(HF_MODEL, out, meta), f"{parameters:,} parameters", {SIZE_MB: parameters * 4 / 1e6 or None})


_VARIANT = StageVariant(LoadConfig, run_load)
STAGE = register(StageDef(
    name="load",
    summary="load the teacher (built-in package, HF folder or GGUF) as safetensors; a decoder LLM or an encoder",
    input_kind=SOURCE,
    output_kind=HF_MODEL,
    variants={DECODER: _VARIANT, ENCODER: _VARIANT},
))
