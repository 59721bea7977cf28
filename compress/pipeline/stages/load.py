"""``load``: the source model as a safetensors Hugging Face folder, checked and counted.

The model is read where it is (a GGUF file's cached conversion, for a GGUF): its content hash is
recorded, and the runner checks it before every later stage and at the end, so a model changed
while the run goes stops the run (see :mod:`compress.pipeline.execute`). ``load.copy_model=true``
copies it into the run directory instead, for a run directory that stands on its own.
"""

from __future__ import annotations

import logging

from compress.core.artifact import HF_MODEL, SOURCE, Artifact, ModelMeta
from compress.core.config import StrictModel
from compress.core.errors import UsageError
from compress.core.files import read_json, top_level_sha256
from compress.models.families import model_kind
from compress.models.loading import copy_model_folder, count_parameters, load_causal_lm, load_encoder, load_tokenizer
from compress.models.sources import materialize, model_files
from compress.pipeline.stage import DECODER, ENCODER, RunContext, StageDef, StageResult, StageVariant, register
from compress.report.figures import SIZE_MB

log = logging.getLogger(__name__)


class LoadConfig(StrictModel):
    """Options of the load stage."""

    smoke_test_prompt: str = "What is the capital of France?"
    # copy the model into the run directory (one more checkpoint on disk) instead of reading it in place
    copy_model: bool = False


def run_load(source: Artifact, config: LoadConfig, ctx: RunContext) -> StageResult:
    folder = materialize(ctx.model_source)
    skipped = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if skipped:
        log.info("sub-folders of %s are not part of the model: %s", folder, ", ".join(skipped))
    if config.copy_model:
        out, sha256 = ctx.stage_dir / "model", ""  # the runner hashes what the stage wrote
        copy_model_folder(model_files(folder), out)
    else:
        out, sha256 = folder, top_level_sha256(folder)
        log.info("reading the model in place: %s (content checked before every stage)", folder)
    kind = model_kind(read_json(out / "config.json"))
    if kind == ENCODER:
        model = load_encoder(out, trust_remote_code=ctx.trust_remote_code, name=f"model={ctx.model_spec}")
    else:  # read in its own dtype: the stage only checks and counts it
        model = load_causal_lm(
            out, trust_remote_code=ctx.trust_remote_code, name=f"model={ctx.model_spec}", own_dtype=True
        )
    cfg = model.config
    rows, tokens = (
        model.get_input_embeddings().num_embeddings,
        len(load_tokenizer(out, trust_remote_code=ctx.trust_remote_code)),
    )
    if tokens > rows:
        raise UsageError(
            f"model={ctx.model_spec}: the tokenizer makes {tokens:,} token ids but the embedding has {rows:,} rows; "
            "the model cannot read its own tokens"
        )
    parameters = count_parameters(model)
    meta = ModelMeta(
        architecture=(cfg.architectures or [type(model).__name__])[0],
        model_type=cfg.model_type,
        model_kind=kind,
        license=ctx.model_source.license,
        source=ctx.model_spec,
        precision="fp32",
        metrics={
            "parameters": parameters,
            "layers": cfg.num_hidden_layers,
            "attention_heads": cfg.num_attention_heads,
            "kv_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
        },
    )
    log.info("loaded %s: %s parameters", meta.architecture, f"{parameters:,}")
    return StageResult(
        Artifact(HF_MODEL, out, meta, sha256), f"{parameters:,} parameters", {SIZE_MB: parameters * 4 / 1e6 or None}
    )


_VARIANT = StageVariant(LoadConfig, run_load)
STAGE = register(
    StageDef(
        name="load",
        summary="check the teacher (built-in package, HF folder or GGUF) as safetensors, read in place; a decoder LLM "
            "or an encoder",
        input_kind=SOURCE,
        output_kind=HF_MODEL,
        variants={DECODER: _VARIANT, ENCODER: _VARIANT},
    )
)
