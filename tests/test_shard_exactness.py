"""Pipeline stages compute exactly what one mlx-lm process computes.

Random-weight llama, qwen2 and qwen3 models (float32) run as 1, 2 and 3 stages loaded
separately from the same directory; their logits are compared with mlx-lm's own model for a
prefill and 24 decode steps. Greedy decoding of random weights degenerates into repeats, so the
tests compare logits, not just tokens.
"""

import json
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, save_config, save_model

from meshd.inference.sampling import SamplingParams, TokenSampler
from meshd.inference.stage.local_pipeline import LocalPipeline
from meshd.inference.stage.model import (
    RequestCaches,
    StageLoadError,
    TooManyRequests,
    UnsupportedModel,
    even_layer_ranges,
    prefill_chunks,
)
from meshd.inference.stage.shard import load_stage
from tests.support.random_model import make_random_model_dir

pytestmark = pytest.mark.integration

LAYERS = 6
PROMPT = [(index * 37 + 11) % 300 for index in range(20)]
DECODE_STEPS = 24
STAGE_SPLITS = {
    1: [(0, 6)],
    2: [(0, 3), (3, 6)],
    3: [(0, 1), (1, 4), (4, 6)],  # uneven on purpose: a one-layer first stage
}
# OpenBLAS float32 GEMM rounds a row differently depending on how many rows are multiplied
# together (measured: rows of a (20 x K) @ W and a (7 x K) @ W differ by ~1e-6 relative), so a
# prompt prefilled in chunks of 7 is not bit-identical to one prefilled at once; mlx-lm's own
# chunked prefill has the same property. Relative to the largest logit, the difference stays
# well below this bound.
CHUNKED_RELATIVE_BOUND = 1e-5


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model; qwen2 with an untied LM head (and qwen2's q/k/v biases)."""
    arch = request.param
    return make_random_model_dir(
        tmp_path_factory.mktemp(arch),
        arch,
        layers=LAYERS,
        hidden=96,
        heads=6,
        kv_heads=2,
        vocab=320,
        seed=3,
        tie_embeddings=arch != "qwen2",
        max_shard_bytes=150_000,  # several files, so per-file loading is exercised
    )


def reference_run(model_dir: Path) -> tuple[mx.array, list[mx.array], list[int]]:
    """mlx-lm's model with a full cache: prefill logits (all positions), then greedy decode."""
    model, _ = load_model(model_dir)
    cache = make_prompt_cache(model)
    prefill_logits = model(mx.array([PROMPT]), cache=cache)
    mx.eval(prefill_logits)
    token = int(mx.argmax(prefill_logits[0, -1]).item())
    tokens, step_logits = [token], []
    for _ in range(DECODE_STEPS):
        logits = model(mx.array([[token]]), cache=cache)
        mx.eval(logits)
        step_logits.append(logits)
        token = int(mx.argmax(logits[0, -1]).item())
        tokens.append(token)
    return prefill_logits, step_logits, tokens


def max_abs_diff(a: mx.array, b: mx.array) -> float:
    assert a.shape == b.shape
    return mx.abs(a - b).max().item()


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_pipeline_logits_equal_single_process(model_dir: Path, num_stages: int) -> None:
    ref_prefill, ref_steps, ref_tokens = reference_run(model_dir)
    pipeline = LocalPipeline.load(model_dir, STAGE_SPLITS[num_stages])
    caches = pipeline.make_caches()

    prefill = pipeline.logits(mx.array([PROMPT]), caches, last_only=False)
    assert max_abs_diff(prefill, ref_prefill) == 0.0

    token = int(mx.argmax(prefill[0, -1]).item())
    tokens = [token]
    for step, ref_logits in enumerate(ref_steps):
        logits = pipeline.logits(mx.array([[token]]), caches)
        assert max_abs_diff(logits, ref_logits) == 0.0, f"decode step {step}"
        token = int(mx.argmax(logits[0, -1]).item())
        tokens.append(token)
    assert tokens == ref_tokens
    assert len(set(ref_steps[0][0, -1].tolist())) > 100, "logits should be varied, not constant"


def test_chunked_prefill_matches_single_process_chunks_exactly(model_dir: Path) -> None:
    """Chunks with a cache offset, also in middle stages, get exactly mlx-lm's masks."""
    model, _ = load_model(model_dir)
    cache = make_prompt_cache(model)
    for chunk in prefill_chunks(mx.array(PROMPT), 7):
        ref_logits = model(chunk, cache=cache)
    mx.eval(ref_logits)

    pipeline = LocalPipeline.load(model_dir, STAGE_SPLITS[3])
    caches = pipeline.make_caches()
    for chunk in prefill_chunks(mx.array(PROMPT), 7):
        logits = pipeline.logits(chunk, caches, last_only=False)
    assert max_abs_diff(logits, ref_logits) == 0.0
    assert [layer_cache.offset for stage in caches for layer_cache in stage] == [len(PROMPT)] * 6


def test_chunked_prefill_close_to_full_prefill(model_dir: Path) -> None:
    ref_prefill, ref_steps, _ = reference_run(model_dir)
    pipeline = LocalPipeline.load(model_dir, STAGE_SPLITS[2])
    caches = pipeline.make_caches()
    last = pipeline.prefill(mx.array(PROMPT), caches, chunk_size=7)
    scale = mx.abs(ref_prefill).max().item()
    assert max_abs_diff(last, ref_prefill[:, -1, :]) <= CHUNKED_RELATIVE_BOUND * scale
    token = int(mx.argmax(ref_prefill[0, -1]).item())
    logits = pipeline.logits(mx.array([[token]]), caches)
    assert max_abs_diff(logits, ref_steps[0]) <= CHUNKED_RELATIVE_BOUND * scale


def test_same_seed_same_sampled_tokens_as_single_process(model_dir: Path) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)
    model, _ = load_model(model_dir)
    cache = make_prompt_cache(model)
    sampler = TokenSampler(params)
    context = list(PROMPT)
    logits = model(mx.array([context]), cache=cache)[:, -1, :]
    reference = []
    for _ in range(params.max_tokens):
        token = sampler.sample(logits, context)
        reference.append(token)
        context.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]

    pipeline = LocalPipeline.load(model_dir, STAGE_SPLITS[3])
    tokens = list(pipeline.generate(PROMPT, params, chunk_size=len(PROMPT)))
    assert tokens == reference
    assert len(set(tokens)) > 1, "temperature 1 on random logits should not repeat one token"


