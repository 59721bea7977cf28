"""Decoder families: folding smoothing scales is exact on each, every quantize path runs on each, others are refused at
plan time."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from compress.cli.main import main
from compress.core.errors import UsageError
from compress.models.families import attention_geometry, decoder_blocks, family_of
from compress.models.loading import load_causal_lm
from compress.models.sources import materialize, model_config, resolve_model
from compress.models.surgery import drop_layers, narrow_mlp, prune_heads
from compress.transforms.quantize.config import QuantizeConfig, quantize_config
from compress.transforms.quantize.decoder import _kv_groups, fold_scales, quantize_model
from tests.conftest import REPO, TINY_SMOKE, build_tiny_llama

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "model"
    return request.param, build_tiny_llama(
        folder, layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, family=request.param
    )


def test_folding_random_smoothing_scales_leaves_the_float_model_unchanged(family_model):
    name, folder = family_model
    model = load_causal_lm(folder).float().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    family = family_of(model.config)
    generator = torch.Generator().manual_seed(1)
    for block in decoder_blocks(model):
        kv_groups = _kv_groups(block, model.config)
        for point in family.points:
            width = block.get_submodule(point.consumers[0]).in_features
            scales = torch.exp(torch.randn(width, generator=generator))  # per-channel factors across ~e^-3..e^3
            if point.name == "attn_out":
                scales = scales[kv_groups]  # one factor per KV channel, shared by the query heads that read it
            fold_scales(block, point, scales, kv_groups, model.config)
    with torch.no_grad():
        after = model(ids).logits
    assert (after - before).abs().max().item() < 1e-4, name
    if name == "qwen2":
        assert decoder_blocks(model)[0].self_attn.v_proj.bias is not None  # the bias was folded with its rows


def _logits_with_masked_inputs(model, ids, module_of, masks) -> torch.Tensor:
    """Logits of ``model`` with the input channels of one module per block multiplied by a 0/1 mask."""
    handles = [block.get_submodule(module_of).register_forward_pre_hook(lambda _m, args, mask=mask: (args[0] * mask,))
               for block, mask in zip(decoder_blocks(model), masks, strict=True)]
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        for handle in handles:
            handle.remove()


def test_head_pruning_mlp_narrowing_and_layer_dropping_equal_masking_what_they_remove(family_model):
    """Removing heads (q rows, biases, fused q parts), MLP channels (gate/up rows, fused or not) and layers must compute
    exactly what the unpruned model computes with those heads' and channels' outputs zeroed and those layers skipped:
    the check that catches a cut in the wrong rows of a fused projection or a layer that changes its attention kind."""
    name, folder = family_model
    model = load_causal_lm(folder).float().eval()
    family = family_of(model.config)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    _, _, head_dim = attention_geometry(model.config)
    plan = [[0, 3], [1, 2]]  # one of the two query heads of each KV group, different per layer
    masks = [
        torch.zeros(4 * head_dim).index_fill_(
            0, torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in kept]), 1
        )
        for kept in plan
    ]
    expected = _logits_with_masked_inputs(model, ids, family.attn_output, masks)
    pruned = copy.deepcopy(model)
    prune_heads(pruned, plan)
    with torch.no_grad():
        assert (pruned(ids).logits - expected).abs().max().item() < 1e-5, name
    importance = [
        torch.rand(model.config.intermediate_size, generator=torch.Generator().manual_seed(i)) for i in range(2)
    ]
    masks = [
        torch.zeros(model.config.intermediate_size).index_fill_(0, scores.topk(160).indices, 1) for scores in importance
    ]
    expected = _logits_with_masked_inputs(model, ids, family.mlp_output, masks)
    narrow_mlp(model, importance, 160)
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max().item() < 1e-5, name
    assert model.config.intermediate_size == 160 and pruned.config.num_attention_heads == 2
    first = decoder_blocks(model)[0]
    skip = first.register_forward_hook(
        lambda _m, args, kwargs, _out: args[0] if args else kwargs["hidden_states"], with_kwargs=True
    )
    with torch.no_grad():
        expected = model(ids).logits
    skip.remove()
    kinds = getattr(model.config, "layer_types", None)
    drop_layers(model, [1])  # layer 1 keeps its attention kind (Gemma 3's full-attention layer)
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max().item() < 1e-5, name
    assert model.config.num_hidden_layers == 1 and (kinds is None or model.config.layer_types == kinds[1:])


def test_distill_prune_sparsify_int8_and_export_on_each_family(family_model, tmp_path):
    name, folder = family_model
    recipe = tmp_path / "family.yaml"
    recipe.write_text("name: family\nstages:\n  - load\n  - distill: {target_fraction: 0.7}\n"
                      "  - prune_heads: {fraction: 0.25, calib_windows: 2, calib_window: 64, min_calib_tokens: 128}\n"
                      "  - sparsify: {calib_windows: 2, calib_window: 64, min_calib_tokens: 128}\n"
                      "  - quantize: {method: int8, calib_windows: 4, calib_window: 128, min_calib_tokens: 512}\n"
                      "  - export_onnx\n  - validate\n")
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "compress",
            "run",
            "target=jetson-orin",
            f"recipe={recipe}",
            f"model={folder}",
            f"out={out}",
            "--no-progress",
            "distill.steps=2",
            "distill.seq_len=64",
            "distill.eval_every=1000",
            "distill.eval_windows=1",
            "distill.teacher_generations=2",
            "distill.generation_prompt_tokens=16",
            *TINY_SMOKE,
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    stages = {s["name"]: s for s in json.loads((out / "report.json").read_text())["stages"]}
    assert stages["distill"]["metrics"]["parameters"] < stages["distill"]["metrics"]["teacher_parameters"]
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    assert json.loads((out / "02_distill" / "model" / "config.json").read_text())["model_type"] == model_type
    assert stages["prune_heads"]["metrics"]["heads_after"] < stages["prune_heads"]["metrics"]["heads_before"]
    assert stages["sparsify"]["metrics"]["pattern_24_fraction"] == pytest.approx(1.0)
    parity = stages["export_onnx"]["metrics"]["parity"]
    assert parity["greedy_match"] and parity["max_abs_logit_diff"] < 1e-3, name
    validate = stages["validate"]["metrics"]
    assert validate["onnx_vs_torch_quantized_pct"] < 1.0 and validate["top1_agreement"] > 0.5


def _int4_logit_error(folder, config: QuantizeConfig) -> tuple[float, float, int]:
    """Relative logit error and argmax agreement after quantizing, and how many linears were quantized."""
    model = load_causal_lm(folder).float().eval()
    windows = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(windows).logits
    result = quantize_model(model, windows, config, progress=False)
    for linear, quant in result.linears.items():  # weight-only, one scale per group of 32 inputs
        assert (
            quant.input_scale is None and quant.weight_scales.shape[-1] == model.get_submodule(linear).in_features // 32
        )
    with torch.no_grad():
        after = model(windows).logits
    agreement = (after.argmax(-1) == before.argmax(-1)).float().mean().item()
    return ((after - before).norm() / before.norm()).item(), agreement, len(result.linears)


def test_int4_awq_gptq_keeps_each_family_close_to_its_float_model(family_model):
    name, folder = family_model
    error, agreement, count = _int4_logit_error(
        folder, quantize_config(method="int4", group_size=32, sample_tokens=256)
    )
    rtn_error, _, _ = _int4_logit_error(folder, quantize_config(method="rtn", bits=4, group_size=32))
    assert count == 2 * len(family_of(load_causal_lm(folder).config).linears())
    # AWQ scales folded into the wrong module would undo the gain over round-to-nearest (measured 0.53-0.63x of it).
    assert error < 0.75 * rtn_error, name
    assert agreement > 0.7, name  # 4-bit weights of a random model: most argmaxes survive


def test_undescribed_families_are_refused_and_a_window_shorter_than_the_context_is_planned(capsys, tmp_path):
    import transformers

    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    ).save_pretrained(gpt2)
    assert main(["run", "target=jetson-orin", "recipe=int8", f"model={gpt2}", f"out={tmp_path / 'a'}"]) == 2
    assert "model_type 'gpt2' is not a decoder family compress describes " \
        "(supported: gemma3_text, llama, ministral, mistral, phi3, qwen2, qwen3)" in capsys.readouterr().err
    mistral = build_tiny_llama(
        tmp_path / "mistral", layers=1, hidden=64, heads=4, kv_heads=2, intermediate=128, family="mistral"
    )
    config = json.loads((mistral / "config.json").read_text())
    config["sliding_window"] = 512
    (mistral / "config.json").write_text(json.dumps(config))
    # The portable ONNX computes the sliding layers' banded mask (next test), so a 512-token window at a 2048 context
    # plans.
    assert (
        main(["run", "target=jetson-orin", "recipe=int8", f"model={mistral}", f"out={tmp_path / 'b'}", "--dry-run"])
        == 0
    )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    ("family", "exporter"), [("mistral", "torchscript"), ("gemma3", "torchscript"), ("gemma3", "dynamo")]
)
def test_sliding_window_layers_are_exported_with_their_banded_mask(family, exporter, tmp_path):
    """At a context three times the window, ONNX Runtime computes what transformers computes (prefill logits, greedy
    decoding and chunked prefill through the KV cache), and that is not what full attention would give: the band is in
    the graph. A sliding layer's cache stops at its window."""
    from compress.backends.onnx.export import ParityCheck, export_decoder_folder
    from compress.backends.onnx.runtime import OnnxDecoder
    from compress.backends.onnx.slices import SlicedDecoder, plan_slices

    window = 8
    options = {"layer_types": None} if family == "mistral" else {}  # Mistral: every layer slides
    folder = build_tiny_llama(
        tmp_path / "model",
        layers=4,
        hidden=64,
        heads=4,
        kv_heads=2,
        intermediate=128,
        family=family,
        sliding_window=window,
        chat_template=True,
        **options,
    )
    export_decoder_folder(folder, tmp_path / "onnx", exporter=exporter, parity=ParityCheck(new_tokens=2))
    decoder = OnnxDecoder(tmp_path / "onnx")
    model = load_causal_lm(folder)
    ids = torch.randint(0, 400, (1, 3 * window), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sliding = model(ids).logits.numpy()
        model.config.sliding_window = 10 * window  # the same weights attending over the whole context
        full = model(ids).logits.numpy()
        model.config.sliding_window = window
    ours = decoder.logits(ids.numpy())
    scale = float(np.abs(sliding).max())
    assert float(np.abs(ours - sliding).max()) < 1e-4 * scale
    # past the window the band changes the numbers
    assert (
        float(np.abs(full - sliding)[:, window:].max()) > 1e-2 * scale
    )
    prompt = ids[0, :window].tolist()
    expected = model.generate(ids[:, :window], max_new_tokens=2 * window, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, window:].tolist()
    assert decoder.greedy(prompt, 2 * window) == expected
    # Five tokens at a time through the cache: each chunk sees the sliding layers' last window - 1 positions only.
    chunked = np.concatenate([logits for _, logits in decoder.logits_in_chunks(ids.numpy(), 5)], axis=1)
    assert float(np.abs(chunked - sliding).max()) < 1e-4 * scale
    # Cut into one slice per block, each run alone over every chunk: the same numbers (each slice reads the sliding
    # layers' shorter caches of the others for their shapes only).
    slices = plan_slices(tmp_path / "onnx", decoder.layout, max_weight_bytes=1)
    assert [piece.blocks for piece in slices] == [range(block, block + 1) for block in range(4)]
    pieces = SlicedDecoder(tmp_path / "onnx", slices).sequences_in_chunks([ids.numpy()[0]], 5)
    assert float(np.abs(np.concatenate([logits for _, _, logits in pieces], axis=1) - chunked).max()) < 1e-5 * scale
    _, past = decoder.forward(ids.numpy(), np.ones_like(ids.numpy()), decoder.empty_past(1))
    slides = set(decoder.layout.sliding_layers)
    assert slides == ({0, 1, 2, 3} if family == "mistral" else {0, 2})
    assert [tensor.shape[2] for tensor in past] == [window - 1 if i // 2 in slides else 3 * window for i in range(8)]


GGUF_MODELS = {  # family: (build options, what transformers' GGUF reader alone gets wrong)
    "llama": ({}, None),
    "mistral": ({}, None),  # written as llama.cpp does, under the "llama" architecture
    "qwen2": ({}, None),
    "qwen3": ({"head_dim": 32}, "head_dim"),  # not hidden / heads: the reader ignores attention.key_length
    "phi3": ({"partial_rotary_factor": 0.5, "sliding_window": 4096}, "partial_rotary_factor"),
    "gemma3": ({"layer_types": ["sliding_attention", "sliding_attention"]}, None),  # llama.cpp's fixed 5:1 pattern
}


@pytest.mark.parametrize("name", list(GGUF_MODELS))
def test_a_gguf_file_of_each_family_loads_with_the_numbers_of_its_folder(name, tmp_path, monkeypatch):
    from tests.support.gguf_files import write_gguf

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    options, completed = GGUF_MODELS[name]
    folder = build_tiny_llama(
        tmp_path / "hf", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, family=name, **options
    )
    (tmp_path / "gguf").mkdir()
    path = write_gguf(folder, tmp_path / "gguf" / f"{name}.gguf", general_name=f"{name}-tiny")
    source = resolve_model(str(path))
    config = model_config(source)
    if completed:
        assert config[completed] == options[completed]
    converted = load_causal_lm(materialize(source))
    reference = load_causal_lm(folder)
    ids = torch.randint(0, reference.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (converted(ids).logits - reference(ids).logits).abs().max().item() < 1e-4, name
    # llama.cpp writes Mistral as "llama", and transformers reads it back as Llama: the same numbers without a window.
    assert family_of(converted.config) is family_of(reference.config) or (name, converted.config.model_type) == (
        "mistral",
        "llama",
    )


def test_a_gguf_with_longrope_factors_is_refused(tmp_path):
    from tests.support.gguf_files import write_gguf

    folder = build_tiny_llama(tmp_path / "hf", layers=1, family="phi3")
    path = write_gguf(
        folder, tmp_path / "phi3.gguf", extra_tensors={"rope_factors_long.weight": np.ones(8, dtype=np.float32)}
    )
    with pytest.raises(UsageError, match="rope_factors_long.weight, LongRoPE"):
        resolve_model(str(path))


def test_runs_converting_the_same_gguf_at_once_convert_it_once_and_share_the_folder(tmp_path, monkeypatch):
    import threading

    from compress.models import sources as models
    from tests.support.gguf_files import write_gguf

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    folder = build_tiny_llama(tmp_path / "hf", layers=1)
    source = resolve_model(str(write_gguf(folder, tmp_path / "tiny.gguf")))
    conversions, first_started = [], threading.Event()
    convert = models._convert_gguf

    def slow_convert(path, out):
        conversions.append(out)
        first_started.set()
        threading.Event().wait(1.0)  # long enough for the second run to arrive while this one converts
        convert(path, out)

    monkeypatch.setattr(models, "_convert_gguf", slow_convert)
    results: list = []
    first = threading.Thread(target=lambda: results.append(materialize(source)))
    first.start()
    assert first_started.wait(60)
    second = threading.Thread(target=lambda: results.append(materialize(source)))
    second.start()
    first.join(120)
    inode_before = results[0].stat().st_ino
    second.join(120)
    assert len(conversions) == 1
    assert results[0] == results[1] and results[0].stat().st_ino == inode_before
    assert not [p for p in results[0].parent.iterdir() if p.name.startswith(".tmp-")]
    assert load_causal_lm(results[1]).config.num_hidden_layers == 1


def test_a_cached_gguf_conversion_that_was_changed_is_converted_again(tmp_path, monkeypatch):
    """Runs read the conversion in place, so one that no longer holds what was written is never used."""
    from safetensors.torch import load_file

    from tests.support.gguf_files import write_gguf

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    folder = build_tiny_llama(tmp_path / "hf", layers=1)
    source = resolve_model(str(write_gguf(folder, tmp_path / "tiny.gguf")))
    converted = materialize(source)
    weights = next(converted.glob("*.safetensors"))
    original = {k: v.clone() for k, v in load_file(weights).items()}
    with open(weights, "r+b") as handle:  # a byte of a tensor flipped in the cache
        handle.seek(weights.stat().st_size - 3)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert any(not torch.equal(original[k], v) for k, v in load_file(weights).items())
    again = materialize(source)
    assert again == converted
    assert all(torch.equal(original[k], v) for k, v in load_file(next(again.glob("*.safetensors"))).items())
