"""Random-weight model directories built from mlx-lm's own model classes.

Why: exactness tests and benchmarks need models of a chosen shape without a model hub. The
directory this writes has the same layout as a converted MLX model (``config.json``, sharded
``model-XXXXX-of-YYYYY.safetensors`` with ``model.safetensors.index.json``, ``tokenizer.json`` and
``tokenizer_config.json``), so ``mlx_lm.load`` and :func:`meshd.inference.shard.load_stage` read
it exactly like a real one. Weights are float32, the only fast dtype on the CPUs we test on.

The tokenizer is a byte-level BPE made with ``tokenizers``: the 256 byte symbols, a few ChatML
special tokens and as many merges of byte pairs as it takes to fill the model's vocabulary, so
every id the model can produce decodes to something.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import load_model
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from meshd.inference.shard import write_sharded_safetensors

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


def model_from_config(config: dict[str, Any]) -> nn.Module:
    """mlx-lm's model for ``config``, unevaluated (its public loader, no weights read).

    `mlx_lm.utils.load_model` maps the config to its model class (remappings included) the
    way `mlx_lm.load` does; with ``strict=False`` and no weight files it only builds.
    """
    with tempfile.TemporaryDirectory(prefix="meshd-config-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        model, _ = load_model(Path(folder), lazy=True, strict=False)
    return model


def random_weights(config: dict[str, Any], *, seed: int) -> dict[str, mx.array]:
    """Float32 weights for ``config`` drawn from a key derived from ``seed`` (not global state).

    Scales keep logits O(1): matrices (the embedding too, which doubles as the tied head) are
    ~ N(0, 1/columns), norms ~ 1, biases small; so sampling at temperature 1 stays varied
    instead of locking onto one token.
    """
    model = model_from_config(config)
    names = [name for name, _ in tree_flatten(model.parameters())]
    keys = dict(zip(names, mx.random.split(mx.random.key(seed), len(names)), strict=True))

    def draw(name: str, param: mx.array) -> mx.array:
        return _random_like(name, param, keys[name])

    params = tree_map_with_path(draw, model.parameters())
    weights = dict(tree_flatten(params))
    mx.eval(weights)
    return weights


def _random_like(name: str, param: mx.array, key: mx.array) -> mx.array:
    """One random tensor shaped like ``param``, scaled by its role (see :func:`random_weights`)."""
    shape = param.shape
    if name.endswith("bias"):
        return 0.02 * mx.random.normal(shape, dtype=mx.float32, key=key)
    if param.ndim == 1:
        return 1.0 + 0.1 * mx.random.normal(shape, dtype=mx.float32, key=key)
    fan_in = shape[-1]
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
