"""``prune_heads``: remove the least important attention heads physically: a decoder's per KV group (GQA-aware), an
encoder's per layer (``prune_encoder_heads``).

The pruned model reloads with plain ``from_pretrained``; the heads kept per layer are recorded.
"""

from __future__ import annotations

import logging

from compress.core.artifact import HF_MODEL, Artifact
from compress.core.config import Target
from compress.core.errors import UsageError
from compress.core.text import calibration_batches, calibration_windows
from compress.models.config_file import ModelConfig
from compress.models.families import attention_geometry, family_of
from compress.models.loading import count_parameters, load_causal_lm, load_encoder, load_tokenizer, save_model_folder
from compress.models.surgery import prune_heads
from compress.pipeline.stage import DECODER, ENCODER, RunContext, StageDef, StageResult, StageVariant, register
from compress.transforms.prune.encoder_heads import PruneEncoderHeadsConfig, encoder_head_importance, plan_encoder_heads
from compress.transforms.prune.heads import (
    PruneHeadsConfig,
    attention_parameters_after,
    head_importance,
    heads_per_group_to_keep,
    plan_heads,
    plan_heads_uniform,
)

log = logging.getLogger(__name__)


def run_prune_heads(source: Artifact, config: PruneHeadsConfig, ctx: RunContext) -> StageResult:
    tokenizer = load_tokenizer(source.path)
    model = load_causal_lm(source.path)
    family_of(model.config)
    windows = calibration_windows(tokenizer, ctx.calibration, config.calib_window, config.calib_windows,
                                  min_tokens=config.min_calib_tokens)
    before = count_parameters(model)
    heads, kv, _ = attention_geometry(model.config)
    keep = heads_per_group_to_keep(model.config, config, lambda k: attention_parameters_after(model.config, k, before))
    log.info("scoring %d heads x %d layers (%s); keeping %d of %d query heads per KV group", heads,
             model.config.num_hidden_layers, config.importance, keep, heads // kv)
    scores = head_importance(model, windows, config.importance)
    plan = (plan_heads_uniform if config.mode == "uniform" else plan_heads)(scores, kv, keep)
    prune_heads(model, plan)
    out = ctx.stage_dir / "model"
    save_model_folder(model, tokenizer, source.path, out)
    after = count_parameters(model)
    meta = source.meta.carried(metrics={
        "parameters": after, "parameters_before": before, "heads_before": heads, "heads_after": kv * keep,
        "pruned_fraction": 1 - kv * keep / heads, "importance": config.importance, "mode": config.mode,
        "heads_kept_per_layer": plan, "importance_scores": [[round(float(v), 6) for v in row] for row in scores],
    })
    return StageResult(Artifact(HF_MODEL, out, meta), f"{after:,} parameters; heads {heads} → {kv * keep} per layer")


def check_encoder_plan(
    config: PruneEncoderHeadsConfig, earlier: dict, target: Target, model_config: ModelConfig | None
) -> None:
    """Pruned encoders are saved in BERT's layout, without a task head."""
    if model_config is None:
        return
    heads = any(a.endswith("ForSequenceClassification") for a in model_config.get("architectures") or [])
    if model_config.get("model_type") != "bert" or heads:
        raise UsageError(
            f"prune_encoder_heads: prunes BERT sentence encoders (model_type bert, no task head); "
            f"the model is {model_config.get('model_type')!r}{' with a classification head' if heads else ''}"
        )


def run_prune_encoder_heads(source: Artifact, config: PruneEncoderHeadsConfig, ctx: RunContext) -> StageResult:
    # lazy: BERT's modelling code, never needed to plan
    from compress.models.pruned_bert import prune_encoder_heads, save_pruned_encoder

    tokenizer = load_tokenizer(source.path)
    model = load_encoder(source.path)
    batches = calibration_batches(
        tokenizer, ctx.calibration, config.calib_sentences, config.batch_size, config.max_length
    )
    before = count_parameters(model)
    plan = plan_encoder_heads(encoder_head_importance(model, batches), config.fraction)
    heads_before = model.config.num_attention_heads
    prune_encoder_heads(model, plan)
    out = ctx.stage_dir / "model"
    save_pruned_encoder(model, tokenizer, plan, out)
    after = count_parameters(model)
    log.info(
        "kept %d of %d heads per layer: %s -> %s parameters", len(plan[0]), heads_before, f"{before:,}", f"{after:,}"
    )
    meta = source.meta.carried(metrics={"heads_before": heads_before, "heads_after": len(plan[0]),
                                        "heads_kept_per_layer": plan, "parameters_before": before, "parameters": after})
    return StageResult(
        Artifact(HF_MODEL, out, meta), f"{after:,} parameters; heads {heads_before} → {len(plan[0])} per layer"
    )


STAGE = register(StageDef(
    name="prune_heads",
    summary="remove the least important attention heads physically (GQA-aware for decoders, per layer for encoders)",
    input_kind=HF_MODEL,
    output_kind=HF_MODEL,
    variants={DECODER: StageVariant(PruneHeadsConfig, run_prune_heads),
              ENCODER: StageVariant(PruneEncoderHeadsConfig, run_prune_encoder_heads, check_plan=check_encoder_plan)},
), aliases={"prune_encoder_heads": ENCODER})