def _header_bytes(model_dir: Path) -> dict[str, int]:
    """Tensor name -> bytes, read independently from the safetensors headers."""
    sizes = {}
    for path in model_dir.glob("*.safetensors"):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                sizes[name] = info["data_offsets"][1] - info["data_offsets"][0]
    return sizes


def test_stage_holds_only_its_share(tmp_path: Path) -> None:
    model_dir = make_random_model_dir(
        tmp_path / "m", "llama", layers=8, hidden=256, heads=4, kv_heads=2, vocab=4096,
        seed=5, max_shard_bytes=1 << 20,
    )  # fmt: skip
    sizes = _header_bytes(model_dir)
    assert len(list(model_dir.glob("*.safetensors"))) > 4
    layer_bytes = sum(size for name, size in sizes.items() if ".layers.2." in name)

    mx.eval(mx.zeros(1))
    mx.clear_cache()
    before = mx.get_active_memory()
    middle = load_stage(model_dir, 2, 5, has_embedding=False, has_head=False)
    held = mx.get_active_memory() - before
    assert middle.nbytes == 3 * layer_bytes
    # Nothing else was materialized: not the other layers, not their random initial weights.
    assert held <= middle.nbytes + 64 * 1024

    embedding_bytes = sizes["model.embed_tokens.weight"]
    first = load_stage(model_dir, 0, 2, has_embedding=True, has_head=False)
    assert first.nbytes == 2 * layer_bytes + embedding_bytes
    last = load_stage(model_dir, 5, 8, has_embedding=False, has_head=True)
    assert last.nbytes == 3 * layer_bytes + embedding_bytes + sizes["model.norm.weight"]
    assert middle.hidden_size == 256 and middle.dtype == mx.float32
    assert middle.layer_range == (2, 5) and len(middle.make_cache()) == 3


