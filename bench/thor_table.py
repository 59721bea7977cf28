"""Jetson AGX Thor precisions on the embedded SmolLM2, one run per variant, side by side.

Each row is a full ``compress run target=jetson-agx-thor`` (quantize -> export_onnx -> export_edgellm ->
build_engine -> validate) into ``bench_runs/thor/<variant>``: FP8 W8A8, NVFP4 weight-only (W4A16)
and W4A4, FP8 with an FP8 KV cache, INT4 AWQ + GPTQ at group 128 (the only group Edge-LLM's INT4
kernels take, which on SmolLM2 divides only down_proj's 1536-wide input, so the other linears stay
FP16), and INT8 SmoothQuant. Quality is that of the numbers the Edge-LLM bundle holds, measured through
our Q/DQ ONNX in ONNX Runtime against the fp32 teacher on the six evaluation domains (the gate's
worst domain, the mixed text's perplexity change, top-1 agreement and KL); sizes are the unified
checkpoint's; decode tokens/s are the latency model's for Thor in each power mode at the budget's
4,096-token context.

    # every variant but the clipping comparisons (about an hour on 2 cores):
    .venv/bin/python bench/thor_table.py
    .venv/bin/python bench/thor_table.py fp8 nvfp4-w4a4
    # where clipping is scored:
    .venv/bin/python bench/thor_table.py nvfp4-w4a16-clip-sampled int4-awq+gptq-g128-down-clip-all
"""

from __future__ import annotations

import argparse
import json

from runs import REPO, compress_run

OUT = REPO / "bench_runs" / "thor"
TARGET = "jetson-agx-thor"
VARIANTS = {
    "fp8": ("thor-fp8", []),
    "fp8-kv-fp8": ("thor-fp8", ["quantize.kv_cache=fp8"]),
    "nvfp4-w4a16": ("thor-nvfp4", ["quantize.activations=float"]),
    "nvfp4-w4a4": ("thor-nvfp4", []),
    "int4-awq+gptq-g128-down": (
        "edgellm-int4",
        ["quantize.float_linears=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj]"],
    ),
    "int8-smoothquant": ("edgellm-int8", []),
    # Where AWQ's clipping is scored: on the sampled rows (the attention sink left out) or on every token.
    "nvfp4-w4a16-clip-sampled": ("thor-nvfp4", ["quantize.activations=float", "quantize.clip_tokens=sampled"]),
    "int4-awq+gptq-g128-down-clip-all": (
        "edgellm-int4",
        ["quantize.float_linears=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj]", "quantize.clip_tokens=all"],
    ),
}
DEFAULT_VARIANTS = [name for name in VARIANTS if "-clip-" not in name]


def run_row(variant: str) -> dict | None:
    recipe, extra = VARIANTS[variant]
    report = compress_run(recipe, OUT / variant, *extra, target=TARGET)
    if report is None:
        return None
    stages = {s["name"]: s for s in report["stages"]}
    validate, bundle = stages["validate"]["metrics"], stages["export_edgellm"]["metrics"]
    predictions = report["predictions"]
    return {
        "variant": variant,
        "recipe": recipe,
        "overrides": extra,
        "verdict": report["gate"]["verdict"],
        "worst_pct": validate["perplexity_increase_pct"],
        "worst_domain": validate["worst_domain"],
        "mixed_pct": validate["perplexity_increase_pct_mixed"],
        "top1": validate["top1_agreement"],
        "kl": validate["mean_kl"],
        "quant_algo": bundle["checkpoint"]["quant_algo"],
        "checkpoint_mb": bundle["checkpoint_bytes"] / 1e6,
        "linear_mb": bundle["checkpoint"]["quantized_linear_bytes"] / 1e6,
        "compared": bundle["custody"]["tensors_compared"],
        "decode_tok_s": {m["power_mode"]: m["decode_tokens_per_s"] for m in predictions["modes"]},
        "ttft_ms": predictions["chosen"]["ttft_ms"],
        "quantize_s": stages["quantize"]["duration_s"],
        "domains": validate["domains"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", metavar="VARIANT",
                        help=f"any of {', '.join(VARIANTS)} (default: all but the two clipping comparisons)")
    variants = parser.parse_args().variants or DEFAULT_VARIANTS
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r} (known: {', '.join(VARIANTS)})")
    rows = [row for row in (run_row(v) for v in variants) if row]
    modes = list(rows[0]["decode_tok_s"]) if rows else []
    print("\n| variant | checkpoint | worst domain | mixed | top-1 | KL | decoder linears MB | checkpoint MB | "
          + " | ".join(f"decode tok/s {m}" for m in modes) + " | TTFT ms | tensors checked | quantize s | gate |")
    print("|---" * (12 + len(modes)) + "|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['quant_algo']} | {r['worst_pct']:+.2f}% ({r['worst_domain']}) | "
            f"{r['mixed_pct']:+.2f}% | "
            f"{100 * r['top1']:.1f}% | {r['kl']:.4f} | {r['linear_mb']:.1f} | {r['checkpoint_mb']:.1f} | "
            + " | ".join(f"{r['decode_tok_s'][m]:.1f}" for m in modes)
            + f" | {r['ttft_ms']:.2f} | {r['compared']} | {r['quantize_s']:.0f} | {r['verdict']} |"
        )
    OUT.mkdir(parents=True, exist_ok=True)
    table = OUT / "table.json"
    earlier = json.loads(table.read_text()) if table.is_file() else {}
    table.write_text(json.dumps({**earlier, **{row["variant"]: row for row in rows}}, indent=2))


if __name__ == "__main__":
    main()
