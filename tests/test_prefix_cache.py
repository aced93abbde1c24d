"""The prefix cache across a 3-stage pipeline: what a request reuses, and that it is exact.

Real gRPC nodes in one process (``tests/support/dataplane_mesh``), random float32 weights of
mlx-lm's own classes: a dense llama, a MoE (qwen3_moe) and one with recurrent layers whose
caches cannot be cut (qwen3_5_moe). Each request is compared with the same request run with
the cache off: the same greedy tokens, and logits within the tolerance the batching tests use
(a kept prefix was computed in other chunks than a cold prefill cuts, which rounds apart in
the last bits). The usage counts the positions reused.
"""

# ruff: noqa: E402
from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()  # before mlx.core: float32 matmuls on OpenBLAS

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from meshd.inference.assignment import Assignment
from meshd.inference.generation_events import FinalEvent, TokenEvent
from meshd.inference.sampling import SamplingParams
from tests.support.dataplane_mesh import LoopThread, Mesh, collect
from tests.support.random_model import make_random_model_dir

pytestmark = pytest.mark.integration

CHUNK = 8
GREEDY = SamplingParams(max_tokens=6)
COLD = replace(GREEDY, prefix_cache=False)
LOGITS_TOLERANCE = 1e-4  # tests/test_batching.py's, for float32 rows computed in other shapes
SYSTEM = [(index * 37 + 11) % 300 + 3 for index in range(40)]  # a long shared "system prompt"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(
        tmp_path_factory.mktemp("model") / "llama",
        "llama",
        layers=6,
        hidden=128,
        heads=4,
        kv_heads=2,
        vocab=320,
        seed=3,
    )


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """n1-n3 hold the stages, and their origins follow the committed plans (a request moves
    to the next one, as a daemon's does); n4 keeps no prefixes (the cache turned off)."""
    loop = LoopThread()
    built = Mesh(loop, tmp_path_factory.mktemp("mesh"))
    try:
        for node_id in ("n1", "n2", "n3"):
            built.add_node(node_id, follow=True, resume_timeout_s=20.0)
        built.add_node("n4", prefix_cache=False)
        yield built
    finally:
        built.close()
        loop.close()


def three_stages(mesh: Mesh, model_dir: Path, layers: int, last: str = "n3") -> Assignment:
    third = layers // 3
    layout = [("n1", (0, third)), ("n2", (third, 2 * third)), (last, (2 * third, layers))]
    return mesh.assignment_for(model_dir, layout)


def run(
    mesh: Mesh, plan: Assignment, prompt: list[int], params: SamplingParams = GREEDY
) -> tuple[list[TokenEvent], FinalEvent]:
    tokens, outcome = mesh.generate(
        "n1", plan.plan_id, prompt, params, return_logits=True, prefill_chunk=CHUNK
    )
    assert isinstance(outcome, FinalEvent), outcome
    return tokens, outcome


def assert_same(warm: list[TokenEvent], cold: list[TokenEvent]) -> None:
    """The same greedy tokens, and logits within the batching tests' tolerance."""
    assert [t.token_id for t in warm] == [t.token_id for t in cold]
    for index, (a, b) in enumerate(zip(warm, cold, strict=True)):
        assert a.logits is not None and b.logits is not None
        difference = float(np.max(np.abs(a.logits - b.logits)))
        assert difference <= LOGITS_TOLERANCE, f"token {index}: logits differ by {difference}"


def checked_turn(mesh: Mesh, plan: Assignment, prompt: list[int]) -> tuple[list[int], FinalEvent]:
    """A request with the cache, checked against the same request without it (which neither
    reads nor leaves a prefix); its tokens and final event."""
    warm, final = run(mesh, plan, prompt)
    cold, cold_final = run(mesh, plan, prompt, COLD)
    assert cold_final.usage.cached_tokens == 0
    assert_same(warm, cold)
    return [t.token_id for t in warm], final


