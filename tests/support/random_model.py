"""Random-weight model directories built from mlx-lm's own model classes.

Why: exactness tests and benchmarks need models of a chosen shape without a model hub. The
directory this writes has the same layout as a converted MLX model (``config.json``, sharded
``model-XXXXX-of-YYYYY.safetensors`` with ``model.safetensors.index.json``, ``tokenizer.json`` and
``tokenizer_config.json``), so ``mlx_lm.load`` and :func:`meshd.inference.stage.shard.load_stage`
read it exactly like a real one. Weights are float32, the only fast dtype on the CPUs we test on.

Models are built by mlx-lm itself (:func:`build_model` runs ``mlx_lm.utils.load_model`` on a
directory holding only ``config.json``), so every architecture mlx-lm has can be made here: the
dense families with :func:`make_random_model_dir`, and the mixture-of-experts and hybrid
architectures people split with :func:`make_architecture_dir`, from the tiny configurations in
:data:`TINY_CONFIGS` (real ``config.json`` field names, tiny dimensions, a few experts, layer
kinds spread so that every stage of a 2- or 3-way split of 6 layers holds each kind).

The tokenizer is a byte-level BPE made with ``tokenizers``: the 256 byte symbols, a few ChatML
special tokens and as many merges of byte pairs as it takes to fill the model's vocabulary, so
every id the model can produce decodes to something.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from math import prod
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import load_model
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from meshd.inference.stage.shard import skeleton_classes
from meshd.models.safetensors import write_sharded_safetensors

Architecture = Literal["llama", "qwen2", "qwen3"]
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3")
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BYTE_SYMBOLS = 256
MIN_VOCAB = BYTE_SYMBOLS + len(SPECIAL_TOKENS)
DEFAULT_MAX_SHARD_BYTES = 64 << 20

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_random_model_dir(
    path: Path,
    arch: Architecture,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int = 512,
    seed: int = 0,
    intermediate: int | None = None,
    tie_embeddings: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a random float32 model of family ``arch`` to ``path`` and return ``path``.

    ``max_shard_bytes`` caps each safetensors file; pass a small value to force several files
    so that per-file lazy loading is exercised. The same arguments give the same bytes.
    """
    _validate_shape(arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab)
    config = random_model_config(
        arch,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        intermediate=intermediate or _default_intermediate(hidden),
        tie_embeddings=tie_embeddings,
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config, seed=seed)
    write_sharded_safetensors(path, weights, max_shard_bytes=max_shard_bytes)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_byte_level_tokenizer(path, vocab)
    return path


def make_three_host_llama(path: Path) -> Path:
    """A random llama of 94 MB in float32: it needs three 120 MB memory budgets.

    The agreement tests and benchmark use it so that a plan really spans several nodes and a
    one-node side of a partition cannot hold the model.
    """
    return make_random_model_dir(
        path, "llama", layers=8, hidden=512, heads=8, kv_heads=4, intermediate=1376
    )


TINY_LAYERS = 6
TINY_VOCAB = 320
SLIDING_WINDOW = 8  # shorter than the test prompts, so rotating caches wrap and windows mask
_EOS_ID = BYTE_SYMBOLS + SPECIAL_TOKENS.index("<|im_end|>")
_TINY_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": TINY_LAYERS,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": TINY_VOCAB,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "eos_token_id": _EOS_ID,
    "torch_dtype": "float32",
}
_HYBRID_TEXT: dict[str, Any] = {
    # Gated-delta-net (linear attention) layers keep an ArraysCache; every second layer is full
    # attention (the real models use 4), so each stage of a 2- or 3-way split of 6 has both.
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
}
_TINY_MOE: dict[str, Any] = {"moe_intermediate_size": 64, "num_experts_per_tok": 2}

