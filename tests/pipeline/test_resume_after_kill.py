"""A run killed with SIGKILL mid-stage resumes: finished stages are reused, nothing half-written stays."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO, TINY_SMOKE


def _command(model, out):
    return [
        sys.executable,
        "-m",
        "compress",
        "run",
        "target=jetson-orin",
        "recipe=baseline",
        f"model={model}",
        f"out={out}",
        *TINY_SMOKE,
    ]


def test_sigkill_during_export_then_rerun_resumes(tiny_llama_deep, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(_command(tiny_llama_deep, out), env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    killed_during_export = False
    while time.time() < deadline and proc.poll() is None:
        if (out / "01_load" / "stage.json").is_file() and list(out.glob(".tmp-02_export_onnx-*")):
            os.killpg(proc.pid, signal.SIGKILL)
            killed_during_export = True
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert killed_during_export, "the run finished before it could be killed mid-export"
    assert not (out / "02_export_onnx").exists()
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"
    assert not (out / "report.json").exists()

    rerun = subprocess.run(
        _command(tiny_llama_deep, out), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert rerun.returncode in (0, 1, 3), rerun.stderr[-3000:]
    assert "load: reused" in rerun.stderr
    statuses = [s["status"] for s in json.loads((out / "report.json").read_text())["stages"]]
    assert statuses == ["reused", "done", "done"]
    assert json.loads((out / "manifest.json").read_text())["status"] == "finished"
    assert not list(out.glob(".tmp-*"))
