"""A checkpoint's tensors read by name, a few at a time, and a model built around them one part at a time.

A Hugging Face folder keeps its weights in one ``model.safetensors`` or in shards named by
``model.safetensors.index.json``. :class:`CheckpointReader` reads the tensors it is asked for and
closes the file again, so the pages it touched leave the process with it: a model read block by
block never has more than one block resident, whatever its depth.

:func:`empty_causal_lm` builds a causal LM from its ``config.json`` with every parameter on the
``meta`` device (no memory) and its buffers (rotary frequencies) real; :func:`materialize` gives one
part of it (a decoder block, the embeddings) its tensors from a reader, and :func:`release` takes
them back. This is how the quantize stage and validation walk a model larger than this machine's
memory in float32.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from compress.core.errors import UsageError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class CheckpointReader:
    """The tensors of a folder's safetensors files (one file, or the shards its index names), read on request."""

    def __init__(self, folder: Path, file: str = SAFETENSORS_FILE, index: str = SAFETENSORS_INDEX) -> None:
        self.folder = Path(folder)
        self.files = _tensor_files(self.folder, file, index)

    def names(self) -> list[str]:
        """Every tensor name, in file order."""
        return list(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, in their stored dtype, as tensors of their own (the files are closed again)."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name not in self.files:
                raise UsageError(f"{self.folder}: no tensor {name!r} in its safetensors files")
            by_file.setdefault(self.files[name], []).append(name)
        tensors = {}
        from safetensors import safe_open

        for path, wanted in by_file.items():
            with safe_open(str(path), framework="pt") as handle:
                for name in wanted:
                    tensors[name] = handle.get_tensor(name).clone()  # not a view of the mapping, which closes here
        return tensors

    def read_prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor whose name starts with ``prefix`` (``"model.layers.3."``)."""
        return self.read(name for name in self.files if name.startswith(prefix))


def _tensor_files(folder: Path, file: str, index: str) -> dict[str, Path]:
    """Tensor name -> the file holding it."""
    if (folder / index).is_file():
        weight_map = json.loads((folder / index).read_text(encoding="utf-8")).get("weight_map") or {}
        return {name: folder / shard for name, shard in weight_map.items()}
    if not (folder / file).is_file():
        raise UsageError(f"{folder} has neither {file} nor {index}")
    from safetensors import safe_open

    with safe_open(str(folder / file), framework="pt") as handle:
        return {name: folder / file for name in handle.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)


def empty_causal_lm(folder: Path, trust_remote_code: bool = False):
    """The causal LM ``folder``'s config describes, its parameters on ``meta`` in the checkpoint's dtype, its buffers
    real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code,
                                                 dtype=getattr(config, "dtype", None) or torch.float32)
    return model.eval()


def module_prefix(model: torch.nn.Module, module: torch.nn.Module) -> str:
    """The state-dict name of ``module`` inside ``model`` (``"model.layers.3"``)."""
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    raise ValueError("the module is not part of the model")


def materialize(
    module: torch.nn.Module,
    prefix: str,
    reader: CheckpointReader,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    skip: frozenset[str] = frozenset(),
) -> None:
    """Give ``module``'s parameters their tensors from ``reader`` (names ``prefix.<param>``), on ``device`` and in
    ``dtype`` (None: as stored); parameters named in ``skip`` (local names) stay on ``meta`` for the caller to fill."""
    shapes = {name: parameter.shape for name, parameter in module.named_parameters() if name not in skip}
    tensors = reader.read(f"{prefix}.{name}" for name in shapes)
    for name, shape in shapes.items():
        value = tensors.pop(f"{prefix}.{name}")
        if value.shape != shape:
            raise UsageError(f"{reader.folder}: {prefix}.{name} is {tuple(value.shape)} where config.json gives "
                             f"{tuple(shape)}; the weights do not match config.json")
        set_parameter(module, name, value.to(device=device, dtype=dtype if value.is_floating_point() else None))


def release(module: torch.nn.Module) -> None:
    """Put ``module``'s parameters back on ``meta``, freeing their memory."""
    for name, parameter in list(module.named_parameters()):
        set_parameter(module, name, torch.empty_like(parameter, device="meta"))


def set_parameter(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Make ``value`` the parameter ``name`` (a dotted local name) of ``module``."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)


def is_materialized(module: torch.nn.Module) -> bool:
    """Whether every parameter of ``module`` holds real memory."""
    return not any(p.is_meta for p in module.parameters())
