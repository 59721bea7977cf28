"""Decoder families: the one place that says how a family's blocks are wired.

Every stage that reaches into a decoder block (quantization's smoothing folds and rotation,
sparsity's shared Hessians, head pruning, distillation's narrowing, the Edge-LLM export) reads
the wiring from here instead of assuming Llama's. An activation point is where a group of
linears reads the same input; its producer is the module whose output scaling can absorb a
per-channel scale exactly (an RMSNorm's weight, or the rows of the linear that computes it).

Families whose wiring compress does not describe are refused when the plan is checked, naming
the model type and the supported list, before any work: on an undescribed layout a fold lands
in the wrong module and gives wrong numbers, not an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compress.errors import UsageError


@dataclass(frozen=True)
class ActivationPoint:
    """Linears that read one activation, and the module whose output produces it."""

    name: str
    consumers: tuple[str, ...]
    producer: str
    producer_kind: str  # "norm" (an RMSNorm weight) or "rows" (output rows of a linear)


@dataclass(frozen=True)
class Family:
    """How one decoder family's blocks are wired."""

    model_types: tuple[str, ...]
    points: tuple[ActivationPoint, ...]
    rotated_point: str  # the input a Hadamard rotation may be chosen for (down_proj's)
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window_key: str | None = None  # config key of a sliding attention window, when the family has one

    def linears(self) -> tuple[str, ...]:
        """Every quantizable linear of a block, by its path inside the block."""
        return tuple(name for point in self.points for name in point.consumers)

    def point(self, name: str) -> ActivationPoint:
        return next(p for p in self.points if p.name == name)


# Llama's layout, shared by Mistral, Qwen2 / 2.5 (q/k/v biases) and Qwen3 (per-head q/k norms after the projections).
# The attention output is produced by v_proj's rows (one scale per KV channel, so GQA stays exact) and the MLP
# hidden state by up_proj's rows (act(gate) * up is linear in up).
LLAMA_POINTS = (
    ActivationPoint("attn_out", ("self_attn.o_proj",), "self_attn.v_proj", "rows"),
    ActivationPoint("mlp_hidden", ("mlp.down_proj",), "mlp.up_proj", "rows"),
    ActivationPoint("attn_in", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm", "norm"),
    ActivationPoint("mlp_in", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm", "norm"),
)

FAMILIES = {
    "llama": Family(("llama",), LLAMA_POINTS, "mlp_hidden"),
    "mistral": Family(("mistral",), LLAMA_POINTS, "mlp_hidden", sliding_window_key="sliding_window"),
    "qwen2": Family(("qwen2",), LLAMA_POINTS, "mlp_hidden", qkv_bias=True, sliding_window_key="sliding_window"),
    "qwen3": Family(("qwen3",), LLAMA_POINTS, "mlp_hidden", qk_norm=True, sliding_window_key="sliding_window"),
}
BY_MODEL_TYPE = {model_type: family for family in FAMILIES.values() for model_type in family.model_types}
LLAMA = FAMILIES["llama"]


def supported_model_types() -> list[str]:
    return sorted(BY_MODEL_TYPE)


def family_of(config: Any) -> Family:
    """The family of a Hugging Face config (object or ``config.json`` mapping); a usage error for any other."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    if model_type not in BY_MODEL_TYPE:
        raise UsageError(f"model_type {model_type!r} is not a decoder family compress describes "
                         f"(supported: {', '.join(supported_model_types())})")
    return BY_MODEL_TYPE[model_type]


def linear_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) features of each kind of decoder linear, from a ``config.json`` mapping."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden), "v_proj": (kv * head_dim, hidden),
            "o_proj": (hidden, heads * head_dim), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def is_decoder_linear(module: str, family: Family) -> bool:
    """Whether a checkpoint module name (``model.layers.N.self_attn.q_proj``) is one of the family's block linears."""
    return ".layers." in module and module.split(".layers.", 1)[1].split(".", 1)[-1] in family.linears()


def check_attention_window(config: dict[str, Any], context_length: int) -> None:
    """Sliding-window attention is exported as full attention, which is exact only while the context fits the window."""
    family = family_of(config)
    key = family.sliding_window_key
    window = config.get(key) if key else None
    uses_window = config.get("use_sliding_window", True)
    if window and uses_window and window < context_length:
        raise UsageError(f"{config['model_type']}: {key}={window} is shorter than the target's context_length {context_length}; "
                         "compress exports full attention, so lower budgets.context_length to the window or below")
