"""Distillation: student construction, the KD loss, determinism, resume, 2-process DDP on gloo, and the 7B plan."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from compress.cli.main import main
from compress.transforms.distill.student import build_student, layer_influence, plan_from_config
from compress.transforms.distill.train import DistillConfig, Distiller, kd_loss, write_job
from tests.conftest import CALIB, REPO, TINY_SMOKE, build_tiny_llama


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    return build_tiny_llama(
        tmp_path_factory.mktemp("d4") / "m", layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128
    )


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def _windows(n=16, length=64, vocab=512, seed=0):
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def _config(**overrides):
    base = dict(
        num_layers=2,
        intermediate_size=64,
        steps=6,
        batch_size=4,
        seq_len=64,
        checkpoint_every=3,
        eval_every=100,
        warmup_steps=1,
        lr=1e-3,
    )
    return DistillConfig(**{**base, **overrides})


def test_kd_loss_is_zero_for_identical_distributions():
    logits = torch.randn(2, 5, 11)
    assert float(kd_loss(logits, logits, 2.0)) == pytest.approx(0.0, abs=1e-6)
    assert float(kd_loss(logits, torch.randn(2, 5, 11), 2.0)) > 0.01


def test_student_reloads_with_plain_transformers_and_follows_importance(llama4, tmp_path):
    model = _load(llama4)
    windows = _windows(4)
    with torch.no_grad():  # make channel 7 of every MLP dominate, so width pruning must keep it
        for block in model.model.layers:
            block.mlp.up_proj.weight[7] *= 50
    influence = layer_influence(model, windows)
    expected = sorted(sorted(range(4), key=lambda i: -influence[i])[:2])
    built = build_student(model, windows, {"num_layers": 2, "intermediate_size": 64, "num_attention_heads": 4})
    assert built["kept_layers"] == expected
    model.save_pretrained(tmp_path / "student")
    student = _load(tmp_path / "student")
    assert student.config.num_hidden_layers == 2 and student.config.intermediate_size == 64
    assert student.model.layers[0].mlp.up_proj.out_features == 64
    kept_rows = student.model.layers[0].mlp.up_proj.weight.abs().sum(dim=1)
    assert float(kept_rows.max()) > 10 * float(kept_rows.median())  # the dominant channel survived
    with torch.no_grad():
        assert student(windows[:1]).logits.shape == (1, 64, 512)


def _student(llama4, windows):
    model = _load(llama4)
    built = build_student(model, windows, {"num_layers": 2, "intermediate_size": 64, "num_attention_heads": 4})
    return model, built


def test_training_lowers_the_loss_and_is_deterministic(llama4, tmp_path):
    windows = _windows()
    results = []
    for run in range(2):
        torch.manual_seed(0)
        student, built = _student(llama4, windows[:4])
        distiller = Distiller(
            student, _load(llama4), windows, _config(steps=8), tmp_path / f"c{run}", built["kept_layers"]
        )
        history = distiller.run(progress=False)
        results.append((history, {k: v.clone() for k, v in student.state_dict().items()}))
    (h0, w0), (h1, w1) = results
    assert [p["loss"] for p in h0] == [p["loss"] for p in h1]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert h0[-1]["loss"] < h0[0]["loss"]


def test_resume_from_checkpoint_reaches_the_same_weights(llama4, tmp_path):
    windows = _windows()
    torch.manual_seed(0)
    student, built = _student(llama4, windows[:4])
    Distiller(student, _load(llama4), windows, _config(), tmp_path / "straight", built["kept_layers"]).run(
        progress=False
    )
    reference = {k: v.clone() for k, v in student.state_dict().items()}

    torch.manual_seed(0)
    student, built = _student(llama4, windows[:4])
    interrupted = Distiller(
        student, _load(llama4), windows, _config(eval_every=1), tmp_path / "killed", built["kept_layers"]
    )

    def crash():
        if interrupted.step == 4:
            raise KeyboardInterrupt
        return {"perplexity": 0.0}

    with pytest.raises(KeyboardInterrupt):
        interrupted.run(crash, progress=False)
    torch.manual_seed(0)
    student, built = _student(llama4, windows[:4])
    resumed = Distiller(student, _load(llama4), windows, _config(), tmp_path / "killed", built["kept_layers"])
    resumed.run(progress=False)
    assert resumed.step == 6
    assert all(torch.allclose(reference[k], v, atol=1e-6) for k, v in student.state_dict().items())


def test_two_gloo_processes_match_one_process(llama4, tmp_path):
    windows = _windows()
    student, built = _student(llama4, windows[:4])
    student.save_pretrained(tmp_path / "init")
    torch.save(windows, tmp_path / "windows.pt")
    outputs = {}
    for processes in (1, 2):
        config = _config(processes=processes, steps=4)
        job = tmp_path / f"job{processes}.json"
        write_job(
            job,
            {
                "student": str(tmp_path / "init"),
                "teacher": str(llama4),
                "windows": str(tmp_path / "windows.pt"),
                "config": config.model_dump(mode="json"),
                "checkpoints": str(tmp_path / f"ck{processes}"),
                "out": str(tmp_path / f"out{processes}"),
                "kept_layers": built["kept_layers"],
            },
        )
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={processes}",
                "-m",
                "compress.transforms.distill.worker",
                "--job",
                str(job),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[processes] = _load(tmp_path / f"out{processes}").state_dict()
    for key, value in outputs[1].items():
        torch.testing.assert_close(outputs[2][key], value, atol=2e-5, rtol=1e-4)


def test_7b_plan_from_config_alone(tmp_path, capsys):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["run", "target=rtx-4090", "recipe=llama-7b-to-3b", f"model={tmp_path}", "--dry-run"]) == 0
    plan = next(s for s in json.loads(capsys.readouterr().out)["stages"] if s["name"] == "distill")["plan"]
    assert 6.5e9 < plan["teacher_parameters"] < 7.0e9
    assert 2.7e9 < plan["student_parameters"] < 3.1e9
    assert plan["student_shape"]["num_layers"] < 32 and plan["gpus"] == 8
    assert 0 < plan["memory_per_gpu_gb"] < 80
    assert plan["launch"].startswith("torchrun --standalone --nproc_per_node=8")
    one_gpu = plan_from_config(config, DistillConfig(target_parameters=3e9, precision="bf16"), gpus=1)
    assert one_gpu["memory_per_gpu_gb"] > plan["memory_per_gpu_gb"] * 4


def test_default_recipe_does_not_distill_and_the_distill_recipe_plans_a_half_size_student(capsys):
    assert main(["run", "target=jetson-orin", "--dry-run"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert [s["name"] for s in stages] == [
        "load",
        "quantize",
        "export_onnx",
        "export_edgellm",
        "build_engine",
        "validate",
    ]
    quantize = next(s for s in stages if s["name"] == "quantize")["config"]
    assert quantize["method"] == "int8" and quantize["hadamard_block"] == 0
    assert main(["run", "target=jetson-orin", "recipe=distill", "--dry-run"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    distill = next(s for s in stages if s["name"] == "distill")
    assert distill["config"]["teacher_generations"] == 64 and distill["config"]["stop_when_unseen_worse_pct"] == 1.0
    assert distill["plan"]["teacher_parameters"] == 134_515_008
    assert distill["plan"]["student_parameters"] < 0.55 * 134_515_008


def test_distill_then_quantize_export_and_validate(llama4, tmp_path):
    out = tmp_path / "run"
    corpus = tmp_path / "corpus.jsonl"  # train_data=: a JSON-lines corpus, packed into the training windows
    corpus.write_text(
        "".join(
            json.dumps({"text": p}) + "\n"
            for p in CALIB.read_text(encoding="utf-8")[:60_000].split("\n\n")
            if p.strip()
        ),
        encoding="utf-8",
    )
    recipe = tmp_path / "distill-int8.yaml"
    recipe.write_text(
        "name: distill-int8\nstages:\n  - load\n  - distill: {target_fraction: 0.7}\n  - quantize: {method: int8}\n"
        "  - export_onnx\n  - build_engine\n  - validate\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "compress",
            "run",
            "target=jetson-orin",
            f"recipe={recipe}",
            f"model={llama4}",
            f"out={out}",
            "--no-progress",
            "distill.steps=2",
            "distill.seq_len=64",
            "distill.eval_every=1000",
            "distill.eval_windows=1",
            "distill.teacher_generations=2",
            "distill.generation_prompt_tokens=16",
            "distill.train_windows=12",
            f"train_data={corpus}",
            "quantize.calib_windows=8",
            *TINY_SMOKE,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    stages = {s["name"]: s for s in json.loads((out / "report.json").read_text())["stages"]}
    assert list(stages) == ["load", "distill", "quantize", "export_onnx", "build_engine", "validate"]
    shape = stages["distill"]["metrics"]["student_shape"]
    assert stages["distill"]["metrics"]["parameters"] < 0.75 * stages["distill"]["metrics"]["teacher_parameters"]
    assert stages["quantize"]["metrics"]["quantized_linears"] == shape["num_layers"] * 7
    assert stages["export_onnx"]["metrics"]["quantized_linears"] == shape["num_layers"] * 7
    student = json.loads((out / "02_distill" / "model" / "config.json").read_text())
    assert (student["num_hidden_layers"], student["intermediate_size"]) == (
        shape["num_layers"],
        shape["intermediate_size"],
    )
    assert (
        stages["validate"]["metrics"]["perplexity_model"] > 0 and stages["validate"]["metrics"]["perplexity_onnx"] > 0
    )
    distill = stages["distill"]["metrics"]
    assert distill["teacher_generations"] == 2 and distill["unseen_domains"] == ["learned", "government", "religion"]
    assert distill["train_data"] == [str(corpus)] and distill["train_windows"] == 12 + 2  # packed windows + generations
    assert distill["perplexity_before_unseen"] > 0 and distill["perplexity_after_unseen"] > 0


def test_explicit_student_larger_than_teacher_is_refused(llama4, tmp_path):
    recipe = tmp_path / "wide.yaml"
    recipe.write_text(
        "name: wide\nstages:\n  - load\n  - distill: {intermediate_size: 4096, steps: 1}\n  - export_onnx\n  - "
        "validate\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "compress",
            "run",
            "target=jetson-orin",
            f"recipe={recipe}",
            f"model={llama4}",
            f"out={tmp_path / 'run'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot be larger than the teacher: intermediate_size 4096 > 128" in proc.stderr


def test_distill_stage_resumes_after_sigkill(llama4, tmp_path):
    recipe = tmp_path / "d.yaml"
    recipe.write_text(
        "name: d\nstages:\n  - load\n  - distill: {num_layers: 2, intermediate_size: 64, steps: 150, batch_size: 2,"
        " seq_len: 64, train_windows: 32, checkpoint_every: 10, eval_every: 1000, eval_windows: 1}\n"
        "  - export_onnx\n  - validate\n"
    )
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "compress",
        "run",
        "target=jetson-orin",
        f"recipe={recipe}",
        f"model={llama4}",
        f"out={out}",
        *TINY_SMOKE,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not list(out.glob("checkpoints/*/checkpoint.pt")):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(out.glob("checkpoints/*/checkpoint.pt")), "no checkpoint was written before the kill"
    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert rerun.returncode in (0, 1), rerun.stderr[-3000:]
    assert "resuming distillation from step" in rerun.stderr
    report = json.loads((out / "report.json").read_text())
    distill = next(s for s in report["stages"] if s["name"] == "distill")
    assert distill["metrics"]["curve"][-1]["step"] == 150
    assert not (out / "checkpoints").exists()


def test_training_stops_when_unseen_domains_get_worse_and_keeps_the_best_weights(llama4, tmp_path):
    windows = _windows()
    torch.manual_seed(0)
    student, built = _student(llama4, windows[:4])
    start = {k: v.clone() for k, v in student.state_dict().items()}
    distiller = Distiller(
        student, _load(llama4), windows, _config(steps=6, eval_every=2), tmp_path / "c", built["kept_layers"]
    )
    rising = iter([11.0, 14.0, 9.0])  # better at step 2, then 27% worse than that at step 4: stop there
    snapshots = {}

    def evaluate():
        snapshots[distiller.step] = {k: v.clone() for k, v in student.state_dict().items()}
        return {"perplexity": 1.0, "perplexity_unseen": next(rising)}

    history = distiller.run(evaluate, progress=False, initial={"perplexity_unseen": 12.0})
    assert distiller.stopped_early_at == 4 and distiller.step == 4
    assert [p["step"] for p in history] == [1, 2, 3, 4]
    assert all(torch.equal(snapshots[2][k], v) for k, v in student.state_dict().items())
    assert not all(torch.equal(start[k], v) for k, v in student.state_dict().items())


def test_unseen_domains_worse_from_the_start_keep_the_untrained_student(llama4, tmp_path):
    windows = _windows()
    torch.manual_seed(0)
    student, built = _student(llama4, windows[:4])
    start = {k: v.clone() for k, v in student.state_dict().items()}
    distiller = Distiller(
        student, _load(llama4), windows, _config(steps=6, eval_every=3), tmp_path / "c", built["kept_layers"]
    )
    distiller.run(
        lambda: {"perplexity": 1.0, "perplexity_unseen": 20.0}, progress=False, initial={"perplexity_unseen": 10.0}
    )
    assert distiller.stopped_early_at == 3
    assert all(torch.equal(start[k], v) for k, v in student.state_dict().items())


def test_teacher_generations_continue_calibration_openings(llama4):
    from compress.core.text import load_calibration
    from compress.models.loading import load_tokenizer
    from compress.transforms.distill.train import teacher_generations as _teacher_generations
    from tests.conftest import CALIB

    tokenizer = load_tokenizer(llama4)
    config = _config(teacher_generations=5, seq_len=48, generation_prompt_tokens=16)
    calibration = load_calibration([CALIB])
    first = _teacher_generations(_load(llama4), tokenizer, calibration, config)
    again = _teacher_generations(_load(llama4), tokenizer, calibration, config)
    assert first.shape == (5, 48)
    assert torch.equal(first, again)
    from compress.core.text import calibration_windows

    assert torch.equal(first[:, :16], calibration_windows(tokenizer, calibration, 16, 5))
    assert not torch.equal(first[:, 16:32], first[:, 32:48])
