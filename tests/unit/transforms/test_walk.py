"""The one block walker: what it hands each visitor is what the model itself computes, block by block."""

from __future__ import annotations

import pytest
import torch

from compress.models.families import decoder_blocks
from compress.models.loading import load_causal_lm
from compress.transforms.walk import BlockVisitor, capture_first_block_inputs, forward_loop_of, walk_blocks


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_causal_lm(tiny_llama)


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 400, (3, 24), generator=torch.Generator().manual_seed(0))


class _Recorder(BlockVisitor):
    def __init__(self) -> None:
        self.visited: list[int] = []
        self.inputs: list[list[torch.Tensor]] = []
        self.outputs: list[list[torch.Tensor]] = []
        self.devices: list[str] = []

    def visit(self, index, block, inputs):
        self.visited.append(index)
        self.inputs.append([h.clone() for h in inputs.hidden])
        self.devices.append(str(next(block.parameters()).device))

    def after(self, index, block, inputs, outputs):
        self.outputs.append([o.clone() for o in outputs])


def test_each_block_sees_the_hidden_states_the_model_computes(model, windows):
    recorder = _Recorder()
    walk_blocks(model, windows, [recorder])
    layers = len(decoder_blocks(model))
    assert recorder.visited == list(range(layers))
    with torch.no_grad():
        for w, row in enumerate(windows):
            states = model(row[None], output_hidden_states=True, use_cache=False).hidden_states
            for layer in range(layers):
                torch.testing.assert_close(recorder.inputs[layer][w], states[layer], rtol=1e-5, atol=1e-5)
            for layer in range(layers - 1):
                torch.testing.assert_close(recorder.outputs[layer][w], recorder.inputs[layer + 1][w])


def test_sliding_and_full_layers_each_get_their_own_mask_and_rotary_tables(tmp_path, windows):
    """Gemma 3 hands its sliding layers a banded mask and the local rotary base, its full layers the causal mask and the
    global base: with a window shorter than the calibration windows, every block still sees what the model computes."""
    from tests.conftest import build_tiny_llama

    folder = build_tiny_llama(tmp_path / "gemma3", layers=4, family="gemma3", sliding_window=6)
    model = load_causal_lm(folder)
    recorder = _Recorder()
    walk_blocks(model, windows, [recorder])
    with torch.no_grad():
        for w, row in enumerate(windows):
            states = model(row[None], output_hidden_states=True, use_cache=False).hidden_states
            for layer in range(len(decoder_blocks(model))):
                torch.testing.assert_close(recorder.inputs[layer][w], states[layer], rtol=1e-5, atol=1e-5)


def test_a_forward_loop_captures_what_windows_capture(model, windows):
    from_windows = capture_first_block_inputs(model, windows)
    from_loop = capture_first_block_inputs(model, forward_loop_of(windows))
    assert len(from_windows.hidden) == len(from_loop.hidden) == len(windows)
    for a, b in zip(from_windows.hidden, from_loop.hidden, strict=True):
        assert torch.equal(a, b)
    assert type(model).forward is model.forward.__func__  # the stopping forward is gone again


def test_propagation_hooks_shape_only_the_next_blocks_inputs(model, windows):
    class _Zeroing(BlockVisitor):
        def propagation_hooks(self, index, block):
            if index != 0:
                return []
            return [block.register_forward_hook(lambda _m, _a, out: (torch.zeros_like(out[0]), *out[1:])
                                                if isinstance(out, tuple) else torch.zeros_like(out))]

    recorder = _Recorder()
    hooks_before = dict(decoder_blocks(model)[0]._forward_hooks)
    walk_blocks(model, windows, [_Zeroing(), recorder])
    assert all(float(h.abs().max()) == 0.0 for h in recorder.inputs[1])  # block 1 was fed block 0's zeroed outputs
    assert float(recorder.inputs[0][0].abs().max()) > 0  # block 0 itself was not
    assert dict(decoder_blocks(model)[0]._forward_hooks) == hooks_before  # and the hook is removed afterwards


def test_a_weights_only_visitor_runs_no_forward_pass(model):
    class _WeightsOnly(_Recorder):
        needs_inputs = False

    def no_data(_model):
        raise AssertionError("a weights-only walk must not run the model")

    visitor = _WeightsOnly()
    walk_blocks(model, no_data, [visitor])
    assert visitor.visited == list(range(len(decoder_blocks(model)))) and visitor.outputs == []


def test_blocks_are_computed_on_the_device_given_and_moved_back(model, windows):
    recorder = _Recorder()
    walk_blocks(model, windows, [recorder], device="cpu")
    assert set(recorder.devices) == {"cpu"}
    assert {str(p.device) for p in model.parameters()} == {"cpu"}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                         reason="no CUDA device"))])
