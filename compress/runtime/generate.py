"""Text generation over a run's output: greedy or sampled, streaming, stop strings, batches.

``load(RUN_DIR)`` checks provenance first (the ONNX files still hash to what the run recorded;
an engine still hashes to what its build recorded, or was built by this TensorRT on this GPU)
and then picks the backend: TensorRT Edge-LLM's runtime when the run has a built bundle engine
and ``llm_inference`` and a CUDA device are here, the generic TensorRT engine where ``tensorrt``
and a matching GPU are present, otherwise ONNX Runtime on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from compress.backends.onnx.encoder import ENCODER_FILE, OnnxEncoder
from compress.backends.onnx.runtime import LAYOUT_FILE, DecoderLayout, OnnxDecoder, greedy_stream
from compress.backends.tensorrt.decoder import TrtDecoder
from compress.backends.tensorrt.encoder import TrtEncoder
from compress.backends.tensorrt.provenance import check_engine_provenance
from compress.core.artifact import ENGINE, ONNX
from compress.core.errors import CompressError, ProvenanceError, UsageError
from compress.core.files import read_json
from compress.core.rundir import BUILD_PLAN, ENGINE_MANIFEST, MANIFEST_FILE, RunDir
from compress.models.loading import chat_prompt_ids, load_tokenizer
from compress.runtime.edgellm import EdgeLLMGenerator, check_engine_files
from compress.runtime.options import GenerationOptions, parse_options

log = logging.getLogger(__name__)


@dataclass
class _Sequence:
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    done: bool = False


def _sample(logits: np.ndarray, options: GenerationOptions, rng: np.random.Generator) -> int:
    if options.greedy:
        return int(logits.argmax())
    scaled = logits.astype(np.float64) / max(options.temperature, 1e-5)
    if 0 < options.top_k < scaled.shape[-1]:
        cutoff = np.partition(scaled, -options.top_k)[-options.top_k]
        scaled = np.where(scaled < cutoff, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = np.cumsum(probs[order]) - probs[order] < options.top_p
    mask = np.zeros_like(probs, dtype=bool)
    mask[order[keep]] = True
    probs = np.where(mask, probs, 0.0)
    return int(rng.choice(len(probs), p=probs / probs.sum()))


class TextGenerator:
    """A loaded model and tokenizer with one generation API over the backends."""

    def __init__(self, decoder, tokenizer, backend: str, provenance: dict) -> None:
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.backend = backend
        self.provenance = provenance
        self.eos = set(decoder.layout.eos_token_ids)
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (decoder.layout.eos_token_ids or [0])[0]
        )

    def encode(self, prompt: str, chat: bool) -> list[int]:
        if chat:
            return chat_prompt_ids(self.tokenizer, prompt)
        return self.tokenizer(prompt, add_special_tokens=True).input_ids

    def _batch_steps(self, prompts: Sequence[str], options: GenerationOptions) -> Iterator[list[_Sequence]]:
        encoded = [self.encode(p, options.chat) for p in prompts]
        width = max(len(ids) for ids in encoded)
        ids = np.full((len(encoded), width), self.pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, tokens in enumerate(encoded):  # left padding keeps every sequence's last token aligned
            ids[row, width - len(tokens):] = tokens
            mask[row, width - len(tokens):] = 1
        sequences = [_Sequence(len(tokens)) for tokens in encoded]
        rng = np.random.default_rng(options.seed)
        logits, past = self.decoder.forward(ids, mask, self.decoder.empty_past(len(encoded)))
        for _ in range(options.max_new_tokens):
            next_ids = np.full((len(encoded), 1), self.pad_id, dtype=np.int64)
            for row, seq in enumerate(sequences):
                if seq.done:
                    continue
                token = _sample(logits[row, -1], options, rng)
                if token in self.eos:
                    seq.done = True
                    continue
                seq.tokens.append(token)
                seq.text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
                hit = next((s for s in options.stop if s in seq.text), None)
                if hit is not None:
                    seq.text = seq.text[: seq.text.index(hit)]
                    seq.done = True
                next_ids[row, 0] = token
            yield sequences
            if all(seq.done for seq in sequences):
                return
            mask = np.concatenate([mask, np.ones((len(encoded), 1), dtype=np.int64)], axis=1)
            logits, past = self.decoder.forward(next_ids, mask, past)

    def stream(self, prompt: str, **options) -> Iterator[str]:
        """Yield the answer to one prompt piece by piece as it is decoded."""
        opts = parse_options(options)
        shown = 0
        for sequences in self._batch_steps([prompt], opts):
            text = sequences[0].text
            if len(text) > shown:
                yield text[shown:]
                shown = len(text)

    def generate(self, prompts: str | Sequence[str], **options) -> str | list[str]:
        """Answer one prompt (returns a string) or a batch of prompts (returns a list)."""
        opts = parse_options(options)
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        if not batch:
            return []
        size = getattr(self.decoder, "max_batch", None) or len(batch)  # an engine takes at most its profiles' batch
        texts: list[str] = []
        for start in range(0, len(batch), size):
            chunk = batch[start:start + size]
            final: list[_Sequence] = [_Sequence(0) for _ in chunk]
            for sequences in self._batch_steps(chunk, opts):
                final = sequences
            texts += [seq.text for seq in final]
        return texts[0] if isinstance(prompts, str) else texts

    def stream_ids(self, prompt_ids: list[int], max_new_tokens: int) -> Iterator[int]:
        """Greedy token ids for raw prompt ids, one at a time (EOS ends it, as in ``model.generate``)."""
        return greedy_stream(self.decoder, prompt_ids, max_new_tokens)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy token ids for raw prompt ids."""
        return list(self.stream_ids(prompt_ids, max_new_tokens))


