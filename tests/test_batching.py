"""Continuous batching: requests decode together, each gets what it would get alone.

What batching changes (docs/architecture.md, "Exactness"): a batched forward pass multiplies
several rows at once, so OpenBLAS may sum in another order than for one row, and a request's
caches are left-padded to the batch's length (padded positions are masked out). A request alone
stays bit-identical to one mlx-lm process (tests/test_dataplane.py); in a batch, its logits
stay within ``LOGIT_BOUND`` of mlx-lm's alone, and its greedy text is the same.

Every architecture stages run keeps KV (``KVCache``), sliding-window (``RotatingKVCache``) or
recurrent (``ArraysCache``) layer caches, and mlx-lm has a batch variant of each, so every
architecture of tests/support/random_model.py decodes batched; an architecture whose recipe
says ``batched=False`` (none today) decodes each request alone, checked here too.
"""

# ruff: noqa: E402
from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()  # before mlx.core: float32 matmuls on OpenBLAS

import asyncio
import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from meshd.inference.generation_events import FinalEvent
from meshd.inference.sampling import SamplingParams
from meshd.inference.stage import shard
from meshd.inference.stage.model import RequestCaches, StageRecipe
from meshd.inference.stage.shard import load_stage
from meshd.models.store import ModelEntry
from tests.support.dataplane_mesh import LoopThread, Mesh, collect, mlx_lm_reference
from tests.support.random_model import TINY_CONFIGS, make_architecture_dir, make_random_model_dir

pytestmark = pytest.mark.integration

# Largest difference between a batched row's logits and the same request's logits alone, in
# float32 (logits of magnitude ~10-30): batching changes only the summation order.
LOGIT_BOUND = 1e-3


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    loop = LoopThread()
    built = Mesh(loop, tmp_path_factory.mktemp("mesh"))
    try:
        for node_id in ("n1", "n2"):
            built.add_node(node_id)
        yield built
    finally:
        built.close()
        loop.close()


@contextlib.contextmanager
def installed(
    mesh: Mesh, model_dir: Path, layout: list[tuple[str, tuple[int, int]]]
) -> Iterator[str]:
    assignment = mesh.assignment_for(model_dir, layout)
    mesh.install(assignment)
    try:
        yield assignment.plan_id
    finally:
        mesh.uninstall(assignment.plan_id)


def eos_ids(model_dir: Path) -> frozenset[int]:
    eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id", [])
    return frozenset(eos if isinstance(eos, list) else [eos])


def batched_rows(mesh: Mesh, plan_id: str, field: str = "batched_rows") -> dict[str, int]:
    """Per node, the plan's stage's decode rows that ran batched (or, with ``field`` =
    "batched_steps", the batched forward passes they ran in)."""

    async def read() -> dict[str, int]:
        return {
            node_id: sum(
                getattr(p, field) for p in node.plane.stats().plans if p.plan_id == plan_id
            )
            for node_id, node in mesh.nodes.items()
        }

    return mesh.loop.run(read())


def run_concurrently(
    mesh: Mesh, plan_id: str, prompts: list[list[int]], params: list[SamplingParams], **options: Any
) -> list[tuple[list[Any], Any]]:
    plane = mesh.nodes["n1"].plane

    async def run_all() -> list[tuple[list[Any], Any]]:
        streams = [
            plane.generate(plan_id, prompt, param, request_id=f"batch-{k}", **options)
            for k, (prompt, param) in enumerate(zip(prompts, params, strict=True))
        ]
        return await asyncio.gather(*(collect(stream) for stream in streams))

    results = mesh.loop.run(run_all())
    mesh.wait_all_freed(plan_id)
    return results


@pytest.fixture(scope="module")
def smollm2(default_model_entry: ModelEntry) -> ModelEntry:
    """The embedded default model's store entry (imported once per session)."""
    return default_model_entry


