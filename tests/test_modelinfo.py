"""read_model_spec on real model directories written by mlx-lm's own classes."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import save_model

from meshd.models.info import ModelInfoError, read_model_spec, read_safetensors_header
from tests.support.random_model import build_model

pytestmark = pytest.mark.unit

LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def write_model(path: Path, model: nn.Module, config: dict[str, Any]) -> Path:
    save_model(path, model)
    (path / "config.json").write_text(json.dumps(config))
    return path


def weights(model: nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


def part_bytes(params: dict[str, mx.array], prefix: str) -> int:
    return sum(array.nbytes for name, array in params.items() if name.startswith(prefix))


def part_count(params: dict[str, mx.array], prefix: str) -> int:
    return sum(array.size for name, array in params.items() if name.startswith(prefix))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, mx.array]]:
    model = build_model(LLAMA)
    path = write_model(tmp_path_factory.mktemp("llama"), model, LLAMA)
    return path, weights(model)


def test_float_llama_sizes_match_the_tensors(llama_dir: tuple[Path, dict[str, mx.array]]) -> None:
    path, params = llama_dir
    spec = read_model_spec(path)
    assert spec.num_layers == 3
    for layer in range(3):
        assert spec.layer_bytes[layer] == part_bytes(params, f"model.layers.{layer}.")
        assert spec.layer_params[layer] == part_count(params, f"model.layers.{layer}.")
    assert spec.embedding_bytes == part_bytes(params, "model.embed_tokens.")
    assert spec.head_bytes == part_bytes(params, "model.norm.") + part_bytes(params, "lm_head.")
    assert not spec.tie_word_embeddings
    assert spec.kv_bytes_per_token_per_layer == 2 * 2 * (64 // 4) * 4  # float32 K and V
    assert (spec.dtype, spec.activation_bytes, spec.context_length) == ("float32", 4, 512)
    assert (spec.hidden_size, spec.intermediate_size, spec.vocab_size) == (64, 128, 256)
    assert spec.total_weight_bytes == sum(array.nbytes for array in params.values())


def test_context_and_kv_width_can_be_given(llama_dir: tuple[Path, dict[str, mx.array]]) -> None:
    spec = read_model_spec(llama_dir[0], context_length=128, kv_bytes_per_element=2)
    assert spec.context_length == 128
    assert spec.kv_bytes_per_token_per_layer == 2 * 2 * 16 * 2


def test_tied_embeddings_are_read_from_the_files(tmp_path: Path) -> None:
    config = {**LLAMA, "tie_word_embeddings": True}
    model = build_model(config)
    spec = read_model_spec(write_model(tmp_path, model, config))
    params = weights(model)
    assert spec.tie_word_embeddings
    assert spec.head_bytes == part_bytes(params, "model.norm.")
    assert spec.head_matrix_bytes == spec.head_bytes + part_bytes(params, "model.embed_tokens.")


def test_quantized_sizes_are_the_packed_sizes_and_params_the_logical_ones(tmp_path: Path) -> None:
    float_model = build_model(LLAMA)
    float_spec = read_model_spec(write_model(tmp_path / "float", float_model, LLAMA))
    nn.quantize(float_model, group_size=64, bits=4)
    config = {**LLAMA, "quantization": {"group_size": 64, "bits": 4}}
    spec = read_model_spec(write_model(tmp_path / "q4", float_model, config))
    params = weights(float_model)
    for layer in range(3):
        assert spec.layer_bytes[layer] == part_bytes(params, f"model.layers.{layer}.")
    assert spec.layer_params == float_spec.layer_params
    assert spec.layer_bytes[0] < float_spec.layer_bytes[0] / 4
    assert spec.embedding_bytes == part_bytes(params, "model.embed_tokens.")
    assert (spec.quant_bits, spec.quant_group_size) == (4, 64)


def test_mixed_quantization_gives_uneven_layers(tmp_path: Path) -> None:
    model = build_model(LLAMA)

    def bits_for(path: str, module: nn.Module) -> bool | dict[str, int]:
        if not hasattr(module, "to_quantized"):
            return False
        return {"group_size": 64, "bits": 4 if path.startswith("model.layers.0.") else 8}

    nn.quantize(model, class_predicate=bits_for)
    overrides = {
        name.rsplit(".", 1)[0]: {"group_size": 64, "bits": 4}
        for name in weights(model)
        if name.startswith("model.layers.0.") and name.endswith(".scales")
    }
    config = {**LLAMA, "quantization": {"group_size": 64, "bits": 8, **overrides}}
    spec = read_model_spec(write_model(tmp_path, model, config))
    assert spec.layer_bytes[0] < spec.layer_bytes[1] == spec.layer_bytes[2]
    assert spec.layer_params[0] == spec.layer_params[1] == spec.layer_params[2]


def test_multi_file_index_is_followed(
    tmp_path: Path, llama_dir: tuple[Path, dict[str, mx.array]]
) -> None:
    path, params = llama_dir
    names = sorted(params)
    halves = {
        "part-1.safetensors": names[: len(names) // 2],
        "part-2.safetensors": names[len(names) // 2 :],
    }
    for file_name, keys in halves.items():
        mx.save_safetensors(str(tmp_path / file_name), {key: params[key] for key in keys})
    index = {"weight_map": {key: file for file, keys in halves.items() for key in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    split = read_model_spec(tmp_path)
    whole = read_model_spec(path)
    assert split.layer_bytes == whole.layer_bytes
    assert (split.embedding_bytes, split.head_bytes) == (whole.embedding_bytes, whole.head_bytes)


def test_another_architecture_qwen2(tmp_path: Path) -> None:
    config = {**LLAMA, "model_type": "qwen2", "tie_word_embeddings": True}
    model = build_model(config)
    spec = read_model_spec(write_model(tmp_path, model, config))
    params = weights(model)
    assert spec.layer_bytes[1] == part_bytes(params, "model.layers.1.")
    assert spec.tie_word_embeddings


def test_header_is_read_without_the_tensor_data(tmp_path: Path) -> None:
    file = tmp_path / "one.safetensors"
    mx.save_safetensors(str(file), {"x": mx.zeros((3, 5), dtype=mx.float16)})
    tensors = read_safetensors_header(file)
    assert tensors["x"].shape == (3, 5) and tensors["x"].nbytes == 30
    assert tensors["x"].dtype == "F16"


def test_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    file = tmp_path / "bad.safetensors"
    file.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(ModelInfoError, match="not plausible"):
        read_safetensors_header(file)


def test_missing_config_and_missing_layers_are_clear_errors(
    tmp_path: Path, llama_dir: tuple[Path, dict[str, mx.array]]
) -> None:
    with pytest.raises(ModelInfoError, match=r"no config\.json"):
        read_model_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 4}))
    (tmp_path / "model.safetensors").write_bytes((llama_dir[0] / "model.safetensors").read_bytes())
    with pytest.raises(ModelInfoError, match="declares 4 layers"):
        read_model_spec(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "gone.safetensors"}})
    )
    with pytest.raises(ModelInfoError, match="missing"):
        read_model_spec(tmp_path)