def conversation(
    mesh: Mesh, plan: Assignment, opening: list[int], turns: list[list[int]]
) -> list[int]:
    """An agent's conversation: every turn sends all before it, its answer and new tokens.
    Each turn from the second reuses everything the turn before computed (its prompt and its
    answer but the last token, which no step ran); the cached counts, per turn."""
    prompt, counts, expected = list(opening), [], 0
    for turn, new in enumerate([[], *turns]):
        prompt += new
        answer, final = checked_turn(mesh, plan, prompt)
        counts.append(final.usage.cached_tokens)
        if turn:
            assert final.usage.cached_tokens == expected, (turn, counts)
        expected = len(prompt) + len(answer) - 1
        prompt += answer
    return counts


def test_a_conversation_prefills_only_each_turns_new_tokens(mesh: Mesh, llama_dir: Path):
    plan = three_stages(mesh, llama_dir, 6)
    mesh.install(plan)
    try:
        counts = conversation(mesh, plan, SYSTEM, [[5, 6, 7, 8], [9, 10, 11], [12] * 9])
        assert counts[0] == 0 and all(c > len(SYSTEM) for c in counts[1:]), counts
        stats = prefix_stats(mesh, plan)
        assert all(hits >= 3 for _, _, hits in stats.values()), stats
    finally:
        mesh.uninstall(plan.plan_id)


def test_conversations_sharing_a_system_prompt_keep_their_own_prefixes(mesh: Mesh, llama_dir: Path):
    """Two conversations interleaved: each turn reuses its own conversation so far, never
    only the shared system prompt (one conversation does not overwrite the other's)."""
    plan = three_stages(mesh, llama_dir, 6)
    mesh.install(plan)
    try:
        prompts = {"a": [*SYSTEM, 20, 21, 22], "b": [*SYSTEM, 30, 31]}
        ends: dict[str, int] = {}
        for turn in range(3):
            for name in ("a", "b"):
                answer, final = checked_turn(mesh, plan, prompts[name])
                if turn:
                    assert final.usage.cached_tokens == ends[name], (name, turn)
                ends[name] = len(prompts[name]) + len(answer) - 1
                prompts[name] += [*answer, 40 + turn]
    finally:
        mesh.uninstall(plan.plan_id)


def test_a_turn_that_rewrites_earlier_content_reuses_up_to_the_change(mesh: Mesh, llama_dir: Path):
    """A chat template that rewrites an earlier turn (e.g. drops a reasoning block): the
    prefix is cut where the new prompt departs from the kept one, not thrown away."""
    plan = three_stages(mesh, llama_dir, 6)
    mesh.install(plan)
    try:
        first = SYSTEM + list(range(50, 70))
        checked_turn(mesh, plan, first)
        rewritten = [*SYSTEM, 50, 51, 52, 99, *list(range(54, 75))]
        _, final = checked_turn(mesh, plan, rewritten)
        assert final.usage.cached_tokens == len(SYSTEM) + 3
    finally:
        mesh.uninstall(plan.plan_id)


def test_a_concurrent_batch_on_one_prefix_is_exact(mesh: Mesh, llama_dir: Path):
    """Requests that share the kept prefix run at once (their decode steps batched): each
    gives what it gives alone without the cache."""
    plan = three_stages(mesh, llama_dir, 6)
    mesh.install(plan)
    try:
        checked_turn(mesh, plan, [*SYSTEM, 1, 2])
        prompts = [[*SYSTEM, 1, 2, 3 + i] for i in range(4)]

        async def together() -> list[tuple[list[TokenEvent], object]]:
            plane = mesh.nodes["n1"].plane
            streams = [
                collect(
                    plane.generate(
                        plan.plan_id,
                        prompt,
                        GREEDY,
                        request_id=f"batch-{i}",
                        return_logits=True,
                        prefill_chunk=CHUNK,
                    )
                )
                for i, prompt in enumerate(prompts)
            ]
            return list(await asyncio.gather(*streams))

        results = mesh.loop.run(together())
        for prompt, (warm, final) in zip(prompts, results, strict=True):
            assert isinstance(final, FinalEvent), final
            assert final.usage.cached_tokens >= len(SYSTEM) + 2
            cold, _ = run(mesh, plan, prompt, COLD)
            assert_same(warm, cold)
    finally:
        mesh.uninstall(plan.plan_id)


