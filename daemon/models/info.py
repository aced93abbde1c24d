"""Read a ModelSpec from a real model directory without loading any weights.

Why: plans must use true sizes (layers need not be equal, quantized files are much smaller
than parameter counts suggest), and reading them must be cheap enough to run on every node.
Only config.json and the JSON headers of the safetensors files are read: a safetensors file
starts with an 8-byte little-endian header length and a JSON header that lists every tensor's
dtype, shape and byte range.

Tensor names are mapped to parts of the model:
- `...layers.N.*` (also `h.N`, `blocks.N`) -> layer N;
- embeddings (`embed_tokens`, `wte`, `wpe`, `tok_embeddings`, `word_embeddings`, `embed_in`)
  -> the first stage;
- the final norm (`model.norm`, `ln_f`, `norm_f`, `final_layernorm`) and the output projection
  (`lm_head`, `embed_out`, `output`) -> the last stage;
- anything else is counted on both the first and the last stage (safe: too much, never too
  little).
Tied embeddings are decided by the files: no output projection tensor means the head uses the
embedding matrix, so the last stage holds it too.

Logical parameters (for FLOPs): a quantized weight (uint32 with a `.scales` sibling) holds
32 / bits values per element, with bits from config.json's `quantization` (per-module
overrides honoured); scales and biases are not parameters. KV cache bytes per token per layer
= 2 x num_key_value_heads x head_dim x bytes per element, the element being the dtype the
weights compute in (the scales' dtype for quantized models) unless given.
"""

from __future__ import annotations

import json
import re
import struct
from collections import Counter
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

from partitioner import ModelSpec

DEFAULT_CONTEXT_LENGTH = 4096
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"

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

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_EMBEDDING = re.compile(
    r"(?:^|\.)(?:embed_tokens|wte|wpe|tok_embeddings|word_embeddings|embed_in)\."
)
_HEAD = re.compile(r"(?:^|\.)(?:lm_head|embed_out|output|norm|ln_f|norm_f|final_layernorm)\.")
_OUTPUT_PROJECTION = re.compile(r"(?:^|\.)(?:lm_head|embed_out|output)\.")


class ModelInfoError(ValueError):
    """The directory does not hold a model we can describe (missing or malformed files)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its safetensors header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensors listed in one safetensors file's header (the tensor data is never read)."""
    try:
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise ModelInfoError(f"{path}: too short to be a safetensors file")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or length > path.stat().st_size - 8:
                raise ModelInfoError(
                    f"{path}: header length {length} is not plausible; the file is not "
                    "safetensors or is truncated"
                )
            header = json.loads(handle.read(length))
    except OSError as error:
        raise ModelInfoError(f"cannot read {path}: {error}") from error
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelInfoError(f"{path}: the safetensors header is not valid JSON") from error
    if not isinstance(header, dict):
        raise ModelInfoError(f"{path}: the safetensors header is not a JSON object")
    return {
        name: _tensor_info(path, name, entry)
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _tensor_info(path: Path, name: str, entry: Any) -> TensorInfo:
    try:
        start, end = entry["data_offsets"]
        return TensorInfo(name, str(entry["dtype"]), tuple(entry["shape"]), int(end) - int(start))
    except (KeyError, TypeError, ValueError) as error:
        raise ModelInfoError(f"{path}: tensor {name!r} has a malformed header entry") from error


def read_model_spec(
    model_dir: Path,
    *,
    context_length: int | None = None,
    kv_bytes_per_element: int | None = None,
) -> ModelSpec:
    """ModelSpec of the model in `model_dir` (config.json + safetensors headers).

    context_length: tokens of KV cache to reserve; default the config's
    max_position_embeddings (else 4096). kv_bytes_per_element: default the compute dtype's size.
    """
    model_dir = Path(model_dir)
    config = _read_config(model_dir)
    tensors = _read_all_headers(model_dir)
    quantization = config.get("quantization") or {}
    parts = _group_tensors(tensors, quantization)
    num_layers = _num_layers(config, parts.layer_bytes, model_dir)
    hidden = _config_int(config, ("hidden_size", "n_embd", "d_model"), model_dir)
    heads = _config_int(config, ("num_attention_heads", "n_head", "num_heads"), model_dir)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    dtype = _compute_dtype(tensors)
    element = kv_bytes_per_element or DTYPE_BYTES[_dtype_code(dtype)]
    return ModelSpec(
        name=str(config.get("_name_or_path") or model_dir.resolve().name),
        layer_bytes=tuple(parts.layer_bytes[i] for i in range(num_layers)),
        layer_params=tuple(parts.layer_params[i] for i in range(num_layers)),
        embedding_bytes=parts.embedding_bytes + parts.other_bytes,
        head_bytes=parts.head_bytes + parts.other_bytes,
        tie_word_embeddings=not parts.has_output_projection,
        kv_bytes_per_token_per_layer=2 * kv_heads * head_dim * element,
        hidden_size=hidden,
        intermediate_size=int(
            config.get("intermediate_size") or config.get("n_inner") or 4 * hidden
        ),
        vocab_size=_config_int(config, ("vocab_size",), model_dir),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        activation_bytes=DTYPE_BYTES[_dtype_code(dtype)],
        dtype=dtype,
        context_length=int(
            context_length or config.get("max_position_embeddings") or DEFAULT_CONTEXT_LENGTH
        ),
        quant_bits=quantization.get("bits") if quantization else None,
        quant_group_size=quantization.get("group_size") if quantization else None,
    )


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


def _read_all_headers(model_dir: Path) -> dict[str, TensorInfo]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ModelInfoError(f"{index} is not a valid safetensors index: {error}") from error
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelInfoError(f"{model_dir} has no *.safetensors weight files")
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        if not path.is_file():
            raise ModelInfoError(f"{path} is listed in {INDEX_FILE} but missing")
        tensors.update(read_safetensors_header(path))
    return tensors


@dataclass
class _Parts:
    layer_bytes: Counter[int]
    layer_params: Counter[int]
    embedding_bytes: int = 0
    head_bytes: int = 0
    other_bytes: int = 0
    has_output_projection: bool = False


def _group_tensors(tensors: dict[str, TensorInfo], quantization: dict[str, Any]) -> _Parts:
    parts = _Parts(Counter(), Counter())
    for name, tensor in sorted(tensors.items()):
        layer = _LAYER.search(name)
        if layer:
            index = int(layer.group(1))
            parts.layer_bytes[index] += tensor.nbytes
            parts.layer_params[index] += _logical_params(name, tensor, tensors, quantization)
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
    if quantized_module and leaf in ("scales", "biases"):
        return 0
    count = prod(tensor.shape) if tensor.shape else 1
    if quantized_module and leaf == "weight" and tensor.dtype == "U32":
        bits = _bits_for(module, quantization)
        return count * 32 // bits
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


def _num_layers(config: dict[str, Any], layer_bytes: Counter[int], model_dir: Path) -> int:
    declared = config.get("num_hidden_layers") or config.get("n_layer") or config.get("num_layers")
    found = sorted(layer_bytes)
    count = int(declared) if declared else len(found)
    if found != list(range(count)):
        raise ModelInfoError(
            f"{model_dir}: config.json declares {count} layers but the weight files hold "
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
