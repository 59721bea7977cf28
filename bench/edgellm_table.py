"""TensorRT Edge-LLM deployment figures for the embedded SmolLM2, one run per recipe, side by side.

Each row is a full ``compress run`` (quantize -> export_onnx -> export_edgellm -> build_engine -> validate) into
``bench_runs/edgellm/<recipe>``. The quality columns are those of the numbers the bundle holds,
measured through our Q/DQ ONNX in ONNX Runtime (exported from the same quantized folder; the
custody check proves the bundle holds exactly its integers and scales), against the fp32 teacher
on the six evaluation domains. Sizes compare the unified checkpoint, the bundle and our ONNX.

    .venv/bin/python bench/edgellm_table.py                 # every recipe (~30 min on 2 cores)
    .venv/bin/python bench/edgellm_table.py edgellm-int4
"""

from __future__ import annotations

import argparse
import json

from runs import REPO, compress_run

OUT = REPO / "bench_runs" / "edgellm"
# Edge-LLM's INT4 kernels take groups of 128 only, which divide only down_proj's 1536-wide input on SmolLM2 (576
# elsewhere): the INT4 bundle that ships keeps every other linear FP16.
INT4_LEGAL = "quantize.float_linears=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj]"
RECIPES = {"edgellm-int4": [INT4_LEGAL], "edgellm-int8": [], "default": []}


def run_row(recipe: str) -> dict | None:
    report = compress_run(recipe, OUT / recipe, *RECIPES[recipe])
    if report is None:
        return None
    stages = {s["name"]: s for s in report["stages"]}
    validate, bundle = stages["validate"]["metrics"], stages["export_edgellm"]["metrics"]
    return {
        "recipe": recipe,
        "verdict": report["gate"]["verdict"],
        "worst_pct": validate["perplexity_increase_pct"],
        "worst_domain": validate["worst_domain"],
        "mixed_pct": validate["perplexity_increase_pct_mixed"],
        "top1": validate["top1_agreement"],
        "kl": validate["mean_kl"],
        "quant_algo": bundle["checkpoint"]["quant_algo"],
        "linear_ratio": bundle["checkpoint"]["ratio_vs_fp16"],
        "checkpoint_mb": bundle["checkpoint_bytes"] / 1e6,
        "bundle_mb": bundle["bundle_bytes"] / 1e6,
        "onnx_mb": validate["model_size_bytes"] / 1e6,
        "export_s": bundle["export_seconds"],
        "compared": bundle["custody"]["tensors_compared"],
        "float_linears": bundle["checkpoint"].get("float_linears", 0),
        "domains": validate["domains"],
        "quantize_s": stages["quantize"]["duration_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipes", nargs="*", metavar="RECIPE", help=f"any of {', '.join(RECIPES)} (default: all)")
    recipes = parser.parse_args().recipes or RECIPES
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown:
        parser.error(f"unknown recipe {unknown[0]!r} (known: {', '.join(RECIPES)})")
    rows = [row for row in (run_row(r) for r in recipes) if row]
    print(
        "\n| recipe | format | worst domain | mixed | top-1 | KL | linears vs fp16 | checkpoint MB | bundle MB | our "
        "ONNX MB | export s | tensors compared | gate |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['recipe']} | {r['quant_algo']} | {r['worst_pct']:+.2f}% ({r['worst_domain']}) | "
            f"{r['mixed_pct']:+.2f}% | "
            f"{100 * r['top1']:.1f}% | {r['kl']:.4f} | {r['linear_ratio']:.3f}x | {r['checkpoint_mb']:.0f} | "
            f"{r['bundle_mb']:.0f} | {r['onnx_mb']:.0f} | {r['export_s']:.0f} | {r['compared']} | {r['verdict']} |"
        )
    (OUT / "table.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
