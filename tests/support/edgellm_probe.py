"""Run by Edge-LLM's own interpreter: load a checkpoint with Edge-LLM's loader and dump what it holds.

    .venv-edgellm/bin/python tests/support/edgellm_probe.py CHECKPOINT OUT.safetensors

For every quantized linear it writes the buffers Edge-LLM's loader left in the module, and the
integers Edge-LLM's own unpacking reads from the checkpoint's bytes (``<name>.integers``); for
every decoder linear it loaded as a plain float linear, its weight (``<name>.float.weight``). The
metadata's ``formats`` names the kind of linear the loader built for each decoder linear (fp16, int8,
int4, fp8, nvfp4), and ``head`` the LM head's.
"""

import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tensorrt_edgellm import AutoModel
from tensorrt_edgellm.checkpoint.loader import _unpack_awq_prepacked
from tensorrt_edgellm.config import _parse_quant
from tensorrt_edgellm.models.linear import (
    FP8Linear,
    FP16Linear,
    INT8SQLinear,
    ModelOptAWQPrepackedLinear,
    NVFP4LinearMethod,
)


def raw_tensor(checkpoint: str, name: str) -> torch.Tensor:
    """A tensor as the checkpoint stores it, from its one file or the shard its index names."""
    file = "model.safetensors"
    if os.path.exists(f"{checkpoint}/model.safetensors.index.json"):
        with open(f"{checkpoint}/model.safetensors.index.json") as handle:
            file = json.load(handle)["weight_map"][name]
    with safe_open(f"{checkpoint}/{file}", framework="pt") as raw:
        return raw.get_tensor(name)


def main(checkpoint: str, out: str) -> None:
    with open(f"{checkpoint}/config.json") as handle:
        config = json.load(handle)
    quant = _parse_quant(checkpoint, config)
    model = AutoModel.from_pretrained(checkpoint)
    dumped, formats = {}, {}
    for name, module in model.named_modules():
        kind = _kind(module)
        if kind is not None and ".layers." in name:
            formats[name] = kind
        if kind in ("fp8", "nvfp4"):
            for key, value in module.named_buffers():
                dumped[f"{name}.loaded.{key}"] = value.contiguous()
        if isinstance(module, (INT8SQLinear, ModelOptAWQPrepackedLinear)):
            for key, value in module.named_buffers():
                dumped[f"{name}.loaded.{key}"] = value.contiguous()
            if isinstance(module, ModelOptAWQPrepackedLinear):
                nibbles = _unpack_awq_prepacked(raw_tensor(checkpoint, f"{name}.weight"), module.out_features)
                dumped[f"{name}.integers"] = torch.where(nibbles > 7, nibbles - 16, nibbles).to(torch.int8)
                dumped[f"{name}.group_size"] = torch.tensor(module.group_size)
        elif isinstance(module, FP16Linear) and ".layers." in name:
            dumped[f"{name}.float.weight"] = module.weight.detach().contiguous()
    save_file(dumped, out, metadata={"quant_type": quant.quant_type, "group_size": str(quant.group_size),
                                     "excluded": ",".join(quant.excluded), "formats": json.dumps(formats),
                                     "head": str(_kind(model.lm_head))})


def _kind(module) -> str | None:
    """The format of the linear Edge-LLM's loader built, or None for a module that is not one."""
    if isinstance(getattr(module, "quant_method", None), NVFP4LinearMethod):
        return "nvfp4"
    kinds = ((FP8Linear, "fp8"), (INT8SQLinear, "int8"), (ModelOptAWQPrepackedLinear, "int4"), (FP16Linear, "fp16"))
    return next((kind for cls, kind in kinds if isinstance(module, cls)), None)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
