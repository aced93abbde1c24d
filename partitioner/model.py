"""The model description the partitioner plans for.

Why a separate, plain description: the planner must never load weights (it runs on every node,
many times a minute), and clusters are often planned before the model is downloaded. Everything
the cost model needs is here, as exact integers where they are sizes, so plans are reproducible
on every machine. `meshd.models.info.read_model_spec` fills it from a real model directory.

Mixture-of-experts and hybrid-attention models differ from dense ones in two ways the cost
model must see, so the description is per layer:
- what a layer holds is not what a decode step reads: memory is every expert's weights
  (`layer_bytes`), a token reads the shared weights plus `num_experts_per_tok` of the
  `num_experts` routed experts (`layer_active_bytes`); `layer_expert_bytes` is the routed
  experts' part (what expert placement splits), `layer_replicated_bytes` the part every
  member of a tensor-parallel group keeps whole (routers, norms, MLA down-projections);
- the per-layer cache is of one of four kinds (`LAYER_KINDS`): "full" attention grows with the
  context, "sliding" attention is capped at its window, "linear" attention / recurrent layers
  keep a constant state, "mla" (multi-head latent attention) stores one compressed latent per
  token that every tensor-parallel member needs whole. Cache bytes of layer i for one sequence
  = layer_kv_bytes_per_token[i] x min(context, window[i] or context) + layer_state_bytes[i].
Dense models leave these at their defaults (active = total, no experts, "full" layers of
`kv_bytes_per_token_per_layer`), so hand-written descriptions stay short.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

_DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "float8": 8, "int8": 8}
LAYER_KINDS = ("full", "sliding", "linear", "mla")
# Optional per-layer lists, with how their default is derived when a description leaves them out.
_PER_LAYER_DEFAULTS = (
    "layer_active_bytes",
    "layer_active_params",
    "layer_expert_bytes",
    "layer_replicated_bytes",
    "layer_kv_kinds",
    "layer_kv_bytes_per_token",
    "layer_kv_window",
    "layer_state_bytes",
)


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
    layer_active_bytes / layer_active_params: what one decode token reads / multiplies in each
        layer (shared weights + the active share of the routed experts); default = the totals.
    layer_expert_bytes: bytes of each layer's routed experts (0 for dense layers).
    layer_replicated_bytes: bytes of each layer a tensor-parallel member holds whole.
    num_experts / num_experts_per_tok: routed experts per MoE layer and how many a token uses.
    layer_kv_kinds, layer_kv_bytes_per_token, layer_kv_window (0 = unbounded),
        layer_state_bytes: each layer's cache (module docstring).
    supports_tensor_parallel: the architecture's mlx-lm model class can shard itself over a
        group (`shard(group)`); without it no plan offers tensor parallelism.
    architecture: the model_type, for messages.
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
    layer_active_bytes: tuple[int, ...] | None = None
    layer_active_params: tuple[int, ...] | None = None
    layer_expert_bytes: tuple[int, ...] | None = None
    layer_replicated_bytes: tuple[int, ...] | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    layer_kv_kinds: tuple[str, ...] | None = None
    layer_kv_bytes_per_token: tuple[int, ...] | None = None
    layer_kv_window: tuple[int, ...] | None = None
    layer_state_bytes: tuple[int, ...] | None = None
    supports_tensor_parallel: bool = False
    architecture: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_bytes", tuple(self.layer_bytes))
        object.__setattr__(self, "layer_params", tuple(self.layer_params))
        count = len(self.layer_bytes)
        defaults = {
            "layer_active_bytes": self.layer_bytes,
            "layer_active_params": self.layer_params,
            "layer_expert_bytes": (0,) * count,
            "layer_replicated_bytes": (0,) * count,
            "layer_kv_kinds": ("full",) * count,
            "layer_kv_bytes_per_token": (self.kv_bytes_per_token_per_layer,) * count,
            "layer_kv_window": (0,) * count,
            "layer_state_bytes": (0,) * count,
        }
        for name in _PER_LAYER_DEFAULTS:
            value = getattr(self, name)
            object.__setattr__(self, name, defaults[name] if value is None else tuple(value))
        _validate(self)

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def compute_key(self) -> str:
        """The key of the node's measured rates this model is priced at (partitioner.mesh):
        its dtype ("bfloat16"), or for a quantized model "q<bits>/<dtype>" (4-bit weights,
        activations and scales in the dtype: "q4/bfloat16")."""
        return f"q{self.quant_bits}/{self.dtype}" if self.quant_bits else self.dtype

    @property
    def total_weight_bytes(self) -> int:
        """Bytes of all weights once (tied embeddings counted once)."""
        return sum(self.layer_bytes) + self.embedding_bytes + self.head_bytes

    @property
    def total_params(self) -> int:
        """Logical weights of all layers (embeddings and head not included)."""
        return sum(self.layer_params)

    @property
    def active_params(self) -> int:
        """Logical weights one decode token uses in all layers (embeddings, head excluded)."""
        return sum(self.layer_active_params)

    @property
    def is_moe(self) -> bool:
        return any(self.layer_expert_bytes)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers with routed experts."""
        return tuple(i for i, size in enumerate(self.layer_expert_bytes) if size)

    def layer_cache_bytes(self, layer: int, context_length: int) -> int:
        """Cache bytes of one layer for one sequence of `context_length` tokens."""
        window = self.layer_kv_window[layer]
        tokens = min(context_length, window) if window else context_length
        return self.layer_kv_bytes_per_token[layer] * tokens + self.layer_state_bytes[layer]

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

    def digest(self) -> str:
        """A short hash of this description: nodes that compute the same digest from their own
        copies of a model mean the same model (the mesh names a selected model by it)."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        """Build from `to_dict()` output, or from a hand-written description.

        Shorthand for hand-written files: `layer_bytes` may be one integer together with
        `num_layers` (equal layers), and `layer_params` may be left out: it is then derived from
        the bytes and the weight width (`quant_bits`, else the dtype's bits). The optional
        per-layer lists may also be one value for every layer.
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
        for name in _PER_LAYER_DEFAULTS:
            if isinstance(data.get(name), int | str):
                values[name] = (data[name],) * len(values["layer_bytes"])
        if "layer_params" in data:
            values["layer_params"] = _layer_list(data, "layer_params")
        else:
            values["layer_params"] = _derive_params(values["layer_bytes"], data)
        optional = {field.name for field in fields(cls) if field.default is not MISSING}
        missing = sorted(known - set(values) - optional)
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
    _validate_per_layer(spec)
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


def _validate_per_layer(spec: ModelSpec) -> None:
    count = spec.num_layers
    for name in _PER_LAYER_DEFAULTS:
        values = getattr(spec, name)
        if len(values) != count:
            raise ModelSpecError(
                f"model {spec.name!r}: {name} has {len(values)} entries but the model has "
                f"{count} layers; give one per layer"
            )
        if name == "layer_kv_kinds":
            unknown = sorted(set(values) - set(LAYER_KINDS))
            if unknown:
                raise ModelSpecError(
                    f"model {spec.name!r}: unknown layer kind(s) {unknown}; use {list(LAYER_KINDS)}"
                )
        elif any(not _is_int(v) or v < 0 for v in values):
            raise ModelSpecError(f"model {spec.name!r}: {name} must be integers >= 0")
    for i in range(count):
        total = spec.layer_bytes[i]
        if spec.layer_active_bytes[i] > total or spec.layer_active_params[i] > spec.layer_params[i]:
            raise ModelSpecError(
                f"model {spec.name!r}: layer {i} reads more per token than it holds "
                "(layer_active_bytes/params must not exceed layer_bytes/params)"
            )
        if spec.layer_expert_bytes[i] + spec.layer_replicated_bytes[i] > total:
            raise ModelSpecError(
                f"model {spec.name!r}: layer {i}: expert and replicated bytes exceed the layer"
            )
    for name in ("num_experts", "num_experts_per_tok"):
        if not _is_int(getattr(spec, name)) or getattr(spec, name) < 0:
            raise ModelSpecError(f"model {spec.name!r}: {name} must be an integer >= 0")
    if spec.num_experts_per_tok > spec.num_experts:
        raise ModelSpecError(
            f"model {spec.name!r}: num_experts_per_tok ({spec.num_experts_per_tok}) exceeds "
            f"num_experts ({spec.num_experts})"
        )
    if spec.is_moe and spec.num_experts == 0:
        raise ModelSpecError(f"model {spec.name!r}: layers have experts but num_experts is 0")


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
