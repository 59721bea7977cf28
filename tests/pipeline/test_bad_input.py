"""Bad input: one line naming the problem, exit status 2, and no run directory marked finished."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from compress.cli.main import main
from tests.conftest import REPO, TINY_SMOKE


def _fails_with_usage_error(capsys, args, needle):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[-1].startswith("compress: error:"), err
    assert needle in err[-1], err[-1]


def _not_finished(out: Path):
    manifest = out / "manifest.json"
    assert not manifest.exists() or json.loads(manifest.read_text())["status"] != "finished"
    assert not (out / "report.json").exists()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["target=jetson-moon"], "unknown target 'jetson-moon'"),
        (["target=jetson-orin", "recipe=nope"], "unknown recipe 'nope'"),
        (["target=jetson-orin", "colour=blue"], "unknown override key 'colour'"),
        (["target=jetson-orin", "validate.colour=blue"], "validate: colour: unknown key"),
        (["target=jetson-orin", "recipe=baseline", "quantize.bits=4"], "stage 'quantize' is not in recipe"),
        (["target=jetson-orin", "validate.eval_tokens=lots"], "validate: eval_tokens"),
        (["target=jetson-orin", "budgets.max_memory_gb=-1"], "budgets: max_memory_gb"),
        (["target=jetson-orin", "seed=abc"], "seed='abc': expected int"),
        (["target=jetson-orin", "power=5W"], "has no mode within 5 W"),
        (["target=jetson-orin", "power=TURBO"], "not a mode of jetson-orin-nano-8gb"),
        (["recipe=baseline"], "missing target=NAME"),
        (["target=jetson-orin", "model=/no/such/model"], "model not found"),
    ],
)
def test_usage_errors(capsys, tmp_path, extra, needle):
    out = tmp_path / "run"
    _fails_with_usage_error(capsys, ["run", f"out={out}", *extra], needle)
    assert not out.exists()


def test_corrupt_safetensors(capsys, tmp_path, tiny_llama):
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny_llama.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _fails_with_usage_error(
        capsys, ["run", "target=jetson-orin", f"model={broken}", f"out={tmp_path / 'run'}"], "truncated"
    )
    weights.write_bytes(b"\x00garbage" * 10)
    _fails_with_usage_error(
        capsys, ["run", "target=jetson-orin", f"model={broken}", f"out={tmp_path / 'run'}"], "corrupt safetensors"
    )


def test_folder_without_weights(capsys, tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    _fails_with_usage_error(capsys, ["run", "target=jetson-orin", f"model={folder}"], "has no weights")


def test_corrupt_gguf(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    _fails_with_usage_error(capsys, ["run", "target=jetson-orin", f"model={bad}"], "corrupt GGUF")
    bad.write_bytes(b"NOPE" * 8)
    _fails_with_usage_error(capsys, ["run", "target=jetson-orin", f"model={bad}"], "not a GGUF file")


def test_unsupported_gguf_architecture(capsys, tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _fails_with_usage_error(capsys, ["run", "target=jetson-orin", f"model={path}"], "GGUF architecture 'mamba'")


def test_empty_and_non_utf8_calibration_text(capsys, tmp_path, tiny_llama):
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n\n")
    _fails_with_usage_error(capsys, ["run", "target=jetson-orin", f"model={tiny_llama}", f"calib={empty}"], "is empty")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 au lait".encode("latin-1"))
    _fails_with_usage_error(
        capsys, ["run", "target=jetson-orin", f"model={tiny_llama}", f"calib={latin}"], "is not UTF-8"
    )


def test_calibration_overlapping_evaluation_is_refused(capsys, tiny_llama):
    evaluation = REPO / "calib_data" / "evaluation" / "prideprejudice.txt"
    _fails_with_usage_error(capsys, ["run", "target=jetson-orin", f"model={tiny_llama}", f"calib={evaluation}"],
                            "is the evaluation text")


def test_out_pointing_at_a_file(capsys, tmp_path, tiny_llama):
    file = tmp_path / "file"
    file.write_text("x")
    _fails_with_usage_error(capsys, ["run", "target=jetson-orin", f"model={tiny_llama}", f"out={file}"], "is a file")


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))


def test_disk_write_failure_is_a_usage_error_and_run_not_finished(tmp_path, tiny_llama):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "compress",
            "run",
            "target=jetson-orin",
            "recipe=baseline",
            f"model={tiny_llama}",
            f"out={out}",
            *TINY_SMOKE,
        ],
        capture_output=True,
        text=True,
        preexec_fn=_limit_file_size,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert last.startswith("compress: error: cannot write to"), last
    _not_finished(out)
    assert not list(out.glob(".tmp-*")), "a staging folder was left behind"


def test_a_library_failure_outside_a_stage_exits_4_not_the_gates_fail_code(capsys, monkeypatch, tmp_path, tiny_llama):
    """TensorRT, CUDA or any library raising in ``build-engine`` / ``validate`` is a failed step (4), never FAIL (1)."""
    import compress.pipeline.device

    run = tmp_path / "run"
    assert main(
        [
            "run",
            "target=jetson-orin",
            "recipe=smoke",
            f"model={tiny_llama}",
            f"out={run}",
            "quantize.calib_window=256",
            "quantize.min_calib_tokens=1024",
            *TINY_SMOKE,
        ]
    ) in (0, 1)
    capsys.readouterr()

    def driver_failure():
        # what cuda-python raises without a driver
        raise RuntimeError(
            "cuInit failed: CUDA_ERROR_NO_DEVICE\n(more lines)"
        )

    monkeypatch.setattr(compress.pipeline.device, "cuda_device", driver_failure)
    assert main(["build-engine", str(run)]) == 4
    err = capsys.readouterr().err
    assert err.startswith("compress: error: RuntimeError: cuInit failed") and "Traceback" not in err
