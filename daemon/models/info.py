"""Read a ModelSpec from a model directory without loading any weights.

Why: plans must use true sizes (layers need not be equal, quantized files are much smaller
than parameter counts suggest, a mixture-of-experts layer holds far more than a token reads),
and reading them must be cheap enough to run on every node.

Where the sizes come from:
- a directory with weights: config.json and the JSON headers of the safetensors files (a
  safetensors file starts with an 8-byte little-endian header length and a JSON header that
  lists every tensor's dtype, shape and byte range); the tensor data is never read;
- a directory with only config.json (clusters are planned before the model is downloaded;
  `examples/models/`): mlx-lm's own model class is built from the config, lazily (MLX arrays
  are not materialised until evaluated, so a 671B model costs ~100 MB and ~0.1 s), cast to the
  config's dtype and quantized as the config says, exactly as mlx-lm's loader would: an MLX
  `quantization` section (with its per-module overrides, e.g. 8-bit routers in a 4-bit MoE,
  and the model's own `quant_predicate`), or a Hugging Face `quantization_config` mlx-lm
  keeps packed (mxfp4; fp8 checkpoints are dequantized to the config dtype by mlx-lm, so they
  are sized that way). The parameters' shapes and dtypes then stand in for the headers.

Tensor names are mapped to parts of the model:
- `...layers.N.*` (also `h.N`, `blocks.N`) -> layer N; within a layer, routed experts
  (`.switch_mlp.`, `.experts.`; mlx-lm stacks them, Hugging Face files number them) and parts
  every tensor-parallel member keeps whole (routers `mlp.gate` / `router` /
  `shared_expert_gate`, norms, MLA down-projections `q_a_proj` / `kv_a_proj_with_mqa`);
  shared experts (`shared_expert(s)`) are always active;
- embeddings (`embed_tokens`, `wte`, `wpe`, `tok_embeddings`, `word_embeddings`, `embed_in`)
  -> the first stage;
- the final norm (`model.norm`, `ln_f`, `norm_f`, `final_layernorm`) and the output projection
  (`lm_head`, `embed_out`, `output`) -> the last stage;
- anything else is counted on both the first and the last stage (safe: too much, never too
  little).
Tied embeddings are decided by the weights: no output projection tensor means the head uses
the embedding matrix, so the last stage holds it too.

What a decode token reads in a MoE layer: everything but the routed experts, plus
num_experts_per_tok / num_experts of them (config: `num_experts_per_tok` or
`experts_per_token`; `num_experts`, `n_routed_experts` or `num_local_experts`). Dense layers
of MoE models (DeepSeek's `first_k_dense_replace`, Qwen's `mlp_only_layers` /
`decoder_sparse_step`) have no expert tensors and are read whole.

Logical parameters (for FLOPs): a quantized weight (uint32 with a `.scales` sibling) holds
32 / bits values per element, with bits from config.json's `quantization` (per-module
overrides honoured); Hugging Face mxfp4 `_blocks` hold two values per byte; scales and biases
are not parameters.

Cache per layer (partitioner.model's kinds), following the cache objects mlx-lm's model
classes make (`make_cache`): multi-head latent attention (`kv_lora_rank`: DeepSeek V3, Kimi
K2) caches the latent and the rope key, (kv_lora_rank + qk_rope_head_dim) elements per token;
Qwen3-Next / Qwen3.5 gated delta-net layers (every layer but each `full_attention_interval`-th)
keep a convolution state of (conv_kernel - 1) x (2 x key_dim + value_dim) elements and a
float32 recurrent state of value_heads x value_dim x key_dim; gpt-oss `sliding_attention`
layers keep at most `sliding_window` tokens; other layers 2 x kv_heads x head_dim elements per
token. An element is the compute dtype's size (the scales' dtype for quantized models) unless
given.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

from meshd.models.architectures import model_refusal
from meshd.models.safetensors import (
    INDEX_FILE,
    ModelInfoError,
    TensorInfo,
    read_safetensors_header,
)
from meshd.models.tensor_parallel_support import supports_tensor_parallel
from partitioner import ModelSpec

DEFAULT_CONTEXT_LENGTH = 4096

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
_CONFIG_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_EMBEDDING = re.compile(
    r"(?:^|\.)(?:embed_tokens|wte|wpe|tok_embeddings|word_embeddings|embed_in)\."
)
_HEAD = re.compile(r"(?:^|\.)(?:lm_head|embed_out|output|norm|ln_f|norm_f|final_layernorm)\.")
_OUTPUT_PROJECTION = re.compile(r"(?:^|\.)(?:lm_head|embed_out|output)\.")
_ROUTED_EXPERT = re.compile(r"\.(?:switch_mlp|experts)\.")
_REPLICATED = re.compile(
    r"\.(?:mlp\.gate|router|shared_expert_gate|q_a_proj|kv_a_proj_with_mqa|[a-z_]*norm)\."
)
_LINEAR_ATTENTION_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text")


def read_model_spec(
    model_dir: Path,
    *,
    context_length: int | None = None,
    kv_bytes_per_element: int | None = None,
) -> ModelSpec:
    """ModelSpec of the model in `model_dir` (config.json + safetensors headers, or config.json
    alone: module docstring).

    context_length: tokens of KV cache to reserve; default the config's
    max_position_embeddings (else 4096). kv_bytes_per_element: default the compute dtype's size.
    """
    model_dir = Path(model_dir)
    config = _read_config(model_dir)
    text = _text_config(config)
    files = _weight_files(model_dir)
    if files:
        tensors = _read_headers(files)
        quantization = config.get("quantization") or {}
        logical: Callable[[str, TensorInfo], int] = lambda name, tensor: _logical_params(  # noqa: E731
            name, tensor, tensors, quantization
        )
    else:
        tensors, counts = _skeleton_tensors(config, model_dir)
        logical = lambda name, tensor: counts[name]  # noqa: E731
    experts, per_token = _moe_counts(text, model_dir)
    parts = _group_tensors(tensors, logical)
    num_layers = _num_layers(text, parts.layers, model_dir)
    if any(parts.layers[i].expert_bytes for i in range(num_layers)) and not experts:
        raise ModelInfoError(
            f"{model_dir}: the weights hold routed experts but config.json names neither "
            "num_experts (or n_routed_experts / num_local_experts) nor num_experts_per_tok"
        )
    hidden = _config_int(text, ("hidden_size", "n_embd", "d_model"), model_dir)
    heads = _config_int(text, ("num_attention_heads", "n_head", "num_heads"), model_dir)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    dtype = _compute_dtype(tensors)
    element = kv_bytes_per_element or DTYPE_BYTES[_dtype_code(dtype)]
    kinds, per_token_kv, windows, states = _cache_layout(text, num_layers, element, model_dir)
    layers = [parts.layers[i] for i in range(num_layers)]
    quant = config.get("quantization") or {}
    return ModelSpec(
        name=str(config.get("_name_or_path") or model_dir.resolve().name),
        layer_bytes=tuple(layer.bytes for layer in layers),
        layer_params=tuple(layer.params for layer in layers),
        embedding_bytes=parts.embedding_bytes + parts.other_bytes,
        head_bytes=parts.head_bytes + parts.other_bytes,
        tie_word_embeddings=not parts.has_output_projection,
        kv_bytes_per_token_per_layer=_full_attention_bytes(kinds, per_token_kv),
        hidden_size=hidden,
        intermediate_size=int(
            text.get("intermediate_size")
            or text.get("moe_intermediate_size")
            or text.get("n_inner")
            or 4 * hidden
        ),
        vocab_size=_config_int(text, ("vocab_size",), model_dir),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        activation_bytes=DTYPE_BYTES[_dtype_code(dtype)],
        dtype=dtype,
        context_length=int(
            context_length or text.get("max_position_embeddings") or DEFAULT_CONTEXT_LENGTH
        ),
        quant_bits=quant.get("bits"),
        quant_group_size=quant.get("group_size"),
        layer_active_bytes=tuple(layer.active_bytes(experts, per_token) for layer in layers),
        layer_active_params=tuple(layer.active_params(experts, per_token) for layer in layers),
        layer_expert_bytes=tuple(layer.expert_bytes for layer in layers),
        layer_replicated_bytes=tuple(layer.replicated_bytes for layer in layers),
        num_experts=experts if any(layer.expert_bytes for layer in layers) else 0,
        num_experts_per_tok=per_token if any(layer.expert_bytes for layer in layers) else 0,
        layer_kv_kinds=kinds,
        layer_kv_bytes_per_token=per_token_kv,
        layer_kv_window=windows,
        layer_state_bytes=states,
        supports_tensor_parallel=supports_tensor_parallel(str(config.get("model_type", ""))),
        architecture=str(config.get("model_type", "")),
    )


def architecture_refusal(model_dir: Path) -> str | None:
    """Why the model in ``model_dir`` cannot run as stages (its architecture), in the words the
    daemon refuses it with, or None when it can (see meshd.models.architectures)."""
    refusal = model_refusal(_read_config(Path(model_dir)))
    return None if refusal is None else f"{model_dir}: {refusal}"


# ---- config ---------------------------------------------------------------------------------


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelInfoError(f"{model_dir} has no config.json; point to a model directory")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ModelInfoError(f"cannot read {path}: {error}") from error
    if not isinstance(config, dict):
        raise ModelInfoError(f"{path} does not hold a JSON object")
    return config


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's settings: vision-language wrappers (Qwen3.5) nest them in
    `text_config`; top-level keys fill what it leaves out."""
    nested = config.get("text_config")
    if not isinstance(nested, dict):
        return config
    return {**config, **nested, "model_type": config.get("model_type")}


