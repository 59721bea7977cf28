"""recipe=auto beside today's default and every uniform recipe that ships an Edge-LLM bundle, per target, one run each.

On the embedded SmolLM2, for the Orin Nano (INT8 and INT4 where the widths allow) and AGX Thor (also
FP8 and NVFP4): the gate's worst domain, top-1 agreement and KL on the six evaluation domains; the
app prompts' answer-prefix agreement; the latency model's predicted decode tokens/s and ms/token at
the target's default power mode; the Edge-LLM checkpoint's size; the formats chosen (groups per
format), the LM head's format and the quantize stage's time (for auto: the search). Runs go to ``bench_runs/auto/``.

    .venv/bin/python bench/auto_table.py                       # both targets
    .venv/bin/python bench/auto_table.py --targets jetson-orin-nano-8gb
    .venv/bin/python bench/auto_table.py --targets jetson-agx-thor --recipes thor-fp8 auto

``--shape NAME`` runs the same rows on a random-weight bf16 checkpoint of a published shape instead (built by
``bench/scale_table.py``'s builder, e.g. ``qwen3-0.6b``): quality there means nothing, but the search's cost, what it
chooses and whether Edge-LLM's exporter and the custody check accept it are real. ``--with KEY=VALUE ...`` adds words
to every ``compress run``.

    .venv/bin/python bench/auto_table.py --shape qwen3-0.6b --targets jetson-orin-nano-8gb --recipes auto default
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runs import REPO, compress_run  # noqa: E402
from scale_table import SHAPES, build  # noqa: E402

# SmolLM2's 576-wide inputs are not multiples of INT4's group of 128, which Edge-LLM's INT4 kernels need: the uniform
# INT4 recipe is refused at plan time as it ships, so it runs with only the 1,536-wide down_proj in INT4 (the README's
# way).
INT4_WHERE_LEGAL = "edgellm-int4 quantize.float_linears=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj]"
RECIPES = {"jetson-orin-nano-8gb": ["default", "edgellm-int8", INT4_WHERE_LEGAL, "auto"],
           "jetson-agx-thor": ["thor-fp8", "thor-nvfp4", "edgellm-int8", "auto"]}


def row(target: str, recipe: str, report: dict | None) -> str:
    if report is None:
        return f"| {target} | {recipe} | run failed | | | | | | | | | |"
    stages = {s["name"]: s for s in report["stages"]}
    validate = stages["validate"]["metrics"]
    quantize = stages["quantize"]["metrics"]
    chosen = report["predictions"]["chosen"]
    formats = quantize.get("formats_chosen") or {f"{quantize['method']} linears": quantize["quantized_linears"]}
    head = (quantize.get("search") or {}).get("lm_head", "fp16")
    checkpoint = stages["export_edgellm"]["metrics"]["checkpoint_bytes"] / 1e6
    prompts = validate.get("prompts") or {}
    return (
        f"| {target} | {recipe} | {validate['worst_domain']} {validate['perplexity_increase_pct']:+.2f}% | "
        f"{100 * validate['top1_agreement']:.1f}% | {validate['mean_kl']:.4f} | "
        f"{100 * prompts.get('answer_prefix_agreement', float('nan')):.1f}% | {chosen['decode_tokens_per_s']:.1f} | "
        f"{chosen['decode_latency_ms']:.3f} | {checkpoint:.0f} | {', '.join(f'{k} {v}' for k, v in formats.items())} | "
        f"{head} | {stages['quantize']['duration_s'] / 60:.1f} | {report['gate']['verdict']} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--recipes", nargs="+", help="only these rows (a recipe name, or the INT4 row's name)")
    parser.add_argument("--shape", choices=list(SHAPES), help="a random-weight checkpoint of this published shape")
    parser.add_argument(
        "--with", dest="extra", nargs="*", default=[], metavar="KEY=VALUE", help="more words for compress run"
    )
    args = parser.parse_args()
    model = [f"model={build(args.shape, weights=True)}"] if args.shape else []
    prefix = f"{args.shape}-" if args.shape else ""
    lines = ["| target | recipe | worst domain | top-1 | KL | answer prefix | predicted tok/s | predicted ms/token | "
             "checkpoint MB | formats (groups, or linears) | LM head | quantize min | gate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for target in args.targets:
        for entry in RECIPES[target]:
            recipe, *extra = entry.split()
            name = recipe + ("-down-proj-only" if extra else "")
            if args.recipes and name not in args.recipes:
                continue
            report = compress_run(
                recipe,
                REPO / "bench_runs" / "auto" / f"{prefix}{target}-{name}",
                *extra,
                *model,
                *args.extra,
                target=target,
            )
            lines.append(row(target, name, report))
            print("\n".join(lines), flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
