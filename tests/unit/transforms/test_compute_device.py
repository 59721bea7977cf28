"""``device=cuda`` computes what ``device=cpu`` computes: every quantization method's search, the validation's
block-by-block logits and the greedy answers, each on the named device against the same work on the CPU.

On a machine without CUDA the CPU cases still run the device-agnostic code with the device named explicitly (the
numbers must then be identical); the CUDA cases are skipped for the missing hardware.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compress.core.devices import Compute
from compress.eval.decoder import deployed_generator, teacher_answers
from compress.eval.prompts import PromptCase
from compress.models.loading import load_tokenizer
from compress.transforms.checkpoint_logits import window_logits
from compress.transforms.quantize.config import QUANTIZE_CONFIG
from compress.transforms.quantize.decoder import quantize_folder
from compress.transforms.quantize.saved import load_quantized_causal_lm

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
METHODS = {
    "int8-smoothquant-gptq": {"method": "int8", "hadamard_block": 0},
    "int8-hadamard": {"method": "int8", "hadamard_block": 32},
    "int4-awq-gptq": {"method": "int4", "group_size": 32, "algorithm": "awq+gptq"},
    "fp8": {"method": "fp8"},
    "nvfp4": {"method": "nvfp4"},
}
CALIBRATION = {"calib_windows": 3, "calib_window": 24, "min_calib_tokens": 1, "sample_tokens": 64}


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 400, (3, 24), generator=torch.Generator().manual_seed(0))


def _logits(folder: Path, windows: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_quantized_causal_lm(folder)(windows).logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_quantizes_on_the_device_as_on_the_cpu(tiny_llama, windows, tmp_path, method, device):
    config = QUANTIZE_CONFIG.validate_python({**METHODS[method], **CALIBRATION})
    quantize_folder(tiny_llama, tmp_path / "cpu", windows, config, Compute("cpu"))
    quantize_folder(tiny_llama, tmp_path / device, windows, config, Compute(device))
    here, there = _logits(tmp_path / "cpu", windows), _logits(tmp_path / device, windows)
    if device == "cpu":
        assert torch.equal(here, there)
    # another device sums in another order, which may move a weight to the next level: the model computes the same
    else:
        assert (here - there).abs().mean() < 0.02 * here.std(), method


@pytest.fixture(scope="module")
def quantized(tiny_llama, windows, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("quantized") / "int8"
    quantize_folder(
        tiny_llama,
        folder,
        windows,
        QUANTIZE_CONFIG.validate_python({**METHODS["int8-hadamard"], **CALIBRATION}),
    )
    return folder


@pytest.mark.parametrize("device", DEVICES)
def test_validation_logits_on_the_device_are_the_cpu_s(quantized, windows, device):
    here, there = window_logits(quantized, windows, "cpu"), window_logits(quantized, windows, device)
    for index in range(len(here)):
        a, b = here.logits(index), there.logits(index)
        assert abs(a - b).max() <= (0.0 if device == "cpu" else 1e-3 * abs(a).max()), index


CASES = [PromptCase(f"case-{i}", prompt, None) for i, prompt in
         enumerate(["What is the capital of France?", "Name a colour.", "Count to three.", "Say hello."])]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_answers_on_the_device_are_the_cpu_s(quantized, tiny_llama, device):
    tokenizer = load_tokenizer(tiny_llama)
    prompts = [tokenizer(case.prompt).input_ids for case in CASES]
    with deployed_generator(quantized, [], 0, "cpu") as generate:
        here = generate(prompts, 8)
    with deployed_generator(quantized, [], 0, device) as generate:
        there = generate(prompts, 8)
    teacher_here = teacher_answers(CASES, tokenizer, tiny_llama, [], 8, Compute("cpu"))
    teacher_there = teacher_answers(CASES, tokenizer, tiny_llama, [], 8, Compute(device))
    if device == "cpu":
        assert here == there and teacher_here == teacher_there
    else:  # a near tie may break the other way on another device: most answers must still be the same, token for token
        same = sum(a == b for a, b in zip(here + teacher_here, there + teacher_there, strict=True))
        assert same >= 6, (here, there, teacher_here, teacher_there)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_model_that_does_not_fit_the_device_is_held_on_the_cpu():
    from compress.models.compute import holding_device

    free, _ = torch.cuda.mem_get_info("cuda:0")
    assert holding_device("cuda:0", free, 0) == "cpu" and holding_device("cuda:0", 1024, 1024) == "cuda:0"
