"""``prune_encoder_heads``: remove an encoder's least important attention heads physically.

Heads are scored on calibration sentences (:mod:`compress.encoder_pruning`); each layer keeps its
most important ``1 - fraction``. The pruned model reloads with ``AutoModel.from_pretrained``.
"""

from __future__ import annotations

import logging

from pydantic import Field, PositiveInt

from compress.artifact import HF_MODEL, Artifact
from compress.config import StrictModel, Target
from compress.data import domain_sentences
from compress.errors import UsageError
from compress.models import count_parameters, load_encoder, load_tokenizer
from compress.stages import StageDef, register

log = logging.getLogger(__name__)


class PruneEncoderHeadsConfig(StrictModel):
    """Options of the prune_encoder_heads stage."""

    fraction: float = Field(0.25, gt=0.0, lt=1.0)
    calib_sentences: PositiveInt = 256
    batch_size: PositiveInt = 32
    max_length: PositiveInt = 128


def check_plan(config: PruneEncoderHeadsConfig, earlier: dict, target: Target, model_config: dict | None) -> None:
    """Pruned encoders are saved in BERT's layout, without a task head."""
    if model_config is None:
        return
    heads = any(a.endswith("ForSequenceClassification") for a in model_config.get("architectures") or [])
    if model_config.get("model_type") != "bert" or heads:
        raise UsageError(f"prune_encoder_heads: prunes BERT sentence encoders (model_type bert, no task head); "
                         f"the model is {model_config.get('model_type')!r}{' with a classification head' if heads else ''}")


def calibration_batches(tokenizer, ctx, total: int, batch_size: int, max_length: int) -> list[dict]:
    """About ``total`` tokenised calibration sentences, as many from each domain, batch by batch, each padded to its longest."""
    per_domain = -(-total // len(ctx.plan.calibration))
    sentences = [s for _, found in domain_sentences(ctx.plan.calibration, per_domain) for s in found]
    if not sentences:
        raise UsageError("the calibration text has no sentences of 20 to 400 characters")
    return [dict(tokenizer(sentences[i:i + batch_size], padding=True, truncation=True, max_length=max_length, return_tensors="pt"))
            for i in range(0, len(sentences), batch_size)]


def run_prune_encoder_heads(source: Artifact, config: PruneEncoderHeadsConfig, ctx) -> Artifact:
    # Imported here: it loads transformers' BERT modelling code, which plans never need.
    from compress.encoder_pruning import encoder_head_importance, plan_encoder_heads, prune_encoder_heads, save_pruned_encoder

    tokenizer = load_tokenizer(source.path)
    model = load_encoder(source.path)
    batches = calibration_batches(tokenizer, ctx, config.calib_sentences, config.batch_size, config.max_length)
    before = count_parameters(model)
    plan = plan_encoder_heads(encoder_head_importance(model, batches), config.fraction)
    heads_before = model.config.num_attention_heads
    prune_encoder_heads(model, plan)
    out = ctx.stage_dir / "model"
    save_pruned_encoder(model, tokenizer, plan, out)
    after = count_parameters(model)
    log.info("kept %d of %d heads per layer: %s -> %s parameters", len(plan[0]), heads_before, f"{before:,}", f"{after:,}")
    meta = {**{k: v for k, v in source.meta.items() if k != "metrics"},
            "metrics": {"heads_before": heads_before, "heads_after": len(plan[0]), "heads_kept_per_layer": plan,
                        "parameters_before": before, "parameters": after}}
    return Artifact(HF_MODEL, out, meta)


STAGE = register(StageDef(
    name="prune_encoder_heads",
    summary="remove an encoder's least important attention heads (scored on calibration sentences)",
    input_kind=HF_MODEL,
    output_kind=HF_MODEL,
    config_cls=PruneEncoderHeadsConfig,
    run=run_prune_encoder_heads,
    check_plan=check_plan,
    model_kinds=("encoder",),
))
