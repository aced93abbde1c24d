"""Stages of the architectures people split compute exactly what one mlx-lm process computes.

For each architecture of ``tests.support.random_model.TINY_CONFIGS`` (mixture-of-experts:
mixtral, qwen3_moe, deepseek_v3, gpt_oss, glm4_moe; hybrid linear attention: qwen3_next,
qwen3_5, qwen3_5_moe; sliding windows: gpt_oss and a llama with sliding layers; mistral), a
random float32 model is split into 2 and 3 stages with :class:`LocalPipeline` (the networked
data plane runs exactly these stages) and compared with mlx-lm's own model (``load_model`` +
``make_prompt_cache`` + the model's ``__call__``): the prompt's logits, then 24 greedy decode
steps. The prompt (40 tokens) is longer than the sliding window (8), so rotating caches wrap.

Bound: 0.0, exactly. Each stage runs the same operations on the same shapes as the reference
(the whole prompt at once, then one token at a time; the head over the same positions), and a
float32 kernel computes the same shapes the same way every time on a given CPU. What differs
between CPU types, and with the number of rows OpenBLAS multiplies at once, is how a shape is
rounded, which affects reference and stages alike; comparisons across different shapes (a
prompt cut into other chunks) are in tests/test_shard_exactness.py with a stated tolerance.
Random-weight models repeat tokens under greedy decoding, so the logits are compared too, and
checked to be varied.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.utils import load_model

from meshd.inference.stage.local_pipeline import LocalPipeline
from meshd.inference.stage.model import StageLoadError, UnsupportedModel, prefill_chunks
from meshd.inference.stage.shard import load_stage
from meshd.models.info import read_safetensors_header
from tests.support.random_model import (
    SLIDING_WINDOW,
    TINY_CONFIGS,
    TINY_LAYERS,
    make_architecture_dir,
    quantize_model_dir,
)

pytestmark = pytest.mark.integration

ARCHITECTURES = list(TINY_CONFIGS)
PROMPT = [(index * 37 + 11) % 300 for index in range(40)]
DECODE_STEPS = 24
SPLITS = {
    "2": [(0, 3), (3, 6)],
    "3": [(0, 2), (2, 4), (4, 6)],
    # A one-layer first stage; the second starts with a full-attention layer where the whole
    # model starts with a linear or sliding one, so positions of each kind's first cache shift.
    "3-uneven": [(0, 1), (1, 4), (4, 6)],
}
assert len(PROMPT) > SLIDING_WINDOW and SPLITS["2"][-1][1] == TINY_LAYERS


@dataclass(frozen=True)
class Reference:
    prefill: mx.array  # logits of every prompt position
    steps: list[mx.array]  # logits of each decode step
    tokens: list[int]  # greedy tokens: the one after the prompt, then one per step


def run_reference(model_dir: Path) -> Reference:
    """One mlx-lm process: its model, its caches, its ``__call__``."""
    model, _ = load_model(model_dir)
    cache = make_prompt_cache(model)
    prefill = model(mx.array([PROMPT]), cache=cache)
    mx.eval(prefill)
    tokens = [int(mx.argmax(prefill[0, -1]).item())]
    steps = []
    for _ in range(DECODE_STEPS):
        logits = model(mx.array([[tokens[-1]]]), cache=cache)
        mx.eval(logits)
        steps.append(logits)
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
    return Reference(prefill, steps, tokens)


@pytest.fixture(scope="module")
def reference(architecture_dir: Callable[[str], Path]) -> Callable[[str], Reference]:
    """The reference run of each architecture, computed once for the module."""
    done: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in done:
            done[name] = run_reference(architecture_dir(name))
        return done[name]

    return get


def max_abs_diff(a: mx.array, b: mx.array) -> float:
    assert a.shape == b.shape
    return mx.abs(a - b).max().item()


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_stages_equal_one_mlx_lm_process(
    name: str, split: str, architecture_dir: Callable[[str], Path], reference
) -> None:
    model_dir = architecture_dir(name)
    ref = reference(name)
    pipeline = LocalPipeline.load(model_dir, SPLITS[split])
    caches = pipeline.make_caches()

    prefill = pipeline.logits(mx.array([PROMPT]), caches, last_only=False)
    assert max_abs_diff(prefill, ref.prefill) == 0.0
    tokens = [int(mx.argmax(prefill[0, -1]).item())]
    for step, ref_logits in enumerate(ref.steps):
        logits = pipeline.logits(mx.array([[tokens[-1]]]), caches)
        assert max_abs_diff(logits, ref_logits) == 0.0, f"decode step {step}"
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
    assert tokens == ref.tokens
    assert len(set(ref.steps[0][0, -1].tolist())) > 100, "logits should be varied, not constant"


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_stage_of_a_three_way_split_holds_every_layer_kind(
    name: str, architecture_dir: Callable[[str], Path]
) -> None:
    """The models are shaped so that the exactness test above exercises each kind's mask in
    every stage, and the stages' caches are the ones mlx-lm's make_cache gives those layers."""
    model_dir = architecture_dir(name)
    model, _ = load_model(model_dir, lazy=True)
    full = make_prompt_cache(model)
    pipeline = LocalPipeline.load(model_dir, SPLITS["3"])
    kinds = {kind for stage in pipeline.stages for kind in stage.layer_kinds}
    expected = {"full"} | ({"window"} if "sliding_window" in TINY_CONFIGS[name] else set())
    if "linear_num_value_heads" in (TINY_CONFIGS[name].get("text_config") or TINY_CONFIGS[name]):
        expected.add("ssm")
    assert kinds == expected
    for stage in pipeline.stages:
        assert set(stage.layer_kinds) == expected
        start, end = stage.layer_range
        made = stage.make_cache()
        assert [type(c) for c in made] == [type(c) for c in full[start:end]]
        assert made[0] is not stage.make_cache()[0], "each request needs its own caches"


@pytest.mark.parametrize("name", ["llama-sliding", "qwen3_next", "qwen3_5_moe", "gpt_oss"])
def test_chunked_prefill_equals_mlx_lm_with_the_same_chunks(
    name: str, architecture_dir: Callable[[str], Path]
) -> None:
    """Chunks longer than the window, with caches already holding earlier chunks: rotating
    and recurrent caches get exactly mlx-lm's masks and states in every stage."""
    model_dir = architecture_dir(name)
    model, _ = load_model(model_dir)
    cache = make_prompt_cache(model)
    pipeline = LocalPipeline.load(model_dir, SPLITS["3-uneven"])
    caches = pipeline.make_caches()
    for chunk in prefill_chunks(mx.array(PROMPT), 12):
        ref_logits = model(chunk, cache=cache)
        logits = pipeline.logits(chunk, caches, last_only=False)
        assert max_abs_diff(logits, ref_logits) == 0.0
    token = mx.array([[int(mx.argmax(ref_logits[0, -1]).item())]])
    assert max_abs_diff(pipeline.logits(token, caches), model(token, cache=cache)) == 0.0


