"""``validate``: measure the final model and gate it against the target's budgets; the last stage of a run.

A decoder is measured by :mod:`compress.eval.decoder` (every evaluation domain against the
teacher, host latency) and an encoder (``validate_encoder``) by :mod:`compress.eval.encoder`
(embeddings or labels against the fp32 model); both are gated on the latency model's predictions
for the target. ``validation.json`` keeps what ``compress validate RUN_DIR`` needs to re-gate the
run for another target without loading a model.
"""

from __future__ import annotations

import logging
from pathlib import Path

from compress.core.artifact import EDGELLM_BUNDLE, ENGINE, HF_MODEL, ONNX, REPORT, Artifact, ReportMeta
from compress.core.files import atomic_write_json, path_size
from compress.core.rundir import DEVICE_REFERENCE, VALIDATION
from compress.eval import decoder, encoder
from compress.eval.gate import gate_json
from compress.eval.prompts import check_prompt_lengths, resolve_prompts
from compress.models.config_file import ModelConfig
from compress.models.loading import load_encoder, load_tokenizer
from compress.pipeline.stage import DECODER, ENCODER, RunContext, StageDef, StageResult, StageVariant, register
from compress.report.figures import DOMAIN_QUALITY, PERPLEXITY_BY_STAGE, PROMPT_ANSWERS

log = logging.getLogger(__name__)


def run_validate(source: Artifact, config: decoder.ValidateConfig, ctx: RunContext) -> StageResult:
    onnx = ctx.last_artifact(ONNX)
    teacher = ctx.first_artifact(HF_MODEL)
    exported_from = ctx.last_artifact(HF_MODEL)
    model_dir = Path(exported_from.path)
    onnx_dir = Path(onnx.path) if onnx is not None else None
    tokenizer = load_tokenizer(model_dir)
    # checked before any pass: a prompt the device cannot take is refused
    cases, _ = resolve_prompts(ctx.prompts, tokenizer)
    check_prompt_lengths(cases, tokenizer, config.prompt_new_tokens, ctx.target.budgets.context_length)
    files = decoder.DeployedFiles(model_dir, Path(teacher.path) if teacher else None, onnx_dir)
    metrics = decoder.measure(files, ctx.evaluation, config, ctx.progress, ctx.unseen_domains, ctx.prompts, ctx.device)
    metrics["model_size_bytes"] = _deployed_size(ctx, onnx_dir, model_dir)
    if onnx is not None and "onnx_pattern_24_fraction" in onnx.metrics:
        metrics["onnx_pattern_24_fraction"] = onnx.metrics["onnx_pattern_24_fraction"]
    if ctx.last_artifact(EDGELLM_BUNDLE) is not None:
        _write_device_reference(ctx, config, model_dir, metrics)
    precision = exported_from.meta.precision
    model_config = ModelConfig.read(model_dir)
    deployment = exported_from.meta.deployment()
    predictions = decoder.target_predictions(model_config, precision, ctx.target, ctx.power_mode, deployment)
    gate = gate_json(decoder.gate_checks(metrics, predictions, ctx.target, ctx.require_measured))
    out = ctx.stage_dir / VALIDATION
    atomic_write_json(out, {"model_kind": DECODER, "metrics": metrics, "predictions": predictions, "gate": gate,
                            "model_config": model_config.to_json(), "precision": precision,
                            "deployment": deployment.to_json()})
    for name, row in metrics.get("domains", {}).items():
        log.info("%-12s %s perplexity %.3f vs teacher %.3f (%+.2f%%), top-1 agreement %.1f%%, KL %.4f", name,
                 "seen  " if row["seen"] else "unseen", row["perplexity_model"], row["perplexity_reference"],
                 row["perplexity_increase_pct"], 100 * row["top1_agreement"], row["mean_kl"])
    if metrics.get("worst_domain"):
        log.info("worst domain %s: %+.2f%%; mixed text: top-1 agreement %.1f%%, KL %.4f", metrics["worst_domain"],
                 metrics["perplexity_increase_pct"], 100 * metrics["top1_agreement"], metrics["mean_kl"])
    log.info("gate: %s", gate["verdict"])
    measured = {
        ctx.stage_of(teacher): metrics.get("perplexity_teacher"),
        ctx.stage_of(exported_from): metrics.get("perplexity_model"),
    }
    line = f"ppl {metrics['perplexity_model']:.3f} (teacher {_fmt(metrics.get('perplexity_teacher'))})"
    if metrics.get("onnx_parity"):
        parity = metrics["onnx_parity"]
        line += f"; ONNX Runtime within {parity['difference_pct']:.3f}% on {parity['windows']} windows"
    lat = metrics["host_latency"]
    if lat:
        line += f"; host decode p50 {lat['decode']['p50_ms']:.1f} ms, TTFT {lat['ttft_ms']:.0f} ms"
    figures = {
        PERPLEXITY_BY_STAGE: {name: value for name, value in measured.items() if name is not None and value is not None}
    }
    if metrics.get("prompts"):
        figures[PROMPT_ANSWERS] = metrics["prompts"]
        log.info("app prompts: %d, identical answers %.0f%%, answer prefix agreement %.0f%%, first token %.0f%%",
                 metrics["prompts"]["prompts"], 100 * metrics["prompts"]["identical_answers"],
                 100 * metrics["prompts"]["answer_prefix_agreement"], 100 * metrics["prompts"]["first_token_agreement"])
    if metrics.get("domains"):
        figures[DOMAIN_QUALITY] = {
            key: metrics.get(key) for key in ("domains", "mixed", "worst_domain", "unseen_domains", "window_prefix")
        }
    return StageResult(
        Artifact(REPORT, out, ReportMeta(metrics=metrics, predictions=predictions, gate=gate)), line, figures
    )


