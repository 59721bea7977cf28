"""Perplexity of pruned students before training, and optionally after a few KD steps.

Each argument is ``LAYERSxINTERMEDIATE`` (SmolLM2-135M is 30x1536), optionally ``:STEPS`` to also
train that many KD steps with the default recipe's distill settings (batch, sequence length,
learning rate). Layers are dropped by block influence and MLP channels by mean activation, exactly
as the distill stage builds its student; perplexity is measured in torch on the first 2,048 tokens
of the evaluation protocol.

    .venv/bin/python bench/student_shapes.py 29x1536 28x1536 30x1408 30x1280
    .venv/bin/python bench/student_shapes.py 30x1472:20 30x1408:30 29x1536:30
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time

from compress.core.config import load_recipe
from compress.core.text import (
    DEFAULT_CALIBRATION,
    DEFAULT_EVALUATION,
    EVAL_SKIP_CHARS,
    calibration_windows,
    load_calibration,
    token_windows,
)
from compress.eval.perplexity import perplexity, torch_logits_fn
from compress.models.loading import count_parameters, load_causal_lm, load_tokenizer
from compress.models.sources import DEFAULT_MODEL, materialize, resolve_model
from compress.transforms.distill.student import build_student
from compress.transforms.distill.train import DistillConfig, Distiller

TRAINING_KEYS = ("batch_size", "seq_len", "lr", "warmup_steps", "temperature", "train_windows", "seed")


def default_training_options() -> dict:
    """The default recipe's distill options that shape training (not the student)."""
    stage = next(s for s in load_recipe("default").stages if s.name == "distill")
    return {k: v for k, v in stage.options.items() if k in TRAINING_KEYS}


def main() -> None:
    folder = materialize(resolve_model(DEFAULT_MODEL))
    teacher = load_causal_lm(folder)
    tokenizer = load_tokenizer(folder)
    sources = load_calibration(DEFAULT_CALIBRATION)
    calibration = calibration_windows(tokenizer, sources, 512, 8)
    evaluation = token_windows(tokenizer, DEFAULT_EVALUATION[0].read_text(encoding="utf-8"), 512, 2048, EVAL_SKIP_CHARS)
    dense = perplexity(torch_logits_fn(teacher), evaluation, progress=False)
    training = default_training_options()
    print(f"KD settings (default recipe): {training}")
    print("| student (layers x MLP width) | parameters | layers dropped | perplexity before training | vs teacher "
          "| KD steps | perplexity after | vs teacher | training s |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| teacher {teacher.config.num_hidden_layers}x{teacher.config.intermediate_size} | "
        f"{count_parameters(teacher):,} | — | {dense:.2f} | — | | | | |"
    )
    for spec in sys.argv[1:] or ["29x1536", "28x1536", "30x1408", "30x1280"]:
        shape_spec, _, steps_spec = spec.partition(":")
        layers, width = (int(v) for v in shape_spec.split("x"))
        shape = {
            "num_layers": layers,
            "intermediate_size": width,
            "num_attention_heads": teacher.config.num_attention_heads,
        }
        student = copy.deepcopy(teacher)
        kept = build_student(student, calibration, shape)
        dropped = sorted(set(range(teacher.config.num_hidden_layers)) - set(kept["kept_layers"])) or "—"
        before = perplexity(torch_logits_fn(student), evaluation, progress=False)
        change = 100 * (before / dense - 1)
        row = f"| {shape_spec} | {count_parameters(student):,} | {dropped} | {before:.2f} | {change:+.1f}% |"
        if steps_spec:
            config = DistillConfig(num_layers=layers, intermediate_size=width, steps=int(steps_spec), **training,
                                   eval_every=10**6, checkpoint_every=10**6)
            train = calibration_windows(tokenizer, sources, config.seq_len, config.train_windows)
            started = time.perf_counter()
            with tempfile.TemporaryDirectory() as checkpoints:
                Distiller(student, teacher, train, config, checkpoints, kept["kept_layers"]).run(progress=False)
            seconds = time.perf_counter() - started
            after = perplexity(torch_logits_fn(student), evaluation, progress=False)
            row += f" {config.steps} | {after:.2f} | {100 * (after / dense - 1):+.1f}% | {seconds:.0f} |"
        else:
            row += " — | | | |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
