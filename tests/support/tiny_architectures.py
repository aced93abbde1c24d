"""Tiny random instances of every text-generation architecture the installed mlx-lm has.

Why: which architectures meshd can run as pipeline or tensor-parallel stages is a fact about
the installed mlx-lm, established by running each one (tests/support/arch_verify.py), not a
hand list. That needs a small instance of every architecture, built from what mlx-lm itself
declares: each ``mlx_lm/models/<name>.py`` that defines ``Model`` and ``ModelArgs`` is an
architecture (found by reading the source, so helpers like ``cache.py`` or ``switch_layers.py``
are skipped without a list of them), and its ``config.json`` is made from the fields of its
``ModelArgs`` dataclass (and of the argument classes a wrapper nests, e.g. a vision-language
model's ``text_config``), each field given a tiny value by its name (:data:`TINY_FIELDS`).
:data:`ARCHITECTURE_OVERRIDES` holds the few per-architecture values no rule by name can give,
each with the reason.

The architectures of :data:`tests.support.random_model.TINY_CONFIGS` keep their hand-made
configurations (layer kinds spread over 6 layers for the deeper tests); this module serves the
verification of all the others.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Any

from meshd.runtime.lazy_imports import import_model_runtime
from tests.support.random_model import SLIDING_WINDOW, TINY_VOCAB

TINY_LAYERS = 4
# Tiny values by field name, shared by every architecture's ModelArgs (and nested configs).
# Dimensions: hidden 64, 4 query / 2 KV heads of 16, MLP 128, experts 4 (2 per token) of 64.
TINY_FIELDS: dict[str, Any] = {
    # widths
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "dim": 64,
    "model_dim": 64,
    "block_dim": 64,
    "hidden_dim": 64,
    # depth
    "num_hidden_layers": TINY_LAYERS,
    "num_layers": TINY_LAYERS,
    "n_layer": TINY_LAYERS,
    "n_layers": TINY_LAYERS,
    "num_transformer_layers": TINY_LAYERS,
    # attention
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "n_kv_heads": 2,
    "num_attention_groups": 2,
    "num_global_key_value_heads": 2,
    "head_dim": 16,
    "hidden_size_per_head": 16,
    "kv_channels": 16,
    "global_head_dim": 16,
    "max_position_embeddings": 4096,
    "n_positions": 4096,
    "n_ctx": 4096,
    "model_max_length": 4096,
    "sliding_window": SLIDING_WINDOW,
    "sliding_window_size": SLIDING_WINDOW,
    "attention_window_size": SLIDING_WINDOW,
    # multi-head latent attention (DeepSeek-style)
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 4,
    # MLP widths
    "intermediate_size": 128,
    "ffn_hidden_size": 128,
    "n_inner": 128,
    "ff_intermediate_size": 128,
    "intermediate_size_mlp": 128,
    "block_ff_dim": 128,
    "moe_intermediate_size": 64,
    "expert_ffn_hidden_size": 64,
    "shared_expert_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
    "shared_intermediate_size": 64,
    "share_expert_dim": 64,
    # experts
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_top_k": 2,
    "moe_k": 2,
    "top_k_experts": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "num_shared_expert": 1,
    "moe_num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    # vocabulary (the byte-level tokenizer needs at least 259 ids)
    "vocab_size": TINY_VOCAB,
    # linear attention / state-space layers
    "full_attention_interval": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_n_heads": 8,
    "mamba_num_heads": 8,
    "mamba_d_ssm": 128,
    "mamba_n_groups": 1,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
    "ssm_state_size": 16,
    "state_size": 16,
    "time_step_rank": 4,
    "conv_kernel": 4,
    "conv_L_cache": 3,
    "conv1d_width": 4,
    "n_groups": 1,
    "a_low_rank_dim": 16,
    "v_low_rank_dim": 16,
    "gate_low_rank_dim": 16,
    "decay_low_rank_dim": 16,
    # positions
    "rope_theta": 10000.0,
    "rotary_emb_base": 10000,
    "rotary_dim": 8,
    # layer patterns: every second layer of the other kind, so 2 stages of 2 layers hold both
    "decoder_sparse_step": 1,
    "attn_layer_offset": 1,
    "attn_layer_period": 2,
    "expert_layer_offset": 1,
    "expert_layer_period": 2,
    "dense_attention_every_n_layers": 2,
    "layer_group_size": 2,
    "cla_share_factor": 2,
    "num_kv_reuse_layers": 1,
    "conv_window": 2,
    "group_norm_size": 1,
    "block_size": 16,
    "block_multiple_of": 16,
    "ffn_dim_divisor": 16,
    "zero_expert_num": 1,
    "dim_model_base": 64,
    "mamba_dt_rank": 4,
    "hidden_act": "silu",
    "topk_method": "noaux_tc",
    # norms
    "rms_norm_eps": 1e-6,
    "norm_eps": 1e-6,
    "layer_norm_eps": 1e-6,
    "layer_norm_epsilon": 1e-6,
    "layernorm_epsilon": 1e-6,
    "norm_epsilon": 1e-6,
}

# Values for required fields only (where mlx-lm's default, when it has one, already derives
# them from the fields above).
_WHEN_REQUIRED: dict[str, Any] = {
    "layer_types": ["sliding_attention", "full_attention"] * (TINY_LAYERS // 2),
    "sliding_window_pattern": 2,
}
_YARN = {
    "type": "yarn",
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# Values no rule by field name can give, and why. Keys are mlx-lm module names.
ARCHITECTURE_OVERRIDES: dict[str, dict[str, Any]] = {
    # rope_scaling defaults to None, yet its attention reads rope_scaling["factor"].
    "deepseek_v2": {"rope_scaling": _YARN},
    # The pattern is a string of L (local) and G (global) per layer.
    "exaone4": {"sliding_window_pattern": "LG"},
    # Which layers are linear (KDA) attention is a nested dict of 1-based layer numbers.
    "kimi_linear": {
        "linear_attn_config": {
            "kda_layers": [1, 3],
            "full_attn_layers": [2, 4],
            "head_dim": 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        }
    },
    # Layer kinds are named "conv" and "full_attention".
    "lfm2": {"layer_types": ["conv", "full_attention"] * (TINY_LAYERS // 2)},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"] * (TINY_LAYERS // 2)},
    # Layer kinds are one letter each: M(amba), *(attention), E (MoE), - (MLP).
    "nemotron_h": {"hybrid_override_pattern": ["M", "*", "M", "*"]},
    # Layer kinds are "recurrent" and "attention".
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # Per-layer lists of head counts and MLP multipliers.
    "openelm": {
        "num_query_heads": [4] * TINY_LAYERS,
        "num_kv_heads": [2] * TINY_LAYERS,
        "ffn_multipliers": [2.0] * TINY_LAYERS,
    },
    # Attention and MLP settings live in nested dicts.
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    },
    # RoPE settings per layer kind, read by name.
    "spark2_5": {
        "layer_types": ["sliding_attention", "full_attention"] * (TINY_LAYERS // 2),
        "rope_parameters": {
            "full_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    },
    # Llama-4-style attention scaling is read from rope_parameters.
    "ministral3": {
        "rope_parameters": {
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 1024,
            "rope_type": "default",
        }
    },
}

# Fields whose meaning is a choice, not a size: kept at mlx-lm's default when it has one.
_KEEP_DEFAULT = frozenset({"model_type"})


def text_architectures() -> list[str]:
    """mlx-lm's architecture modules: those whose source defines ``Model`` and ``ModelArgs``
    at top level (read, not imported: some modules exit when an optional package is missing)."""
    import_model_runtime()
    import mlx_lm.models

    folder = Path(mlx_lm.models.__file__).parent
    found = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
        if {"Model", "ModelArgs"} <= classes:
            found.append(path.stem)
    return found


def tiny_config(architecture: str) -> dict[str, Any]:
    """The ``config.json`` of a tiny instance of mlx-lm's ``architecture``.

    Raises what importing the module raises (e.g. a missing optional package) or
    :class:`TinyConfigError` when a required field has no tiny value.
    """
    module = _import(architecture)
    args_class = module.ModelArgs
    config = _fill(args_class, architecture)
    nested = _nested_args_classes(module)
    for name, value in list(config.items()):
        if name.endswith("_config") and isinstance(value, dict) and name != "quantization_config":
            config[name] = _nested_config(name, nested)
    config.update(ARCHITECTURE_OVERRIDES.get(architecture, {}))
    config["model_type"] = architecture
    config.setdefault("torch_dtype", "float32")
    return config


class TinyConfigError(ValueError):
    """A required ModelArgs field has no tiny value by name (add one to TINY_FIELDS)."""


def _import(architecture: str) -> types.ModuleType:
    import_model_runtime()
    try:
        return importlib.import_module(f"mlx_lm.models.{architecture}")
    except SystemExit as error:  # e.g. olmo: prints what to install, then sys.exit(1)
        raise ImportError(f"importing mlx_lm.models.{architecture} exits ({error})") from None


def _fill(args_class: type, architecture: str) -> dict[str, Any]:
    """Every field of ``args_class`` with a tiny value by name; others keep mlx-lm's default,
    and a required one without a rule gets the neutral value of its type."""
    config: dict[str, Any] = {}
    hints = _type_hints(args_class)
    for field in dataclasses.fields(args_class):
        required = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        if field.name in TINY_FIELDS and field.name not in _KEEP_DEFAULT:
            config[field.name] = TINY_FIELDS[field.name]
        elif required and field.name in _WHEN_REQUIRED:
            config[field.name] = _WHEN_REQUIRED[field.name]
        elif required:
            config[field.name] = _neutral(field.name, hints.get(field.name), architecture)
    return config


def _type_hints(args_class: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(args_class)
    except Exception:  # forward references mlx-lm never resolves
        return {field.name: field.type for field in dataclasses.fields(args_class)}


def _neutral(name: str, hint: Any, architecture: str) -> Any:
    """A value for a required field no rule names: what its type makes neutral."""
    if name == "model_type":
        return architecture
    origin = typing.get_origin(hint) or hint
    if inspect.isclass(origin) and dataclasses.is_dataclass(origin):
        return {}  # a nested config, filled by _nested_config
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _neutral(name, options[0], architecture) if options else None
    if origin is bool or hint == "bool":
        return False
    if origin is int or hint == "int":
        raise TinyConfigError(f"mlx-lm's {architecture} requires {name} (int): no tiny value")
    if origin is float or hint == "float":
        return 1.0
    if name == "model_type":
        return architecture
    if origin is str or hint == "str":
        raise TinyConfigError(f"mlx-lm's {architecture} requires {name} (str): no tiny value")
    if origin in (list, typing.List, tuple) or hint in ("list", "List"):  # noqa: UP006
        return []
    if origin in (dict, typing.Dict) or hint in ("dict", "Dict"):  # noqa: UP006
        return {}
    raise TinyConfigError(f"mlx-lm's {architecture} requires {name} ({hint}): no tiny value")


def _nested_args_classes(module: types.ModuleType) -> list[type]:
    """Argument classes a wrapper builds its inner models from: dataclasses defined or imported
    in its module, and the ModelArgs of the sibling architecture modules it imports."""
    from mlx_lm.models.base import BaseModelArgs

    found: list[type] = []
    values = list(vars(module).values())
    # Siblings whose classes it imports (``from .qwen3_5 import Model``) count as imported too.
    values += [
        sys.modules[value.__module__]
        for value in vars(module).values()
        if inspect.isclass(value)
        and value.__module__.startswith("mlx_lm.models.")
        and value.__module__ != module.__name__
    ]
    for value in values:
        if isinstance(value, types.ModuleType) and value.__name__.startswith("mlx_lm.models."):
            # A sibling architecture: its ModelArgs and the text arguments it nests in turn.
            found.extend(
                item
                for item in vars(value).values()
                if inspect.isclass(item)
                and issubclass(item, BaseModelArgs)
                and dataclasses.is_dataclass(item)
            )
        elif (
            inspect.isclass(value)
            and issubclass(value, BaseModelArgs)
            and dataclasses.is_dataclass(value)
            and value is not module.ModelArgs
        ):
            found.append(value)
    return found


def _nested_config(name: str, classes: list[type]) -> dict[str, Any]:
    """A nested config (``text_config``, ``vision_config``...): tiny values for every field the
    nested argument classes name; extra keys are harmless (``from_dict`` drops them)."""
    if not name.startswith("text"):
        return {}
    config: dict[str, Any] = {}
    for args_class in reversed(classes):
        owner = args_class.__module__.rsplit(".", 1)[-1]
        config.update(_fill(args_class, owner))
        config.update(ARCHITECTURE_OVERRIDES.get(owner, {}))
    return config