def _moe_counts(text: dict[str, Any], model_dir: Path) -> tuple[int, int]:
    """(routed experts per MoE layer, experts a token uses); (0, 0) for dense models."""
    experts = next(
        (text[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if text.get(k)),
        0,
    )
    per_token = next(
        (text[k] for k in ("num_experts_per_tok", "experts_per_token") if text.get(k)), 0
    )
    if not isinstance(experts, int) or not isinstance(per_token, int) or per_token > experts:
        raise ModelInfoError(
            f"{model_dir}/config.json: expert counts {experts!r} / {per_token!r} per token "
            "are not integers with per-token <= total"
        )
    return experts, per_token


def _num_layers(text: dict[str, Any], layers: dict[int, _Layer], model_dir: Path) -> int:
    declared = text.get("num_hidden_layers") or text.get("n_layer") or text.get("num_layers")
    found = sorted(layers)
    count = int(declared) if declared else len(found)
    if found[:count] != list(range(count)):
        raise ModelInfoError(
            f"{model_dir}: config.json declares {count} layers but the weights hold "
            f"layers {found[:5]}{'...' if len(found) > 5 else ''} ({len(found)} in all); "
            "the directory is incomplete or the config does not belong to these weights"
        )
    return count


def _config_int(config: dict[str, Any], keys: tuple[str, ...], model_dir: Path) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ModelInfoError(f"{model_dir}/config.json has no positive integer {' or '.join(keys)}")


# ---- cache per layer ------------------------------------------------------------------------


def _cache_layout(
    text: dict[str, Any], num_layers: int, element: int, model_dir: Path
) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Per layer: kind, bytes per token, window (0 = unbounded), constant state bytes."""
    model_type = str(text.get("model_type", ""))
    heads = _config_int(text, ("num_attention_heads", "n_head", "num_heads"), model_dir)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    hidden = _config_int(text, ("hidden_size", "n_embd", "d_model"), model_dir)
    head_dim = int(text.get("head_dim") or hidden // heads)
    full = 2 * kv_heads * head_dim * element
    kinds, per_token, windows, states = [], [], [], []
    for layer in range(num_layers):
        if text.get("kv_lora_rank"):
            latent = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)
            entry = ("mla", latent * element, 0, 0)
        elif model_type in _LINEAR_ATTENTION_TYPES and _is_linear_layer(text, layer):
            entry = ("linear", 0, 0, _delta_net_state_bytes(text, element, model_dir))
        elif model_type == "gpt_oss" and _gpt_oss_layer_type(text, layer) == "sliding_attention":
            window = _config_int(text, ("sliding_window",), model_dir)
            entry = ("sliding", full, window, 0)
        else:
            entry = ("full", full, 0, 0)
        for values, value in zip((kinds, per_token, windows, states), entry, strict=True):
            values.append(value)
    return tuple(kinds), tuple(per_token), tuple(windows), tuple(states)


def every_layer_keeps_kv(config: dict[str, Any]) -> bool:
    """Whether every layer of the model ``config`` (config.json) describes keeps a KV cache
    of full attention or MLA: a cache that can drop its last positions again (speculative
    decoding takes back rejected drafts that way). False for sliding-window and recurrent
    layers, and for a config that does not say enough."""
    text = _text_config(config)
    declared = text.get("num_hidden_layers") or text.get("n_layer") or text.get("num_layers")
    if not isinstance(declared, int) or declared <= 0:
        return False
    try:
        kinds = _cache_layout(text, declared, 2, Path("config.json"))[0]
    except ModelInfoError:
        return False
    return all(kind in ("full", "mla") for kind in kinds)


def _is_linear_layer(text: dict[str, Any], layer: int) -> bool:
    """mlx-lm's rule (qwen3_next.py, qwen3_5.py): every full_attention_interval-th layer is
    full attention, the others gated delta-net."""
    interval = int(text.get("full_attention_interval") or 4)
    return (layer + 1) % interval != 0


def _delta_net_state_bytes(text: dict[str, Any], element: int, model_dir: Path) -> int:
    key_heads = _config_int(text, ("linear_num_key_heads",), model_dir)
    value_heads = _config_int(text, ("linear_num_value_heads",), model_dir)
    key_dim = _config_int(text, ("linear_key_head_dim",), model_dir)
    value_dim = _config_int(text, ("linear_value_head_dim",), model_dir)
    kernel = _config_int(text, ("linear_conv_kernel_dim",), model_dir)
    conv_channels = 2 * key_heads * key_dim + value_heads * value_dim
    conv_state = (kernel - 1) * conv_channels * element
    recurrent_state = value_heads * value_dim * key_dim * 4  # float32 in mlx-lm
    return conv_state + recurrent_state


def _gpt_oss_layer_type(text: dict[str, Any], layer: int) -> str:
    """gpt-oss: `layer_types`, else mlx-lm's default of alternating sliding and full."""
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list) and layer < len(layer_types):
        return str(layer_types[layer])
    return "sliding_attention" if layer % 2 == 0 else "full_attention"