def test_quantizing_on_a_named_device_gives_the_numbers_of_the_model_s_own_device(tiny_llama, windows, device):
    from compress.transforms.quantize.config import QUANTIZE_CONFIG
    from compress.transforms.quantize.decoder import quantize_model

    config = QUANTIZE_CONFIG.validate_python(
        {"method": "int8", "calib_windows": 3, "calib_window": 24, "min_calib_tokens": 1, "sample_tokens": 64}
    )
    here, there = load_causal_lm(tiny_llama), load_causal_lm(tiny_llama)
    quantize_model(here, windows, config, progress=False)
    quantize_model(there, windows, config, progress=False, device=device)
    assert {str(p.device) for p in there.parameters()} == {"cpu"}
    if device == "cpu":
        for (name, a), (_, b) in zip(here.state_dict().items(), there.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
    # another device sums in another order, which moves some weights to the next level: the model computes the same
    else:
        with torch.no_grad():
            a, b = here(windows).logits, there(windows).logits
        assert (a - b).abs().mean() < 0.02 * a.std()


def test_a_model_held_in_bf16_is_computed_in_float32_one_block_at_a_time(tiny_llama, windows):
    from compress.transforms.quantize.config import QUANTIZE_CONFIG
    from compress.transforms.quantize.decoder import quantize_model

    config = QUANTIZE_CONFIG.validate_python(
        {
            "method": "int4",
            "calib_windows": 3,
            "calib_window": 24,
            "min_calib_tokens": 1,
            "sample_tokens": 64,
            "group_size": 32,
        }
    )
    held = load_causal_lm(tiny_llama).to(torch.bfloat16)
    reference = load_causal_lm(tiny_llama).to(torch.bfloat16).float()  # the same numbers, held in float32
    dtypes: list[torch.dtype] = []

    class _Dtypes(BlockVisitor):
        needs_inputs = False

        def visit(self, index, block, inputs):
            dtypes.append(next(block.parameters()).dtype)

    walk_blocks(held, None, [_Dtypes()])
    assert dtypes == [torch.float32] * len(decoder_blocks(held))
    bf16_result = quantize_model(held, windows, config, progress=False)
    fp32_result = quantize_model(reference, windows, config, progress=False)
    assert {p.dtype for p in held.parameters()} == {torch.bfloat16}  # no float32 copy of the model is left behind
    for name, quant in fp32_result.linears.items():
        ours = bf16_result.linears[name].levels
        assert ours.dtype == torch.int8 and ours.shape == quant.levels.shape
        # What enters the first block, rotary tables included, is computed in float32 either way: the same integers.
        assert torch.equal(ours, quant.levels), name


def test_sparsegpt_on_a_bf16_model_keeps_it_in_bf16_and_its_2_4_pattern_exact(tiny_llama, windows):
    from compress.transforms.sparsify import SparsifyConfig, sparse_linears, sparsify_model

    held = load_causal_lm(tiny_llama).to(torch.bfloat16)
    result = sparsify_model(
        held, windows, SparsifyConfig(calib_windows=3, calib_window=24, min_calib_tokens=1), progress=False
    )
    assert {p.dtype for p in held.parameters()} == {torch.bfloat16}
    assert result["pattern_fraction"] == 1.0  # the zeros survive the return to bf16
    for name, weight in sparse_linears(held).items():
        groups = (weight.reshape(weight.shape[0], -1, 4) == 0).sum(dim=2)
        assert bool((groups >= 2).all()), name


def test_streamed_blocks_are_read_one_at_a_time_and_see_what_held_blocks_see(tiny_llama_deep, tmp_path):
    """Blocks read from the checkpoint when their turn comes: the same inputs and outputs as the held model's, and at no
    visit is any other block in memory."""
    from compress.models.weights import CheckpointReader, empty_causal_lm, is_materialized, materialize, module_prefix
    from compress.transforms.walk import StreamedBlocks

    windows = torch.randint(0, 400, (2, 32), generator=torch.Generator().manual_seed(3))
    held = _Recorder()
    walk_blocks(load_causal_lm(tiny_llama_deep), windows, [held])
    model = empty_causal_lm(tiny_llama_deep)
    reader = CheckpointReader(tiny_llama_deep)
    embeddings = model.get_input_embeddings()
    materialize(embeddings, module_prefix(model, embeddings), reader)
    layers = decoder_blocks(model)
    resident: list[int] = []

    class _Resident(BlockVisitor):
        def visit(self, index, block, inputs):
            resident.append(sum(is_materialized(b) for b in layers))

    streamed = _Recorder()
    walk_blocks(model, windows, [streamed, _Resident()], blocks=StreamedBlocks(model, reader))
    assert resident == [1] * len(layers)
    assert all(p.is_meta for p in layers.parameters())  # every block let go after its visit
    for ours, theirs in zip(streamed.inputs + streamed.outputs, held.inputs + held.outputs, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)


def test_a_streamed_quantization_writes_the_levels_the_held_model_computes(tiny_llama, windows, tmp_path):
    """quantize_folder (one block in memory, each written as it is done) stores the integers, scales and folded norms
    that quantizing the whole held model gives."""
    from compress.models.weights import CheckpointReader
    from compress.transforms.quantize.config import QUANTIZE_CONFIG
    from compress.transforms.quantize.decoder import quantize_folder, quantize_model
    from compress.transforms.quantize.saved import load_quantization

    config = QUANTIZE_CONFIG.validate_python(
        {
            "method": "int8",
            "calib_windows": 3,
            "calib_window": 24,
            "min_calib_tokens": 1,
            "sample_tokens": 64,
            "alpha": "auto",
            "weight_algorithm": "gptq",
        }
    )
    held = load_causal_lm(tiny_llama)
    expected = quantize_model(held, windows, config, progress=False)
    result = quantize_folder(tiny_llama, tmp_path / "q", windows, config)
    _, stored = load_quantization(tmp_path / "q")
    assert set(stored) == set(expected.linears) and all(q.levels is None for q in result.linears.values())
    for name, quant in expected.linears.items():
        assert torch.equal(stored[name].levels, quant.levels), name
        assert torch.equal(stored[name].weight_scales, quant.weight_scales.float()), name
        assert stored[name].input_scale == quant.input_scale
    saved = CheckpointReader(tmp_path / "q")
    state = held.state_dict()
    for name in saved.names():  # norms with the migration scales folded in, embeddings as they were
        assert torch.equal(saved.read([name])[name], state[name]), name
    assert not {f"{name}.weight" for name in expected.linears} & set(saved.names())
