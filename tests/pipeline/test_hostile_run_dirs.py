"""A run directory received from elsewhere must not make compress write, empty or delete anything outside it: every file
compress opens for writing there is opened without following a link, and a link is refused (exit 2) and left alone.
Real runs on a tiny model, real links, real commands."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compress.cli.main import main
from compress.core.rundir import LOCK_FILE, PLOTS_DIR, RUN_LOG
from tests.conftest import REPO, TINY_SMOKE, baseline_run, build_tiny_llama

OUTSIDE_TEXT = "a file of the user's, outside the run directory\n"


_run = baseline_run


def _received(finished: Path, dest: Path) -> Path:
    """A copy of a finished run directory, as it arrives from another machine."""
    shutil.copytree(finished, dest, ignore=shutil.ignore_patterns(LOCK_FILE), symlinks=True)
    return dest


def _outside(tmp_path: Path, name: str = "victim.txt") -> Path:
    victim = tmp_path / "elsewhere" / name
    victim.parent.mkdir(exist_ok=True)
    victim.write_text(OUTSIDE_TEXT)
    return victim


def _last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("command", [["verify"], ["validate"], ["show"]])
def test_a_lock_file_linked_outside_is_refused_and_the_outside_file_is_untouched(capsys, tmp_path, finished, command):
    run = _received(finished, tmp_path / "run")
    victim = _outside(tmp_path)
    (run / LOCK_FILE).symlink_to(victim)
    code = main([*command, str(run)])
    assert victim.read_text() == OUTSIDE_TEXT
    if command != ["show"]:  # show takes no lock: it reads
        assert code == 2 and "is a symbolic link" in _last_error(capsys)
    assert (run / LOCK_FILE).is_symlink()  # refused, and left alone


def test_a_rerun_through_a_linked_lock_writes_nothing_outside(capsys, tmp_path, finished, user_model):
    run = _received(finished, tmp_path / "run")
    victim = _outside(tmp_path)
    (run / LOCK_FILE).symlink_to(victim)
    assert _run(user_model, run) == 2
    error = _last_error(capsys)
    assert victim.read_text() == OUTSIDE_TEXT and "is a symbolic link" in error


def test_a_run_log_linked_outside_is_refused_before_the_run_is_marked_running(capsys, tmp_path, finished, user_model):
    run = _received(finished, tmp_path / "run")
    victim = _outside(tmp_path)
    (run / RUN_LOG).unlink()
    (run / RUN_LOG).symlink_to(victim)
    manifest = (run / "manifest.json").read_text()
    assert _run(user_model, run) == 2
    assert victim.read_text() == OUTSIDE_TEXT
    error = _last_error(capsys)
    assert "run.log" in error and "symbolic link" in error
    assert (run / "manifest.json").read_text() == manifest  # not left "running"


def test_a_plots_folder_linked_outside_gets_no_plot(capsys, tmp_path, finished, user_model):
    run = _received(finished, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "stages.png"
    victim.write_text(OUTSIDE_TEXT)
    shutil.rmtree(run / PLOTS_DIR)
    (run / PLOTS_DIR).symlink_to(elsewhere, target_is_directory=True)
    assert _run(user_model, run) == 2
    assert victim.read_text() == OUTSIDE_TEXT and sorted(p.name for p in elsewhere.iterdir()) == ["stages.png"]
    error = _last_error(capsys)
    assert "plots" in error and "symbolic link" in error


def test_verify_reads_without_writing_and_two_verifications_run_side_by_side(tmp_path, finished):
    run = _received(finished, tmp_path / "run")
    assert main(["verify", str(run)]) in (0, 3)
    assert (run / LOCK_FILE).read_text() == ""  # a reader writes no PID into the lock
    from compress.core.rundir import locked

    with locked(run, shared=True):  # another reader holds it: a verification still runs
        assert main(["verify", str(run)]) in (0, 3)
    with locked(run):  # a writer holds it: a verification waits for nobody and says so
        assert main(["verify", str(run)]) == 2


def test_verify_on_a_directory_it_cannot_write_verifies_without_a_lock(capsys, tmp_path, finished, monkeypatch):
    """A read-only copy (a read-only mount: EROFS on creating the lock file) is verified, not reported as tampered."""
    run = _received(finished, tmp_path / "run")
    real_open = os.open

    def read_only_mount(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and Path(path).parent == run:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_mount)
    assert main(["verify", str(run)]) in (0, 3)
    assert not (run / LOCK_FILE).exists()
    assert "cannot write" not in capsys.readouterr().err


def _edit_manifest(run: Path, change) -> None:
    path = run / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("entry", ["plots/../notes.md", "/etc/hostname", "./notes.md", "plots//notes.md"])
def test_a_manifest_entry_that_is_not_a_plain_relative_path_is_refused_and_deletes_nothing(capsys, tmp_path, finished,
                                                                                           user_model, entry):
    run = _received(finished, tmp_path / "run")
    notes = run / "notes.md"
    notes.write_text("the user's notes\n")
    _edit_manifest(run, lambda m: m["files"].update({entry: {"size": 17, "mtime_ns": 0, "sha256": "0" * 64}}))
    assert _run(user_model, run) == 2
    assert "not a compress manifest" in _last_error(capsys) and notes.read_text() == "the user's notes\n"
    assert main(["verify", str(run)]) == 2


def test_a_stage_record_naming_a_file_outside_its_folder_fails_verification(capsys, tmp_path, finished):
    run = _received(finished, tmp_path / "run")
    record_path = next(run.glob("01_*/stage.json"))
    record = json.loads(record_path.read_text())
    record["files"]["../manifest.json"] = {"size": 1, "mtime_ns": 0, "sha256": "0" * 64}
    record_path.write_text(json.dumps(record))
    assert main(["verify", str(run)]) == 2
    assert "not a plain relative path" in capsys.readouterr().err


def test_a_report_the_user_annotated_is_neither_removed_nor_replaced(capsys, tmp_path, finished, user_model):
    run = _received(finished, tmp_path / "run")
    annotated = (run / "report.md").read_text() + "\nReviewed: ship it.\n"
    (run / "report.md").write_text(annotated)
    assert _run(user_model, run) == 2
    assert "report.md" in _last_error(capsys) and (run / "report.md").read_text() == annotated
    assert (run / "report.json").is_file()  # nothing else removed either


def test_a_refused_force_has_removed_nothing(capsys, tmp_path, finished, user_model):
    """Two stage folders of the replaced plan, the second holding a user's file: the refusal comes before the first is
    removed, and the manifest still describes the directory."""
    run = _received(finished, tmp_path / "run")
    stage_dirs = sorted(p.name for p in run.iterdir() if p.is_dir() and p.name[:2].isdigit())
    (run / stage_dirs[-1] / "mine.txt").write_text("a file of the user's\n")
    manifest = (run / "manifest.json").read_text()
    code = main(
        [
            "run",
            "target=jetson-orin",
            "recipe=smoke",
            f"model={user_model}",
            f"out={run}",
            "--no-progress",
            "--force",
            *TINY_SMOKE,
        ]
    )
    assert code == 2 and "mine.txt" in _last_error(capsys)
    assert sorted(p.name for p in run.iterdir() if p.is_dir() and p.name[:2].isdigit()) == stage_dirs
    assert (run / "manifest.json").read_text() == manifest


@pytest.mark.parametrize("how", ["orphan", "linked orphan", "linked report"])
def test_verify_fails_on_orphaned_or_linked_entries(capsys, tmp_path, finished, how):
    run = _received(finished, tmp_path / "run")
    first = next(p for p in sorted(run.iterdir()) if p.is_dir() and p.name[:2].isdigit())
    if how == "orphan":
        shutil.copytree(first, run / "99_extra")
    elif how == "linked orphan":
        (run / "99_extra").symlink_to(first, target_is_directory=True)
    else:
        shutil.move(run / "report.html", tmp_path / "report.html")
        (run / "report.html").symlink_to(tmp_path / "report.html")
    assert main(["verify", str(run)]) == 2
    said = capsys.readouterr()
    assert ("99_extra" if how != "linked report" else "report.html") in said.out + said.err


def test_a_file_changed_in_place_with_its_modification_time_put_back_is_seen(capsys, tmp_path, finished):
    """Size and modification time alike, content not: the change time (which cannot be set back) sends it to a full
    hash, so every command that reads the run refuses it, not only verify."""
    run = _received(finished, tmp_path / "run")
    assert main(["show", str(run)]) == 0
    graph = next(run.glob("*_export_onnx/onnx/*.onnx"))
    before = graph.stat()
    data = bytearray(graph.read_bytes())
    data[-1] ^= 0xFF
    graph.write_bytes(bytes(data))
    os.utime(graph, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert graph.stat().st_mtime_ns == before.st_mtime_ns and graph.stat().st_size == before.st_size
    capsys.readouterr()
    assert main(["show", str(run)]) == 2
    assert graph.name in _last_error(capsys)


@pytest.mark.parametrize("name", ["manifest.json", "stage.json"])
def test_a_json_file_nested_too_deeply_is_refused_as_corrupt(capsys, tmp_path, finished, user_model, name):
    run = _received(finished, tmp_path / "run")
    path = run / name if name == "manifest.json" else next(run.glob("01_*")) / name
    path.write_text("[" * 200_000 + "]" * 200_000)
    for command in (["show", str(run)], ["verify", str(run)]):
        assert main(command) == 2, command
    assert _run(user_model, run) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_key_given_twice_is_refused(capsys, user_model, tmp_path):
    code = main(["run", "target=jetson-orin", f"model={user_model}", f"out={tmp_path / 'run'}", "validate.window=64",
                 "validate.window=32", "--dry-run"])
    assert code == 2 and "validate.window= is given twice" in _last_error(capsys)


HOSTILE = "# Injected heading\n| x | [link](http://example.com) *"


def _with_hostile_names(report: dict) -> dict:
    from compress.report.figures import DOMAIN_QUALITY, PROMPT_ANSWERS

    stage = next(s for s in reversed(report["stages"]) if DOMAIN_QUALITY in (s.get("figures") or {}))
    quality = stage["figures"][DOMAIN_QUALITY]
    first = next(iter(quality["domains"]))
    quality["domains"] = {HOSTILE: quality["domains"][first], **quality["domains"]}
    quality["worst_domain"], quality["unseen_domains"] = HOSTILE, [HOSTILE]
    row = {
        "id": HOSTILE,
        "prompt": "p",
        "prefix_fraction": 1.0,
        "teacher_answer": "a",
        "model_answer": "a",
        "identical": True,
        "common_prefix": "a",
        "expect": None,
        "teacher_passes": None,
        "model_passes": None,
    }
    stage["figures"][PROMPT_ANSWERS] = {"prompts": 1, "source": "app.jsonl", "new_tokens": 4, "identical_answers": 1.0,
                                        "answer_prefix_agreement": 1.0, "first_token_agreement": 1.0, "rows": [row]}
    report["data"]["evaluation"][0]["domain"] = HOSTILE
    report["data"]["unseen_domains"] = [HOSTILE]
    report["model"]["spec"] = HOSTILE
    return report


def test_names_a_user_gave_cannot_inject_markdown_into_the_reports(finished):
    from compress.report.markdown import render_markdown
    from compress.report.model_card import render_model_card

    report = _with_hostile_names(json.loads((finished / "report.json").read_text()))
    for text in (render_markdown(report), render_model_card(report)):
        lines = text.splitlines()
        assert not [line for line in lines if line.startswith("# Injected") or line.startswith("| x |")]
        outside_code = re.sub(r"(`+).*?\1", "", text)  # inside a code span Markdown reads nothing as markup
        assert "[link](http" not in outside_code and "Injected heading" in text
        tables = [line for line in lines if line.startswith("| ") and "Injected" in line]
        for line in tables:  # a name stays in its own cell: the row has as many cells as its table's header
            header = next(h for h in reversed(lines[: lines.index(line)]) if h.startswith("|---"))
            assert line.replace("\\|", "").count("|") == header.count("|")


FILL_THE_DISK_WHEN_PLOTTING = """
import os, sys
import compress.report.build as build
plots = build.make_plots

