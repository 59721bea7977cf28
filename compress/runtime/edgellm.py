"""Generation through TensorRT Edge-LLM's runtime: its ``llm_inference`` program on a built bundle engine.

Each call writes Edge-LLM's request file, runs ``llm_inference`` on the engine and reads the
responses, so a batch of prompts costs one engine load. The engine is checked against the
hashes ``compress build-engine`` recorded before it is used.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from compress.backends.edgellm import tools as edgellm_tools
from compress.core.errors import ProvenanceError
from compress.core.files import read_json, sha256_file
from compress.core.rundir import EDGELLM_BUILD_PLAN, ENGINE_MANIFEST
from compress.runtime.options import parse_options


class EdgeLLMGenerator:
    """The :class:`~compress.runtime.generate.TextGenerator` API over an Edge-LLM engine folder."""

    backend = "edgellm"

    def __init__(self, engine_folder: Path, tokenizer, provenance: dict[str, Any]) -> None:
        self.folder = engine_folder
        self.tokenizer = tokenizer
        self.provenance = provenance
        self.plan = read_json(engine_folder / EDGELLM_BUILD_PLAN)
        self.tool = edgellm_tools.require_device_tool(edgellm_tools.INFERENCE_TOOL)

    def _request_file(self, prompts: list[str], options) -> dict[str, Any]:
        request = edgellm_tools.greedy_requests(prompts, options.max_new_tokens)
        request.update(apply_chat_template=options.chat, add_generation_prompt=options.chat)
        if not options.greedy:
            request.update(temperature=options.temperature, top_k=options.top_k, top_p=options.top_p)
            if options.seed is not None:
                request["sampling_seed"] = options.seed
        if options.stop:
            for item in request["requests"]:
                item["stop"] = list(options.stop)
        return request

    def _run(self, prompts: list[str], options) -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory(prefix="edgellm-") as work:
            output, _ = edgellm_tools.run_inference(self.tool, self.folder / self.plan["engine_dir"],
                                                     self._request_file(prompts, options), Path(work), warmup=0)
        return sorted(output.get("responses", []), key=lambda r: (int(r["request_idx"]), int(r.get("batch_idx", 0))))

    def generate(self, prompts: str | Sequence[str], **options) -> str | list[str]:
        """Answer one prompt (returns a string) or a batch of prompts (returns a list)."""
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        if not batch:
            return []
        texts = [r["output_text"] for r in self._run(batch, parse_options(options))]
        return texts[0] if isinstance(prompts, str) else texts

    def stream(self, prompt: str, **options) -> Iterator[str]:
        """The answer in one piece (``llm_inference`` returns whole responses)."""
        yield self.generate(prompt, **options)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy token ids for raw prompt ids (sent as their text, no chat template)."""
        text = self.tokenizer.decode(prompt_ids)
        responses = self._run([text], parse_options({"max_new_tokens": max_new_tokens, "chat": False}))
        return [int(t) for t in responses[0]["output_ids"]]


def check_engine_files(engine_folder: Path) -> dict[str, Any]:
    """The built engine files still hash to what ``compress build-engine`` recorded; returns the engine manifest."""
    manifest = read_json(engine_folder / ENGINE_MANIFEST)
    for name, digest in manifest["engine_sha256"].items():
        if sha256_file(engine_folder / name) != digest:
            raise ProvenanceError(f"{engine_folder / name} does not match the hash recorded when it was built; "
                                  "rebuild it with `compress build-engine RUN_DIR`")
    return manifest
