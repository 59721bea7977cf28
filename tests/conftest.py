"""Shared fixtures: tiny models built in-process from a config, and paths to shipped text."""

from __future__ import annotations

import os
from pathlib import Path

# Each pytest-xdist worker gets its share of the cores, for its own torch and ONNX Runtime and for the runs it
# starts: thread pools spin while they wait, so more threads than cores slow every test down. Set before torch loads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CALIB = REPO / "calib_data" / "calibration" / "emma.txt"
EVAL = REPO / "calib_data" / "evaluation" / "prideprejudice.txt"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_tokenizer(vocab_size: int = 512, chat_template: bool = False):
    """A byte-level BPE tokenizer trained in-process on a slice of the calibration text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CALIB.read_text(encoding="utf-8")[:200_000]], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if chat_template:  # Edge-LLM's exporter ships the model's chat template and refuses a model without one
        tokenizer.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    return tokenizer


def build_tiny_llama(folder: Path, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                     intermediate: int = 128, seed: int = 0, chat_template: bool = False, family: str = "llama",
                     **config_overrides) -> Path:
    """Save a randomly initialised decoder (GQA) with a trained tokenizer to ``folder``.

    ``family``: "llama", "mistral", "qwen2" (q/k/v biases), "qwen3" (q/k norms), "gemma3" (text; offset norms,
    post-norms, sliding-window layers) or "phi3" (fused projections, partial rotary).
    """
    import transformers

    tokenizer = build_tokenizer(chat_template=chat_template)
    torch.manual_seed(seed)
    names = {"llama": ("Llama", "Llama"), "mistral": ("Mistral", "Mistral"), "qwen2": ("Qwen2", "Qwen2"),
             "qwen3": ("Qwen3", "Qwen3"), "gemma3": ("Gemma3Text", "Gemma3"), "phi3": ("Phi3", "Phi3")}[family]
    config_cls, model_cls = getattr(transformers, f"{names[0]}Config"), getattr(transformers, f"{names[1]}ForCausalLM")
    extra = {
        "qwen3": {"head_dim": hidden // heads},
        # Every other layer slides over a window longer than the targets' contexts, so full attention is exact; a wider
        # initialisation than the default gives the random model peaked logits, so top-1 agreement means something.
        "gemma3": {"head_dim": hidden // heads, "sliding_window": 4096, "initializer_range": 0.1, "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]},
        "phi3": {"partial_rotary_factor": 0.5},
    }.get(family, {}) | config_overrides
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **extra,
    )
    model = model_cls(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# The longest test files (whole runs on the real models, the Edge-LLM exporter) go first: pytest-xdist hands out
# whole files in collection order, and a long file handed out last runs on one worker while the other waits.
LONGEST_FIRST = ("test_e2e_smollm2.py", "test_families.py", "test_encoder_pipeline.py", "test_edgellm_export.py",
                 "test_unified_checkpoint.py", "test_thor_formats.py", "test_run_dir_safety.py", "test_distill.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer GQA Llama folder (safetensors + tokenizer)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_llama_deep(tmp_path_factory) -> Path:
    """A 6-layer GQA Llama folder, slower to export (for the kill-and-resume test)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny6") / "model", layers=6, hidden=128, intermediate=256)


TINY_SMOKE = [
    "export_onnx.parity_new_tokens=4",
    "validate.eval_tokens=256",
    "validate.window=64",
    "validate.latency_prompt_tokens=16",
    "validate.latency_new_tokens=4",
]


def smoke_overrides(*extra: str) -> list[str]:
    """:data:`TINY_SMOKE` with ``extra`` on top: a key ``extra`` gives replaces the smoke list's (compress refuses a key
    given twice)."""
    given = {word.split("=", 1)[0] for word in extra}
    return [word for word in TINY_SMOKE if word.split("=", 1)[0] not in given] + list(extra)


def baseline_run(model: Path, out: Path, *extra: str) -> int:
    """``compress run recipe=baseline`` of ``model`` into ``out`` at the smoke sizes (``extra`` on top), in this
    process."""
    from compress.cli.main import main  # lazy: the suite's helpers import compress only where a test needs it

    return main(["run", "target=jetson-orin", "recipe=baseline", f"model={model}", f"out={out}", "--no-progress",
                 *smoke_overrides(*extra)])


@pytest.fixture(scope="module")
def user_model(tmp_path_factory) -> Path:
    """A tiny decoder of a user's, built once per test module."""
    return build_tiny_llama(tmp_path_factory.mktemp("user") / "model")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, user_model) -> Path:
    """A finished baseline run of :func:`user_model`, made once per test module (copy it before changing it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert baseline_run(user_model, out) in (0, 1)
    return out


def cached_decode_logits(decoder, ids, prefill: int):
    """Logits from prefilling ``ids[:, :prefill]`` then decoding the rest one token at a time with the KV cache."""
    import numpy as np

    logits, past = decoder.forward(ids[:, :prefill], np.ones((1, prefill), dtype=np.int64), decoder.empty_past(1))
    steps = [logits]
    for i in range(prefill, ids.shape[1]):
        logits, past = decoder.forward(ids[:, i:i + 1], np.ones((1, i + 1), dtype=np.int64), past)
        steps.append(logits)
    return np.concatenate(steps, axis=1)


def tamper_bundle(bundle: Path, tensor: str, change) -> None:
    """Rewrite one initializer of an Edge-LLM bundle's ONNX (external data included) with ``change(array)``."""
    import onnx
    from onnx import numpy_helper

    path = bundle / "llm" / "model.onnx"
    model = onnx.load(path, load_external_data=True)
    for index, init in enumerate(model.graph.initializer):
        if init.name == tensor:
            model.graph.initializer[index].CopyFrom(
                numpy_helper.from_array(change(numpy_helper.to_array(init)), tensor)
            )
    (bundle / "llm" / "model.onnx.data").unlink()
    onnx.save(model, path, save_as_external_data=True, location="model.onnx.data")


QUANTIZE_SMALL = ["quantize.calib_window=256", "quantize.min_calib_tokens=1024", "quantize.calib_windows=8"]


def run_compress(*args: str, timeout: int = 900):
    """``python -m compress ARGS...`` from the repository, as a user would run it; the completed process."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "compress", *args],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
