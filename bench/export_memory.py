"""The ONNX export's peak memory by phase, on the quantized checkpoint of a finished run.

In a fresh process, :func:`compress.backends.onnx.export.export_decoder_folder` exports the run's
``02_quantize/model`` folder (e.g. the Qwen3-0.6B shape's from ``bench/scale_table.py --measure
qwen3-0.6b``) into a temporary folder: the peak resident memory of writing the graph (tracing the
skeleton, writing the weights), of ONNX Runtime's side of the parity check and of torch's reference
(each what the process held then, ``VmHWM``); the export's peak is the largest.

    .venv/bin/python bench/export_memory.py bench_runs/scale/qwen3-0.6b-default
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = r'''
import json, sys
from pathlib import Path
from compress.backends.onnx.export import export_decoder_folder

exported = export_decoder_folder(Path(sys.argv[1]), Path(sys.argv[2]))
print(json.dumps({"phases_mb": exported.phase_peak_rss_mb,
                  "onnx_bytes": exported.onnx_size_bytes, "max_abs_logit_diff": exported.parity["max_abs_logit_diff"]}))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    source = args.run_dir / "02_quantize" / "model"
    loaded = json.loads((args.run_dir / "01_load" / "stage.json").read_text())["output"]["path"]
    # read in place, or a copy
    model = (
        Path(loaded) if Path(loaded).is_absolute() else args.run_dir / "01_load" / loaded
    )
    checkpoint = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    with tempfile.TemporaryDirectory() as work:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(source), str(Path(work) / "onnx")],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    print("| phase | peak GiB |\n|---|---|")
    for name, mib in row["phases_mb"].items():  # the runner's MB are MiB (VmHWM's kB / 1024)
        print(f"| {name} | {mib / 1024:.2f} |")
    print(f"| the export (its largest phase) | {max(row['phases_mb'].values()) / 1024:.2f} |")
    if checkpoint:
        print(f"\ncheckpoint {checkpoint / 1e9:.2f} GB; ONNX {row['onnx_bytes'] / 1e9:.2f} GB; "
              f"max logit difference {row['max_abs_logit_diff']:.3g}")


if __name__ == "__main__":
    main()
