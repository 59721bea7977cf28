"""Quantization figures side by side, on one protocol, in one run.

Protocol: Pride and Prejudice after its first 5,000 characters, the first 8,192 tokens in
non-overlapping 512-token windows (the validate stage's defaults). Every row is a full
``compress run`` (quantize -> export_onnx -> validate) into ``bench_runs/quant/<row>``, so the
ONNX perplexity is measured in ONNX Runtime on the exported Q/DQ graph.

    .venv/bin/python bench/quantize_table.py            # all rows (~40 min on 2 cores)
    .venv/bin/python bench/quantize_table.py int8 int4-awq
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# This table's protocol: one domain (Pride and Prejudice), 8,192 tokens; bench/domain_table.py covers every domain.
AUSTEN_PROTOCOL = ["eval=calib_data/evaluation/prideprejudice.txt", "validate.eval_tokens=8192"]
OUT = REPO / "bench_runs" / "quant"

ROWS: dict[str, tuple[str, list[str]]] = {
    "fp32": ("baseline", []),
    "rtn-w8a8": ("int8", ["quantize.method=rtn", "quantize.bits=8", "quantize.hadamard_block=0"]),
    "int8": ("int8", []),
    "int8-smoothquant": ("int8", ["quantize.hadamard_block=0"]),
    "int8-fallback20": ("int8", ["quantize.float_activations_below_db=20"]),
    "rtn-int4-g64": ("int4", ["quantize.method=rtn", "quantize.bits=4", "quantize.group_size=64"]),
    "int4-awq": ("int4", ["quantize.algorithm=awq"]),
    "int4-gptq": ("int4", ["quantize.algorithm=gptq"]),
    "int4-awq+gptq": ("int4", ["quantize.algorithm=awq+gptq"]),
}


def run_row(name: str) -> dict:
    recipe, extra = ROWS[name]
    out = OUT / name
    cmd = [str(REPO / ".venv" / "bin" / "compress"), "run", "target=jetson-orin", f"recipe={recipe}", f"out={out}",
           "--no-progress", *AUSTEN_PROTOCOL, *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=False)
    report = json.loads((out / "report.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    validate = stages["validate"]["metrics"]
    quant = stages.get("quantize")
    return {
        "row": name,
        "ppl_model": validate["perplexity_model"],
        "ppl_teacher": validate["perplexity_teacher"],
        "ppl_torch_quantized": validate.get("perplexity_torch_quantized"),
        "increase_pct": validate["perplexity_increase_pct"],
        "onnx_size_mb": validate["model_size_bytes"] / 1e6,
        "decode_ms_p50": (validate["host_latency"] or {}).get("decode", {}).get("p50_ms"),
        "calibration_s": quant["metrics"]["calibration_seconds"] if quant else None,
        "quantize_peak_rss_mb": quant["peak_rss_mb"] if quant else None,
        "greedy_match": stages["export_onnx"]["metrics"]["parity"]["greedy_match"],
        "answer": stages["export_onnx"]["metrics"]["parity"]["greedy_text_onnx"],
    }


def interleaved_latency(
    names: list[str], rounds: int = 3, prompt_tokens: int = 128, new_tokens: int = 16
) -> dict[str, float]:
    """Median ORT decode ms/token per row, measured round-robin so machine noise hits every row alike."""
    from compress.backends.onnx.runtime import OnnxDecoder
    from compress.core.text import DEFAULT_EVALUATION, EVAL_SKIP_CHARS
    from compress.eval.latency import measure_decoder_latency
    from compress.models.loading import load_tokenizer

    decoders = {}
    for name in names:
        onnx_dir = next((OUT / name).glob("*_export_onnx/onnx"))
        decoders[name] = OnnxDecoder(onnx_dir)
    tokenizer = load_tokenizer(next((OUT / names[0]).glob("*_export_onnx/onnx")))
    prompt = tokenizer(DEFAULT_EVALUATION[0].read_text(encoding="utf-8")[EVAL_SKIP_CHARS:]).input_ids[:prompt_tokens]
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name, decoder in decoders.items():
            samples[name].append(measure_decoder_latency(decoder, prompt, new_tokens, warmup=1)["decode"]["p50_ms"])
    return {name: sorted(values)[len(values) // 2] for name, values in samples.items()}


def table(rows: list[dict]) -> str:
    fp32 = next((r for r in rows if r["row"] == "fp32"), None)
    lines = [
        "| row | ppl (deployed numbers, torch) | vs fp32 teacher | ppl torch on the ONNX parity sample | ONNX MB | "
        "size vs fp32 | "
        "ORT decode ms/token (interleaved) | latency vs fp32 | calibration s | quantize peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        size_ratio = f"{r['onnx_size_mb'] / fp32['onnx_size_mb']:.2f}x" if fp32 else "—"
        lat_ratio = f"{r['decode_ms_p50'] / fp32['decode_ms_p50']:.2f}x" if fp32 else "—"
        torch_q = f"{r['ppl_torch_quantized']:.3f}" if r["ppl_torch_quantized"] else "—"
        lines.append(
            f"| {r['row']} | {r['ppl_model']:.3f} | {r['increase_pct']:+.2f}% | {torch_q} | {r['onnx_size_mb']:.0f} | "
            f"{size_ratio} | {r['decode_ms_p50']:.1f} | {lat_ratio} | {r['calibration_s'] or '—'} | "
            f"{r['quantize_peak_rss_mb'] or '—'} |"
        )
    return "\n".join(lines)


def main() -> None:
    names = sys.argv[1:] or list(ROWS)
    if "fp32" not in names:
        names = ["fp32", *names]
    rows = [run_row(name) for name in names]
    latency = interleaved_latency(names)
    for row in rows:
        row["decode_ms_p50"] = latency[row["row"]]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(rows, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
