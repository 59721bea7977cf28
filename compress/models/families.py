"""Decoder families: the one place that says how a family's blocks are wired.

Every stage that reaches into a decoder block (quantization's smoothing folds and rotation,
sparsity's shared Hessians, head pruning, distillation's narrowing, the exports, the latency model)
reads the wiring from here instead of assuming Llama's. An activation point is where a group of
linears reads the same input; its producer is the module whose output scaling can absorb a
per-channel scale exactly (an RMSNorm's weight, or the rows of the linear that computes it).

A linear is made of parts: ``q_proj`` is the part "q"; Phi-3's fused ``qkv_proj`` is "q", "k" and
"v" stacked by rows, its ``gate_up_proj`` "gate" then "up". Head pruning keeps rows of part "q",
MLP narrowing rows of "gate" and "up", and a fold into a fused producer scales the rows of one part.

Families whose wiring compress does not describe are refused when the plan is checked, naming
the model type and the supported list, before any work: on an undescribed layout a fold lands
in the wrong module and gives wrong numbers, not an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from compress.core.errors import UsageError


@dataclass(frozen=True)
class ActivationPoint:
    """Linears that read one activation, and the module whose output produces it."""

    name: str
    consumers: tuple[str, ...]
    producer: str
    producer_kind: str  # "norm" (an RMSNorm weight) or "rows" (output rows of a linear)
    producer_part: str | None = None  # for "rows": the part of the producer whose rows make the activation


@dataclass(frozen=True)
class Family:
    """How one decoder family's blocks are wired."""

    model_types: tuple[str, ...]
    points: tuple[ActivationPoint, ...]
    rotated_point: str  # the input a Hadamard rotation may be chosen for (down_proj's)
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (linear, its parts in row order) for fused projections
    attn_output: str = "self_attn.o_proj"
    mlp_output: str = "mlp.down_proj"
    norm_offset: float = 0.0  # an RMSNorm multiplying by (offset + weight): Gemma's (1 + w)
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window_key: str | None = None  # config key of a sliding attention window, when the family has one
    # each branch's output normalised before the residual add (Gemma 3): no rotation of the residual stream passes
    post_norms: bool = False

    @property
    def attention(self) -> str:
        """The path of a block's attention module."""
        return self.attn_output.rsplit(".", 1)[0]

    def linears(self) -> tuple[str, ...]:
        """Every quantizable linear of a block, by its path inside the block."""
        return tuple(name for point in self.points for name in point.consumers)

    def point(self, name: str) -> ActivationPoint:
        return next(p for p in self.points if p.name == name)

    def parts(self, linear: str) -> tuple[str, ...]:
        """The parts a linear's rows are made of: ("q", "k", "v") for a fused qkv_proj, ("q",) for q_proj."""
        fused = dict(self.fused)
        return fused.get(linear) or (linear.rsplit(".", 1)[-1].removesuffix("_proj"),)

    def linears_with(self, part: str) -> tuple[str, ...]:
        """The block linears holding rows of ``part``."""
        return tuple(name for name in self.linears() if part in self.parts(name))


def decoder_blocks(model) -> torch.nn.ModuleList:
    """The decoder blocks of a causal LM of a described family (every family keeps them at ``model.model.layers``)."""
    return model.model.layers


def final_norm(model) -> torch.nn.Module:
    """The norm between a causal LM's last decoder block and its LM head (every described family's
    ``model.model.norm``)."""
    return model.model.norm


def _getter(config: Any):
    return config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)


