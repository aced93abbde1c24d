"""Convert a llama-family GGUF file into an MLX model directory (float32 safetensors).

Why float32: on the CPUs we run on, float32 is the only fast dtype (float16/bfloat16 are
3-40x slower, quantized matmuls need float32 scales anyway), so Q4_0/Q4_1/Q8_0 tensors and
8-bit embeddings are dequantized at import.

What it does:

* Tensors: ``mx.load`` reads GGUF natively (Q4_0/Q4_1/Q8_0 arrive as MLX affine-quantized
  triples ``weight``/``scales``/``biases`` with groups of 32). Names are mapped to the HF/mlx-lm
  names (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``). llama.cpp
  permutes the rows of q/k for the ``llama`` architecture (to its interleaved RoPE layout); we
  undo the permutation so the directory is a plain HF-layout model with ``rope_traditional``
  false, identical in layout to what ``mlx_lm.convert`` would make from the original.
* ``config.json`` from the GGUF metadata (``llama.embedding_length`` etc.).
* ``tokenizer.json`` rebuilt with the ``tokenizers`` library from ``tokenizer.ggml.*``
  (byte-level BPE for ``gpt2`` vocabularies, sentencepiece-style BPE for ``llama`` ones),
  and ``tokenizer_config.json`` with the chat template and the special tokens, so that
  mlx-lm's ``load_tokenizer`` and ``apply_chat_template`` work on the result.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from meshd.models.safetensors import write_sharded_safetensors

ProgressCallback = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: phase is a short human-readable step name."""

SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3")
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
GGML_BLOCK_SIZE = 32
DEFAULT_MAX_SHARD_BYTES = 256 << 20
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp stores for its own convenience; the model rebuilds them from the config.
_DERIVED_TENSORS = {"rope_freqs.weight"}

# Pre-tokenizer split patterns, by ``tokenizer.ggml.pre`` (from llama.cpp's llama-vocab.cpp).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    "default": _GPT2_SPLIT,
    "gpt2": _GPT2_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Vocabularies that split every digit on its own before the byte-level regex (HF Digits).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact"}
# Llama 3 tokenizers match whole words in the vocabulary before applying merges.
_IGNORE_MERGES_PRE = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe"}


class GGUFImportError(ValueError):
    """The GGUF file cannot be converted; the message says what is missing or unsupported."""


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    progress: ProgressCallback | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """Write the MLX model directory for ``gguf_path`` into ``out_dir``; returns the config.

    ``out_dir`` should be a fresh (temporary) directory: the caller renames it into place.
    """
    report = progress or _no_progress
    report("reading GGUF", 0, 1)
    tensors, metadata = read_gguf(gguf_path)
    report("reading GGUF", 1, 1)
    architecture = _architecture(metadata, gguf_path)
    config = config_from_metadata(metadata, tensors)
    weights = hf_weights(tensors, metadata, config)
    del tensors
    out_dir.mkdir(parents=True, exist_ok=True)
    total = len(weights)
    write_sharded_safetensors(
        out_dir,
        weights,
        max_shard_bytes=max_shard_bytes,
        progress=lambda done: report("converting weights to float32", done, total),
    )
    report("building tokenizer", 0, 1)
    write_tokenizer_files(out_dir, metadata, config)
    report("building tokenizer", 1, 1)
    config["architectures"] = [HF_ARCHITECTURES[architecture]]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return config


def _no_progress(_phase: str, _done: int, _total: int) -> None:
    """Default progress sink."""