# Field names are those of the real config.json files (Hugging Face / mlx-community); only the
# sizes are tiny. Layer kinds are spread so that a 2- or 3-way split puts each in every stage
# where the architecture allows it (DeepSeek/GLM dense layers come first by design).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "mistral": {**_TINY_COMMON, "model_type": "mistral", "tie_word_embeddings": False},
    "llama-sliding": {
        **_TINY_COMMON,
        "model_type": "llama",
        "tie_word_embeddings": True,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * (TINY_LAYERS // 2),
    },
    "mixtral": {
        **_TINY_COMMON,
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        **_TINY_COMMON,
        **_TINY_MOE,
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0, 3, 4],  # dense MLP layers between the MoE ones
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    "qwen3_next": {
        **_TINY_COMMON,
        **_HYBRID_TEXT,
        **_TINY_MOE,
        "model_type": "qwen3_next",
        "num_experts": 4,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "qwen3_5": {
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "eos_token_id": _EOS_ID,
        "text_config": {
            **_TINY_COMMON,
            **_HYBRID_TEXT,
            "model_type": "qwen3_5_text",
            "tie_word_embeddings": True,
        },
    },
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "eos_token_id": _EOS_ID,
        "text_config": {
            **_TINY_COMMON,
            **_HYBRID_TEXT,
            **_TINY_MOE,
            "model_type": "qwen3_5_moe_text",
            "num_experts": 4,
            "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 64,
            "norm_topk_prob": True,
        },
    },
    "deepseek_v3": {
        **_TINY_COMMON,
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 2,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
    },
    "gpt_oss": {
        **_TINY_COMMON,
        "model_type": "gpt_oss",
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * (TINY_LAYERS // 2),
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    },
    "glm4_moe": {
        **_TINY_COMMON,
        "model_type": "glm4_moe",
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "rope_scaling": None,
        "use_qk_norm": True,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
    },
}


def make_architecture_dir(
    path: Path,
    name: str,
    *,
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write the random float32 model :data:`TINY_CONFIGS` ``[name]`` to ``path``.

    ``overrides`` replaces top-level config fields (e.g. a larger ``num_hidden_layers``).
    """
    if name not in TINY_CONFIGS:
        raise ValueError(f"Unknown architecture {name!r}; choose one of {', '.join(TINY_CONFIGS)}.")
    config = json.loads(json.dumps(TINY_CONFIGS[name]))  # a deep copy the caller cannot change
    config.update(overrides or {})
    return write_model_dir(path, config, seed=seed, max_shard_bytes=max_shard_bytes)


def write_model_dir(
    path: Path,
    config: dict[str, Any],
    *,
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a model directory for ``config`` with random float32 weights; returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config, seed=seed)
    write_sharded_safetensors(path, weights, max_shard_bytes=max_shard_bytes)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    text_config = config.get("text_config") or config
    write_byte_level_tokenizer(path, int(text_config["vocab_size"]))
    return path


def quantize_model_dir(
    source: Path,
    dest: Path,
    *,
    bits: int = 4,
    group_size: int = 64,
    mode: str = "affine",
    quant_predicate: Callable[[str, nn.Module], bool | dict[str, Any]] | None = None,
) -> Path:
    """Quantize ``source`` into ``dest`` with ``mlx_lm.convert``, as mlx-community checkpoints are.

    Without ``quant_predicate`` the model's own ``quant_predicate`` applies (mlx-lm's default),
    which is where the per-module overrides of real MoE checkpoints come from (8-bit routers
    and gates in a 4-bit model).
    """
    from mlx_lm.convert import convert

    convert(
        str(source),
        str(dest),
        quantize=True,
        q_group_size=group_size,
        q_bits=bits,
        q_mode=mode,
        quant_predicate=quant_predicate,
    )
    return Path(dest)


def random_model_config(
    arch: Architecture,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    intermediate: int,
    tie_embeddings: bool,
) -> dict[str, Any]:
    """The ``config.json`` of a model of family ``arch`` (HF field names, as mlx-lm reads them)."""
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_embeddings,
        "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>") + BYTE_SYMBOLS,
        "torch_dtype": "float32",
    }
    return config


def random_weights(config: dict[str, Any], *, seed: int) -> dict[str, mx.array]:
    """Float32 weights for ``config`` drawn from a key derived from ``seed`` (not global state).

    Scales keep logits O(1): matrices (the embedding too, which doubles as the tied head) are
    ~ N(0, 1/columns), norms ~ 1, biases small; so sampling at temperature 1 stays varied
    instead of locking onto one token.
    """
    model = build_model(config)
    names = [name for name, _ in tree_flatten(model.parameters())]
    keys = dict(zip(names, mx.random.split(mx.random.key(seed), len(names)), strict=True))

    def draw(name: str, param: mx.array) -> mx.array:
        return _random_like(name, param, keys[name])

    params = tree_map_with_path(draw, model.parameters())
    weights = dict(tree_flatten(params))
    mx.eval(weights)
    return weights


def build_model(config: dict[str, Any]) -> nn.Module:
    """The mlx-lm model of ``config`` with lazy random initial weights, built by mlx-lm itself.

    ``mlx_lm.utils.load_model`` on a directory that holds only ``config.json`` (lazy, non-strict)
    is mlx-lm's public way to go from a config to its model class, aliases included (mlx-lm's own
    ``sharded_load`` does the same before it knows which weights a rank needs); with the stage
    loader's :func:`skeleton_classes`, as wrappers cannot sanitize an empty checkpoint.
    """
    with tempfile.TemporaryDirectory(prefix="meshd-config-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        model, _ = load_model(
            Path(folder), lazy=True, strict=False, get_model_classes=skeleton_classes
        )
    return model


def _random_like(name: str, param: mx.array, key: mx.array) -> mx.array:
    """One random tensor shaped like ``param``, scaled by its role (see :func:`random_weights`)."""
    shape = param.shape
    if name.endswith("bias"):
        return 0.02 * mx.random.normal(shape, dtype=mx.float32, key=key)
    if param.ndim == 1:
        return 1.0 + 0.1 * mx.random.normal(shape, dtype=mx.float32, key=key)
    # Matrices and stacked experts (E, out, in) read their last axis; a depthwise convolution
    # (channels, kernel, 1) reads its kernel.
    fan_in = shape[-1] if shape[-1] > 1 else prod(shape[1:])
    return mx.random.normal(shape, dtype=mx.float32, key=key) * (fan_in**-0.5)


def write_byte_level_tokenizer(path: Path, vocab_size: int) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` of a byte-level BPE of ``vocab_size``.

    mlx-lm picks its BPE streaming detokenizer for it (ByteLevel decoder) and transformers'
    ``PreTrainedTokenizerFast`` loads it; the ChatML template makes chat prompts work.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_symbols = sorted(alphabet)
    vocab = {symbol: index for index, symbol in enumerate(byte_symbols)}
    for special in SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    merges = list(_filler_merges(byte_symbols, vocab_size - len(vocab)))
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHATML_TEMPLATE,
    }
    _write_json_atomically(path / "tokenizer_config.json", tokenizer_config)


def _filler_merges(byte_symbols: list[str], count: int) -> Iterator[tuple[str, str]]:
    """``count`` merges of two byte symbols, printable ASCII pairs first, in a fixed order."""
    printable = [symbol for symbol in byte_symbols if symbol.isascii() and symbol.isalnum()]
    others = [symbol for symbol in byte_symbols if symbol not in printable]
    ordered = printable + others
    produced = 0
    for left in ordered:
        for right in ordered:
            if produced == count:
                return
            yield left, right
            produced += 1


def _write_json_atomically(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON through a temp file and rename, so readers never see half a file."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(payload, indent=2, ensure_ascii=False))
    temp.replace(path)


def _default_intermediate(hidden: int) -> int:
    """The usual SwiGLU width: about 8/3 of ``hidden``, rounded up to a multiple of 32."""
    return -(-(hidden * 8 // 3) // 32) * 32


def _validate_shape(
    arch: str, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int
) -> None:
    """Reject shapes mlx-lm's classes would fail on later with a less helpful message."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"Unsupported architecture {arch!r}; "
            f"choose one of {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}.")
    if heads < 1 or hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a positive multiple of heads ({heads}).")
    if (hidden // heads) % 2:
        raise ValueError(f"head size hidden/heads = {hidden // heads} must be even for RoPE.")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads}).")
    if vocab < MIN_VOCAB or vocab > MIN_VOCAB + BYTE_SYMBOLS * BYTE_SYMBOLS:
        raise ValueError(
            f"vocab must be between {MIN_VOCAB} (bytes + special tokens) and "
            f"{MIN_VOCAB + BYTE_SYMBOLS * BYTE_SYMBOLS}, got {vocab}."
        )