def test_a_stage_without_the_prefix_makes_the_origin_run_it_again_without(
    mesh: Mesh, llama_dir: Path
):
    """n4 keeps no prefixes: the first stage starts from its own kept prefix, the last one
    cannot follow, and the origin runs the request again without the cache, exactly."""
    plan = three_stages(mesh, llama_dir, 6, last="n4")
    mesh.install(plan)
    try:
        checked_turn(mesh, plan, SYSTEM)
        answer, final = checked_turn(mesh, plan, [*SYSTEM, 7, 8, 9])
        assert final.usage.cached_tokens == 0 and len(answer) == GREEDY.max_tokens
    finally:
        mesh.uninstall(plan.plan_id)


def test_a_stage_that_keeps_its_layers_across_a_plan_change_keeps_its_prefixes(
    mesh: Mesh, llama_dir: Path
):
    """The next plan of the same layout reuses what the plan before kept; a layout that
    moves the layers starts cold."""
    before = three_stages(mesh, llama_dir, 6)
    mesh.install(before)
    checked_turn(mesh, before, [*SYSTEM, 3])
    same = three_stages(mesh, llama_dir, 6)
    mesh.install(same)  # committed while ``before`` drains, as a re-plan does
    mesh.uninstall(before.plan_id)
    moved = mesh.assignment_for(llama_dir, [("n1", (0, 3)), ("n2", (3, 4)), ("n3", (4, 6))])
    try:
        _, final = checked_turn(mesh, same, [*SYSTEM, 3, 4])
        assert final.usage.cached_tokens > len(SYSTEM)
        mesh.install(moved)
        _, final = checked_turn(mesh, moved, [*SYSTEM, 3, 4, 5])
        assert final.usage.cached_tokens == 0
    finally:
        mesh.uninstall(same.plan_id)
        mesh.uninstall(moved.plan_id)


def test_distinct_long_prompts_never_take_a_stage_over_its_kv_budget(mesh: Mesh, llama_dir: Path):
    """A plan that reserves 2 x 96 KV tokens: kept prefixes and running requests together
    never hold more; the least recently used prefixes are evicted, and the engines free them."""
    plan = replace(three_stages(mesh, llama_dir, 6), context_length=96, concurrency=2)
    mesh.install(plan)
    try:
        for i in range(8):
            prompt = [(i * 31 + j * 7) % 300 + 3 for j in range(70)]
            run(mesh, plan, prompt)
            for node, (slots, tokens, _) in prefix_stats(mesh, plan).items():
                assert tokens <= 2 * 96, (node, i, slots, tokens)
        assert all(slots <= 2 for slots, _, _ in prefix_stats(mesh, plan).values())
        held = engine_slots(mesh, plan)
        assert held == {node: ids for node, ids in kept_ids(mesh, plan).items()}, held
    finally:
        mesh.uninstall(plan.plan_id)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_moe_and_recurrent_models_reuse_exactly(
    mesh: Mesh, architecture_dir: Callable[[str], Path], arch: str
):
    """A MoE reuses any common prefix; a model with recurrent layers (qwen3_5: gated delta
    net, whose state cannot be cut) reuses a kept prefix only whole: a conversation's turns
    extend the one before, so both reuse every turn."""
    model_dir = architecture_dir(arch)  # 6 layers each
    plan = three_stages(mesh, model_dir, 6)
    mesh.install(plan)
    try:
        counts = conversation(mesh, plan, SYSTEM[:20], [[5, 6, 7], [8, 9]])
        assert all(c > 20 for c in counts[1:]), counts
    finally:
        mesh.uninstall(plan.plan_id)


# --- what the stages hold -----------------------------------------------------------------------


