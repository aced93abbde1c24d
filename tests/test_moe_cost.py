"""MoE and hybrid-attention sizes: the real configs under examples/models against numbers
worked out by hand from their shapes, and the cache per layer kind against the caches
mlx-lm's own model classes fill."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
from mlx_lm.utils import _get_classes, quantize_model, save_model

from meshd.models.info import ModelInfoError, read_model_spec
from partitioner import ModelSpec, PlanOptions
from partitioner.cost import CostModel, Unit

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "models"
GB = 10**9


@pytest.fixture(scope="module")
def specs() -> dict[str, ModelSpec]:
    names = [path.name for path in MODELS.iterdir() if (path / "config.json").is_file()]
    return {name: read_model_spec(MODELS / name) for name in names}


# ---- the real configurations, by hand -------------------------------------------------------


def test_qwen3_235b_total_and_active_parameters(specs: dict[str, ModelSpec]) -> None:
    spec = specs["qwen3-235b-a22b-instruct-2507"]
    hidden, heads, kv_heads, head_dim, experts, moe = 4096, 64, 4, 128, 128, 1536
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    norms = 2 * head_dim + 2 * hidden  # q_norm, k_norm, the two layer norms
    router = experts * hidden
    routed = experts * 3 * hidden * moe
    layer = attention + norms + router + routed
    assert spec.layer_params == (layer,) * 94
    active = layer - routed + 8 * 3 * hidden * moe
    assert spec.layer_active_params == (active,) * 94
    assert spec.layer_bytes == (2 * layer,) * 94  # bfloat16
    assert spec.layer_expert_bytes == (2 * routed,) * 94
    assert spec.layer_replicated_bytes == (2 * (norms + router),) * 94
    # 234B non-embedding parameters, 22B active with the head: the model card's numbers
    assert spec.total_params == 233_848_970_752
    assert spec.active_params + 151936 * hidden == 21_568_429_568  # ~22B
    assert (spec.num_experts, spec.num_experts_per_tok) == (128, 8)
    assert spec.layer_kv_kinds == ("full",) * 94
    assert spec.layer_kv_bytes_per_token == (2 * kv_heads * head_dim * 2,) * 94
    assert spec.supports_tensor_parallel  # mlx-lm's qwen3_moe has shard(group)


def test_deepseek_v3_dense_layers_mla_and_37b_active(specs: dict[str, ModelSpec]) -> None:
    spec = specs["deepseek-v3"]
    hidden, heads, q_rank, kv_rank, rope, nope, v_dim = 7168, 128, 1536, 512, 64, 128, 128
    attention = (
        hidden * q_rank
        + q_rank  # q_a_layernorm
        + q_rank * heads * (nope + rope)
        + hidden * (kv_rank + rope)
        + kv_rank  # kv_a_layernorm
        + heads * nope * kv_rank  # embed_q (kv_b_proj's key half, absorbed by mlx-lm)
        + heads * kv_rank * v_dim  # unembed_out (its value half)
        + heads * v_dim * hidden
    )
    norms = 2 * hidden
    dense = attention + norms + 3 * hidden * 18432
    expert = 3 * hidden * 2048
    moe = attention + norms + 256 * hidden + 256 + expert + 256 * expert
    assert spec.layer_params == (dense,) * 3 + (moe,) * 58  # first_k_dense_replace = 3
    assert spec.layer_expert_bytes[:3] == (0, 0, 0)
    assert spec.moe_layers == tuple(range(3, 61))
    active_moe = moe - 256 * expert + 8 * expert
    assert spec.layer_active_params == (dense,) * 3 + (active_moe,) * 58
    assert spec.active_params == 35_698_932_224  # + 0.9B head: the 36.6B DeepSeek states
    # fp8 checkpoints are dequantized by mlx-lm: held in bfloat16, except the routers'
    # score-correction bias, which mlx-lm's cast_predicate keeps in float32
    assert sum(spec.layer_bytes) == 2 * sum(spec.layer_params) + 58 * 256 * 2
    assert spec.layer_kv_kinds == ("mla",) * 61
    assert spec.layer_kv_bytes_per_token == ((kv_rank + rope) * 2,) * 61


def test_qwen3_next_keeps_constant_state_in_three_of_four_layers(
    specs: dict[str, ModelSpec],
) -> None:
    spec = specs["qwen3-next-80b-a3b-instruct"]
    kinds = spec.layer_kv_kinds
    assert kinds == ("linear", "linear", "linear", "full") * 12
    conv_channels = 2 * 16 * 128 + 32 * 128
    state = 3 * conv_channels * 2 + 32 * 128 * 128 * 4  # conv state + float32 delta state
    assert {spec.layer_state_bytes[i] for i in range(48) if kinds[i] == "linear"} == {state}
    full = 2 * 2 * 256 * 2
    context = 262144
    reserved = sum(spec.layer_cache_bytes(i, context) for i in range(48))
    assert reserved == 12 * full * context + 36 * state
    assert 48 * full * context / reserved > 3.9  # all-full accounting over-reserves ~4x
    assert not spec.supports_tensor_parallel  # mlx-lm's qwen3_next has no shard(group)


def test_gpt_oss_sliding_layers_are_capped_at_the_window(specs: dict[str, ModelSpec]) -> None:
    spec = specs["gpt-oss-120b"]
    assert spec.layer_kv_kinds == ("sliding", "full") * 18
    assert set(spec.layer_kv_window) == {0, 128}
    per_token = 2 * 8 * 64 * 2
    assert spec.layer_cache_bytes(0, 100_000) == per_token * 128
    assert spec.layer_cache_bytes(1, 100_000) == per_token * 100_000
    assert spec.layer_cache_bytes(0, 50) == per_token * 50
    # 117B parameters with embeddings and head, 5.1B active with the head (OpenAI's card)
    assert round((spec.total_params + 2 * 201088 * 2880) / 1e9) == 117
    assert round((spec.active_params + 201088 * 2880) / 1e9, 1) == 5.1
    assert (spec.num_experts, spec.num_experts_per_tok) == (128, 4)


@pytest.mark.parametrize(
    ("name", "published_gb"),
    [
        # the checkpoints' sizes as exo's model cards list them (GB; resources/...model_cards)
        ("qwen3-235b-a22b-instruct-2507-8bit", 250),
        ("qwen3-235b-a22b-instruct-2507-4bit", 132),
        ("deepseek-v3-8bit", 713),
        ("deepseek-v3-4bit", 378),
        ("qwen3-next-80b-a3b-instruct-8bit", 84.7),
        ("qwen3-next-80b-a3b-instruct-4bit", 44.8),
    ],
)
def test_config_only_sizes_match_the_published_checkpoints(
    specs: dict[str, ModelSpec], name: str, published_gb: float
) -> None:
    assert specs[name].total_weight_bytes / GB == pytest.approx(published_gb, rel=0.01)


def test_decode_reads_active_experts_but_memory_holds_all(specs: dict[str, ModelSpec]) -> None:
    spec = specs["qwen3-235b-a22b-instruct-2507-8bit"]
    cost = CostModel(spec, PlanOptions(context_length=4096))
    layers = spec.num_layers
    assert cost.active_bytes(0, layers) == sum(spec.layer_active_bytes)
    assert sum(spec.layer_bytes) / sum(spec.layer_active_bytes) > 10  # what a dense cost misses
    whole = cost.memory(0, layers, first=True, last=True)
    assert whole.weights == spec.total_weight_bytes
    assert whole.kv_cache == 94 * 2048 * 4096


@pytest.mark.parametrize("rows", [1, 2, 8, 64, 4096])
def test_a_batched_step_reads_the_experts_its_tokens_touch(
    specs: dict[str, ModelSpec], rows: int
) -> None:
    """A decode step of r tokens reads the shared weights once and, of 128 routed experts with
    8 per token, the 128 x (1 - (1 - 8/128)^r) the tokens touch on average (all of them, at
    most): one token reads 1/16 of the routed experts, 64 tokens ~98 %."""
    spec = specs["qwen3-235b-a22b-instruct-2507-8bit"]
    cost = CostModel(spec, PlanOptions(context_length=4096))
    layers = spec.num_layers
    routed = sum(spec.layer_expert_bytes)
    shared = sum(spec.layer_active_bytes) - routed / 16
    touched = routed * (1 - (1 - 1 / 16) ** rows)
    assert cost.active_read(0, layers, rows) == pytest.approx(shared + touched, rel=1e-9)
    bandwidth = 800e9  # the step is memory-bound on a node with this much compute
    unit = Unit(("n",), 10**13, 1e18, bandwidth)
    step = cost.stage_step_s(unit, 0, layers, last=False, rows=rows)
    assert step == pytest.approx((shared + touched) / bandwidth, rel=1e-9)
    assert cost.stage_step_s(unit, 0, layers, last=False, rows=1) == pytest.approx(
        cost.stage_decode_s(unit, 0, layers, last=False)
    )


# ---- the cache per layer kind, measured on mlx-lm's own models ------------------------------

TINY: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "full_attention_interval": 2,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "rms_norm_eps": 1e-5,
        "vocab_size": 128,
        "rope_theta": 150000.0,
        "tie_word_embeddings": False,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
}


def build(config: dict[str, Any]) -> nn.Module:
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def measured_cache_bytes(cache: Any) -> int:
    """Bytes a layer's cache really holds for its tokens (allocation steps excluded)."""
    if isinstance(cache, ArraysCache):
        return sum(array.nbytes for array in cache.cache if array is not None)
    if isinstance(cache, RotatingKVCache):
        tokens = min(cache.offset, cache.max_size)
    else:
        assert isinstance(cache, KVCache)
        tokens = cache.offset
    keys, values = cache.keys[..., :tokens, :], cache.values[..., :tokens, :]
    return keys.nbytes + values.nbytes


