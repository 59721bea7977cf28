"""``prune_heads``: remove the least important attention heads physically (GQA-aware).

The pruned model reloads with plain ``AutoModelForCausalLM.from_pretrained``; the per-layer plan
(heads kept per layer) is recorded.
"""

from __future__ import annotations

import logging

from compress.artifact import HF_MODEL, Artifact
from compress.data import calibration_windows
from compress.families import attention_geometry, family_of
from compress.models import count_parameters, load_causal_lm, load_tokenizer, save_model_folder
from compress.pruning import (
    PruneHeadsConfig,
    attention_parameters_after,
    head_importance,
    heads_per_group_to_keep,
    plan_heads,
    prune_heads,
)
from compress.stages import StageDef, register

log = logging.getLogger(__name__)


def run_prune_heads(source: Artifact, config: PruneHeadsConfig, ctx) -> Artifact:
    tokenizer = load_tokenizer(source.path)
    model = load_causal_lm(source.path)
    family_of(model.config)
    windows = calibration_windows(tokenizer, ctx.plan.calibration, config.calib_window, config.calib_windows,
                                  min_tokens=config.min_calib_tokens)
    before = count_parameters(model)
    heads, kv, _ = attention_geometry(model.config)
    keep = heads_per_group_to_keep(model.config, config, lambda k: attention_parameters_after(model.config, k, before))
    log.info("scoring %d heads x %d layers (%s); keeping %d of %d query heads per KV group", heads,
             model.config.num_hidden_layers, config.importance, keep, heads // kv)
    scores = head_importance(model, windows, config.importance)
    plan = plan_heads(scores, kv, keep)
    prune_heads(model, plan)
    out = ctx.stage_dir / "model"
    save_model_folder(model, tokenizer, source.path, out)
    after = count_parameters(model)
    meta = {
        **{k: v for k, v in source.meta.items() if k != "metrics"},
        "metrics": {"parameters": after, "parameters_before": before, "heads_before": heads, "heads_after": kv * keep,
                    "pruned_fraction": 1 - kv * keep / heads, "importance": config.importance,
                    "heads_kept_per_layer": plan,
                    "importance_scores": [[round(float(v), 6) for v in row] for row in scores]},
    }
    return Artifact(HF_MODEL, out, meta)


STAGE = register(StageDef(
    name="prune_heads",
    summary="remove the least important attention heads physically (GQA-aware)",
    input_kind=HF_MODEL,
    output_kind=HF_MODEL,
    config_cls=PruneHeadsConfig,
    run=run_prune_heads,
))
