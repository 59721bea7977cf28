"""Run by Edge-LLM's own interpreter: load an FP8 or NVFP4 checkpoint with Edge-LLM and run its quantized linears.

    .venv-edgellm/bin/python tests/support/edgellm_fp_probe.py CHECKPOINT OUT.safetensors [--no-quantize-activations]

Edge-LLM's FP8 and NVFP4 linears compute with real torch bodies (the ONNX export replaces them
with Q/DQ nodes of the same definition). For every such linear, after Edge-LLM's loader (and its
q/k/v fusion) has read the checkpoint, this writes a seeded FP16 input ``<name>.x``, the input as
Edge-LLM quantizes it (``<name>.x_q``), the weight as Edge-LLM dequantizes it (``<name>.weight``)
and the linear's output (``<name>.y``).
"""

import json
import sys

import torch
from safetensors.torch import save_file
from tensorrt_edgellm import AutoModel
from tensorrt_edgellm.config import set_default_quantize_activations
from tensorrt_edgellm.models import ops
from tensorrt_edgellm.models.linear import FP8Linear, is_nvfp4_linear


def _input(width: int, amax: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(6, width, generator=generator) * amax / 4
    x[0, 0] = amax  # one value at the calibrated maximum
    return x.half()


def main(checkpoint: str, out: str, quantize_activations: bool) -> None:
    set_default_quantize_activations(quantize_activations)
    model = AutoModel.from_pretrained(checkpoint)
    dumped = {}
    with torch.no_grad():
        for index, (name, module) in enumerate(model.named_modules()):
            if isinstance(module, FP8Linear):
                x = _input(module.in_features, float(module.input_scale) * 448, index)
                x_q = ops.fp8_dequantize(ops.fp8_quantize(x, module.input_scale), module.input_scale)
                weight = ops.fp8_dequantize(module.weight, module.weight_scale)
            elif is_nvfp4_linear(module):
                x = _input(
                    module.in_features, float(module.input_scale) * 6 * 448 if quantize_activations else 4.0, index
                )
                x_q = ops.nvfp4_act_qdq(x, module.input_scale) if module.quantize_activations else x.clone()
                weight = ops.nvfp4_dequantize(
                    module.weight, module.weight_scale, module.weight_scale_2, module.group_size
                )
            else:
                continue
            dumped.update({f"{name}.x": x, f"{name}.x_q": x_q, f"{name}.weight": weight, f"{name}.y": module(x),
                           f"{name}.quantize_activations": torch.tensor(int(module.quantize_activations))})
    save_file({k: v.contiguous() for k, v in dumped.items()}, out, metadata={"modules": json.dumps(sorted(
        {k.rsplit(".", 1)[0] for k in dumped}))})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--no-quantize-activations" not in sys.argv[3:])