def fill_the_disk_then_plot(*args, **kwargs):
    fd = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\\\\0" * 65536)
    except OSError:
        pass
    os.close(fd)
    return plots(*args, **kwargs)

build.make_plots = fill_the_disk_then_plot
from compress.cli.main import main
arguments = ["run", "target=jetson-orin", "recipe=baseline", "model=" + sys.argv[3], "out=" + sys.argv[1]]
sys.exit(main([*arguments, "--no-progress", *sys.argv[4:]]))
"""


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs of its own (the disk a full-disk test may fill without touching anything else)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("needs a tmpfs of its own (mount as root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_disk_that_fills_while_plotting_fails_the_run_naming_the_plot(tmp_path, finished, small_disk):
    run = _received(finished, small_disk / "run")
    model = json.loads((run / "manifest.json").read_text())["model"]["spec"]
    script = tmp_path / "fill.py"
    script.write_text(FILL_THE_DISK_WHEN_PLOTTING)
    proc = subprocess.run(
        [sys.executable, str(script), str(run), str(small_disk / "filler"), model, *TINY_SMOKE],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("compress: error: cannot write to ") and "plots/stages.png" in last
    manifest = json.loads((run / "manifest.json").read_text())
    # the disk was full, the failure is recorded
    assert (
        manifest["status"] == "failed" and "stages.png" in manifest["error"]
    )
    assert not list((run / "plots").glob(".*partial*"))


@pytest.fixture
def chat_model(tmp_path) -> Path:
    return build_tiny_llama(tmp_path / "chat", chat_template=True)


def test_a_chat_template_that_does_not_parse_is_refused_at_plan_time(capsys, tmp_path, chat_model):
    config_file = chat_model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{% for message in messages %}{{ message.content }"
    config_file.write_text(json.dumps(config))
    (chat_model / "chat_template.jinja").unlink(missing_ok=True)
    capsys.readouterr()
    code = main(["run", "target=jetson-orin", f"model={chat_model}", f"out={tmp_path / 'run'}", "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "chat template" in err[0] and "does not parse" in err[0]


def test_a_tokenizer_file_that_is_a_device_is_refused_in_one_line(capsys, tmp_path, chat_model):
    (chat_model / "tokenizer.json").unlink()
    (chat_model / "tokenizer.json").symlink_to("/dev/zero")
    capsys.readouterr()
    code = main(["run", "target=jetson-orin", f"model={chat_model}", f"out={tmp_path / 'run'}", "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "tokenizer.json is not a regular file" in err[0]


def test_an_app_prompt_longer_than_the_target_s_context_is_refused_not_passed(capsys, tmp_path, user_model):
    prompts = tmp_path / "app.jsonl"
    prompts.write_text(
        json.dumps({"id": "long", "prompt": "word " * 400}) + "\n" + json.dumps({"prompt": "short"}) + "\n"
    )
    code = _run(
        user_model, tmp_path / "run", f"prompts={prompts}", "budgets.context_length=128", "budgets.prompt_length=16"
    )
    error = _last_error(capsys)
    assert code == 2 and "'long'" in error and "context_length 128" in error


@pytest.mark.parametrize("kind", ["empty parquet", "fifo"])
def test_data_that_cannot_be_read_is_named_for_what_it_is(capsys, tmp_path, user_model, kind):
    if kind == "fifo":
        data = tmp_path / "calib.txt"
        os.mkfifo(data)  # a reader would block on it for ever
        expected = "is not a regular file (a FIFO, a device or a socket)"
    else:
        data = tmp_path / "calib.parquet"
        data.write_bytes(b"")
        expected = "is empty"
    code = main(
        ["run", "target=jetson-orin", f"model={user_model}", f"out={tmp_path / 'run'}", f"calib={data}", "--dry-run"]
    )
    error = _last_error(capsys)
    assert code == 2 and str(data) in error and expected in error


def _domains_file(path: Path, domains: int) -> Path:
    words = (CALIB_TEXT * 4).split()
    rows = [
        {"domain": f"d{i}", "text": " ".join(words[i * 300 % 20_000 : i * 300 % 20_000 + 1200])} for i in range(domains)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


CALIB_TEXT = (REPO / "compress" / "catalog" / "text" / "evaluation" / "learned.txt").read_text(encoding="utf-8")[
    :200_000
]


def test_thousands_of_evaluation_domains_are_refused_and_a_few_dozen_are_estimated(capsys, tmp_path, user_model):
    def planned(domains: int) -> tuple[int, dict]:
        data = _domains_file(tmp_path / f"eval{domains}.jsonl", domains)
        code = main(["run", "target=jetson-orin", "recipe=baseline", f"model={user_model}", f"out={tmp_path / 'run'}",
                     f"eval={data}", "--dry-run"])
        said = capsys.readouterr()
        return code, (json.loads(said.out) if code == 0 else {"error": said.err})

    code, refused = planned(10_000)
    assert code == 2 and "10,000 domains" in refused["error"]
    seconds = {}
    for domains in (6, 30):
        code, plan = planned(domains)
        assert code == 0
        seconds[domains] = next(e for e in plan["estimates"] if e["stage"] == "validate")["seconds"]
    assert seconds[30] > 3 * seconds[6]


def test_a_fifo_planted_as_the_run_log_is_refused_not_waited_on(capsys, tmp_path, finished, user_model):
    run = _received(finished, tmp_path / "run")
    (run / RUN_LOG).unlink()
    os.mkfifo(run / RUN_LOG)
    assert _run(user_model, run) == 2
    assert "run.log is not a regular file" in _last_error(capsys)
