"""Mixed precision: a format per group of linears, their sensitivities, and the exact choice under a budget."""

from __future__ import annotations

import gc
import itertools
import math
import random
import sys

import pytest
import torch

from compress.algorithms.knapsack import Choice, solve, solve_apart
from compress.core.memory import peak_mb, reset_peak
from compress.models.compute import computed_in_float32
from compress.models.families import family_of
from compress.models.loading import load_causal_lm
from compress.transforms.checkpoint_logits import window_logits
from compress.transforms.quantize.config import QUANTIZE_CONFIG, candidate_configs
from compress.transforms.quantize.decoder import quantize_folder, quantize_model
from compress.transforms.quantize.mixed import (
    FLOAT,
    HEAD,
    HEAD_INDEX,
    MixedPlan,
    SensitivityJob,
    output_fisher,
    sensitivity,
)
from compress.transforms.quantize.saved import (
    attach_quantization,
    dequantized_weight,
    held_quantized_causal_lm,
    load_quantization,
    load_quantized_causal_lm,
)
from tests.conftest import build_tiny_llama

SHARED = {"calib_windows": 3, "calib_window": 40, "min_calib_tokens": 1, "sample_tokens": 64}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Every linear input a multiple of 128, so INT4 in groups of 128 is a candidate everywhere."""
    return build_tiny_llama(
        tmp_path_factory.mktemp("wide") / "model", layers=2, hidden=128, heads=2, kv_heads=1, intermediate=256
    )


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 400, (3, 40), generator=torch.Generator().manual_seed(2))


def test_a_plan_quantizes_each_group_in_its_own_format_and_validation_computes_it(wide, windows, tmp_path):
    configs = candidate_configs(["int8", "int4"], SHARED)
    plan = MixedPlan({0: {"attn_in": "int8", "attn_out": FLOAT, "mlp_in": "int4", "mlp_hidden": "int8"},
                      1: {"attn_in": "int4", "attn_out": "int8", "mlp_in": FLOAT, "mlp_hidden": "int4"}}, configs)
    config = QUANTIZE_CONFIG.validate_python({"method": "auto", **SHARED})
    quantize_folder(wide, tmp_path / "q", windows, config, plan=plan)
    meta, linears = load_quantization(tmp_path / "q")
    assert meta.is_mixed() and meta.plan == plan.to_json()
    family = family_of(load_causal_lm(wide).config)
    expected = {}
    for index, points in plan.formats.items():
        for point, name in points.items():
            for linear in family.point(point).consumers:
                if name != FLOAT:
                    expected[f"model.layers.{index}.{linear}"] = name
    assert {name: q.precision for name, q in linears.items()} == expected
    assert all(q.group_size == 128 for q in linears.values() if q.precision == "int4")
    assert all(q.input_scale is not None for q in linears.values() if q.precision == "int8")  # W8A8: inputs quantized
    assert all(q.input_scale is None for q in linears.values() if q.precision == "int4")  # weight-only
    model, rebuilt = held_quantized_causal_lm(tmp_path / "q")
    attach_quantization(model, *load_quantization(tmp_path / "q"))
    with computed_in_float32(model, rebuilt), torch.no_grad():
        reference = [model(row[None]).logits[0] for row in windows]
    measured = window_logits(tmp_path / "q", windows)
    for index, logits in enumerate(reference):
        torch.testing.assert_close(torch.from_numpy(measured.logits(index)), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head", ["fp8", "int4"])
def test_a_plan_may_quantize_the_tied_lm_head_as_a_linear_of_its_own(wide, windows, tmp_path, head):
    """The head is quantized on the last block's deployed outputs, shipped untied (the embedding table as stored), and
    every reader computes it as deployed: its levels, and for FP8 its input quantized."""
    configs = candidate_configs(["int8", head], SHARED)
    points = {"attn_in": "int8", "attn_out": "int8", "mlp_in": "int8", "mlp_hidden": "int8"}
    plan = MixedPlan({0: points, 1: points}, configs, head=head)
    assert plan.counts() == {"int8": 8, head: 1} and plan.quantized_formats() == {"int8", head}
    config = QUANTIZE_CONFIG.validate_python({"method": "auto", **SHARED})
    quantize_folder(wide, tmp_path / "q", windows, config, plan=plan)
    meta, linears = load_quantization(tmp_path / "q")
    quant = linears["lm_head"]
    assert quant.precision == head and (quant.input_scale is not None) == (head == "fp8")
    source = load_causal_lm(wide)
    saved = load_quantized_causal_lm(tmp_path / "q")
    assert source.config.tie_word_embeddings and not saved.config.tie_word_embeddings
    assert torch.equal(saved.model.embed_tokens.weight, source.model.embed_tokens.weight)  # the table is not touched
    head_weight = dequantized_weight(quant)
    error = float((head_weight - source.lm_head.weight).norm() / source.lm_head.weight.norm())
    assert 0 < error < (0.1 if head == "fp8" else 0.25), error  # on the format's grid, near the float head
    model, rebuilt = held_quantized_causal_lm(tmp_path / "q")
    attach_quantization(model, meta, linears)
    with computed_in_float32(model, rebuilt), torch.no_grad():
        reference = [model(row[None]).logits[0] for row in windows]
    measured = window_logits(tmp_path / "q", windows)
    for index, logits in enumerate(reference):
        torch.testing.assert_close(torch.from_numpy(measured.logits(index)), logits, atol=1e-5, rtol=1e-5)
    assert (measured.head_input is not None) == (head == "fp8")  # FP8 quantizes the head's input, INT4 W4A16 does not
    if head == "fp8":
        measured.head_input = None
        assert (torch.from_numpy(measured.logits(0)) - reference[0]).abs().max() > 1e-4


def test_a_plan_saves_the_weights_the_quantizer_computed_with(wide, windows):
    """A point's migration scales fold into the linear producing its input (v_proj for o_proj, up_proj for down_proj): a
    producer quantized in another format must take the fold before its levels are taken, whatever the formats' order."""
    configs = candidate_configs(["int8", "int4"], SHARED)
    plan = MixedPlan({0: {"attn_in": "int4", "attn_out": "int8", "mlp_in": "int4", "mlp_hidden": "int8"},
                      1: {"attn_in": "int8", "attn_out": "int4", "mlp_in": "int8", "mlp_hidden": "int4"}}, configs)
    model = load_causal_lm(wide)
    config = QUANTIZE_CONFIG.validate_python({"method": "auto", **SHARED})
    result = quantize_model(model, windows, config, progress=False, plan=plan)
    assert {q.migration_ratio is not None for q in result.linears.values()} == {True}  # every input had scales folded
    for name, quant in result.linears.items():
        torch.testing.assert_close(
            dequantized_weight(quant),
            model.get_submodule(name).weight.detach(),
            atol=1e-6,
            rtol=1e-5,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def test_sensitivities_are_per_point_and_format_and_zero_for_float(wide, windows):
    model = load_causal_lm(wide)
    family = family_of(model.config)
    linears = [f"model.layers.{i}.{name}" for i in range(2) for name in family.linears()]
    fisher = output_fisher(model, windows[:2], linears)
    assert set(fisher) == set(linears) and all(
        f.shape == (model.get_submodule(n).out_features,) for n, f in fisher.items()
    )
    assert all(float(f.sum()) > 0 for f in fisher.values())
    configs = candidate_configs(["int8", "int4"], SHARED)
    table = sensitivity(model, windows, SensitivityJob(
        configs, lambda index, point, name: point != HEAD and not (name == "int4" and point == "attn_out"), fisher))
    assert set(table.kl) == {(i, p.name) for i in range(2) for p in family.points}
    for (_, point), values in table.kl.items():
        assert values[FLOAT] == 0.0 and values["int8"] > 0
        assert ("int4" in values) == (point != "attn_out")  # a format the caller does not allow is not measured
    # 4 bits cost more
    assert sum(v["int4"] for v in table.kl.values() if "int4" in v) > sum(
        v["int8"] for v in table.kl.values()
    )
    for parameter in model.parameters():  # the model itself is left float: every trial ran on a copy
        assert parameter.dtype == torch.float32
    assert torch.equal(
        model.model.layers[0].mlp.down_proj.weight, load_causal_lm(wide).model.layers[0].mlp.down_proj.weight
    )


def _plain_fisher(model, windows: torch.Tensor, linears: list[str]) -> dict[str, torch.Tensor]:
    """The same estimate by plain autograd on a float32 model: every output's gradient retained, then read."""
    generator = torch.Generator().manual_seed(0)
    sums = {name: 0.0 for name in linears}
    tokens = 0
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(_module, _args, out):
            out.retain_grad()
            outputs[name] = out
        return hook

    handles = [model.get_submodule(name).register_forward_hook(keep(name)) for name in linears]
    for row in windows:
        log_probs = torch.log_softmax(model(row[None], use_cache=False).logits[0, :-1], dim=-1)
        labels = torch.multinomial(log_probs.detach().exp(), 1, generator=generator)[:, 0]
        log_probs.gather(1, labels[:, None]).sum().backward()
        for name in linears:
            sums[name] = sums[name] + outputs[name].grad[0].pow(2).sum(0)
        tokens += log_probs.shape[0]
        model.zero_grad(set_to_none=True)
    for handle in handles:
        handle.remove()
    return {name: total / tokens for name, total in sums.items()}


def test_the_fisher_of_a_bf16_model_is_what_plain_autograd_gives_its_float32_copy(wide, windows):
    held = load_causal_lm(wide).to(torch.bfloat16)
    copy = load_causal_lm(wide).to(torch.bfloat16).float()
    linears = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"]
    fisher = output_fisher(held, windows[:2], linears)
    reference = _plain_fisher(copy, windows[:2], linears)
    for name in linears:  # each gradient counted once, though its block was computed twice
        torch.testing.assert_close(
            fisher[name], reference[name], rtol=1e-3, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert all(p.grad is None and p.requires_grad and p.dtype == torch.bfloat16 for p in held.parameters())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak reads Linux's VmHWM")
def test_the_fisher_pass_holds_one_block_in_float32_not_every_block():
    """Its backward pass needs every block's weights; kept as the float32 copies the forward used, they would all be
    held at once (and, were weights trainable, their gradients too). Each MLP weight is over 32 MB in float32, so the
    allocator maps and unmaps it on its own and the resident peak sees every copy."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=36864,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=400,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    blocks_float32_mb = 4 * sum(p.numel() for p in model.model.layers.parameters()) / 2**20
    ids = torch.randint(0, 400, (1, 16), generator=torch.Generator().manual_seed(3))
    output_fisher(model, ids, ["model.layers.5.mlp.down_proj"])  # threads and small buffers settled
    gc.collect()
    reset_peak()
    before = peak_mb()
    output_fisher(model, ids, ["model.layers.5.mlp.down_proj"])
    assert peak_mb() - before < 0.4 * blocks_float32_mb  # one block is a sixth of them


def test_the_lm_head_is_a_group_whose_sensitivity_is_measured_in_the_formats_allowed_for_it(wide, windows):
    model = load_causal_lm(wide)
    fisher = output_fisher(model, windows[:2], ["lm_head", "model.layers.1.mlp.down_proj"])
    assert fisher["lm_head"].shape == (model.config.vocab_size,) and float(fisher["lm_head"].sum()) > 0
    configs = candidate_configs(["int8", "fp8", "int4"], SHARED)
    ones = {f"model.layers.{i}.{n}": torch.ones(1) for i in range(2) for n in family_of(model.config).linears()}
    table = sensitivity(
        model,
        windows,
        SensitivityJob(
            configs, lambda index, point, name: point != HEAD or name in ("fp8", "int4"), {**fisher, **ones}
        ),
    )
    head = table.kl[(HEAD_INDEX, HEAD)]
    # int8: not for the head
    assert (
        set(head) == {FLOAT, "fp8", "int4"} and head[FLOAT] == 0.0 and head["int4"] > head["fp8"] > 0
    )
    # measured on copies
    torch.testing.assert_close(
        model.lm_head.weight, load_causal_lm(wide).lm_head.weight, rtol=0, atol=0
    )
    none = sensitivity(model, windows, SensitivityJob(configs, lambda index, point, name: point != HEAD, fisher | ones))
    assert (HEAD_INDEX, HEAD) not in none.kl


def test_the_solver_finds_the_exact_optimum_of_a_small_table():
    """Against every assignment of a synthetic table (KL in thousandths, so the budget's steps hold them exactly)."""
    rng = random.Random(7)
    choices = {}
    for group in range(6):
        options = [Choice(FLOAT, 0.0, 10.0)]
        options += [Choice(name, rng.randint(1, 20) / 1000, rng.uniform(2.0, 9.0)) for name in ("int8", "int4")]
        choices[(group, "p")] = options
    for budget in (0.0, 0.01, 0.02, 0.04, 0.1):
        chosen = solve(choices, budget)
        assert sum(c.kl for c in chosen.values()) <= budget + 1e-12
        best = min(sum(c.cost for c in combo) for combo in itertools.product(*choices.values())
                   if sum(c.kl for c in combo) <= budget + 1e-12)
        assert sum(c.cost for c in chosen.values()) == pytest.approx(best, abs=1e-9), budget


def test_formats_one_bundle_cannot_hold_together_are_never_chosen_together():
    """The exact optimum over plans drawn from one format set, against every assignment; here the unconstrained optimum
    would mix nvfp4 with int8, which one Edge-LLM bundle cannot hold."""
    from compress.backends.edgellm.contracts import mixed_conflict, mixed_format_sets

    rng = random.Random(11)
    names = ("int8", "int4", "fp8", "nvfp4")
    sets = mixed_format_sets(list(names))
    choices = {
        (group, "p"): [
            Choice(FLOAT, 0.0, 10.0),
            *(Choice(n, rng.randint(1, 12) / 1000, rng.uniform(1.0, 9.0)) for n in names),
        ]
        for group in range(5)
    }
    for budget in (0.005, 0.02, 0.06):
        free = solve(choices, budget)
        chosen = solve_apart(choices, budget, sets, always=FLOAT)
        assert (
            mixed_conflict(c.format for c in chosen.values()) is None
            and sum(c.kl for c in chosen.values()) <= budget + 1e-12
        )
        best = min(sum(c.cost for c in combo) for combo in itertools.product(*choices.values())
                   if sum(c.kl for c in combo) <= budget + 1e-12 and mixed_conflict(c.format for c in combo) is None)
        assert sum(c.cost for c in chosen.values()) == pytest.approx(best, abs=1e-9), budget
    assert mixed_conflict(c.format for c in free.values()) is not None  # the constraint bound at the largest budget


def test_a_budget_of_zero_keeps_everything_float_and_a_large_one_takes_the_cheapest():
    choices = {(0, "a"): [Choice(FLOAT, 0.0, 4.0), Choice("int8", 0.01, 2.0), Choice("int4", 0.05, 1.0)],
               (1, "a"): [Choice(FLOAT, 0.0, 4.0), Choice("int8", 0.02, 2.0)]}
    assert {c.format for c in solve(choices, 0.0).values()} == {FLOAT}
    assert [c.format for c in solve(choices, 1.0).values()] == ["int4", "int8"]
    assert {g: c.format for g, c in solve(choices, 0.031).items()} == {(0, "a"): "int8", (1, "a"): "int8"}


def test_the_portable_onnx_carries_the_same_mix(wide, windows, tmp_path):
    """INT8 and INT4 weights side by side in one Q/DQ graph, which ONNX Runtime computes as the torch measurement
    does."""
    import numpy as np
    import onnx

    from compress.backends.onnx.export import ParityCheck, export_decoder_folder
    from compress.backends.onnx.runtime import ONNX_FILE, OnnxDecoder
    from compress.models.loading import load_tokenizer, save_side_files

    plan = MixedPlan({0: {"attn_in": "int8", "attn_out": FLOAT, "mlp_in": "int4", "mlp_hidden": "int8"},
                      1: {"attn_in": "int4", "attn_out": "int8", "mlp_in": FLOAT, "mlp_hidden": "int4"}},
                     candidate_configs(["int8", "int4"], SHARED))
    quantize_folder(
        wide,
        tmp_path / "q",
        windows,
        QUANTIZE_CONFIG.validate_python({"method": "auto", **SHARED}),
        plan=plan,
    )
    save_side_files(load_tokenizer(wide), wide, tmp_path / "q")
    exported = export_decoder_folder(tmp_path / "q", tmp_path / "onnx", parity=ParityCheck(new_tokens=4))
    graph = onnx.load(str(tmp_path / "onnx" / ONNX_FILE), load_external_data=False).graph
    kinds = {onnx.TensorProto.DataType.Name(init.data_type) for init in graph.initializer}
    assert {"INT8", "INT4"} <= kinds and exported.quantized
    assert exported.qdq["quantized_linears"] == len(load_quantization(tmp_path / "q")[1])
    measured = window_logits(tmp_path / "q", windows)
    decoder = OnnxDecoder(tmp_path / "onnx")
    for index, row in enumerate(windows):
        onnx_logits = np.asarray(decoder.logits(row.numpy()[None, :]))[0]
        assert float(np.abs(onnx_logits - measured.logits(index)).max()) < 0.05 * float(
            np.abs(measured.logits(index)).max()
        )


def _head_inputs(model, windows) -> list[torch.Tensor]:
    """The last decoder block's outputs on ``windows`` (what the head's quantizer reads, before the final norm)."""
    outputs = []
    handle = model.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: outputs.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        for row in windows:
            model(row[None])
    handle.remove()
    return [o.float() for o in outputs]


class _LargestFloat32(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements any float32 tensor an operation returns holds."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("head_format", ["fp8", "int4", "nvfp4"])
def test_the_lm_head_is_quantized_a_slice_of_rows_at_a_time_with_the_numbers_of_the_whole(wide, windows, monkeypatch,
                                                                                        head_format):
    """Rows are independent once the input statistics and per-tensor scales are fixed: slices of 24 rows (the last one
    ragged) give the levels and scales of the whole head, and no float32 tensor the size of the head is ever made."""
    from compress.transforms.quantize import decoder

    model = load_causal_lm(wide)
    head = decoder.lm_head_of(model)
    head.weight = head.weight.detach().to(torch.bfloat16)  # as a real checkpoint stores it
    outputs = _head_inputs(model, windows)
    config = candidate_configs([head_format], SHARED)[head_format]
    whole = decoder.quantize_head(head, outputs, config)
    monkeypatch.setattr(decoder, "ROWS_AT_A_TIME", 24)
    assert head.weight.shape[0] % 24 != 0
    with _LargestFloat32() as largest:
        sliced = decoder.quantize_head(head, outputs, config)
    assert largest.largest < head.weight.numel() / 2, largest.largest
    assert sliced.levels.shape == whole.levels.shape == head.weight.shape and sliced.levels.dtype == whole.levels.dtype
    same = (sliced.levels.float() == whole.levels.float()).float().mean().item()
    if head_format == "fp8":  # round to nearest under one per-tensor scale: exactly the same numbers
        assert (
            same == 1.0 and torch.equal(sliced.weight_scales, whole.weight_scales) and sliced.weight_scales.dim() == 0
        )
    else:  # GPTQ's row updates go through matrix products whose float order may differ with the slice's height
        assert same > 0.995, same
        torch.testing.assert_close(sliced.weight_scales, whole.weight_scales, rtol=0.02, atol=1e-6)
    assert sliced.global_scale == whole.global_scale and sliced.input_scale == whole.input_scale
    assert sliced.sqnr_db == pytest.approx(whole.sqnr_db, abs=0.05) and math.isfinite(sliced.sqnr_db)
    assert sliced.output_mse.shape == (head.weight.shape[0],)
