"""What the latency model knows of a decoder: its shapes, read from a config or written for a published model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compress.core.errors import UsageError
from compress.models.config_file import ModelConfig
from compress.models.families import BY_MODEL_TYPE, decoder_shape, family_of, sliding_layers

KV_CACHE_BYTES = 2  # FP16 KV cache on the device, unless quantized


@dataclass(frozen=True)
class ModelShape:
    """What the latency model needs to know of a decoder: shapes only, no weights."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    sliding_layers: int = 0  # layers attending through a window of sliding_window tokens (Gemma 3, Mistral)
    sliding_window: int = 0
    kv_cache_bytes: float = KV_CACHE_BYTES  # per cached element: 2 for FP16, 1 for an FP8 KV cache

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelShape:
        """From a Hugging Face decoder ``config.json`` mapping."""
        try:
            shape = decoder_shape(cfg)
            return cls(
                num_layers=shape.layers,
                hidden_size=shape.hidden,
                intermediate_size=shape.intermediate,
                num_heads=shape.heads,
                num_kv_heads=shape.kv_heads,
                head_dim=shape.head_dim,
                vocab_size=shape.vocab,
                tie_word_embeddings=shape.tied,
                **_windows(cfg),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"model config is not a decoder LLM config: missing or bad {exc}") from exc

    def layer_linear_params(self) -> int:
        """Parameters of the linear layers of one decoder block (attention + gated MLP)."""
        q_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q_o + k_v + mlp

    def decoder_linear_params(self) -> int:
        return self.num_layers * self.layer_linear_params()

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.lm_head_params()
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.decoder_linear_params() + embed + head + norms

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_cache_bytes

    def kv_bytes_read(self, context: int) -> float:
        """KV-cache bytes one decoded token reads at ``context``: a sliding layer reads at most its window."""
        sliding = self.sliding_layers * min(context, self.sliding_window)
        return (
            self.kv_bytes_per_token() / self.num_layers * ((self.num_layers - self.sliding_layers) * context + sliding)
        )


def _windows(cfg: dict[str, Any]) -> dict[str, int]:
    """Sliding-window layers of a described family's config; none for any other."""
    if cfg.get("model_type") not in BY_MODEL_TYPE or not sliding_layers(cfg):
        return {}
    return {"sliding_layers": sliding_layers(cfg), "sliding_window": int(cfg[family_of(cfg).sliding_window_key])}


# The published models the latency model is fitted and checked on (their Hugging Face configs).
LLAMA3_8B = ModelShape(32, 4096, 14336, 32, 8, 128, 128256, False)
LLAMA2_7B = ModelShape(32, 4096, 11008, 32, 32, 128, 32000, False)
QWEN3_0_6B = ModelShape(28, 1024, 3072, 16, 8, 128, 151936, True)
QWEN3_1_7B = ModelShape(28, 2048, 6144, 16, 8, 128, 151936, True)
QWEN3_4B = ModelShape(36, 2560, 9728, 32, 8, 128, 151936, True)
QWEN3_8B = ModelShape(36, 4096, 12288, 32, 8, 128, 151936, False)
