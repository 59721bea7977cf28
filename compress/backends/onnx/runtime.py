"""A decoder-only LM in ONNX Runtime with an explicit KV cache.

The exported graph takes ``input_ids``, ``attention_mask``, ``position_ids`` and
``past_key_values.{i}.key|value`` and returns ``logits`` and ``present.{i}.key|value``
(see :mod:`compress.backends.onnx.export`). The layout is described by ``compress_onnx.json``
beside the model file.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ONNX_FILE = "model.onnx"
LAYOUT_FILE = "compress_onnx.json"


@dataclass(frozen=True)
class DecoderLayout:
    """Names and shapes of the KV-cache inputs of an exported decoder."""

    num_layers: int
    num_kv_heads: list[int]
    head_dim: int
    eos_token_ids: list[int]
    int8_activations: bool = False
    fp4_weights: bool = False  # NVFP4 weights stored as FLOAT4E2M1, which ONNX Runtime's CPU kernels do not read
    sliding_window: int = 0  # the tokens a sliding layer attends over (itself included); 0 when no layer slides
    sliding_layers: tuple[int, ...] = ()  # layers whose cache keeps only their last sliding_window - 1 positions

    @classmethod
    def load(cls, folder: Path) -> DecoderLayout:
        data = json.loads((Path(folder) / LAYOUT_FILE).read_text(encoding="utf-8"))
        return cls(
            data["num_layers"],
            list(data["num_kv_heads"]),
            data["head_dim"],
            list(data.get("eos_token_ids", [])),
            bool(data.get("int8_activations", False)),
            bool(data.get("fp4_weights", False)),
            int(data.get("sliding_window", 0)),
            tuple(data.get("sliding_layers", ())),
        )

    def to_json(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "eos_token_ids": self.eos_token_ids,
            "int8_activations": self.int8_activations,
            "fp4_weights": self.fp4_weights,
            "sliding_window": self.sliding_window,
            "sliding_layers": list(self.sliding_layers),
        }

    def cache_length(self, layer: int, past: int) -> int:
        """How many positions ``layer``'s cache holds after ``past`` tokens: a sliding layer only its window's."""
        return min(past, self.sliding_window - 1) if layer in self.sliding_layers else past


def past_names(num_layers: int) -> list[str]:
    """Input names of the KV cache, in graph order."""
    return [f"past_key_values.{i}.{part}" for i in range(num_layers) for part in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    """Output names of the updated KV cache, in graph order."""
    return [f"present.{i}.{part}" for i in range(num_layers) for part in ("key", "value")]


def host_has_int8_dot_product() -> bool:
    """True when the CPU has VNNI, so ONNX Runtime's s8 x s8 kernels do not saturate."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8")) or platform.machine() in (
        "aarch64",
        "arm64",
    )


def fp4_as_fp8(model_path: Path) -> bytes:
    """The graph with its FLOAT4E2M1 initializers retyped to FLOAT8E4M3FN, serialized.

    Every E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives) is an E4M3 value, so the retyped
    graph computes exactly the same numbers; ONNX Runtime's CPU kernels dequantize FP8 but not FP4.
    """
    import ml_dtypes
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path))
    for init in model.graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT4E2M1:
            values = numpy_helper.to_array(init).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
            init.CopyFrom(numpy_helper.from_array(values, init.name))
    return model.SerializeToString()