@pytest.mark.parametrize("arch", sorted(TINY))
def test_cache_per_layer_kind_matches_mlx_lm(tmp_path: Path, arch: str) -> None:
    config = TINY[arch]
    model = build(config)
    save_model(tmp_path, model)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = read_model_spec(tmp_path)
    cache = model.make_cache() if hasattr(model, "make_cache") else None
    if cache is None:
        cache = [KVCache() for _ in range(config["num_hidden_layers"])]
    prompt = mx.array([[(7 * i) % 128 for i in range(20)]])
    logits = model(prompt, cache=cache)
    for _ in range(3):  # decode steps: rotating caches settle at their window
        logits = model(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
    mx.eval(logits)
    tokens = 23
    for layer, layer_cache in enumerate(cache):
        assert spec.layer_cache_bytes(layer, tokens) == measured_cache_bytes(layer_cache), (
            f"{arch} layer {layer} ({spec.layer_kv_kinds[layer]})"
        )


# ---- weights on disk, config alone, quantized -----------------------------------------------


def test_moe_headers_split_experts_router_and_shared_parts(tmp_path: Path) -> None:
    config = TINY["qwen3_moe"]
    model = build(config)
    save_model(tmp_path, model)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = read_model_spec(tmp_path)
    params = dict(tree_flatten(model.parameters()))

    def layer_bytes(layer: int, part: str = "") -> int:
        prefix = f"model.layers.{layer}."
        return sum(
            v.nbytes for k, v in params.items() if k.startswith(prefix) and part in k[len(prefix) :]
        )

    assert spec.layer_bytes == tuple(layer_bytes(i) for i in range(3))
    experts = tuple(layer_bytes(i, "switch_mlp.") for i in range(3))
    assert spec.layer_expert_bytes == experts and experts[1] == 0  # mlp_only_layers = [1]
    assert spec.moe_layers == (0, 2)
    for i in (0, 2):
        assert spec.layer_active_bytes[i] == layer_bytes(i) - experts[i] + experts[i] * 2 // 8
        replicated = layer_bytes(i, "mlp.gate.") + layer_bytes(i, "norm.")
        assert spec.layer_replicated_bytes[i] == replicated
    assert spec.layer_active_bytes[1] == layer_bytes(1)


def test_config_alone_sizes_a_quantized_moe_exactly_as_its_weights(tmp_path: Path) -> None:
    """A 4-bit MoE with mlx-lm's own 8-bit routers: the directory with weights (headers) and
    the same config.json alone (mlx-lm's model class, never materialised) give one spec."""
    config = {**TINY["qwen3_moe"], "torch_dtype": "float32"}  # the weights' dtype
    model = build(config)
    model, quantized = quantize_model(model, config, 32, 4)
    assert quantized["quantization"]["model.layers.0.mlp.gate"]["bits"] == 8
    with_weights = tmp_path / "weights"
    save_model(with_weights, model)
    (with_weights / "config.json").write_text(json.dumps(quantized))
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(with_weights / "config.json", config_only / "config.json")
    from_headers = read_model_spec(with_weights)
    from_config = read_model_spec(config_only)
    assert from_headers.layer_bytes == from_config.layer_bytes
    assert from_headers.layer_active_bytes == from_config.layer_active_bytes
    assert from_headers.layer_expert_bytes == from_config.layer_expert_bytes
    assert from_headers.layer_params == from_config.layer_params == build_params(config)


def build_params(config: dict[str, Any]) -> tuple[int, ...]:
    """Unquantized parameter count per layer (what the logical counts must give back)."""
    params = dict(tree_flatten(build(config).parameters()))
    return tuple(
        sum(v.size for k, v in params.items() if k.startswith(f"model.layers.{i}."))
        for i in range(config["num_hidden_layers"])
    )


def test_config_alone_of_an_unknown_architecture_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(ModelInfoError, match="mlx-lm cannot build model_type 'no_such_model'"):
        read_model_spec(tmp_path)