@dataclass(frozen=True)
class DecoderShape:
    """A decoder's geometry as its config states it or its family implies it (KV heads default to the query heads, the
    head size to hidden / heads): built once by :func:`decoder_shape` and handed to whatever needs heads or widths."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @property
    def queries_per_kv_head(self) -> int:
        return self.heads // self.kv_heads


def decoder_shape(config: Any) -> DecoderShape:
    """The :class:`DecoderShape` of a config object or ``config.json`` mapping (a KeyError names a missing field)."""
    get = _getter(config)

    def required(key: str) -> int:
        value = get(key)
        if value is None:
            raise KeyError(key)
        return int(value)

    heads, kv, head_dim = attention_geometry(config)
    return DecoderShape(
        required("num_hidden_layers"),
        required("hidden_size"),
        required("intermediate_size"),
        heads,
        kv,
        head_dim,
        required("vocab_size"),
        bool(get("tie_word_embeddings", False)),
    )


def attention_geometry(config: Any) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a config object or ``config.json`` mapping: the attention part of
    :class:`DecoderShape`, for configs that hold no more than the attention's fields."""
    get = _getter(config)
    heads = int(get("num_attention_heads"))
    return heads, int(get("num_key_value_heads") or heads), int(get("head_dim") or get("hidden_size") // heads)


def part_sizes(config: Any) -> dict[str, int]:
    """Rows of each part of a block's linears, from a config object or ``config.json`` mapping."""
    heads, kv, head_dim = attention_geometry(config)
    inter = _getter(config)("intermediate_size")
    return {"q": heads * head_dim, "k": kv * head_dim, "v": kv * head_dim, "gate": inter, "up": inter}


def part_rows(family: Family, config: Any, linear: str, part: str) -> slice:
    """Where ``part``'s rows sit inside ``linear``."""
    sizes = part_sizes(config)
    start = 0
    for name in family.parts(linear):
        if name == part:
            return slice(start, start + sizes[name])
        start += sizes[name]
    raise KeyError(f"{linear} has no part {part!r}")


def rows_keeping(family: Family, config: Any, linear: str, keep: dict[str, torch.Tensor]) -> torch.Tensor:
    """Row indices of ``linear`` that keep the given rows of some parts (indices inside the part) and every other
    row."""
    sizes = part_sizes(config)
    rows, start = [], 0
    for name in family.parts(linear):
        rows.append(start + (keep[name] if name in keep else torch.arange(sizes[name])))
        start += sizes[name]
    return torch.cat(rows)


def _points(
    attn_in: tuple[str, ...],
    attn_v: tuple[str, str | None],
    mlp_in: tuple[str, ...],
    mlp_up: tuple[str, str | None],
    attn_norm: str = "input_layernorm",
    mlp_norm: str = "post_attention_layernorm",
) -> tuple[ActivationPoint, ...]:
    # The attention output is produced by the value rows (one scale per KV channel, so GQA stays exact) and the MLP
    # hidden state by the up rows (act(gate) * up is linear in up).
    return (
        ActivationPoint("attn_out", ("self_attn.o_proj",), attn_v[0], "rows", attn_v[1]),
        ActivationPoint("mlp_hidden", ("mlp.down_proj",), mlp_up[0], "rows", mlp_up[1]),
        ActivationPoint("attn_in", attn_in, attn_norm, "norm"),
        ActivationPoint("mlp_in", mlp_in, mlp_norm, "norm"),
    )


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
LLAMA_POINTS = _points(_QKV, ("self_attn.v_proj", None), _GATE_UP, ("mlp.up_proj", None))
# Gemma 3 normalises the attention output (post_attention_layernorm) before the residual add, so the MLP reads
# pre_feedforward_layernorm's output; its RMSNorms multiply by (1 + weight).
GEMMA3_POINTS = _points(_QKV, ("self_attn.v_proj", None), _GATE_UP, ("mlp.up_proj", None),
                        mlp_norm="pre_feedforward_layernorm")
# Phi-3 / Phi-4-mini: q, k and v stacked in one qkv_proj, gate then up in one gate_up_proj.
PHI3_POINTS = _points(
    ("self_attn.qkv_proj",), ("self_attn.qkv_proj", "v"), ("mlp.gate_up_proj",), ("mlp.gate_up_proj", "up")
)

FAMILIES = {
    "llama": Family(("llama",), LLAMA_POINTS, "mlp_hidden"),
    # transformers loads a Mistral folder with a sliding window as Ministral (the same blocks, with layer_types)
    "mistral": Family(("mistral", "ministral"), LLAMA_POINTS, "mlp_hidden", sliding_window_key="sliding_window"),
    "qwen2": Family(("qwen2",), LLAMA_POINTS, "mlp_hidden", qkv_bias=True, sliding_window_key="sliding_window"),
    "qwen3": Family(("qwen3",), LLAMA_POINTS, "mlp_hidden", qk_norm=True, sliding_window_key="sliding_window"),
    "gemma3": Family(("gemma3_text",), GEMMA3_POINTS, "mlp_hidden", norm_offset=1.0, qk_norm=True,
                     sliding_window_key="sliding_window", post_norms=True),
    "phi3": Family(("phi3",), PHI3_POINTS, "mlp_hidden",
                   fused=(("self_attn.qkv_proj", ("q", "k", "v")), ("mlp.gate_up_proj", ("gate", "up"))),
                   sliding_window_key="sliding_window"),
}
BY_MODEL_TYPE = {model_type: family for family in FAMILIES.values() for model_type in family.model_types}


def supported_model_types() -> list[str]:
    return sorted(BY_MODEL_TYPE)


def _model_type(config: Any) -> str | None:
    return config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)