def read_gguf(gguf_path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors and metadata of a GGUF file, with errors that say what to do."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise GGUFImportError(f"GGUF file {gguf_path} does not exist.")
    with open(gguf_path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise GGUFImportError(f"{gguf_path} is not a GGUF file (no GGUF magic bytes).")
    try:
        tensors, metadata = mx.load(str(gguf_path), return_metadata=True)
    except (RuntimeError, ValueError) as error:
        raise GGUFImportError(
            f"MLX cannot read {gguf_path}: {error}. MLX reads F32, F16, Q4_0, Q4_1 and Q8_0 "
            "tensors; re-quantize K-quant files (Q4_K etc.) to Q8_0 or F16 with llama.cpp's "
            "llama-quantize first."
        ) from error
    return tensors, metadata


def _architecture(metadata: dict[str, Any], gguf_path: Path) -> str:
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise GGUFImportError(
            f"{gguf_path} has architecture {architecture!r}; importable GGUF architectures are "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}."
        )
    return str(architecture)


def _meta(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as a plain Python value (MLX gives scalars as 0-d arrays)."""
    value = metadata.get(key, default)
    if isinstance(value, mx.array) and value.ndim == 0 and value.dtype == mx.float32:
        return float(str(np.float32(value.item())))  # 1e-05, not 9.999999747378752e-06
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _require(metadata: dict[str, Any], key: str) -> Any:
    value = _meta(metadata, key)
    if value is None:
        raise GGUFImportError(f"The GGUF metadata lacks {key!r}, which the import needs.")
    return value


def config_from_metadata(metadata: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    """An HF-style ``config.json`` dict for the GGUF's model."""
    arch = str(metadata["general.architecture"])
    hidden = int(_require(metadata, f"{arch}.embedding_length"))
    heads = int(_require(metadata, f"{arch}.attention.head_count"))
    kv_heads = int(_meta(metadata, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_meta(metadata, f"{arch}.attention.key_length", hidden // heads))
    rope_dims = int(_meta(metadata, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFImportError(
            f"Partial rotary embeddings (rope dims {rope_dims} of head size {head_dim}) are not "
            "supported for this architecture."
        )
    vocab = _meta(metadata, f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", []))
    vocab = int(vocab or tensors["token_embd.weight"].shape[0])
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(_require(metadata, f"{arch}.block_count")),
        "intermediate_size": int(_require(metadata, f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(_meta(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": vocab,
        "max_position_embeddings": int(_meta(metadata, f"{arch}.context_length", 4096)),
        "rope_theta": float(_meta(metadata, f"{arch}.rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "torch_dtype": "float32",
    }
    rope_scaling = _rope_scaling(metadata, tensors, config)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    config.update(_special_token_ids(metadata))
    return config


def _rope_scaling(
    metadata: dict[str, Any], tensors: dict[str, mx.array], config: dict[str, Any]
) -> dict[str, Any] | None:
    """RoPE scaling from the metadata, or Llama 3's, recognized from its ``rope_freqs`` tensor."""
    arch = config["model_type"]
    if "rope_freqs.weight" in tensors:
        return _llama3_scaling_from_freqs(tensors["rope_freqs.weight"], config)
    scaling_type = _meta(metadata, f"{arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    if scaling_type == "linear":
        return {
            "type": "linear",
            "factor": float(_require(metadata, f"{arch}.rope.scaling.factor")),
        }
    raise GGUFImportError(f"RoPE scaling type {scaling_type!r} is not supported by the importer.")


def _llama3_scaling_from_freqs(rope_freqs: mx.array, config: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.x stores its RoPE frequency divisors; recover the standard parameters and check
    that they reproduce the divisors exactly, since the config cannot carry arbitrary ones."""
    divisors = np.array(rope_freqs.astype(mx.float32))
    scaling = {
        "rope_type": "llama3",
        "factor": float(divisors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = _llama3_divisors(config["head_dim"], config["rope_theta"], scaling)
    if expected.shape != divisors.shape or not np.allclose(expected, divisors, rtol=1e-3):
        raise GGUFImportError(
            "The GGUF's rope_freqs tensor does not match Llama 3 RoPE scaling with the standard "
            "parameters; this RoPE variant is not supported by the importer."
        )
    return scaling


def _llama3_divisors(dims: int, base: float, scaling: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors that Llama 3 scaling applies (what llama.cpp stores)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelens = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
    smooth = (old_context / wavelens - low) / (high - low)
    medium = (wavelens > old_context / high) & (wavelens < old_context / low)
    divisors = np.where(wavelens > old_context / low, factor, 1.0)
    return np.where(medium, 1.0 / ((1 - smooth) / factor + smooth), divisors)


def _special_token_ids(metadata: dict[str, Any]) -> dict[str, Any]:
    """``bos_token_id`` and ``eos_token_id`` (plus llama.cpp's end-of-turn token, which also
    ends generation)."""
    ids: dict[str, Any] = {}
    bos = _meta(metadata, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        ids["bos_token_id"] = int(bos)
    eos = [
        int(value)
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if (value := _meta(metadata, key)) is not None
    ]
    unique_eos = list(dict.fromkeys(eos))
    if unique_eos:
        ids["eos_token_id"] = unique_eos[0] if len(unique_eos) == 1 else unique_eos
    return ids


def hf_tensor_name(gguf_name: str) -> str:
    """HF/mlx-lm name of a GGUF tensor, e.g. ``blk.3.ffn_up.weight`` ->
    ``model.layers.3.mlp.up_proj.weight``."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise GGUFImportError(
        f"GGUF tensor {gguf_name!r} has no known HF name; this file's architecture variant is "
        "not supported by the importer."
    )


def hf_weights(
    tensors: dict[str, mx.array], metadata: dict[str, Any], config: dict[str, Any]
) -> dict[str, mx.array]:
    """Lazy float32 HF-named weights: dequantized and, for llama, q/k un-permuted."""
    unpermute = config["model_type"] == "llama"
    weights: dict[str, mx.array] = {}
    for gguf_name in sorted(tensors):
        if gguf_name in _DERIVED_TENSORS or gguf_name.endswith((".scales", ".biases")):
            continue
        base = gguf_name.removesuffix(".weight").removesuffix(".bias")
        value = _to_float32(gguf_name, tensors)
        if unpermute and base.endswith(".attn_q"):
            value = unpermute_rows(value, config["num_attention_heads"])
        elif unpermute and base.endswith(".attn_k"):
            value = unpermute_rows(value, config["num_key_value_heads"])
        weights[hf_tensor_name(gguf_name)] = value
    return weights


def _to_float32(name: str, tensors: dict[str, mx.array]) -> mx.array:
    """The tensor as float32, dequantizing MLX's (weight, scales, biases) view of GGML blocks.

    Scales and biases are promoted to float32 first, so each value is ``q * d + m`` computed
    in float32 from the file's exact float16 block constants.
    """
    value = tensors[name]
    base = name.removesuffix(".weight")
    scales = tensors.get(f"{base}.scales")
    if scales is None or not name.endswith(".weight"):
        return value.astype(mx.float32)
    biases = tensors[f"{base}.biases"]
    bits = value.shape[-1] // scales.shape[-1]
    return mx.dequantize(
        value,
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        group_size=GGML_BLOCK_SIZE,
        bits=bits,
    )


def unpermute_rows(weight: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.LlamaModel.permute``).

    llama.cpp reorders each head's rows from "first half, second half" (HF's RoPE layout) to
    interleaved pairs; this is the inverse: ``(heads, half, 2) -> (heads, 2, half)``.
    """
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def permute_rows(weight: mx.array, heads: int) -> mx.array:
    """llama.cpp's q/k permutation (HF layout -> GGUF layout); used to write test GGUFs."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(heads, 2, rows // heads // 2, *rest).swapaxes(1, 2).reshape(weight.shape)


# ----------------------------------------------------------------------------- tokenizer


def write_tokenizer_files(out_dir: Path, metadata: dict[str, Any], config: dict[str, Any]) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` rebuilt from ``tokenizer.ggml.*``."""
    tokens = list(_require(metadata, "tokenizer.ggml.tokens"))
    token_types = _meta(metadata, "tokenizer.ggml.token_type") or [1] * len(tokens)
    kind = _meta(metadata, "tokenizer.ggml.model")
    add_bos = bool(_meta(metadata, "tokenizer.ggml.add_bos_token", kind == "llama"))
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(tokens, metadata)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(tokens, token_types, metadata)
    else:
        raise GGUFImportError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level "
            "BPE) and 'llama' (sentencepiece BPE)."
        )
    _add_special_tokens(tokenizer, tokens, token_types)
    special = _special_token_strings(metadata, tokens)
    _set_post_processor(tokenizer, special.get("bos_token"), add_bos=add_bos, kind=kind)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": add_bos,
        "add_eos_token": bool(_meta(metadata, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    chat_template = _meta(metadata, "tokenizer.chat_template")
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False)
    )


def _byte_level_bpe(tokens: list[str], metadata: dict[str, Any]) -> Any:
    """GPT-2 style byte-level BPE; the split regex follows ``tokenizer.ggml.pre``."""
    merges = [tuple(merge.split(" ", 1)) for merge in _require(metadata, "tokenizer.ggml.merges")]
    pre = str(_meta(metadata, "tokenizer.ggml.pre", "default"))
    model = models.BPE(vocab=_vocab(tokens), merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE)
    tokenizer = Tokenizer(model)
    if pre in _DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        split = _PRE_TOKENIZER_SPLITS.get(pre, _GPT2_SPLIT)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(tokens: list[str], token_types: list[int], metadata: dict[str, Any]) -> Any:
    """Llama/Mistral style BPE over ``▁``-spaced pieces with byte fallback (``<0x41>``)."""
    merges_meta = _meta(metadata, "tokenizer.ggml.merges")
    if merges_meta:
        merges = [tuple(merge.split(" ", 1)) for merge in merges_meta]
    else:
        scores = _meta(metadata, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = merges_from_scores(tokens, scores, token_types)
    unk_id = _meta(metadata, "tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    tokenizer = Tokenizer(
        models.BPE(
            vocab=_vocab(tokens), merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True
        )
    )
    add_prefix = bool(_meta(metadata, "tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", "▁")]
    if add_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode_steps)
    return tokenizer


def merges_from_scores(
    tokens: list[str], scores: list[float], token_types: list[int]
) -> list[tuple[str, str]]:
    """Sentencepiece BPE merges implied by the vocabulary: every split of a normal token into
    two vocabulary pieces, best-scored resulting token first (how HF converts such models)."""
    rank = {token: index for index, token in enumerate(tokens)}
    candidates: list[tuple[float, int, int, str, str]] = []
    for token, score, token_type in zip(tokens, scores, token_types, strict=True):
        if token_type != 1 or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in rank and right in rank:
                candidates.append((-score, rank[left], rank[right], left, right))
    candidates.sort()
    return [(left, right) for _, _, _, left, right in candidates]


def _vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id; a token listed twice keeps its first id (later copies are unreachable)."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    return vocab


def _add_special_tokens(tokenizer: Any, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens (``<|im_start|>`` ...) become special added tokens, user-defined ones
    plain added tokens, so that text containing them is matched whole, as llama.cpp does."""
    control = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == TOKEN_TYPE_CONTROL and token
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == TOKEN_TYPE_USER_DEFINED and token
    ]
    if control:
        tokenizer.add_special_tokens(control)
    if user_defined:
        tokenizer.add_tokens(user_defined)


def _special_token_strings(metadata: dict[str, Any], tokens: list[str]) -> dict[str, str]:
    """``bos_token`` etc. for tokenizer_config.json, from the ids in the metadata."""
    keys = {
        "bos_token": "tokenizer.ggml.bos_token_id",
        "eos_token": "tokenizer.ggml.eos_token_id",
        "unk_token": "tokenizer.ggml.unknown_token_id",
        "pad_token": "tokenizer.ggml.padding_token_id",
    }
    special: dict[str, str] = {}
    for name, key in keys.items():
        token_id = _meta(metadata, key)
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            special[name] = tokens[int(token_id)]
    return special


def _set_post_processor(tokenizer: Any, bos: str | None, *, add_bos: bool, kind: str) -> None:
    """Prepend BOS when the GGUF says so (llama.cpp does it at tokenization time)."""
    if add_bos and bos is not None:
        bos_id = tokenizer.token_to_id(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    elif kind == "gpt2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
