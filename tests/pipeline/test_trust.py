"""Trusting what is on disk: a changed model never reuses old results, a partial checkpoint never loads as random
weights, a tampered artifact is refused by every command that reads it, and nothing is deleted, written or run outside
what compress made. Real files, real runs, real processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from compress.cli.main import main
from compress.core.errors import Interrupted, raise_interrupted, signals_held
from compress.core.rundir import LOCK_FILE
from tests.conftest import CALIB, EVAL, REPO, TINY_SMOKE, baseline_run, build_tiny_llama

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
TARGETS = REPO / "compress" / "catalog" / "targets"


_run = baseline_run


def _statuses(out: Path) -> dict[str, str]:
    return {s["dir"]: s["status"] for s in json.loads((out / "manifest.json").read_text())["stages"]}


def _last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns(LOCK_FILE))
    return dest


def _flip_byte(path: Path, offset: int = 200) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


# 1. A changed model is a changed plan: nothing made from the old weights is reused.

@pytest.mark.parametrize("how", ["replaced", "overwritten"])
def test_a_changed_model_at_the_same_path_redoes_every_stage(tmp_path, user_model, how):
    model = shutil.copytree(user_model, tmp_path / "model")
    out = tmp_path / "run"
    assert _run(model, out) in (0, 1)
    first = json.loads((out / "report.json").read_text())
    other = build_tiny_llama(tmp_path / "other", seed=7)
    if how == "replaced":
        shutil.copy(other / "model.safetensors", model / "new.tmp")
        os.replace(model / "new.tmp", model / "model.safetensors")
    else:
        inode = (model / "model.safetensors").stat().st_ino
        (model / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
        assert (model / "model.safetensors").stat().st_ino == inode
    assert _run(model, out) in (0, 1)
    assert set(_statuses(out).values()) == {"done"}, _statuses(out)
    second = json.loads((out / "report.json").read_text())
    assert second["gate"]["checks"] != first["gate"]["checks"]


def test_a_stage_made_from_another_input_is_not_reused(finished, tmp_path):
    from compress.core.artifact import Artifact
    from compress.pipeline import execute
    from compress.pipeline.plan import RunOptions, build_plan

    out = _copy(finished, tmp_path / "run")
    manifest = json.loads((out / "manifest.json").read_text())
    pairs = {"target": "jetson-orin", "recipe": "baseline", "model": manifest["model"]["spec"], "out": str(out),
             **dict(p.split("=", 1) for p in TINY_SMOKE)}
    plan = build_plan(RunOptions.from_pairs(pairs))
    entries = {e["dir"]: e for e in manifest["stages"]}
    export = plan.stages[1]
    loaded = json.loads((out / "01_load" / "stage.json").read_text())["output"]
    same_input = Artifact(loaded["kind"], out / "01_load" / loaded["path"], loaded["meta"], loaded["sha256"])
    assert execute._reuse(out, export, same_input, entries[export.dirname]) is not None
    other_input = Artifact(loaded["kind"], same_input.path, loaded["meta"], "0" * 64)
    assert execute._reuse(out, export, other_input, entries[export.dirname]) is None


# 2. Weights that do not match config.json are refused, naming the tensors.

def test_config_with_more_layers_than_the_weights_is_refused(capsys, tmp_path, user_model):
    model = shutil.copytree(user_model, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (model / "config.json").write_text(json.dumps(config))
    assert _run(model, tmp_path / "run") == 2
    error = _last_error(capsys)
    assert "missing from the weights: model.layers.2." in error, error
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["status"] == "failed"


def test_a_tensor_deleted_from_the_weights_is_refused(capsys, tmp_path, user_model):
    from safetensors.torch import load_file, save_file

    model = shutil.copytree(user_model, tmp_path / "model")
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    assert _run(model, tmp_path / "run") == 2
    assert "missing from the weights: model.layers.1.mlp.up_proj.weight" in _last_error(capsys)


# 3. The model is read in place and checked before every stage; a copy, when asked for, is the run's own.

def test_the_model_is_read_in_place_and_a_change_to_it_is_seen(capsys, tmp_path, user_model):
    model = shutil.copytree(user_model, tmp_path / "model")
    out = tmp_path / "run"
    assert _run(model, out) in (0, 1)
    loaded = json.loads((out / "01_load" / "stage.json").read_text())["output"]
    assert loaded["read_in_place"] and Path(loaded["path"]) == model.resolve()
    assert not [p for p in (out / "01_load").rglob("*") if p.is_file() and p.name != "stage.json"]
    assert main(["verify", str(out)]) == 0
    assert f"the model read in place, {model.resolve()}, still holds what the run read" in capsys.readouterr().out
    _flip_byte(model / "model.safetensors", offset=4000)
    # The run directory is still what compress wrote (it can be shown, re-gated, copied and verified without the model);
    # verify says what became of the model, and a rerun reads it again from the start.
    assert main(["verify", str(out)]) == 0
    assert f"the model read in place, {model.resolve()}, does not hold what the run read" in capsys.readouterr().out
    assert main(["validate", str(out)]) in (0, 1)
    assert _run(model, out) in (0, 1)
    assert set(_statuses(out).values()) == {"done"}, _statuses(out)


def test_a_model_changed_while_the_run_goes_stops_the_run(tmp_path, user_model):
    model = shutil.copytree(user_model, tmp_path / "model")
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "compress",
        "run",
        "target=jetson-orin",
        "recipe=baseline",
        f"model={model}",
        f"out={out}",
        "--no-progress",
        *TINY_SMOKE,
    ]
    run = subprocess.Popen(command, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "01_load" / "stage.json").is_file():
        time.sleep(0.02)
    run.send_signal(signal.SIGSTOP)  # the user edits the model between the runner's checks
    try:
        _flip_byte(model / "model.safetensors", offset=4000)
    finally:
        run.send_signal(signal.SIGCONT)
    _, err = run.communicate(timeout=600)
    assert run.returncode == 2, err[-3000:]
    assert "changed while the run was going" in err.strip().splitlines()[-1]
    assert json.loads((out / "manifest.json").read_text())["status"] == "failed"
    assert not (out / "report.json").exists()


def test_the_run_copy_shares_no_inode_with_the_users_model_and_skips_linked_folders(tmp_path, user_model, finished):
    model = shutil.copytree(user_model, tmp_path / "model")
    (model / "loop").symlink_to(model, target_is_directory=True)
    out = tmp_path / "run"
    assert _run(model, out, "load.copy_model=true") in (0, 1)
    copy = out / "01_load" / "model"
    assert not (copy / "loop").exists()
    for name in ("model.safetensors", "config.json"):
        assert (copy / name).stat().st_ino != (model / name).stat().st_ino
    before = (model / "model.safetensors").read_bytes()
    with open(copy / "model.safetensors", "r+b") as handle:
        handle.write(b"\0" * 16)
    assert (model / "model.safetensors").read_bytes() == before


# 4. The overlap check reads the part of the evaluation text that is evaluated.

def test_calibration_holding_exactly_the_evaluated_part_is_refused(capsys, tmp_path, user_model):
    novel = EVAL.read_text(encoding="utf-8")
    (tmp_path / "novel.txt").write_text(novel)
    (tmp_path / "calib.txt").write_text(novel[5000:20000] + CALIB.read_text(encoding="utf-8")[:60_000])
    code = main(["run", "target=jetson-orin", f"model={user_model}", f"calib={tmp_path / 'calib.txt'}",
                 f"eval={tmp_path / 'novel.txt'}", f"out={tmp_path / 'run'}", "--dry-run"])
    assert code == 2
    assert "of the evaluated part of" in _last_error(capsys)


# 5. Every command that reads an artifact checks it first; `compress verify` checks everything.

def test_a_flipped_byte_in_a_finished_onnx_is_refused_by_show_validate_build_engine_and_verify(
    capsys, tmp_path, finished
):
    out = _copy(finished, tmp_path / "run")
    assert main(["verify", str(out)]) == 0
    assert "every recorded file holds what compress wrote" in capsys.readouterr().out
    data = next(p for p in (out / "02_export_onnx").rglob("*") if p.is_file() and p.suffix in (".data", ".onnx"))
    _flip_byte(data)
    for command in (["show", str(out)], ["validate", str(out)], ["build-engine", str(out)]):
        assert main(command) == 2, command
        assert f"{data} does not hold the content compress wrote" in _last_error(capsys), command
    assert main(["verify", str(out)]) == 2
    assert str(data) in capsys.readouterr().out


def test_a_copied_run_directory_verifies_in_full(tmp_path, finished):
    out = tmp_path / "copied"
    # new time stamps
    shutil.copytree(
        finished, out, copy_function=shutil.copyfile, ignore=shutil.ignore_patterns(LOCK_FILE)
    )
    assert main(["verify", str(out)]) == 0
    assert main(["show", str(out)]) == 0


def test_a_stage_the_manifest_records_otherwise_is_redone(tmp_path, finished, user_model):
    out = _copy(finished, tmp_path / "run")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["stages"][1]["output_sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert _run(user_model, out) in (0, 1)
    # The export is redone; it writes the same bytes, so the validation made from them still stands.
    assert _statuses(out) == {"01_load": "reused", "02_export_onnx": "done", "03_validate": "reused"}
    recorded = json.loads((out / "manifest.json").read_text())["stages"][1]["output_sha256"]
    assert recorded == json.loads((out / "02_export_onnx" / "stage.json").read_text())["output"]["sha256"] != "0" * 64


@pytest.mark.parametrize("where", ["../elsewhere", "/tmp", ".", "07_Link"])
def test_a_stage_folder_outside_the_run_is_never_read(capsys, tmp_path, finished, where):
    out = _copy(finished, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(out / "03_validate", elsewhere)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["stages"][2]["dir"] = where
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert main(["validate", str(out)]) == 2
    assert "not a compress manifest" in _last_error(capsys)


def test_a_stage_folder_that_is_a_link_is_refused(capsys, tmp_path, finished):
    out = _copy(finished, tmp_path / "run")
    shutil.move(out / "03_validate", tmp_path / "moved")
    (out / "03_validate").symlink_to(tmp_path / "moved", target_is_directory=True)
    assert main(["validate", str(out)]) == 2
    assert "is a symbolic link" in _last_error(capsys)


# 7. --force removes only stage folders compress made, inside out=.

@pytest.mark.parametrize("where", ["../victim", ".", "/tmp/victim"])
def test_force_never_removes_what_a_manifest_points_outside_its_stage_folders(
    capsys, tmp_path, finished, user_model, where
):
    out = _copy(finished, tmp_path / "run")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("mine")
    (out / "notes.txt").write_text("mine")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["stages"][1]["dir"] = where if where != "/tmp/victim" else str(victim)
    (out / "manifest.json").write_text(json.dumps(manifest))
    code = main(
        ["run", "target=jetson-orin", "recipe=sparse24", f"model={user_model}", f"out={out}", "--force", "--dry-run"]
    )
    assert code == 2
    assert "not a compress manifest" in _last_error(capsys)
    assert (victim / "precious.txt").read_text() == "mine" and (out / "notes.txt").read_text() == "mine"


def test_force_refuses_a_stage_folder_that_is_a_link(capsys, tmp_path, finished, user_model):
    out = _copy(finished, tmp_path / "run")
    victim = tmp_path / "victim"
    shutil.move(out / "02_export_onnx", victim)
    (out / "02_export_onnx").symlink_to(victim, target_is_directory=True)
    assert main(["run", "target=jetson-orin", "recipe=sparse24", f"model={user_model}", f"out={out}", "--force"]) == 2
    assert "is a symbolic link" in _last_error(capsys)
    assert (victim / "stage.json").is_file()


# 8. Files of the user's inside a run directory are never removed.

def test_a_rerun_keeps_the_users_files_beside_the_reports(tmp_path, finished, user_model):
    out = _copy(finished, tmp_path / "run")
    (out / "validate-notes.md").write_text("mine")
    (out / "plots" / "my_figure.png").write_bytes(b"mine")
    assert _run(user_model, out, "validate.eval_tokens=200") in (0, 1)
    assert (out / "validate-notes.md").read_text() == "mine"
    assert (out / "plots" / "my_figure.png").read_bytes() == b"mine"
    assert (out / "plots" / "stages.png").is_file()


def test_a_stage_folder_holding_a_users_file_is_not_replaced(capsys, tmp_path, finished, user_model):
    out = _copy(finished, tmp_path / "run")
    (out / "03_validate" / "my-notes.txt").write_text("mine")
    assert _run(user_model, out, "validate.eval_tokens=200") == 2
    assert "my-notes.txt is not a file compress wrote, so 03_validate is not replaced" in _last_error(capsys)
    assert (out / "03_validate" / "my-notes.txt").read_text() == "mine"


# 9-11. Names and values in generated scripts; names as file names; a target given as a file.

def test_a_target_field_with_a_line_break_runs_nothing_from_the_device_script(tmp_path):
    from compress.backends.edgellm import tools
    from compress.core.config import load_target

    target = load_target("jetson-orin")
    evil = target.model_copy(
        update={"edgellm": target.edgellm.model_copy(update={"support": f"x\ntouch {tmp_path / 'owned'}\n#"})}
    )
    profile = tools.engine_profile(evil, 1)
    script = tmp_path / "build_on_device.sh"
    script.write_text(tools.device_script(evil, profile, "../bundle/llm", "engines"))
    proc = subprocess.run(["bash", str(script)], env={**os.environ, "EDGELLM_TOOLS": str(tmp_path / "none")},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0  # the build tool is not there
    assert not (tmp_path / "owned").exists()


@pytest.mark.parametrize("name", ["../../escaped", "orin\ntouch owned", "a;b", "my orin"])
def test_a_target_name_that_is_no_file_name_is_refused(capsys, tmp_path, finished, name):
    data = yaml.safe_load((TARGETS / "jetson-orin-nano-8gb.yaml").read_text())
    data["name"] = name
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(data))
    out = _copy(finished, tmp_path / "run")
    assert main(["validate", str(out), f"target={tmp_path / 't.yaml'}"]) == 2
    assert "name" in _last_error(capsys)
    assert not list(tmp_path.glob("**/*escaped*"))


def test_a_target_given_as_a_file_works_end_to_end_and_after_the_file_is_gone(tmp_path, user_model):
    data = yaml.safe_load((TARGETS / "jetson-orin-nano-8gb.yaml").read_text())
    data["name"], data["aliases"] = "my-orin", []
    target = tmp_path / "my-orin.yaml"
    target.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    code = main(
        [
            "run",
            f"target={target}",
            "recipe=baseline",
            f"model={user_model}",
            f"out={out}",
            "--no-progress",
            *TINY_SMOKE,
        ]
    )
    assert code in (0, 1)
    assert json.loads((out / "report.json").read_text())["target"]["name"] == "my-orin"
    assert (out / "plots" / "pareto.png").is_file()
    target.unlink()
    assert main(["validate", str(out)]) == code
    assert (out / "validate-my-orin-MAXN_SUPER.json").is_file()


# Exit codes: one line naming the input, exit 2.

@pytest.mark.parametrize(
    ("manifest", "needle"),
    [
        (
            {"schema_version": "1.0", "status": "finished", "recipe": "baseline", "model": {"spec": "x"}, "stages": []},
            "recipe",
        ),
        (
            {
                "schema_version": "1.0",
                "status": "finished",
                "recipe": {"name": "baseline", "stages": []},
                "model": {"spec": "x"},
                "stages": [{"name": "load", "status": "done"}],
            },
            "stages.0.dir",
        ),
        ({}, "schema_version"),
        ([1, 2], "not a compress manifest"),
        (b"\x89PNG\r\n\x1a\n\xff\xfe", "unreadable"),
    ],
)
def test_show_validate_and_run_on_a_broken_manifest_exit_2(capsys, tmp_path, user_model, manifest, needle):
    out = tmp_path / "run"
    out.mkdir()
    (out / "manifest.json").write_bytes(manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode())
    (out / "report.json").write_text("{}")
    for command in (["show", str(out)], ["validate", str(out)], ["verify", str(out)],
                    ["run", "target=jetson-orin", "recipe=baseline", f"model={user_model}", f"out={out}", "--dry-run"]):
        assert main(command) == 2, command
        assert needle in _last_error(capsys), command


@pytest.mark.parametrize("report", [b"{}", b"[1]", b"\xff\xfe\x00"])
def test_validate_on_a_broken_report_exits_2(capsys, tmp_path, finished, report):
    out = _copy(finished, tmp_path / "run")
    (out / "report.json").write_bytes(report)
    assert main(["validate", str(out)]) == 2
    assert "report.json" in _last_error(capsys)


def _model_with(tmp_path, user_model, **changes) -> Path:
    model = shutil.copytree(user_model, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize(("changes", "needle"), [
    ({"num_hidden_layers": 100000}, "num_hidden_layers = 100000 is not a whole number from 1 to 1,024"),
    ({"hidden_size": -64}, "hidden_size = -64"),
    ({"num_attention_heads": 0}, "num_attention_heads = 0"),
    ({"num_attention_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"vocab_size": 100}, "the tokenizer makes 512 token ids but the embedding has 100 rows"),
])
def test_a_model_config_out_of_range_is_refused_at_plan_time(capsys, tmp_path, user_model, changes, needle):
    model = _model_with(tmp_path, user_model, **changes)
    assert main(["run", "target=jetson-orin", f"model={model}", f"out={tmp_path / 'run'}", "--dry-run"]) == 2
    assert needle in _last_error(capsys)


@pytest.mark.parametrize(("changes", "needle"), [
    ({"num_hidden_layers": -2}, "num_hidden_layers = -2"),
    ({"hidden_size": 10**400}, "hidden_size = a 401-digit number"),
    ({"num_key_value_heads": True}, "num_key_value_heads = True"),
])
def test_predict_refuses_a_config_out_of_range(capsys, tmp_path, changes, needle):
    config = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
              "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152} | changes
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["predict", "target=jetson-orin", f"model_config={tmp_path / 'config.json'}"]) == 2
    assert needle in _last_error(capsys)


@pytest.mark.parametrize(("override", "needle"), [
    ("validate.eval_tokens=true", "validate: eval_tokens"),
    ("budgets.max_ppl_increase_pct=1e309", "max_ppl_increase_pct"),
    ("budgets.max_ppl_increase_pct=Infinity", "max_ppl_increase_pct"),
    ("validate.window=64.0", "validate: window"),
])
def test_values_of_another_type_or_infinite_are_refused(capsys, tmp_path, user_model, override, needle):
    assert (
        main(["run", "target=jetson-orin", f"model={user_model}", f"out={tmp_path / 'run'}", override, "--dry-run"])
        == 2
    )
    assert needle in _last_error(capsys)


def test_a_safetensors_header_nested_too_deeply_exits_2(capsys, tmp_path, user_model):
    model = shutil.copytree(user_model, tmp_path / "model")
    header = ("[" * 100_000 + "]" * 100_000).encode()
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    assert main(["run", "target=jetson-orin", f"model={model}", f"out={tmp_path / 'run'}", "--dry-run"]) == 2
    assert "nested too deeply" in _last_error(capsys)


def test_a_home_folder_of_no_user_exits_2(capsys, tmp_path):
    assert (
        main(["run", "target=jetson-orin", "model=~nosuchuser-compress/x", f"out={tmp_path / 'run'}", "--dry-run"]) == 2
    )
    assert "model=~nosuchuser-compress/x" in _last_error(capsys)


def test_a_cache_folder_that_is_a_file_exits_2(capsys, tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    assert main(["run", "target=jetson-orin", f"out={tmp_path / 'run'}", "--dry-run"]) == 2
    assert "COMPRESS_CACHE" in _last_error(capsys)


# A second signal while the first one's failure is being recorded.

def test_a_signal_while_a_failure_is_recorded_is_held_until_it_is_written():
    previous = signal.signal(signal.SIGINT, raise_interrupted)
    written = []
    try:
        with pytest.raises(Interrupted) as caught, signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            written.append("manifest")  # the block runs to its end although the signal came first
        assert written == ["manifest"] and caught.value.exit_code == 130
    finally:
        signal.signal(signal.SIGINT, previous)


def test_sigterm_then_sigint_during_export_leaves_the_run_marked_failed(tmp_path, tiny_llama_deep):
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "compress",
        "run",
        "target=jetson-orin",
        "recipe=baseline",
        f"model={tiny_llama_deep}",
        f"out={out}",
        *TINY_SMOKE,
    ]
    proc = subprocess.Popen(command, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not list(out.glob(".tmp-02_export_onnx-*")):
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be signalled mid-export"
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.0015)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (130, 143), err[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"] == "terminated (SIGTERM)"
