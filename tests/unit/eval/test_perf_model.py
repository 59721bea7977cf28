"""The latency, memory and energy model: calibration, monotonicity, power-mode selection."""

from __future__ import annotations

import json

import pytest

from compress.cli.main import main
from compress.core.config import load_target, select_power_mode
from compress.core.errors import UsageError
from compress.eval.perf_model import (
    QWEN3_0_6B,
    QWEN3_8B,
    Lengths,
    ModelShape,
    Storage,
    anchor_errors,
    fit_decode,
    lowest_power_mode_meeting_budget,
    mode_bandwidth_gbps,
    mode_tops,
    predict,
    predict_all_modes,
    predict_mixed,
    weight_bytes,
)

SMOL = ModelShape(30, 576, 1536, 9, 3, 64, 49152, True)


TOLERANCE_PCT = {"decode tokens/s": 10.0, "prefill ms": 20.0}


def test_every_fitted_and_held_out_point_is_within_its_tolerance():
    rows = anchor_errors()
    checked = [row for row in rows if row.role in ("anchor", "held out")]
    assert all(abs(row.error_pct) <= TOLERANCE_PCT[row.measure] for row in checked), [
        (row.anchor, row.error_pct) for row in checked if abs(row.error_pct) > TOLERANCE_PCT[row.measure]
    ]
    thor_decode = [row for row in checked if "Thor" in row.anchor and row.measure == "decode tokens/s"]
    for label in ("NVFP4", "INT4 AWQ"):
        rows_of = [row for row in thor_decode if label in row.anchor]
        fitted = {row.anchor.split()[0] for row in rows_of if row.role == "anchor"}
        held = {row.anchor.split()[0] for row in rows_of if row.role == "held out"}
        assert len(fitted) >= 3 and held - fitted, label  # a model size the fit never saw is checked
    assert any(row.role == "held out" and row.measure == "prefill ms" for row in checked)


def test_earlier_releases_are_reported_and_not_fitted():
    from compress.eval.perf_model import _matching
    from compress.eval.published_rates import ANCHORS, PREFILL_ANCHORS

    earlier = [row for row in anchor_errors() if row.role == "earlier release"]
    assert any("0.4.0" in row.anchor and "NVFP4" in row.anchor for row in earlier)
    fitted = _matching(ANCHORS, None, None) + _matching(PREFILL_ANCHORS, None, None)
    assert fitted and all(anchor.role == "anchor" for anchor in fitted)
    assert not {row.anchor for row in earlier} & {anchor.name for anchor in fitted}


# The Orin predictions before Thor's refit (Edge-LLM 0.9.0 and the two earlier figures): they must not move.
ORIN_BEFORE = {
    "Qwen3-0.6B INT4 AWQ (Edge-LLM 0.9.0)": 183.1, "Qwen3-1.7B INT4 AWQ (Edge-LLM 0.9.0)": 101.2,
    "Qwen3-4B-2507 INT4 AWQ (Edge-LLM 0.9.0)": 56.5, "Qwen3-8B INT4 AWQ (Edge-LLM 0.9.0)": 33.8,
    "Llama-3-8B INT4 (TensorRT-LLM 0.12, AWQ)": 35.4, "Llama-2-7B INT4 (MLC q4f16_ft)": 43.5,
}


def test_orin_decode_predictions_hold_within_one_percent():
    predicted = {row.anchor: row.predicted for row in anchor_errors() if row.anchor in ORIN_BEFORE}
    assert predicted.keys() == ORIN_BEFORE.keys()
    assert all(abs(predicted[name] / before - 1) < 0.01 for name, before in ORIN_BEFORE.items())


