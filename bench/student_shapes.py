"""Perplexity of pruned students before any training: what a shape costs before distillation repairs it.

Each argument is ``LAYERSxINTERMEDIATE`` (SmolLM2-135M is 30x1536). Layers are dropped by block
influence and MLP channels by mean activation, exactly as the distill stage builds its student;
perplexity is measured in torch on the first 2,048 tokens of the evaluation protocol.

    .venv/bin/python bench/student_shapes.py 29x1536 28x1536 30x1408 30x1280
"""

from __future__ import annotations

import copy
import sys

from compress.data import DEFAULT_CALIBRATION, DEFAULT_EVALUATION, EVAL_SKIP_CHARS, calibration_windows, load_calibration, token_windows
from compress.distillation import build_student
from compress.eval.perplexity import perplexity, torch_logits_fn
from compress.models import DEFAULT_MODEL, count_parameters, load_causal_lm, load_tokenizer, materialize, resolve_model


def main() -> None:
    folder = materialize(resolve_model(DEFAULT_MODEL))
    teacher = load_causal_lm(folder)
    tokenizer = load_tokenizer(folder)
    calibration = calibration_windows(tokenizer, load_calibration(DEFAULT_CALIBRATION), 512, 8)
    evaluation = token_windows(tokenizer, DEFAULT_EVALUATION.read_text(encoding="utf-8"), 512, 2048, EVAL_SKIP_CHARS)
    dense = perplexity(torch_logits_fn(teacher), evaluation, progress=False)
    print("| student (layers x MLP width) | parameters | layers dropped | perplexity | vs teacher |")
    print("|---|---|---|---|---|")
    print(f"| teacher {teacher.config.num_hidden_layers}x{teacher.config.intermediate_size} | {count_parameters(teacher):,} | — | "
          f"{dense:.2f} | — |")
    for spec in sys.argv[1:] or ["29x1536", "28x1536", "30x1408", "30x1280"]:
        layers, width = (int(v) for v in spec.split("x"))
        student = copy.deepcopy(teacher)
        heads = teacher.config.num_attention_heads
        kept = build_student(student, calibration, {"num_layers": layers, "intermediate_size": width, "num_attention_heads": heads})
        dropped = sorted(set(range(teacher.config.num_hidden_layers)) - set(kept["kept_layers"])) or "—"
        ppl = perplexity(torch_logits_fn(student), evaluation, progress=False)
        print(f"| {spec} | {count_parameters(student):,} | {dropped} | {ppl:.2f} | {100 * (ppl / dense - 1):+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