def thread_cap() -> int | None:
    """The thread count ``OMP_NUM_THREADS`` caps this process at, or None.

    torch follows that variable and ONNX Runtime does not (its pool spins on every core), so the
    sessions compress creates follow it too: a process asked to stay on N cores does.
    """
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def session_options(threads: int | None = None, int8_activations: bool = False):
    """The ONNX Runtime session options every compress session uses.

    INT4 weight-only matrices run in fp32 (``accuracy_level`` 0), matching the torch reference.
    For W8A8 graphs on x86 CPUs without VNNI, ONNX Runtime's fused integer kernels saturate
    16-bit intermediate sums and break accuracy, so the Q/DQ graph is run unfused there.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if int8_activations and not host_has_int8_dot_product():
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    threads = threads or thread_cap()
    if threads:
        options.intra_op_num_threads = threads
    return options


def make_session(
    model_path: Path, threads: int | None = None, int8_activations: bool = False, fp4_weights: bool = False
):
    """An ONNX Runtime CPU session with :func:`session_options`; NVFP4 weights are read through :func:`fp4_as_fp8`."""
    import onnxruntime as ort

    source = fp4_as_fp8(model_path) if fp4_weights else str(model_path)
    return ort.InferenceSession(source, session_options(threads, int8_activations), providers=["CPUExecutionProvider"])


def greedy_stream(decoder, prompt_ids: list[int], max_new_tokens: int) -> Iterator[int]:
    """Greedy decoding with the KV cache over any decoder with ``forward``/``empty_past``/``layout``.

    Yields token ids; an end-of-sequence token is yielded and ends the stream.
    """
    ids = np.asarray([prompt_ids], dtype=np.int64)
    mask = np.ones_like(ids)
    logits, past = decoder.forward(ids, mask, decoder.empty_past(1))
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        yield token
        if token in decoder.layout.eos_token_ids:
            return
        mask = np.concatenate([mask, np.ones((1, 1), dtype=np.int64)], axis=1)
        logits, past = decoder.forward(np.asarray([[token]], dtype=np.int64), mask, past)


class OnnxDecoder:
    """Run an exported decoder step by step in ONNX Runtime."""

    def __init__(self, folder: Path, threads: int | None = None) -> None:
        self.folder = Path(folder)
        self.layout = DecoderLayout.load(self.folder)
        self.session = make_session(
            self.folder / ONNX_FILE, threads, self.layout.int8_activations, self.layout.fp4_weights
        )
        self._past_names = past_names(self.layout.num_layers)
        types = {i.name: i.type for i in self.session.get_inputs()}
        self._past_dtype = np.float16 if types.get(self._past_names[0]) == "tensor(float16)" else np.float32

    def empty_past(self, batch: int) -> list[np.ndarray]:
        """A zero-length KV cache for ``batch`` sequences (FP16 for an FP16 graph)."""
        return [np.zeros((batch, self.layout.num_kv_heads[i // 2], 0, self.layout.head_dim), dtype=self._past_dtype)
                for i in range(2 * self.layout.num_layers)]

    def forward(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, past: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One step: logits for ``input_ids`` and the grown cache. ``attention_mask`` covers past + new tokens (a
        sliding layer's cache holds fewer)."""
        past_len = attention_mask.shape[1] - input_ids.shape[1]
        positions = np.clip(np.cumsum(attention_mask, axis=-1) - 1, 0, None)[:, past_len:]
        feed = {"input_ids": input_ids.astype(np.int64), "attention_mask": attention_mask.astype(np.int64),
                "position_ids": positions.astype(np.int64)}
        feed.update(zip(self._past_names, past, strict=False))
        outputs = self.session.run(None, feed)
        return outputs[0], outputs[1:]

    def logits(self, input_ids: np.ndarray) -> np.ndarray:
        """Logits of a full, unpadded batch with no cache."""
        mask = np.ones_like(input_ids, dtype=np.int64)
        return self.forward(input_ids, mask, self.empty_past(input_ids.shape[0]))[0]

    def logits_in_chunks(self, input_ids: np.ndarray, chunk: int) -> Iterator[tuple[int, np.ndarray]]:
        """The logits of one unpadded sequence, ``chunk`` tokens at a time through the KV cache: ``(first position,
        logits[1, chunk, vocab])`` pairs. What :meth:`logits` computes, without a whole window's logits and
        activations in ONNX Runtime's memory at once."""
        past = self.empty_past(input_ids.shape[0])
        for start in range(0, input_ids.shape[1], chunk):
            piece = input_ids[:, start:start + chunk]
            mask = np.ones((input_ids.shape[0], start + piece.shape[1]), dtype=np.int64)
            logits, past = self.forward(piece, mask, past)
            yield start, logits

    def sequences_in_chunks(self, sequences: list[np.ndarray], chunk: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """:meth:`logits_in_chunks` of each sequence in turn: ``(sequence, first position, logits[1, chunk,
        vocab])``."""
        for index, ids in enumerate(sequences):
            for start, logits in self.logits_in_chunks(ids[None, :], chunk):
                yield index, start, logits

    def stream_greedy(self, prompt_ids: list[int], max_new_tokens: int) -> Iterator[int]:
        """Greedy decoding with the KV cache, yielding token ids until EOS or the limit."""
        return greedy_stream(self, prompt_ids, max_new_tokens)

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of one prompt."""
        return list(self.stream_greedy(prompt_ids, max_new_tokens))