def prefix_stats(mesh: Mesh, plan: Assignment) -> dict[str, tuple[int, int, int]]:
    """Per node of the plan: (slots, tokens they hold, hits)."""

    async def read() -> dict[str, tuple[int, int, int]]:
        out = {}
        for spec in plan.stages:
            view = mesh.nodes[spec.node_id].plane.stage.core.prefix_view(plan.plan_id)
            assert view is not None, spec.node_id
            out[spec.node_id] = (view.slots, view.tokens, view.hits)
        return out

    return mesh.loop.run(read())


def kept_ids(mesh: Mesh, plan: Assignment) -> dict[str, set[int]]:
    async def read() -> dict[str, set[int]]:
        return {
            spec.node_id: set(mesh.nodes[spec.node_id].plane.stage.core.prefix_slots(plan.plan_id))
            for spec in plan.stages
        }

    return mesh.loop.run(read())


def engine_slots(mesh: Mesh, plan: Assignment) -> dict[str, set[int]]:
    """The slots each engine holds arrays for (read on the compute thread, after the queued
    frees)."""

    async def read() -> dict[str, set[int]]:
        out = {}
        for spec in plan.stages:
            plane = mesh.nodes[spec.node_id].plane
            engine = plane._plans[plan.plan_id].engine
            assert engine is not None and engine.stage is not None
            stage = engine.stage
            out[spec.node_id] = await plane._compute.run(lambda s=stage: set(s.slots))
        return out

    return mesh.loop.run(read())


def test_a_request_through_another_node_hits_what_the_stages_kept(mesh: Mesh, llama_dir: Path):
    """The kept prefixes live on the stages, keyed by the tokens: a conversation's next turn
    that a client sends to another node of the mesh reuses them all the same."""
    plan = three_stages(mesh, llama_dir, 6)
    mesh.install(plan)
    try:
        prompt = [*SYSTEM, 4, 5]
        answer, _ = checked_turn(mesh, plan, prompt)
        follow_up = [*prompt, *answer, 6]
        tokens, final = mesh.generate(
            "n3", plan.plan_id, follow_up, GREEDY, return_logits=True, prefill_chunk=CHUNK
        )
        assert isinstance(final, FinalEvent), final
        assert final.usage.cached_tokens == len(prompt) + len(answer) - 1
        cold, _ = run(mesh, plan, follow_up, COLD)
        assert_same(tokens, cold)
    finally:
        mesh.uninstall(plan.plan_id)


def test_a_request_that_loses_its_plan_mid_stream_resumes_exactly_with_the_cache(
    mesh: Mesh, llama_dir: Path
):
    """A request that started from a kept prefix loses its plan after a few tokens (a stage
    lost, a re-plan): the origin replays it on the next plan, whose stages kept nothing of it,
    and the tokens are those the request gives with the cache off."""
    before = three_stages(mesh, llama_dir, 6)
    after = mesh.assignment_for(llama_dir, [("n3", (0, 3)), ("n2", (3, 6))])
    mesh.install(before)
    prompt = [*SYSTEM, 8, 9]
    try:
        answer, _ = checked_turn(mesh, before, prompt)
        follow_up = [*prompt, *answer, 10]
        long = replace(GREEDY, max_tokens=12)

        async def move_after_three() -> tuple[list[TokenEvent], object]:
            plane = mesh.nodes["n1"].plane
            stream = plane.generate(
                before.plan_id,
                follow_up,
                long,
                request_id="moved-with-cache",
                return_logits=True,
                prefill_chunk=CHUNK,
            )
            tokens: list[TokenEvent] = []
            async for event in stream:
                if isinstance(event, FinalEvent):
                    return tokens, event
                tokens.append(event)
                if len(tokens) == 3:
                    await mesh.install_async(after)
                    await mesh.uninstall_async(before.plan_id, "a stage was lost")
            raise AssertionError("no final event")

        tokens, final = mesh.loop.run(move_after_three())
        assert isinstance(final, FinalEvent), final
        assert final.usage.resumes == 1 and final.usage.cached_tokens > len(prompt)
        cold, _ = run(mesh, after, follow_up, replace(long, prefix_cache=False))
        assert_same(tokens, cold)
    finally:
        mesh.uninstall(before.plan_id)
        mesh.uninstall(after.plan_id)