def _deployed_size(ctx: RunContext, onnx_dir: Path | None, model_dir: Path) -> int:
    """Bytes of what ships: the Edge-LLM bundle where there is one, else the portable ONNX, else the checkpoint."""
    bundle = ctx.last_artifact(EDGELLM_BUNDLE)
    return path_size(Path(bundle.path) if bundle is not None else onnx_dir or model_dir)


def _write_device_reference(ctx: RunContext, config: decoder.ValidateConfig, model_dir: Path, metrics: dict) -> None:
    """The host's greedy answers that ``validate --on-device`` compares the device's with: the deployed numbers in
    torch."""
    tokenizer = load_tokenizer(model_dir)
    log.info(
        "host greedy reference for the on-device check: %d domains and the app prompts, %d new tokens",
        len(ctx.evaluation),
        config.device_new_tokens,
    )
    eos = decoder.model_eos_ids(model_dir, tokenizer)
    with decoder.deployed_generator(model_dir, eos, decoder.pad_id_of(tokenizer, eos), ctx.device) as generate:
        reference = decoder.device_reference(generate, tokenizer, ctx.evaluation, config, metrics.get("prompts"),
                                             "the quantized checkpoint in torch (the numbers the bundle holds)")
    atomic_write_json(ctx.stage_dir / DEVICE_REFERENCE, reference)


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.5g}"


def run_validate_encoder(source: Artifact, config: encoder.ValidateEncoderConfig, ctx: RunContext) -> StageResult:
    teacher = ctx.first_artifact(HF_MODEL)
    exported = ctx.last_artifact(ONNX) or source  # the engine build, when there is one, comes between
    onnx_dir = Path(exported.path)
    metrics = encoder.measure(onnx_dir, Path(teacher.path), ctx.evaluation, config, ctx.eval_labels)
    shape = encoder.encoder_shape(load_encoder(Path(ctx.last_artifact(HF_MODEL).path)))
    precision = exported.meta.precision
    predicted = encoder.predictions(shape, precision, ctx.target, ctx.power_mode, metrics["median_tokens"])
    gate = gate_json(encoder.gate_checks(metrics, predicted, ctx.target, ctx.require_measured))
    out = ctx.stage_dir / VALIDATION
    atomic_write_json(
        out,
        {
            "model_kind": ENCODER,
            "metrics": metrics,
            "predictions": predicted,
            "gate": gate,
            "shape": shape,
            "precision": precision,
        },
    )
    for domain, row in metrics["domains"].items():
        log.info(
            "%-12s %s", domain, ", ".join(f"{key} {value:.4f}" for key, value in row.items() if key != "sentences")
        )
    for row in metrics["host_latency"]:
        log.info(
            "host batch %2d: p50 %.1f ms, p90 %.1f ms, %.0f sentences/s",
            row["batch"],
            row["p50_ms"],
            row["p90_ms"],
            row["sentences_per_s"],
        )
    log.info("gate: %s", gate["verdict"])
    if "embedding_cosine_mean" in metrics:
        line = (f"{metrics['sentences']} sentences: cosine mean {metrics['embedding_cosine_mean']:.4f}, worst "
                f"{metrics['embedding_cosine_min']:.4f}, neighbour agreement {metrics['neighbour_agreement']:.3f}")
    else:
        line = f"{metrics['sentences']} sentences: label agreement {metrics['label_agreement']:.4f}"
    line += "; host " + ", ".join(f"batch {row['batch']} p50 {row['p50_ms']:.1f} ms" for row in metrics["host_latency"])
    return StageResult(Artifact(REPORT, out, ReportMeta(metrics=metrics, predictions=predicted, gate=gate)), line)


STAGE = register(
    StageDef(
        name="validate",
        summary="measure quality (per domain, or embeddings/labels for an encoder), latency and memory; gate them "
            "against the budgets",
        # A decoder's figures are taken in torch from the checkpoint (the ONNX only adds its parity and host latency),
        # so a decoder recipe may validate the quantized checkpoint itself; an encoder is measured in ONNX Runtime.
        input_kind=(ONNX, ENGINE, EDGELLM_BUNDLE, HF_MODEL),
        output_kind=REPORT,
        variants={
            DECODER: StageVariant(decoder.ValidateConfig, run_validate),
            ENCODER: StageVariant(encoder.ValidateEncoderConfig, run_validate_encoder, input_kind=(ONNX, ENGINE)),
        },
        uses_target=True,
    ),
    aliases={"validate_encoder": ENCODER},
)
