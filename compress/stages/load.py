"""``load``: bring the source model into the run directory as a safetensors Hugging Face folder."""

from __future__ import annotations

import logging

from compress.artifact import HF_MODEL, SOURCE, Artifact
from compress.config import StrictModel
from compress.families import model_kind
from compress.fsutil import read_json
from compress.models import count_parameters, link_or_copy_tree, load_causal_lm, load_encoder, materialize
from compress.stages import StageDef, register

log = logging.getLogger(__name__)


class LoadConfig(StrictModel):
    """Options of the load stage."""

    smoke_test_prompt: str = "What is the capital of France?"


def run_load(source: Artifact, config: LoadConfig, ctx) -> Artifact:
    folder = materialize(ctx.plan.model)
    out = ctx.stage_dir / "model"
    link_or_copy_tree(folder, out)
    kind = model_kind(read_json(out / "config.json"))
    loader = load_encoder if kind == "encoder" else load_causal_lm
    model = loader(out, trust_remote_code=ctx.plan.options.trust_remote_code, name=f"model={ctx.plan.model.spec}")
    cfg = model.config
    meta = {
        "architecture": (cfg.architectures or [type(model).__name__])[0],
        "model_type": cfg.model_type,
        "model_kind": kind,
        "license": ctx.plan.model.license,
        "source": ctx.plan.model.spec,
        "precision": "fp32",
        "metrics": {
            "parameters": count_parameters(model),
            "layers": cfg.num_hidden_layers,
            "attention_heads": cfg.num_attention_heads,
            "kv_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
        },
    }
    log.info("loaded %s: %s parameters", meta["architecture"], f"{meta['metrics']['parameters']:,}")
    return Artifact(HF_MODEL, out, meta)


STAGE = register(StageDef(
    name="load",
    summary="load the teacher (built-in package, HF folder or GGUF) as safetensors; a decoder LLM or an encoder",
    input_kind=SOURCE,
    output_kind=HF_MODEL,
    config_cls=LoadConfig,
    run=run_load,
    model_kinds=("decoder", "encoder"),
))
