"""The model description the partitioner plans for.

Why a separate, plain description: the planner must never load weights (it runs on every node,
many times a minute), and clusters are often planned before the model is downloaded. Everything
the cost model needs is here, as exact integers where they are sizes, so plans are reproducible
on every machine. `meshd.models.info.read_model_spec` fills it from a real model directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

_DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "float8": 8, "int8": 8}


class ModelSpecError(ValueError):
    """A model description that cannot be planned for (missing or inconsistent fields)."""


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of one model, as the partitioner needs them.

    layer_bytes: bytes of each transformer layer's weights, in layer order (need not be equal).
    layer_params: logical weights of each layer (unpacked if quantized); FLOPs/token = 2 x this.
    embedding_bytes: parts that live only on the first stage (token embeddings).
    head_bytes: parts that live only on the last stage (final norm + lm_head). With
        tie_word_embeddings the head multiplies by the embedding matrix, so the last stage
        also holds `embedding_bytes` (counted once when one node is both first and last).
    kv_bytes_per_token_per_layer: K and V cache bytes for one token in one layer.
    activation_bytes: bytes of one activation element (the dtype hidden states travel in).
    context_length: default number of tokens to reserve KV cache for (PlanOptions may override).
    """

    name: str
    layer_bytes: tuple[int, ...]
    layer_params: tuple[int, ...]
    embedding_bytes: int
    head_bytes: int
    tie_word_embeddings: bool
    kv_bytes_per_token_per_layer: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    activation_bytes: int
    dtype: str
    context_length: int
    quant_bits: int | None = None
    quant_group_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_bytes", tuple(self.layer_bytes))
        object.__setattr__(self, "layer_params", tuple(self.layer_params))
        _validate(self)

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def total_weight_bytes(self) -> int:
        """Bytes of all weights once (tied embeddings counted once)."""
        return sum(self.layer_bytes) + self.embedding_bytes + self.head_bytes

    @property
    def head_matrix_bytes(self) -> int:
        """Bytes the last stage reads per token for the output projection (and final norm)."""
        return self.head_bytes + (self.embedding_bytes if self.tie_word_embeddings else 0)

    @property
    def hidden_state_bytes(self) -> int:
        """Bytes of one token's hidden state: what a pipeline hop carries per token."""
        return self.hidden_size * self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict; `from_dict(to_dict())` gives back an equal spec."""
        out: dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            out[field.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        """Build from `to_dict()` output, or from a hand-written description.

        Shorthand for hand-written files: `layer_bytes` may be one integer together with
        `num_layers` (equal layers), and `layer_params` may be left out: it is then derived from
        the bytes and the weight width (`quant_bits`, else the dtype's bits).
        """
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(data) - known - {"num_layers"})
        if unknown:
            raise ModelSpecError(
                f"unknown model spec field(s) {unknown}; expected some of {sorted(known)}"
            )
        values = dict(data)
        values.pop("num_layers", None)
        values["layer_bytes"] = _layer_list(data, "layer_bytes")
        if "layer_params" in data:
            values["layer_params"] = _layer_list(data, "layer_params")
        else:
            values["layer_params"] = _derive_params(values["layer_bytes"], data)
        missing = sorted(known - set(values) - {"quant_bits", "quant_group_size"})
        if missing:
            raise ModelSpecError(f"model spec is missing field(s) {missing}")
        return cls(**values)

    @classmethod
    def uniform(
        cls,
        name: str,
        num_layers: int,
        layer_bytes: int,
        *,
        hidden_size: int = 4096,
        bytes_per_param: float = 2.0,
        embedding_bytes: int | None = None,
        head_bytes: int | None = None,
        tie_word_embeddings: bool = False,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        vocab_size: int = 32000,
        context_length: int = 4096,
        activation_bytes: int = 2,
        dtype: str = "float16",
    ) -> ModelSpec:
        """A model of equal layers with llama-like proportions; for examples and benchmarks."""
        head_dim = hidden_size // num_attention_heads
        default_table = int(vocab_size * hidden_size * bytes_per_param)
        return cls(
            name=name,
            layer_bytes=(layer_bytes,) * num_layers,
            layer_params=(int(layer_bytes / bytes_per_param),) * num_layers,
            embedding_bytes=default_table if embedding_bytes is None else embedding_bytes,
            head_bytes=default_table if head_bytes is None else head_bytes,
            tie_word_embeddings=tie_word_embeddings,
            kv_bytes_per_token_per_layer=2 * num_key_value_heads * head_dim * activation_bytes,
            hidden_size=hidden_size,
            intermediate_size=hidden_size * 7 // 2,
            vocab_size=vocab_size,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            activation_bytes=activation_bytes,
            dtype=dtype,
            context_length=context_length,
        )


def _validate(spec: ModelSpec) -> None:
    if not spec.layer_bytes:
        raise ModelSpecError(f"model {spec.name!r} has no layers; a plan needs at least one")
    if len(spec.layer_params) != len(spec.layer_bytes):
        raise ModelSpecError(
            f"model {spec.name!r}: layer_params has {len(spec.layer_params)} entries but "
            f"layer_bytes has {len(spec.layer_bytes)}; give one per layer"
        )
    for label, values in (("layer_bytes", spec.layer_bytes), ("layer_params", spec.layer_params)):
        if any(not _is_int(v) or v < 0 for v in values):
            raise ModelSpecError(f"model {spec.name!r}: {label} must be integers >= 0")
    non_negative = ("embedding_bytes", "head_bytes", "kv_bytes_per_token_per_layer")
    positive = (
        "hidden_size",
        "intermediate_size",
        "vocab_size",
        "num_attention_heads",
        "num_key_value_heads",
        "activation_bytes",
        "context_length",
    )
    for name in non_negative:
        if not _is_int(getattr(spec, name)) or getattr(spec, name) < 0:
            raise ModelSpecError(f"model {spec.name!r}: {name} must be an integer >= 0")
    for name in positive:
        if not _is_int(getattr(spec, name)) or getattr(spec, name) <= 0:
            raise ModelSpecError(f"model {spec.name!r}: {name} must be an integer > 0")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layer_list(data: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = data.get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        count = data.get("num_layers")
        if not isinstance(count, int) or count <= 0:
            raise ModelSpecError(f"{key} is a single number, so give num_layers (> 0) too")
        return (value,) * count
    if isinstance(value, list | tuple):
        return tuple(value)
    raise ModelSpecError(f"{key} must be a list of integers (one per layer) or one integer")


def _derive_params(layer_bytes: tuple[int, ...], data: Mapping[str, Any]) -> tuple[int, ...]:
    bits = data.get("quant_bits") or _DTYPE_BITS.get(str(data.get("dtype")))
    if not bits:
        raise ModelSpecError(
            "layer_params is missing and cannot be derived: give quant_bits or a dtype among "
            f"{sorted(_DTYPE_BITS)}"
        )
    return tuple(size * 8 // bits for size in layer_bytes)