def _check_onnx_provenance(run: RunDir) -> tuple[Path, dict]:
    """The run's exported folder, still holding what the run recorded; a provenance error otherwise."""
    manifest = run.manifest()
    if manifest.get("status") != "finished":
        raise ProvenanceError(f"{run.path} is not a finished run (status {manifest.get('status')}); rerun it to finish")
    found = run.stage_producing(ONNX)
    if found is None:
        raise ProvenanceError(f"{run.path} has no exported ONNX model")
    run.require_intact()
    stage_dir, record = found
    onnx_dir = stage_dir / record.output.path
    return onnx_dir, {"run": str(run.path), "onnx_sha256": record.output.sha256, "target": manifest["target"]}


def load(path: str | Path, backend: Literal["auto", "edgellm", "onnxruntime", "tensorrt"] = "auto",
         threads: int | None = None) -> TextGenerator | EdgeLLMGenerator | OnnxEncoder:
    """Load a run directory (or an exported ONNX folder): a generator for a decoder, an :class:`OnnxEncoder` for an
    encoder (``.embed(...)``, ``.classify(...)``)."""
    path = Path(path)
    run = RunDir(path) if (path / MANIFEST_FILE).is_file() else None
    if run is not None:
        onnx_dir, provenance = _check_onnx_provenance(run)
        if (onnx_dir / ENCODER_FILE).is_file():
            return _encoder(onnx_dir, provenance, backend, threads, run)
    elif (path / ENCODER_FILE).is_file():
        return _encoder(path, {"onnx_folder": str(path)}, backend, threads)
    elif (path / LAYOUT_FILE).is_file():
        onnx_dir, provenance = path, {"onnx_folder": str(path)}
    else:
        raise UsageError(f"{path} is neither a run directory nor an exported ONNX folder")
    tokenizer = load_tokenizer(onnx_dir)
    if backend in ("auto", "edgellm") and run is not None:
        generator = _try_edgellm(run, tokenizer, provenance, required=backend == "edgellm")
        if generator is not None:
            return generator
    engine = (
        _try_tensorrt(run, required=backend == "tensorrt")
        if backend in ("auto", "tensorrt") and run is not None
        else None
    )
    if engine is not None:
        decoder = TrtDecoder(engine[0], DecoderLayout.load(onnx_dir), engine[1])
        return TextGenerator(decoder, tokenizer, "tensorrt", provenance)
    if backend == "tensorrt":
        raise UsageError(f"backend='tensorrt' needs a run directory with a built engine, not {path}")
    return TextGenerator(OnnxDecoder(onnx_dir, threads), tokenizer, "onnxruntime", provenance)


def _encoder(
    onnx_dir: Path, provenance: dict, backend: str, threads: int | None, run: RunDir | None = None
) -> OnnxEncoder:
    if backend not in ("auto", "onnxruntime", "tensorrt"):
        raise UsageError(f"backend={backend!r}: encoders run in ONNX Runtime or on their TensorRT engine")
    engine = (
        _try_tensorrt(run, required=backend == "tensorrt") if run is not None and backend != "onnxruntime" else None
    )
    if engine is None and backend == "tensorrt":
        raise UsageError(f"backend='tensorrt' needs a run directory with a built engine, not {onnx_dir}")
    encoder = TrtEncoder(onnx_dir, engine[0], engine[1]) if engine is not None else OnnxEncoder(onnx_dir, threads)
    encoder.provenance = provenance
    return encoder


def _try_edgellm(run: RunDir, tokenizer, provenance: dict, required: bool) -> EdgeLLMGenerator | None:
    """An :class:`~compress.runtime.edgellm.EdgeLLMGenerator` on the run's built Edge-LLM engine, or None."""
    folder = run.edgellm_engine_folder()
    if folder is None or not (folder / ENGINE_MANIFEST).is_file():
        if required:
            raise ProvenanceError(
                f"{run.path} has no built Edge-LLM engine; run `compress build-engine {run.path}` on the device"
            )
        return None
    manifest = check_engine_files(folder)
    try:
        return EdgeLLMGenerator(folder, tokenizer, {**provenance, "engine_sha256": manifest["engine_sha256"]})
    except CompressError as exc:
        if required:
            raise
        log.info("Edge-LLM engine not used (%s); trying the other backends", exc)
        return None


def _try_tensorrt(run: RunDir, required: bool) -> tuple[Path, bool] | None:
    """The run's built engine, checked against this TensorRT and GPU, and whether it is version-compatible; or None."""
    if run.edgellm_engine_folder() is not None:
        if required:
            raise ProvenanceError(f"{run.path}'s engine is built by TensorRT Edge-LLM; load it with backend='edgellm'")
        return None
    found = run.stage_producing(ENGINE)
    engine_dir = found[0] / found[1].output.path if found else None
    if engine_dir is None or not (engine_dir / ENGINE_MANIFEST).is_file():
        if required:
            raise ProvenanceError(
                f"{run.path} has no built engine; run `compress build-engine {run.path}` on the device"
            )
        return None
    try:
        manifest = check_engine_provenance(engine_dir)
    except ProvenanceError:
        raise
    except UsageError as exc:
        raise ProvenanceError(str(exc)) from exc
    except CompressError as exc:
        if required:
            raise
        log.info("TensorRT engine not used (%s); running the ONNX model in ONNX Runtime", exc)
        return None
    plan = read_json(engine_dir / BUILD_PLAN)
    return engine_dir / plan["engine_file"], bool(manifest.get("version_compatible"))