def test_quantized_model_stages_equal_single_process(tmp_path: Path) -> None:
    """A config with ``quantization`` is quantized before loading, exactly as mlx-lm does."""
    source = make_random_model_dir(
        tmp_path / "f32",
        "llama",
        layers=4,
        hidden=128,
        heads=4,
        kv_heads=2,
        vocab=320,
        seed=9,
        intermediate=384,
    )
    model, config = load_model(source)
    nn.quantize(model, group_size=64, bits=4)
    quantized = tmp_path / "q4"
    save_model(quantized, model)
    config["quantization"] = {"group_size": 64, "bits": 4}
    save_config(config, quantized / "config.json")

    reference, _ = load_model(quantized)
    assert any("scales" in name for name, _ in tree_flatten(reference.parameters()))
    ref_logits = reference(mx.array([PROMPT]), cache=make_prompt_cache(reference))
    pipeline = LocalPipeline.load(quantized, even_layer_ranges(4, 2))
    logits = pipeline.logits(mx.array([PROMPT]), pipeline.make_caches(), last_only=False)
    assert max_abs_diff(logits, ref_logits) == 0.0


def test_stage_errors_are_clear(tmp_path: Path) -> None:
    model_dir = make_random_model_dir(
        tmp_path / "m", "qwen3", layers=4, hidden=64, heads=4, kv_heads=2, vocab=300
    )
    with pytest.raises(StageLoadError, match=r"\[3, 6\)"):
        load_stage(model_dir, 3, 6, has_embedding=False, has_head=True)
    middle = load_stage(model_dir, 1, 3, has_embedding=False, has_head=False)
    with pytest.raises(RuntimeError, match="only the first stage"):
        middle.embed(mx.array([1, 2]))
    with pytest.raises(RuntimeError, match="only the last stage"):
        middle.head(mx.zeros((1, 1, 64)))
    with pytest.raises(ValueError, match="make_cache"):
        middle.forward(mx.zeros((1, 1, 64)), [])
    with pytest.raises(ValueError, match="contiguous"):
        LocalPipeline.load(model_dir, [(0, 1), (2, 4)])

    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    with pytest.raises(UnsupportedModel, match="gemma"):
        load_stage(model_dir, 0, 4, has_embedding=True, has_head=True)


def test_request_caches_are_per_request_and_freed(tmp_path: Path) -> None:
    model_dir = make_random_model_dir(
        tmp_path / "m", "llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=300
    )
    stage = load_stage(model_dir, 0, 2, has_embedding=True, has_head=True)
    caches = RequestCaches(stage, max_requests=2)
    first = caches.get("a")
    stage.forward(stage.embed(mx.array(PROMPT)), first)
    assert caches.get("a") is first and first[0].offset == len(PROMPT)
    assert caches.get("b")[0].offset == 0
    with pytest.raises(TooManyRequests):
        caches.get("c")
    caches.release("a")
    assert "a" not in caches and len(caches) == 1
    assert caches.get("c")[0].offset == 0


def test_prefill_chunks_cover_the_prompt_in_order() -> None:
    chunks = prefill_chunks(mx.arange(20), 7)
    assert [chunk.shape for chunk in chunks] == [(1, 7), (1, 7), (1, 6)]
    assert mx.concatenate(chunks, axis=1).tolist() == [list(range(20))]
    with pytest.raises(ValueError):
        prefill_chunks(mx.arange(3), 0)
    assert even_layer_ranges(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