def _lookup(config: Any, table: dict, kind: str):
    model_type = _model_type(config)
    if model_type not in table:
        raise UsageError(
            f"model_type {model_type!r} is not {kind} family compress describes (supported: {', '.join(sorted(table))})"
        )
    return table[model_type]


def family_of(config: Any) -> Family:
    """The family of a Hugging Face config (object or ``config.json`` mapping); a usage error for any other."""
    return _lookup(config, BY_MODEL_TYPE, "a decoder")


_BLOCK_ORDER = ("q", "k", "v", "o", "gate", "up", "down")


def linear_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) features of each of a block's linears, by short name (``q_proj``, or ``qkv_proj`` where fused)."""
    family = family_of(config)
    sizes = part_sizes(config)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    inputs = {"o": sizes["q"], "down": inter}
    shapes = {}
    for linear in sorted(family.linears(), key=lambda name: _BLOCK_ORDER.index(family.parts(name)[0])):
        parts = family.parts(linear)
        out = hidden if parts[0] in inputs else sum(sizes[p] for p in parts)
        shapes[linear.rsplit(".", 1)[-1]] = (out, inputs.get(parts[0], hidden))
    return shapes


def linear_parameter_fraction(config: dict[str, Any], linears: list[str]) -> float:
    """Share of a block's linear parameters that the linears named ``linears`` (short names, ``down_proj``) hold."""
    shapes = linear_shapes(config)
    total = sum(out * inp for out, inp in shapes.values())
    return round(sum(shapes[name][0] * shapes[name][1] for name in linears) / total, 6)


def is_decoder_linear(module: str, family: Family) -> bool:
    """Whether a checkpoint module name (``model.layers.N.self_attn.q_proj``) is one of the family's block linears."""
    return ".layers." in module and module.split(".layers.", 1)[1].split(".", 1)[-1] in family.linears()


def sliding_layer_indices(config: dict[str, Any]) -> list[int]:
    """The layers that attend through a sliding window, as transformers runs the config (none when the family or config
    has no window; every layer when a window is set and ``layer_types`` does not say otherwise)."""
    family = family_of(config)
    key = family.sliding_window_key
    if not key or not config.get(key) or not config.get("use_sliding_window", True):
        return []
    layer_types = config.get("layer_types")
    if layer_types:
        return [index for index, kind in enumerate(layer_types) if kind == "sliding_attention"]
    return list(range(int(config["num_hidden_layers"])))


def sliding_layers(config: dict[str, Any]) -> int:
    """How many layers attend through a sliding window (0 when the family or config has none)."""
    return len(sliding_layer_indices(config))


def attention_window(config: dict[str, Any]) -> int | None:
    """The window its sliding layers attend over, when some layers of the model slide (None when none does)."""
    if not sliding_layers(config):
        return None
    return int(config[family_of(config).sliding_window_key])