def test_thor_prefill_and_decode_are_fitted_on_its_own_anchors():
    from compress.eval.perf_model import decode_fit_for, fit_prefill

    thor, agx = load_target("jetson-agx-thor"), load_target("jetson-agx-orin-64gb")
    assert fit_prefill("blackwell", "fp4").fitted and fit_prefill("blackwell", "fp16").fitted
    assert fit_prefill("ampere", "fp16").fitted  # Edge-LLM 0.10.0's Orin prefill rows
    assert fit_prefill("blackwell", "fp4").utilisation > fit_prefill("blackwell", "fp16").utilisation
    assert decode_fit_for(thor, "nvfp4") == fit_decode("blackwell", "nvfp4")
    assert decode_fit_for(thor, "fp8") == fit_decode("blackwell")  # no FP8 anchor: Thor's pooled fit
    assert decode_fit_for(agx, "int8") == fit_decode("ampere")
    assert decode_fit_for(load_target("rtx-4090"), "int4") == fit_decode()  # no Ada anchor: every anchor
    assert fit_decode("blackwell", "nvfp4").efficiency < 1  # no more bytes moved than the weights hold


def test_nvfp4_weight_only_pays_for_the_fp16_copy_tensorrt_dequantizes_to():
    thor = load_target("jetson-agx-thor")
    w4a4, w4a16, fp16 = (predict(thor, QWEN3_8B, p, "MAXN") for p in ("nvfp4", "nvfp4_a16", "fp16"))
    assert w4a16.decode_tokens_per_s < fp16.decode_tokens_per_s < w4a4.decode_tokens_per_s
    assert w4a16.memory_gb == pytest.approx(w4a4.memory_gb)  # stored the same; only the per-step traffic differs
    assert w4a16.ttft_ms > w4a4.ttft_ms  # weight-only GEMMs run at the FP16 rate


def test_thor_predictions_use_its_fp8_and_fp4_tensor_cores_and_orin_has_none():
    thor, agx = load_target("jetson-agx-thor"), load_target("jetson-agx-orin-64gb")
    assert [m.name for m in thor.power_modes] == ["120W", "MAXN"]
    fp16, fp8, nvfp4 = (predict(thor, QWEN3_8B, p, "MAXN") for p in ("fp16", "fp8", "nvfp4"))
    assert nvfp4.ttft_ms < fp8.ttft_ms < fp16.ttft_ms  # prefill is compute-bound: FP4 > FP8 > FP16 rates
    assert fp8.decode_tokens_per_s > 1.6 * fp16.decode_tokens_per_s  # decode is bandwidth-bound: half the bytes
    assert nvfp4.decode_tokens_per_s > 1.3 * fp8.decode_tokens_per_s
    assert predict(thor, QWEN3_8B, "int4").decode_tokens_per_s > predict(agx, QWEN3_8B, "int4").decode_tokens_per_s
    assert (
        mode_tops(thor, thor.power_mode(), "fp4") == 1035
        and mode_tops(thor, thor.power_mode(), "fp4", sparse=True) == 2070
    )
    with pytest.raises(UsageError, match=r"jetson-agx-orin-64gb \(sm_87\) has no FP4 tensor cores"):
        predict(agx, QWEN3_8B, "nvfp4")


def test_small_models_pay_a_fixed_cost_per_layer():
    fit = fit_decode()
    assert fit.per_layer_ms > 0
    agx = load_target("jetson-agx-orin-64gb")
    prediction = predict(agx, QWEN3_0_6B, "int4", "MAXN", lengths=Lengths(context=128))
    roofline = (
        fit.efficiency * mode_bandwidth_gbps(agx, agx.power_mode("MAXN")) * 1e9 / weight_bytes(QWEN3_0_6B, "int4")
    )
    assert prediction.decode_tokens_per_s < 0.75 * roofline  # the 0.6B model sits well below its bandwidth bound


def test_more_bandwidth_is_faster_and_int4_beats_fp16():
    nano, agx = load_target("jetson-orin-nano-8gb"), load_target("jetson-agx-orin-64gb")
    assert predict(agx, SMOL, "fp16").decode_tokens_per_s > predict(nano, SMOL, "fp16").decode_tokens_per_s
    fp16, int8, int4 = (predict(nano, SMOL, p).decode_tokens_per_s for p in ("fp16", "int8", "int4"))
    assert int4 > int8 > fp16
    assert predict(nano, SMOL, "int4").memory_gb < predict(nano, SMOL, "fp16").memory_gb


