"""The figures a stage records for the report, by name: stages write them into ``stage.json``, the report reads them.

A stage's ``figures`` (see :class:`~compress.pipeline.stage.StageResult`) hold only these keys; the
report never reads a stage's metrics by name or finds a stage by its name.
"""

from __future__ import annotations

from typing import Any

SIZE_MB = "size_mb"  # size of the stage's model (MB), for the size-and-perplexity plot
# {stage name: perplexity of that stage's model} (the validation measures them)
PERPLEXITY_BY_STAGE = "perplexity_by_stage"
LAYER_SQNR = "layer_sqnr_db"  # [{"name": linear, "sqnr_db": ...}]: quantization error per linear
QUANTIZATION = "quantization"  # one line: method, algorithm, formats, calibration tokens (the model card's)
# a decoder's {"domains", "mixed", "worst_domain", "unseen_domains"} against its teacher
DOMAIN_QUALITY = "domain_quality"
# quantize.method=auto: candidates measured, references, sensitivities, the plan, its mix
PRECISION_SEARCH = "precision_search"
# the app prompts' comparison: {"rows": [teacher vs deployed answer, worst first], shares}
PROMPT_ANSWERS = "prompt_answers"
# {"loss", "before", "teacher", "before_unseen", "teacher_unseen", "stopped_early_at", "points"}
TRAINING_CURVE = "training_curve"


def figure(report: dict[str, Any], name: str) -> Any:
    """The figure ``name`` of the last stage of ``report`` that recorded it, or None."""
    return next(
        (s["figures"][name] for s in reversed(report.get("stages", [])) if name in (s.get("figures") or {})), None
    )


def validation_metrics(report: dict[str, Any]) -> dict[str, Any]:
    """The measurements of the run's validation (the stage whose output is the report); empty without one."""
    return next((s.get("metrics") or {} for s in reversed(report.get("stages", [])) if s.get("kind") == "report"), {})