def _full_attention_bytes(kinds: tuple[str, ...], per_token: tuple[int, ...]) -> int:
    """The per-token bytes of a full-attention layer (the legacy single number)."""
    return next((size for kind, size in zip(kinds, per_token, strict=True) if kind == "full"), 0)


# ---- weights --------------------------------------------------------------------------------


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ModelInfoError(f"{index} is not a valid safetensors index: {error}") from error
        files = sorted({model_dir / name for name in weight_map.values()})
        if not any(model_dir.glob("*.safetensors")):
            return []  # an index without any weight file: size from the config
        for path in files:
            if not path.is_file():
                raise ModelInfoError(f"{path} is listed in {INDEX_FILE} but missing")
        return files
    return sorted(model_dir.glob("*.safetensors"))


def _read_headers(files: list[Path]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        tensors.update(read_safetensors_header(path))
    return tensors


@dataclass
class _Layer:
    bytes: int = 0
    params: int = 0
    expert_bytes: int = 0
    expert_params: int = 0
    replicated_bytes: int = 0

    def active_bytes(self, experts: int, per_token: int) -> int:
        if not self.expert_bytes or not experts:
            return self.bytes
        return self.bytes - self.expert_bytes + self.expert_bytes * per_token // experts

    def active_params(self, experts: int, per_token: int) -> int:
        if not self.expert_params or not experts:
            return self.params
        return self.params - self.expert_params + self.expert_params * per_token // experts


@dataclass
class _Parts:
    layers: dict[int, _Layer] = field(default_factory=dict)
    embedding_bytes: int = 0
    head_bytes: int = 0
    other_bytes: int = 0
    has_output_projection: bool = False


def _group_tensors(
    tensors: dict[str, TensorInfo], logical: Callable[[str, TensorInfo], int]
) -> _Parts:
    parts = _Parts()
    for name, tensor in sorted(tensors.items()):
        layer = _LAYER.search(name)
        if layer:
            entry = parts.layers.setdefault(int(layer.group(1)), _Layer())
            params = logical(name, tensor)
            entry.bytes += tensor.nbytes
            entry.params += params
            if _ROUTED_EXPERT.search(name):
                entry.expert_bytes += tensor.nbytes
                entry.expert_params += params
            elif _REPLICATED.search(name):
                entry.replicated_bytes += tensor.nbytes
        elif _EMBEDDING.search(name):
            parts.embedding_bytes += tensor.nbytes
        elif _HEAD.search(name):
            parts.head_bytes += tensor.nbytes
            parts.has_output_projection |= bool(_OUTPUT_PROJECTION.search(name))
        else:
            parts.other_bytes += tensor.nbytes
    return parts


def _logical_params(
    name: str, tensor: TensorInfo, tensors: dict[str, TensorInfo], quantization: dict[str, Any]
) -> int:
    """Values a tensor stands for: unpacked for quantized weights, 0 for scales and biases."""
    module, _, leaf = name.rpartition(".")
    quantized_module = f"{module}.scales" in tensors
    if (quantized_module and leaf in ("scales", "biases")) or leaf.endswith(
        ("_scales", "weight_scale_inv")
    ):
        return 0
    count = prod(tensor.shape) if tensor.shape else 1
    if quantized_module and leaf == "weight" and tensor.dtype == "U32":
        bits = _bits_for(module, quantization)
        return count * 32 // bits
    if leaf.endswith("_blocks") and tensor.dtype == "U8":
        return count * 2  # mxfp4: two 4-bit values per byte
    return count


def _bits_for(module: str, quantization: dict[str, Any]) -> int:
    override = quantization.get(module)
    if isinstance(override, dict) and "bits" in override:
        return int(override["bits"])
    if "bits" not in quantization:
        raise ModelInfoError(
            f"{module} is quantized but config.json has no quantization.bits; cannot tell "
            "how many values each packed element holds"
        )
    return int(quantization["bits"])


def _compute_dtype(tensors: dict[str, TensorInfo]) -> str:
    """The floating dtype holding the most bytes (scales for quantized models)."""
    totals: Counter[str] = Counter()
    for tensor in tensors.values():
        if tensor.dtype in FLOAT_DTYPES:
            totals[tensor.dtype] += tensor.nbytes
    if not totals:
        raise ModelInfoError("no floating point tensors in the weights; cannot tell the dtype")
    code = max(sorted(totals), key=lambda c: totals[c])
    return FLOAT_DTYPES[code]


def _dtype_code(dtype: str) -> str:
    return {name: code for code, name in FLOAT_DTYPES.items()}[dtype]


# ---- config only: mlx-lm's model class, never materialised ----------------------------------


def _skeleton_tensors(
    config: dict[str, Any], model_dir: Path
) -> tuple[dict[str, TensorInfo], dict[str, int]]:
    """The tensors mlx-lm would hold for this config (module docstring), with each tensor's
    logical parameter count. Nothing is evaluated: shapes and dtypes only."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map_with_path

    model = _build_model(config, model_dir)
    dtype = getattr(mx, _config_dtype(config))
    keep = getattr(model, "cast_predicate", lambda _: True)
    model.update(
        tree_map_with_path(
            lambda path, value: (
                value.astype(dtype)
                if keep(path) and mx.issubdtype(value.dtype, mx.floating)
                else value
            ),
            model.parameters(),
        )
    )
    _quantize_as_configured(model, config, model_dir)
    counts: dict[str, int] = {}
    for path, module in model.named_modules():
        bits = getattr(module, "bits", None)
        for leaf, value in tree_flatten(module.parameters()):
            if "." in leaf:
                continue  # a child module's parameter: counted with the child
            name = f"{path}.{leaf}" if path else leaf
            if bits and leaf in ("scales", "biases", "global_scale"):
                counts[name] = 0
            elif bits and leaf == "weight":
                counts[name] = value.size * 32 // bits
            else:
                counts[name] = value.size
    tensors = {
        name: TensorInfo(name, _mx_dtype_code(value.dtype), tuple(value.shape), value.nbytes)
        for name, value in tree_flatten(model.parameters())
    }
    missing = set(tensors) - set(counts)
    if missing:  # pragma: no cover - every parameter belongs to some module
        raise ModelInfoError(f"cannot attribute parameters {sorted(missing)[:3]} to modules")
    del nn
    return tensors, counts


def _build_model(config: dict[str, Any], model_dir: Path) -> Any:
    from meshd.runtime.lazy_imports import import_model_runtime

    import_model_runtime()
    from mlx_lm.utils import _get_classes

    try:
        model_class, args_class = _get_classes(config)
        return model_class(args_class.from_dict(config))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ModelInfoError(
            f"{model_dir} has no weight files, and mlx-lm cannot build model_type "
            f"{config.get('model_type')!r} from its config.json to size it: {error}"
        ) from error


def _config_dtype(config: dict[str, Any]) -> str:
    text = _text_config(config)
    dtype = config.get("torch_dtype") or text.get("torch_dtype") or text.get("dtype")
    return dtype if dtype in _CONFIG_DTYPES else "bfloat16"


def _quantize_as_configured(model: Any, config: dict[str, Any], model_dir: Path) -> None:
    """Quantize the skeleton as mlx-lm's loader would for this config (module docstring)."""
    import mlx.nn as nn

    quantization = config.get("quantization")
    if isinstance(quantization, dict) and "bits" in quantization:
        group_size = int(quantization.get("group_size", 64))
        predicate = getattr(model, "quant_predicate", None)

        def configured(path: str, module: Any) -> bool | dict[str, Any]:
            if path in quantization:
                return quantization[path]  # type: ignore[no-any-return]
            if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
                return False
            return predicate(path, module) if predicate is not None else True

        nn.quantize(
            model,
            group_size=group_size,
            bits=int(quantization["bits"]),
            mode=quantization.get("mode", "affine"),
            class_predicate=configured,
        )
        return
    hf = config.get("quantization_config") or _text_config(config).get("quantization_config")
    if not isinstance(hf, dict):
        return
    method = hf.get("quant_method")
    if method == "fp8":
        return  # mlx-lm dequantizes fp8 checkpoints to the config dtype while loading
    if method != "mxfp4":
        raise ModelInfoError(
            f"{model_dir} has no weight files and a {method!r} quantization_config; only MLX "
            "`quantization` sections, mxfp4 and fp8 can be sized from config.json alone "
            "(add the safetensors files, whose headers give the true sizes)"
        )
    skip = [str(pattern) for pattern in hf.get("modules_to_not_convert") or ()]

    def mxfp4(path: str, module: Any) -> bool:
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % 32:
            return False
        return not any(
            fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, pattern + ".*")
            for pattern in skip
        )

    nn.quantize(model, group_size=32, bits=4, mode="mxfp4", class_predicate=mxfp4)


def _mx_dtype_code(dtype: Any) -> str:
    name = str(dtype).rsplit(".", 1)[-1]
    codes = {
        "float32": "F32",
        "float16": "F16",
        "bfloat16": "BF16",
        "uint32": "U32",
        "uint8": "U8",
        "int8": "I8",
        "int32": "I32",
        "bool_": "BOOL",
    }
    if name not in codes:
        raise ModelInfoError(f"unexpected parameter dtype {dtype} in the model skeleton")
    return codes[name]