@dataclass(frozen=True)
class EncoderFamily:
    """How one encoder family's layers are wired (paths inside a layer; the layer list inside the base model).

    In a post-LN encoder every LayerNorm output feeds a residual add as well as the next linears, so a
    smoothing scale cannot be folded into the LayerNorm without changing the residual stream: the q/k/v
    and FFN inputs are smoothed online (a per-channel multiply in front of their quantizer), and only the
    attention output, produced by the value rows, takes its scale for free.
    """

    model_types: tuple[str, ...]
    layers: str
    attn_in: tuple[str, str, str]  # query, key, value: read the layer input
    attn_out: str  # reads the attention context (produced by the value rows)
    ffn_in: str  # reads the attention block's normalised output
    ffn_out: str  # reads the activation of ffn_in's output (GELU, kept float)

    @property
    def value(self) -> str:
        return self.attn_in[2]

    def linears(self) -> tuple[str, ...]:
        return (*self.attn_in, self.attn_out, self.ffn_in, self.ffn_out)


_BERT_LAYOUT = (
    "encoder.layer",
    ("attention.self.query", "attention.self.key", "attention.self.value"),
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)
ENCODER_FAMILIES = {
    "bert": EncoderFamily(("bert", "roberta", "xlm-roberta", "compress-pruned-bert"), *_BERT_LAYOUT),
    "distilbert": EncoderFamily(
        ("distilbert",),
        "transformer.layer",
        ("attention.q_lin", "attention.k_lin", "attention.v_lin"),
        "attention.out_lin",
        "ffn.lin1",
        "ffn.lin2",
    ),
    "mpnet": EncoderFamily(
        ("mpnet",),
        "encoder.layer",
        ("attention.attn.q", "attention.attn.k", "attention.attn.v"),
        "attention.attn.o",
        "intermediate.dense",
        "output.dense",
    ),
}
ENCODER_BY_MODEL_TYPE = {
    model_type: family for family in ENCODER_FAMILIES.values() for model_type in family.model_types
}


# The largest value of each dimension compress takes from a config.json: a few times today's largest published models,
# far below what would make a size, a latency or an allocation meaningless.
DIMENSION_LIMITS = {
    "num_hidden_layers": 1024, "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_attention_heads": 4096,
    "num_key_value_heads": 4096, "head_dim": 4096, "vocab_size": 1 << 24, "max_position_embeddings": 1 << 26,
}


def check_model_dimensions(config: dict[str, Any], where: str) -> None:
    """Refuse a config whose dimensions are not whole numbers in a sane range, or whose heads do not divide the width
    (``where`` names the config for the error). A multimodal config's ``text_config`` is checked too."""
    if not isinstance(config, Mapping):
        raise UsageError(f"{where}: a model config is a JSON object")
    for key, limit in DIMENSION_LIMITS.items():
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            shown = (
                value if not isinstance(value, int) or abs(value) < 10**12 else f"a {len(str(abs(value)))}-digit number"
            )
            raise UsageError(f"{where}: {key} = {shown} is not a whole number from 1 to {limit:,}")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise UsageError(
            f"{where}: num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv_heads}"
        )
    if heads and config.get("hidden_size") and not config.get("head_dim") and config["hidden_size"] % heads:
        raise UsageError(f"{where}: hidden_size = {config['hidden_size']} does not divide into {heads} attention heads")
    if isinstance(config.get("text_config"), dict):
        check_model_dimensions(config["text_config"], f"{where} (text_config)")


def model_kind(config: Any) -> str:
    """ "encoder" for the encoder families compress describes, "decoder" otherwise (decoders are checked by
    :func:`family_of`)."""
    return "encoder" if _model_type(config) in ENCODER_BY_MODEL_TYPE else "decoder"


def encoder_family_of(config: Any) -> EncoderFamily:
    """The encoder family of a config; a usage error for any other."""
    return _lookup(config, ENCODER_BY_MODEL_TYPE, "an encoder")


def encoder_layers(model) -> list:
    """The layers of an encoder (a base model or one with a task head)."""
    return list(model.base_model.get_submodule(encoder_family_of(model.config).layers))
