"""Shared by the benchmark scripts: one ``compress run`` into a folder of ``bench_runs/``, and its report."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def compress_run(recipe: str, out: Path, *extra: str, target: str = "jetson-orin") -> dict | None:
    """Run (or resume) ``compress run target=TARGET recipe=RECIPE out=OUT EXTRA...``; the report, or None if it
    failed."""
    cmd = [
        str(REPO / ".venv" / "bin" / "compress"),
        "run",
        f"target={target}",
        f"recipe={recipe}",
        f"out={out}",
        "--no-progress",
        *extra,
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=False)
    if not (out / "report.json").is_file():
        print(f"{recipe}: no report (the run failed; see {out / 'run.log'})", flush=True)
        return None
    return json.loads((out / "report.json").read_text())
