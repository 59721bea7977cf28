"""Run-directory safety: compress deletes only what it created, holds a lock, handles signals, and says the truth."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from compress.cli.main import main
from compress.core.errors import UsageError
from compress.core.rundir import LOCK_FILE, RunDirLock
from tests.conftest import CALIB, REPO, TINY_SMOKE, smoke_overrides

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _command(model: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "compress",
        "run",
        "target=jetson-orin",
        "recipe=baseline",
        f"model={model}",
        f"out={out}",
        *smoke_overrides(*extra),
    ]


def _last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_llama) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    proc = subprocess.run(_command(tiny_llama, out), env=ENV, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert (out / "report.json").is_file()
    return out


def _copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns(LOCK_FILE))
    return dest


# 1. Ownership: nothing of the user's is ever deleted.

def test_foreign_folder_is_refused_and_untouched(capsys, tmp_path, tiny_llama):
    out = tmp_path / "mine"
    (out / "00_important").mkdir(parents=True)
    (out / "00_important" / "data.txt").write_text("keep me")
    (out / ".tmp-editor-swap").write_text("swap")
    code = main(["run", "target=jetson-orin", "recipe=baseline", f"model={tiny_llama}", f"out={out}"])
    assert code == 2
    assert "is not empty and is not a compress run directory" in _last_error(capsys)
    assert (out / "00_important" / "data.txt").read_text() == "keep me"
    assert (out / ".tmp-editor-swap").read_text() == "swap"
    assert sorted(p.name for p in out.iterdir()) == [".tmp-editor-swap", "00_important"]


def test_relative_out_is_resolved_and_a_foreign_folder_refused(capsys, tmp_path, tiny_llama, monkeypatch):
    victim = tmp_path / "etc"
    victim.mkdir()
    (victim / "passwd").write_text("root:x:0:0")
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    code = main(["run", "target=jetson-orin", "recipe=baseline", f"model={tiny_llama}", "out=../../etc"])
    assert code == 2
    message = _last_error(capsys)
    assert str(victim) in message, message
    assert sorted(p.name for p in victim.iterdir()) == ["passwd"]


def test_manifest_that_is_not_ours_is_refused(capsys, tmp_path, tiny_llama):
    out = tmp_path / "other"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"name": "some other tool"}))
    assert main(["run", "target=jetson-orin", "recipe=baseline", f"model={tiny_llama}", f"out={out}"]) == 2
    assert "is not a compress manifest" in _last_error(capsys)
    assert [p.name for p in out.iterdir()] == ["manifest.json"]


def test_other_plan_needs_force_and_force_removes_only_recorded_stages(capsys, tmp_path, finished_run, tiny_llama):
    out = _copy_run(finished_run, tmp_path / "run")
    (out / "notes.txt").write_text("mine")
    (out / "07_mine").mkdir()
    (out / ".tmp-editor-swap").write_text("swap")
    other = ["run", "target=jetson-orin", "recipe=sparse24", f"model={tiny_llama}", f"out={out}", "--dry-run"]
    assert main(other) == 2
    assert "holds a run of another plan" in _last_error(capsys)
    assert (out / "02_export_onnx").is_dir() and (out / "report.json").is_file()

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "compress",
            "run",
            "target=jetson-orin",
            "recipe=sparse24",
            f"model={tiny_llama}",
            f"out={out}",
            "--force",
            "sparsify.calib_window=256",
            "sparsify.calib_windows=8",
            "sparsify.min_calib_tokens=1024",
            *TINY_SMOKE,
        ],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode in (0, 1, 3), proc.stderr[-3000:]
    names = {p.name for p in out.iterdir()}
    assert {"notes.txt", "07_mine", ".tmp-editor-swap"} <= names
    assert {"01_load", "02_sparsify", "03_export_onnx", "04_validate"} <= names
    assert "02_export_onnx" not in names and "03_validate" not in names
    assert json.loads((out / "manifest.json").read_text())["recipe"]["name"] == "sparse24"


# 2. The lock: one process per run directory; a SIGKILL leaves no stale lock.

def test_second_run_on_the_same_folder_is_refused_naming_the_pid(tmp_path, tiny_llama_deep):
    out = tmp_path / "run"
    first = subprocess.Popen(_command(tiny_llama_deep, out), env=ENV, cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "manifest.json").is_file():
        time.sleep(0.05)
    # The manifest is written under the lock; freezing the first run keeps it holding the lock however fast it would
    # otherwise finish, so the second run meets the lock on any machine.
    first.send_signal(signal.SIGSTOP)
    try:
        second = subprocess.run(
            _command(tiny_llama_deep, out), env=ENV, cwd=REPO, capture_output=True, text=True, timeout=120
        )
    finally:
        first.send_signal(signal.SIGCONT)
    _, first_err = first.communicate(timeout=600)
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"in use by another compress process (PID {first.pid})" in second.stderr.strip().splitlines()[-1]
    assert first.returncode in (0, 1, 3), first_err[-3000:]
    assert json.loads((out / "manifest.json").read_text())["status"] == "finished"
    for stage in ("01_load", "02_export_onnx", "03_validate"):
        assert (out / stage / "stage.json").is_file()
    assert json.loads((out / "01_load" / "stage.json").read_text())["output"]["read_in_place"]


def test_sigkill_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from compress.core.rundir import RunDirLock
        RunDirLock({str(tmp_path)!r}).acquire()
        print("locked", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(UsageError, match=f"PID {holder.pid}"):
        RunDirLock(tmp_path).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    lock = RunDirLock(tmp_path)
    lock.acquire()
    lock.release()


def test_validate_and_build_engine_take_the_lock(capsys, tmp_path, finished_run):
    run = _copy_run(finished_run, tmp_path / "run")
    with RunDirLock(run):
        assert main(["validate", str(run)]) == 2
        assert f"PID {os.getpid()}" in _last_error(capsys)
        assert main(["build-engine", str(run)]) == 2
        assert f"PID {os.getpid()}" in _last_error(capsys)
    assert main(["validate", str(run)]) in (0, 1)


# 3. Overlap of calibration and evaluation text cannot hide behind line wrapping.

def test_wrapped_copy_of_the_evaluation_text_is_refused(capsys, tmp_path, tiny_llama):
    evaluation = tmp_path / "eval.txt"
    evaluation.write_text(CALIB.read_text(encoding="utf-8")[200_000:260_000])
    calibration = tmp_path / "calib.txt"
    calibration.write_text(textwrap.fill(CALIB.read_text(encoding="utf-8")[150_000:300_000], 50))
    code = main(["run", "target=jetson-orin", f"model={tiny_llama}", f"calib={calibration}", f"eval={evaluation}",
                 f"out={tmp_path / 'run'}", "--dry-run"])
    assert code == 2
    assert "contains 100% of the evaluation text" in _last_error(capsys)


# 4. A failed rerun leaves no report from an earlier attempt.

def test_failed_rerun_removes_the_earlier_reports(capsys, tmp_path, finished_run, tiny_llama):
    run = _copy_run(finished_run, tmp_path / "run")
    assert (run / "report.md").is_file() and (run / "MODEL_CARD.md").is_file()
    proc = subprocess.run(_command(tiny_llama, run, "validate.window=100000"), env=ENV, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "window" in manifest["error"]
    for name in ("report.json", "report.md", "report.html", "MODEL_CARD.md", "plots"):
        assert not (run / name).exists(), name
    assert main(["show", str(run)]) == 0
    shown = capsys.readouterr().out
    assert "status:  failed" in shown and "gate:" not in shown


# 5. SIGTERM and SIGINT: staging removed, manifest failed with the reason, exit 128 + signal.

@pytest.mark.parametrize(("sig", "code", "reason"), [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                                      (signal.SIGINT, 130, "interrupted (SIGINT)")])
def test_signal_during_a_stage_cleans_up_and_marks_the_run_failed(tmp_path, tiny_llama_deep, sig, code, reason):
    out = tmp_path / "run"
    proc = subprocess.Popen(_command(tiny_llama_deep, out), env=ENV, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not list(out.glob(".tmp-02_export_onnx-*")):
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be signalled mid-export"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert not list(out.glob(".tmp-*"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"] == reason
    assert not (out / "report.json").exists()


# 6. Disk errors are exit 2 and name the path that could not be written.

def _limit_file_size(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_full_model_cache_is_a_usage_error_naming_the_cache(tmp_path, tiny_llama):
    from tests.support.gguf_files import write_gguf

    # its conversion writes ~0.4 MB of weights; the limit stops it
    gguf = write_gguf(
        tiny_llama, tmp_path / "tiny.gguf"
    )
    cache = tmp_path / "cache"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "compress",
            "run",
            "target=jetson-orin",
            "recipe=baseline",
            f"model={gguf}",
            f"out={tmp_path / 'run'}",
        ],
        env={**ENV, "COMPRESS_CACHE": str(cache)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_limit_file_size(200_000),
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert last.startswith(f"compress: error: cannot write to {cache / 'models'}"), last
    assert not [p for p in (cache / "models").iterdir() if p.name.startswith(".tmp-")]


def test_copy_into_a_full_folder_names_the_destination(tmp_path):
    from compress.models import loading as models

    source = tmp_path / "src"
    source.mkdir()
    (source / "weights.bin").write_bytes(os.urandom(300_000))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        with pytest.raises(UsageError) as caught:
            models.copy_model_folder([source / "weights.bin"], tmp_path / "dst")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(caught.value) == f"cannot write to {tmp_path / 'dst' / 'weights.bin'}: File too large"


# 7. Unsafe models: one line naming what the user gave, and the fix.

def _copy_model(tiny: Path, dest: Path) -> Path:
    shutil.copytree(tiny, dest)
    return dest


def test_pickled_code_is_refused_in_one_line(capsys, tmp_path, tiny_llama):
    import torch

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(tmp_path / "owned"),))

    model = _copy_model(tiny_llama, tmp_path / "evil")
    (model / "model.safetensors").unlink()
    torch.save({"weight": Payload()}, model / "pytorch_model.bin")
    code = main(["run", "target=jetson-orin", f"model={model}", f"out={tmp_path / 'run'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert lines == [lines[-1]], lines
    assert lines[-1].startswith(f"compress: error: model={model}: pytorch_model.bin holds pickled objects")
    assert "posix.system" in lines[-1] and "convert the weights to safetensors" in lines[-1]
    assert "weights_only=False" not in lines[-1]
    assert not (tmp_path / "owned").exists() and not (tmp_path / "run").exists()


def test_custom_code_is_refused_in_one_line(capsys, tmp_path, tiny_llama):
    model = _copy_model(tiny_llama, tmp_path / "custom")
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="my-robot-llm", auto_map={"AutoModelForCausalLM": "modeling_robot.RobotLM"})
    (model / "config.json").write_text(json.dumps(config))
    code = main(["run", "target=jetson-orin", f"model={model}", f"out={tmp_path / 'run'}"], )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert lines == [f"compress: error: model={model} runs its own Python code (model_type 'my-robot-llm', auto_map in "
                     "config.json); pass trust_remote_code=true if you trust it"]
    assert not (tmp_path / "run").exists()


# 8. validate --on-device without a device: exit 3, whatever the host checks say; memory is a device check.

def test_on_device_validate_without_a_gpu_exits_3_and_names_the_file(capsys, tmp_path, tiny_llama):
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "compress",
            "run",
            "target=jetson-orin",
            "recipe=smoke",
            f"model={tiny_llama}",
            f"out={run}",
            "quantize.calib_window=256",
            "quantize.min_calib_tokens=1024",
            *TINY_SMOKE,
        ],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert json.loads((run / "04_build_engine" / "stage.json").read_text())["status"] == "deferred"
    kl = json.loads((run / "05_validate" / "stage.json").read_text())["metrics"]["mean_kl"]
    assert kl > 0
    code = main(["validate", str(run), "--on-device", f"budgets.max_mean_kl={kl / 2}"])  # a host check that fails
    out = capsys.readouterr().out
    assert code == 3
    written = run / "validate-jetson-orin-nano-8gb-MAXN_SUPER.md"
    assert f": {written}" in out and written.is_file()
    assert "on-device measurement: not run" in out
    report = json.loads(written.with_suffix(".json").read_text())
    checks = {c["name"]: c for c in report["gate"]["checks"]}
    assert checks["mean_kl"]["verdict"] == "FAIL"
    for name in ("decode_latency_ms", "ttft_ms", "memory_gb"):
        assert checks[name]["verdict"] == "NOT_MEASURED" and checks[name]["source"] == "measured"
        assert checks[name]["detail"].startswith("not run")
    assert report["exit_code"] == 3


def test_a_signal_whose_exception_python_dropped_still_stops_the_run():
    """A signal landing in a weakref callback (torch's exporters free thread pools that way) raises where Python only
    prints the exception; the remembered signal is raised again at the next stage boundary."""
    import weakref

    from compress.core.errors import Interrupted, forget_pending_interrupts, raise_interrupted, raise_pending_interrupt

    class Pool:
        pass

    forget_pending_interrupts()
    pool = Pool()
    reference = weakref.ref(pool, lambda _ref: raise_interrupted(signal.SIGTERM, None))
    del pool  # the callback's Interrupted is printed and ignored by Python
    assert reference() is None
    with pytest.raises(Interrupted, match="terminated"):
        raise_pending_interrupt()
    forget_pending_interrupts()
    raise_pending_interrupt()  # nothing pending: no exception