QUANTIZED = (nn.QuantizedLinear, QuantizedSwitchLinear, nn.QuantizedEmbedding)


def quantized_modules(pipeline: LocalPipeline) -> dict[str, tuple[str, int, str]]:
    """Module path -> (class name, bits, mode) for every quantized module of the stages."""
    found = {}
    for stage in pipeline.stages:
        for path, module in stage._model.named_modules():
            if isinstance(module, QUANTIZED):
                found[path] = (type(module).__name__, module.bits, module.mode)
    return found


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe", "gpt_oss"])
def test_four_bit_moe_with_eight_bit_gates_equals_mlx_lm(
    name: str, architecture_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Quantized by ``mlx_lm.convert`` as mlx-community checkpoints are: 4-bit, with the
    model's own per-module overrides (8-bit routers and gates)."""
    quantized = quantize_model_dir(architecture_dir(name), tmp_path / "q4", bits=4, group_size=64)
    config = json.loads((quantized / "config.json").read_text())
    overrides = {path: q for path, q in config["quantization"].items() if isinstance(q, dict)}
    assert overrides and all(q["bits"] == 8 for q in overrides.values()), overrides

    ref = run_reference(quantized)
    for split in ("2", "3"):
        pipeline = LocalPipeline.load(quantized, SPLITS[split])
        caches = pipeline.make_caches()
        prefill = pipeline.logits(mx.array([PROMPT]), caches, last_only=False)
        assert max_abs_diff(prefill, ref.prefill) == 0.0
        for token, ref_logits in zip(ref.tokens, ref.steps, strict=False):
            assert max_abs_diff(pipeline.logits(mx.array([[token]]), caches), ref_logits) == 0.0

    modules = quantized_modules(pipeline)
    assert {path: bits for path, (_, bits, _) in modules.items() if path in overrides} == {
        path: 8 for path in overrides
    }
    experts = [bits for kind, bits, _ in modules.values() if kind == "QuantizedSwitchLinear"]
    assert experts and set(experts) == {4}


def test_mxfp4_quantization_config_checkpoint_loads_as_mlx_lm_does(
    architecture_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """gpt-oss ships with ``quantization_config: {quant_method: mxfp4}`` and no
    ``quantization``; mlx-lm loads that, so stages do too."""
    quantized = quantize_model_dir(
        architecture_dir("gpt_oss"),
        tmp_path / "mxfp4",
        mode="mxfp4",
        bits=4,
        group_size=32,
        quant_predicate=lambda path, _: not path.endswith("router"),
    )
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization"]
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (quantized / "config.json").write_text(json.dumps(config))

    ref = run_reference(quantized)
    pipeline = LocalPipeline.load(quantized, SPLITS["3"])
    caches = pipeline.make_caches()
    assert (
        max_abs_diff(pipeline.logits(mx.array([PROMPT]), caches, last_only=False), ref.prefill)
        == 0.0
    )
    token = mx.array([[ref.tokens[0]]])
    assert max_abs_diff(pipeline.logits(token, caches), ref.steps[0]) == 0.0
    assert {(bits, mode) for _, bits, mode in quantized_modules(pipeline).values()} == {
        (4, "mxfp4")
    }


def _bytes_read() -> int:
    """Bytes this process has read through read(2) and friends (cache hits included)."""
    with open("/proc/self/io") as stats:
        return int(next(line for line in stats if line.startswith("rchar")).split()[1])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_a_stage_reads_only_its_own_tensors(tmp_path: Path) -> None:
    """A middle stage of a MoE model spread over many files reads its tensors' bytes plus
    the index, the config and the headers of the files that hold them: nothing of the rest."""
    model_dir = make_architecture_dir(
        tmp_path / "m", "qwen3_moe", overrides={"num_hidden_layers": 8}, max_shard_bytes=100_000
    )
    headers = {path: read_safetensors_header(path) for path in model_dir.glob("*.safetensors")}
    assert len(headers) > 10
    stage_layers = (".layers.3.", ".layers.4.")
    stage_bytes = sum(
        info.nbytes
        for tensors in headers.values()
        for name, info in tensors.items()
        if any(layer in name for layer in stage_layers)
    )
    total_bytes = sum(path.stat().st_size for path in headers)
    load_stage(model_dir, 0, 1, has_embedding=True, has_head=False)  # imports, compiled code

    before = _bytes_read()
    stage = load_stage(model_dir, 3, 5, has_embedding=False, has_head=False)
    read = _bytes_read() - before
    assert stage.nbytes == stage_bytes
    index_and_config = sum(
        (model_dir / name).stat().st_size
        for name in ("model.safetensors.index.json", "config.json")
    )
    # Headers of the (few) files holding layers 3 and 4: a few KB at most here.
    assert stage_bytes <= read <= stage_bytes + index_and_config + 16 * 1024, (read, stage_bytes)
    assert read < 0.3 * total_bytes


def _copy_with_config(source: Path, dest: Path, **changes) -> Path:
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_model_type_aliases_run_as_their_architecture(
    architecture_dir: Callable[[str], Path], reference, tmp_path: Path
) -> None:
    """Kimi K2 checkpoints say ``kimi_k2``; mlx-lm runs them with deepseek_v3."""
    kimi = _copy_with_config(
        architecture_dir("deepseek_v3"), tmp_path / "kimi", model_type="kimi_k2"
    )
    pipeline = LocalPipeline.load(kimi, SPLITS["2"])
    assert {stage.architecture for stage in pipeline.stages} == {"deepseek_v3"}
    prefill = pipeline.logits(mx.array([PROMPT]), pipeline.make_caches(), last_only=False)
    assert max_abs_diff(prefill, reference("deepseek_v3").prefill) == 0.0


def test_what_cannot_run_as_stages_says_why(
    architecture_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """The reason is the measured table's (meshd.models.architecture_table), with what to use."""
    source = architecture_dir("qwen3_moe")
    gpt2 = _copy_with_config(source, tmp_path / "gpt2", model_type="gpt2")
    with pytest.raises(
        UnsupportedModel,
        match=r"gpt2 cannot run as pipeline stages: .*"
        r"no embed_tokens.*Use a model of a verified architecture: .*qwen3_moe",
    ):
        load_stage(gpt2, 0, 2, has_embedding=True, has_head=False)
    unknown = _copy_with_config(source, tmp_path / "unknown", model_type="no_such_model")
    with pytest.raises(UnsupportedModel, match=r"no_such_model.*not among the architectures"):
        load_stage(unknown, 0, 2, has_embedding=True, has_head=False)


def test_incomplete_or_mismatched_checkpoints_are_refused(
    architecture_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """mlx-lm loads stages non-strictly; the stage itself insists on every tensor, in shape."""
    model_dir = _copy_with_config(architecture_dir("qwen3_moe"), tmp_path / "m")
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    gate = "model.layers.1.mlp.gate.weight"
    del index["weight_map"][gate]
    index_path.write_text(json.dumps(index))
    with pytest.raises(StageLoadError, match=r"lacks 1 tensors .*layers\.1\.mlp\.gate\.weight"):
        load_stage(model_dir, 0, 3, has_embedding=True, has_head=False)
    load_stage(model_dir, 3, 6, has_embedding=False, has_head=True)  # the other stage is whole

    wider = _copy_with_config(architecture_dir("qwen3_moe"), tmp_path / "w", num_experts=5)
    with pytest.raises(
        StageLoadError, match=r"\(4, 64\) in the checkpoint, \(5, 64\) in the model"
    ):
        load_stage(wider, 1, 3, has_embedding=False, has_head=False)


@pytest.mark.parametrize("name", ["qwen3_5_moe", "deepseek_v3"])
def test_a_fetched_part_loads_the_same_stage_as_the_whole_model(
    name: str, architecture_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """A node without the model fetches its part (meshd.models.share.export_part: the stage's
    tensors as they are in the checkpoint, nested names included); its stage is the same."""
    from meshd.models.share import PartSpec, export_part

    model_dir = architecture_dir(name)
    part_dir = tmp_path / "part"
    export_part(model_dir, PartSpec(name, "digest", 2, 4, False, False), part_dir)
    headers = [read_safetensors_header(path) for path in part_dir.glob("*.safetensors")]
    assert all(".layers.2." in n or ".layers.3." in n for h in headers for n in h)

    whole = load_stage(model_dir, 2, 4, has_embedding=False, has_head=False)
    part = load_stage(part_dir, 2, 4, has_embedding=False, has_head=False)
    assert part.nbytes == whole.nbytes and part.layer_kinds == whole.layer_kinds
    hidden = mx.random.normal((1, len(PROMPT), whole.hidden_size), key=mx.random.key(1))
    caches = (whole.make_cache(), part.make_cache())
    assert max_abs_diff(whole.run(hidden, caches[0]), part.run(hidden, caches[1])) == 0.0