@pytest.fixture(scope="module")
def alone(
    smollm2: ModelEntry,
) -> Callable[[list[int], SamplingParams], tuple[list[int], list[Any]]]:
    """What one mlx-lm process generates for a prompt alone, and its logits: worked out once
    per prompt for the module (both batch layouts are compared with the same runs)."""
    path = smollm2.path
    model, _ = load_model(path)

    @functools.cache
    def reference(prompt: tuple[int, ...], params: SamplingParams) -> Any:
        return mlx_lm_reference(path, prompt, params, eos_ids=eos_ids(path), model=model)

    return lambda prompt, params: reference(tuple(prompt), params)


@pytest.mark.parametrize("min_rows", [8, 4], ids=["one-batch", "two-micro-batches"])
def test_eight_smollm2_requests_decode_together_as_each_would_alone(
    mesh: Mesh, smollm2: ModelEntry, alone, monkeypatch, min_rows: int
) -> None:
    """8 concurrent greedy requests of different lengths on 2 stages: each one's text is the
    text one mlx-lm process generates for it alone, its logits within LOGIT_BOUND; and they
    did decode together (the stages ran batched steps). As one batch (8 rows are too few to
    cut), and cut by the first stage into two micro-batch cohorts when the fewest rows a
    micro-batch may have is 4 (how cohorts form and stay: tests/test_cohorts.py)."""
    import partitioner.cost

    monkeypatch.setattr(partitioner.cost, "MIN_MICRO_BATCH_ROWS", min_rows)

    questions = [
        "What is the capital of France?",
        "Name a primary colour.",
        "How many legs has a spider?",
        "What is 2 + 2?",
        "Which planet is the largest?",
        "What do bees make?",
        "Translate 'hello' into Spanish.",
        "What is the boiling point of water in Celsius?",
    ]
    layout = [("n1", (0, 15)), ("n2", (15, smollm2.num_layers))]
    with installed(mesh, smollm2.path, layout) as plan_id:
        plane = mesh.nodes["n1"].plane
        prompts = [
            plane.encode_chat(plan_id, [{"role": "user", "content": question}])
            for question in questions
        ]
        params = [SamplingParams(max_tokens=8)] * len(prompts)
        results = run_concurrently(mesh, plan_id, prompts, params, return_logits=True)
        rows = batched_rows(mesh, plan_id)
        passes = batched_rows(mesh, plan_id, "batched_steps")
    assert rows["n1"] > 0 and rows["n2"] > 0, f"no step ran batched: {rows}"
    rounds = max(len(events) for events, _ in results) - 1  # decode steps of the longest
    if min_rows == 4:  # two micro-batches while all 8 are open: more passes than rounds
        assert passes["n1"] > rounds, (rows, passes, rounds)
    else:  # one batch: a pass a round (and the prompts' last tokens, batched as they come)
        assert passes["n1"] <= rounds + len(prompts), (rows, passes, rounds)
    worst = 0.0
    for prompt, (events, outcome) in zip(prompts, results, strict=True):
        assert isinstance(outcome, FinalEvent), outcome
        tokens, logits = alone(prompt, params[0])
        assert [event.token_id for event in events] == tokens
        for event, reference in zip(events, logits, strict=True):
            worst = max(worst, float(np.abs(event.logits - reference).max()))
    assert worst <= LOGIT_BOUND, f"batched logits differ from alone by {worst}"


