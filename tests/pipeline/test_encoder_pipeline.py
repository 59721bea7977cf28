"""Encoders through ``compress run``: the packaged MiniLM end to end (INT8, FP16, pruned), classifiers of the other
encoder families, the gate failing a broken model, and decoder-only stages refused at plan time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import compress.runtime
from compress.cli.main import main
from compress.models.loading import load_encoder
from compress.models.sources import resolve_model
from compress.transforms.quantize.encoder import EncoderQuantizeConfig, quantize_encoder
from tests.conftest import REPO

FAST = [
    "validate_encoder.sentences_per_domain=24",
    "validate_encoder.latency_sentences=32",
    "validate_encoder.latency_repeats=1",
]


def _run(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compress", "run", "target=jetson-orin", f"out={out}", "--no-progress", *args],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _validation(out: Path) -> dict:
    return json.loads(next(out.glob("*_validate_encoder/validation.json")).read_text())


@pytest.fixture(scope="module")
def minilm_int8(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("minilm") / "run"
    proc = _run(out, "model=all-minilm-l6-v2", *FAST)  # recipe=default picks encoder-int8 for an encoder
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_default_on_minilm_is_int8_and_passes_the_embedding_gate(minilm_int8):
    report = json.loads((minilm_int8 / "report.json").read_text())
    assert report["recipe"] == "encoder-int8" and report["gate"]["verdict"] == "PASS"
    checks = {c["name"]: c for c in report["gate"]["checks"]}
    assert {
        "embedding_cosine_mean",
        "embedding_cosine_min",
        "neighbour_agreement",
        "encoder_batch_ms",
        "memory_gb",
    } <= set(checks)
    metrics = _validation(minilm_int8)["metrics"]
    assert 0.99 < metrics["embedding_cosine_mean"] < 1.0 and len(metrics["domains"]) == 6
    assert [row["batch"] for row in metrics["host_latency"]] == [1, 8, 32]
    export = json.loads(next(minilm_int8.glob("*_export_encoder/stage.json")).read_text())["metrics"]
    assert export["precision"] == "int8" and export["activation_qdq_pairs"] > 0 and export["parity_min_cosine"] > 0.999
    assert "quantize_encoder" in (minilm_int8 / "report.md").read_text()


def test_the_run_directory_loads_as_an_encoder_with_bucketed_batches(minilm_int8):
    encoder = compress.runtime.load(minilm_int8)
    sentences = ["Stop.", "The robot arm picks up the red block and places it in the bin.", "Go to the dock.",
                 "Emma Woodhouse, handsome, clever, and rich, seemed to unite some of the best blessings of existence."]
    plain = encoder.embed(sentences, batch_size=2)
    bucketed = encoder.embed(sentences, batch_size=2, bucket=True)
    assert plain.shape == (4, 384) and encoder.provenance["run"] == str(minilm_int8)
    assert np.abs(plain - bucketed).max() < 1e-3  # same sentences, batched with others of their length
    assert encoder.last_batch_width < 30  # the last bucket holds the two longest sentences only


def test_smoothing_is_what_makes_int8_minilm_hold(minilm_int8):
    """Without migration (alpha 0) the same W8A8 loses several times more; a scale in the wrong place would too."""
    from transformers import AutoTokenizer

    folder = resolve_model("all-minilm-l6-v2").path
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = (REPO / "calib_data" / "calibration" / "emma.txt").read_text()[5000:40000].split(". ")
    batches = [dict(tokenizer(text[i:i + 32], padding=True, truncation=True, max_length=128, return_tensors="pt"))
               for i in range(0, 128, 32)]
    evaluation = dict(tokenizer(text[200:296], padding=True, truncation=True, max_length=128, return_tensors="pt"))

    def cosine(model) -> float:
        with torch.no_grad():
            hidden = model(**evaluation).last_hidden_state
        mask = evaluation["attention_mask"][..., None].float()
        return (hidden * mask).sum(1) / mask.sum(1)

    reference = cosine(load_encoder(folder))
    losses = {}
    for alpha in ("auto", 0.0):
        model = load_encoder(folder)
        from compress.transforms.quantize.encoder import attach_encoder_quant

        attach_encoder_quant(
            model, quantize_encoder(model, batches, EncoderQuantizeConfig(alpha=alpha, float_activations_below_db=None))
        )
        losses[alpha] = 1 - torch.nn.functional.cosine_similarity(cosine(model), reference).mean().item()
    assert losses["auto"] < 0.5 * losses[0.0], losses


def test_fp16_passes_and_pruned_minilm_fails_the_gate(tmp_path):
    fp16 = _run(tmp_path / "fp16", "model=all-minilm-l6-v2", "recipe=encoder-fp16", *FAST)
    assert fp16.returncode == 0, fp16.stderr[-3000:]
    assert _validation(tmp_path / "fp16")["metrics"]["embedding_cosine_min"] > 0.9999
    pruned = _run(tmp_path / "pruned", "model=all-minilm-l6-v2", "recipe=encoder-prune-heads", *FAST)
    assert pruned.returncode == 1, pruned.stderr[
        -3000:
    ]  # a quarter of the heads, no recovery training: the gate says no
    validation = _validation(tmp_path / "pruned")
    assert validation["gate"]["verdict"] == "FAIL"
    assert next(c for c in validation["gate"]["checks"] if c["name"] == "embedding_cosine_mean")["verdict"] == "FAIL"
    stage = json.loads(next((tmp_path / "pruned").glob("*_prune_encoder_heads/stage.json")).read_text())["metrics"]
    assert stage["heads_before"] == 12 and stage["heads_after"] == 9


def test_a_pruned_encoder_is_healed_by_distillation_and_ships(tmp_path):
    out = tmp_path / "healed"
    healed = _run(out, "model=all-minilm-l6-v2", "recipe=encoder-prune-distill", "distill_encoder.steps=6",
                  "distill_encoder.calib_sentences=160", "distill_encoder.batch_size=16",
                  "distill_encoder.eval_every=3", *FAST)
    assert healed.returncode in (0, 1), healed.stderr[-3000:]  # a verdict, whichever it is
    stage = json.loads(next(out.glob("*_distill_encoder/stage.json")).read_text())["metrics"]
    assert stage["held_out_cosine_after"] >= stage["held_out_cosine_before"] > 0.5
    assert stage["steps"] == 6 and stage["parameters"] < stage["teacher_parameters"]
    validation = _validation(out)
    assert validation["metrics"]["embedding_cosine_mean"] > 0.9  # the healed, pruned encoder as exported
    assert json.loads((out / "report.json").read_text())["recipe"] == "encoder-prune-distill"


def test_decoder_stages_on_an_encoder_and_encoder_stages_on_a_decoder_are_refused(capsys, tmp_path):
    assert main(["run", "target=jetson-orin", "model=all-minilm-l6-v2", "recipe=int8", f"out={tmp_path / 'a'}"]) == 2
    assert "stage quantize works on decoders; model=all-minilm-l6-v2 is an encoder (bert)" in capsys.readouterr().err
    assert main(["run", "target=jetson-orin", "recipe=encoder-int8", f"out={tmp_path / 'b'}"]) == 2
    assert (
        "stage quantize_encoder works on encoders; model=smollm2-135m-instruct is a decoder (llama)"
        in capsys.readouterr().err
    )
    assert (
        main(
            ["run", "target=jetson-orin", "model=all-minilm-l6-v2", "eval_labels=missing.tsv", f"out={tmp_path / 'c'}"]
        )
        == 2
    )
    assert "eval_labels=missing.tsv: no such file" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "abc")


def _tiny_classifier(folder: Path, family: str) -> Path:
    """A randomly initialised sequence classifier of ``family`` with MiniLM's WordPiece tokenizer."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model("all-minilm-l6-v2").path)
    torch.manual_seed(0)
    names = ["ENTAILMENT", "NEUTRAL", "CONTRADICTION"]
    labels = {"id2label": dict(enumerate(names)), "label2id": {name: i for i, name in enumerate(names)}}
    config = {
        "roberta": transformers.RobertaConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=130,
            pad_token_id=0,
            **labels,
        ),
        "distilbert": transformers.DistilBertConfig(
            vocab_size=tokenizer.vocab_size, dim=64, n_layers=2, n_heads=4, hidden_dim=128, **labels
        ),
        "mpnet": transformers.MPNetConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            pad_token_id=0,
            **labels,
        ),
    }[family]
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", ["roberta", "distilbert", "mpnet"])
def test_classifiers_of_each_encoder_family_run_int8_with_a_labelled_set(family, tmp_path):
    folder = _tiny_classifier(tmp_path / family, family)
    labels = tmp_path / "labels.tsv"
    labels.write_text(
        "\n".join(
            f"{['ENTAILMENT', 'NEUTRAL', 'CONTRADICTION'][i % 3]}\tThe robot moved {i} blocks to the bin."
            for i in range(30)
        )
        + "\n"
    )
    out = tmp_path / "run"
    proc = _run(out, f"model={folder}", "recipe=encoder-int8", f"eval_labels={labels}", *FAST)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    metrics = _validation(out)["metrics"]
    assert metrics["output"] == "logits" and metrics["label_agreement"] > 0.9
    assert metrics["labelled"]["sentences"] == 30 and 0 <= metrics["labelled"]["accuracy"] <= 1
    checks = {c["name"] for c in _validation(out)["gate"]["checks"]}
    assert {"label_agreement", "accuracy_drop_pct"} <= checks
    classifier = compress.runtime.load(out)
    assert set(classifier.classify(["Stop.", "The robot moved 3 blocks to the bin."])) <= {
        "ENTAILMENT",
        "NEUTRAL",
        "CONTRADICTION",
    }