def test_power_modes_are_monotonic_in_clock_caps():
    nano = load_target("jetson-orin-nano-8gb")
    modes = predict_all_modes(nano, SMOL, "fp16")
    by_name = {m.power_mode: m for m in modes}
    assert by_name["15W"].decode_tokens_per_s <= by_name["MAXN_SUPER"].decode_tokens_per_s
    assert by_name["15W"].ttft_ms > by_name["MAXN_SUPER"].ttft_ms
    assert by_name["15W"].joules_per_token < by_name["MAXN_SUPER"].joules_per_token


def test_power_mode_selection():
    nano = load_target("jetson-orin-nano-8gb")
    assert select_power_mode(nano, "15W").name == "15W"
    assert select_power_mode(nano, "30W").name == "25W"
    with pytest.raises(UsageError, match="no mode within 5 W"):
        select_power_mode(nano, "5W")
    modes = predict_all_modes(nano, SMOL, "fp16")
    assert lowest_power_mode_meeting_budget(modes, 1000).power_mode == "7W"
    assert lowest_power_mode_meeting_budget(modes, 0.001) is None


def test_predict_command_on_a_7b_config(tmp_path, capsys):
    config = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
              "num_key_value_heads": 32, "vocab_size": 32000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["predict", "target=jetson-agx-orin-64gb", f"model_config={path}", "precision=int4", "power=MAXN",
                 "context=192"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert abs(result["selected"]["decode_tokens_per_s"] / 46.9 - 1) < 0.1  # the published Llama-2-7B INT4 figure
    assert len(result["modes"]) == 4
    assert main(["predict", "target=jetson-orin", f"model_config={path}"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "lowest_power_mode_meeting_latency_budget" in result
    assert main(["predict", "target=jetson-orin", f"model_config={path}", "precision=fp3"]) == 2


def test_linears_left_fp16_are_read_at_fp16():
    nano = load_target("jetson-orin-nano-8gb")
    int8, mixed, fp16 = (
        predict(nano, SMOL, p, storage=Storage(float_fraction=f))
        for p, f in (("int8", 0.0), ("int8", 0.25), ("fp16", 0.0))
    )
    assert fp16.decode_tokens_per_s < mixed.decode_tokens_per_s < int8.decode_tokens_per_s
    assert int8.memory_gb < mixed.memory_gb < fp16.memory_gb
    assert predict(nano, SMOL, "int8", storage=Storage(float_fraction=1.0)).decode_tokens_per_s == pytest.approx(
        fp16.decode_tokens_per_s
    )


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"])
def test_predict_reads_the_config_of_every_family(family, tmp_path, capsys):
    import transformers

    names = {
        "llama": "Llama",
        "mistral": "Mistral",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "gemma3": "Gemma3Text",
        "phi3": "Phi3",
    }
    config = getattr(transformers, f"{names[family]}Config")(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, vocab_size=262144, tie_word_embeddings=True).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["predict", "target=jetson-orin-nano-8gb", f"model_config={path}", "precision=int4", "context=4096",
                 "power=MAXN_SUPER"]) == 0
    result = json.loads(capsys.readouterr().out)["selected"]
    expected = predict(
        load_target("jetson-orin-nano-8gb"), ModelShape.from_config(config), "int4", "MAXN_SUPER",
        lengths=Lengths(context=4096),
    )
    assert result["decode_tokens_per_s"] == pytest.approx(expected.decode_tokens_per_s, rel=1e-3)
    assert result["decode_tokens_per_s"] > 0 and result["memory_gb"] > 0


def test_sliding_window_layers_read_at_most_their_window():
    """Gemma 3 1B: five of every six layers attend over 512 tokens, so at a long context they read far less KV cache."""
    import transformers

    config = transformers.Gemma3TextConfig(
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=262144,
        sliding_window=512,
    ).to_dict()
    windowed = ModelShape.from_config(config)
    assert windowed.sliding_layers == sum(kind == "sliding_attention" for kind in config["layer_types"]) > 20
    full = ModelShape.from_config({**config, "sliding_window": None})
    assert full.sliding_layers == 0
    assert windowed.kv_bytes_read(256) == full.kv_bytes_read(256)  # inside the window nothing changes
    assert windowed.kv_bytes_read(8192) < 0.25 * full.kv_bytes_read(8192)
    nano = load_target("jetson-orin-nano-8gb")
    fast, slow = (predict(nano, shape, "int4", lengths=Lengths(context=8192)) for shape in (windowed, full))
    assert fast.decode_tokens_per_s > slow.decode_tokens_per_s and fast.memory_gb < slow.memory_gb


def test_predict_on_thor_covers_each_power_mode_and_orin_refuses_nvfp4(tiny_llama, capsys):
    assert main(["predict", "target=jetson-agx-thor", f"model_config={tiny_llama}", "precision=nvfp4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["power_mode"] for row in report["modes"]] == ["120W", "MAXN"]
    assert main(["predict", "target=jetson-orin", f"model_config={tiny_llama}", "precision=fp8"]) == 2
    assert "jetson-orin-nano-8gb (sm_87) has no FP8 tensor cores" in capsys.readouterr().err


def test_an_fp8_kv_cache_halves_the_cache_bytes_and_needs_fp8(tiny_llama, capsys):
    from dataclasses import replace

    thor = load_target("jetson-agx-thor")
    fp16_cache = predict(thor, QWEN3_8B, "nvfp4", lengths=Lengths(context=32768))
    fp8_cache = predict(thor, replace(QWEN3_8B, kv_cache_bytes=1), "nvfp4", lengths=Lengths(context=32768))
    assert replace(QWEN3_8B, kv_cache_bytes=1).kv_bytes_read(32768) == QWEN3_8B.kv_bytes_read(32768) / 2
    assert fp8_cache.decode_tokens_per_s > fp16_cache.decode_tokens_per_s and fp8_cache.memory_gb < fp16_cache.memory_gb
    assert main(["predict", "target=jetson-agx-thor", f"model_config={tiny_llama}", "kv_cache=fp8"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_cache"] == "fp8"
    assert main(["predict", "target=jetson-orin", f"model_config={tiny_llama}", "kv_cache=fp8"]) == 2
    assert "has no FP8 tensor cores" in capsys.readouterr().err


def test_run_predictions_read_the_group_size_the_float_share_and_the_kv_cache_of_the_run(tiny_llama):
    from compress.core.artifact import Deployment
    from compress.eval.decoder import target_predictions

    thor = load_target("jetson-agx-thor")

    def decode(deployment):
        deployment = Deployment.model_validate(deployment)
        return target_predictions(tiny_llama, "int4", thor, "MAXN", deployment)["chosen"]["decode_tokens_per_s"]

    int4 = {"method": "int4", "format": "int", "weight_bits": 4}
    g32 = decode({"quantization": {**int4, "group_size": 32}})
    g128 = decode({"quantization": {**int4, "group_size": 128}})
    assert g32 < g128 == decode({})  # smaller groups carry more scale bytes; 128 when the run names none
    assert decode({"quantization": {**int4, "group_size": 128, "kv_cache": "fp8"}}) > g128
    assert decode({"quantization": {**int4, "group_size": 128}, "float_linear_fraction": 0.5}) < g128
    with pytest.raises(ValueError, match="groupsize"):  # a renamed key fails where it is read, not as a default
        decode({"quantization": {**int4, "groupsize": 32}})


def test_a_quantized_lm_head_is_read_at_its_precision_beside_the_fp16_embedding():
    thor = load_target("jetson-agx-thor")
    mix = {"fp8": 1.0}
    fp16_head, fp8_head = (predict_mixed(thor, SMOL, mix, head=head) for head in ("fp16", "fp8"))
    # The head moves half its bytes (28M of SmolLM2's 135M parameters); on Thor the fixed per-layer cost dominates a
    # model this small, so decode gains a few percent.
    assert 1.02 < fp8_head.decode_tokens_per_s / fp16_head.decode_tokens_per_s < 1.2
    # Tied in FP16 the table is stored once; a quantized head is stored beside it, at one byte per parameter.
    assert fp8_head.memory_gb - fp16_head.memory_gb == pytest.approx(SMOL.lm_head_params() / 1e9, rel=1e-6)
    assert predict_mixed(thor, SMOL, mix, head="fp16").decode_tokens_per_s == pytest.approx(
        fp16_head.decode_tokens_per_s
    )