def test_a_stage_that_cannot_batch_decodes_each_request_alone(
    mesh: Mesh, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An architecture whose recipe says ``batched=False``: concurrent requests still all
    finish, each bit-identical to mlx-lm alone, and no step ran batched."""
    monkeypatch.setitem(shard.STAGE_RECIPES, "llama", StageRecipe(batched=False))
    model_dir = make_random_model_dir(
        tmp_path_factory.mktemp("models") / "llama",
        "llama",
        layers=4,
        hidden=64,
        heads=4,
        kv_heads=2,
        vocab=320,
        seed=3,
    )
    prompts = [[(index * (5 + k) + k) % 300 for index in range(9 + 2 * k)] for k in range(4)]
    params = [SamplingParams(max_tokens=12)] * 4
    with installed(mesh, model_dir, [("n1", (0, 2)), ("n2", (2, 4))]) as plan_id:
        results = run_concurrently(mesh, plan_id, prompts, params, return_logits=True)
        rows = batched_rows(mesh, plan_id)
    assert rows == {"n1": 0, "n2": 0}
    for prompt, (events, outcome) in zip(prompts, results, strict=True):
        assert isinstance(outcome, FinalEvent), outcome
        tokens, logits = mlx_lm_reference(model_dir, prompt, params[0])
        assert [event.token_id for event in events] == tokens
        for event, reference in zip(events, logits, strict=True):
            assert np.array_equal(event.logits, reference)


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_every_architecture_decodes_batched_as_alone(tmp_path: Path, arch: str) -> None:
    """Three requests prefilled alone, then decoded together on merged caches, with one of
    them stepping alone in the middle (its row is taken out of the group and merged back):
    every row's logits within LOGIT_BOUND of the same request decoding alone throughout,
    the same greedy tokens. Sliding-window layers wrap (prompts longer than the window)."""
    stage = load_stage(
        make_architecture_dir(tmp_path / arch, arch), 0, 6, has_embedding=True, has_head=True
    )
    assert stage.batchable
    prompts = [[(i * 37 + 11 + k) % 300 for i in range(n)] for k, n in [(0, 40), (5, 13), (9, 27)]]
    ids = [f"r{k}" for k in range(len(prompts))]
    alone, batched = RequestCaches(stage), RequestCaches(stage)
    next_alone, next_batched = [], []
    for request_id, prompt in zip(ids, prompts, strict=True):
        for caches, out in ((alone, next_alone), (batched, next_batched)):
            logits = stage.run(mx.array([prompt]), caches.get(request_id), logits="last")
            out.append(int(logits[0, -1].argmax()))
    worst = 0.0
    for step in range(12):
        reference = [
            stage.run(mx.array([[next_alone[k]]]), alone.get(rid), logits="last")
            for k, rid in enumerate(ids)
        ]
        together = ids if step != 6 else [ids[0], ids[2]]
        cache, order = batched.batch(together)
        inputs = mx.concatenate([mx.array([[next_batched[ids.index(rid)]]]) for rid in order])
        logits = stage.run(inputs, cache, logits="last")
        for row, rid in enumerate(order):
            k = ids.index(rid)
            worst = max(worst, float(mx.abs(logits[row] - reference[k][0]).max()))
            next_batched[k] = int(logits[row, -1].argmax())
        if step == 6:  # ids[1] steps alone: out of the group, merged back next step
            out = stage.run(mx.array([[next_batched[1]]]), batched.get(ids[1]), logits="last")
            worst = max(worst, float(mx.abs(out[0] - reference[1][0]).max()))
            next_batched[1] = int(out[0, -1].argmax())
        next_alone = [int(row[0, -1].argmax()) for row in reference]
        assert next_batched == next_alone, f"step {step}"
    assert worst <= LOGIT_BOUND, worst
    assert batched.groups == 1 and len(batched) == 3
    for rid in ids:
        batched.release(rid)
    assert len(batched) == 0 and batched.groups == 0


def test_the_first_stage_cuts_only_batches_with_enough_rows_per_micro_batch() -> None:
    """A micro-batch has at least MIN_MICRO_BATCH_ROWS rows (fewer would read every weight
    again for nothing), and there are never more micro-batches than stages."""
    from partitioner.cost import MIN_MICRO_BATCH_ROWS, micro_batches

    rows = MIN_MICRO_BATCH_ROWS
    assert [micro_batches(2, n) for n in (0, 1, rows - 1, rows, 2 * rows - 1)] == [1] * 5
    assert micro_batches(2, 2 * rows) == 2 and micro_batches(2, 64 * rows) == 2
    assert micro_batches(3, 2 * rows) == 2 and micro_batches(3, 3 * rows) == 3
    assert micro_batches(1, 64 * rows) == 1
