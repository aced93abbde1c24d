"""A request moved to another plan mid-stream goes on exactly where it was.

The origin holds the prompt and every token so far; when its plan is withdrawn or loses a
stage, it starts the request on the next plan with those tokens: the new stages prefill the
prompt as the first run cut it and replay each generated token alone, and the sampler goes
on at the same position of the same seed. So the tokens, and the logits each was sampled
from, are bit-identical to one uninterrupted mlx-lm run, on any CPU, whatever the layouts
before and after (stage boundaries do not change any layer's arithmetic; replaying the
tokens in one chunk would). Real gRPC nodes in one process (``tests/support/dataplane_mesh``)
with random float32 llama weights; the daemon-level tests (``test_resume_netns.py``) kill,
cut and stop real daemons running the real model.
"""

# ruff: noqa: E402
from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()  # before mlx.core: float32 matmuls on OpenBLAS

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from meshd.inference.assignment import Assignment
from meshd.inference.errors import ErrorKind, InferenceError
from meshd.inference.generation_events import FinalEvent, TokenEvent
from meshd.inference.origin.runtime import DEFAULT_CATCH_UP_TIMEOUT_S
from meshd.inference.sampling import SamplingParams
from tests.support.dataplane_mesh import LoopThread, Mesh, mlx_lm_reference
from tests.support.random_model import make_random_model_dir

pytestmark = pytest.mark.integration

PROMPT = [(index * 29 + 5) % 300 for index in range(13)]
CHUNK = 4  # the prompt goes in three chunks and its last token: replay must cut it alike
TOKENS = 24
MOVE_AFTER = 9
LONG_TOKENS = 64  # a background move catches up before the request ends
GREEDY = SamplingParams(max_tokens=TOKENS)
SAMPLED = SamplingParams(
    temperature=1.0, top_p=0.9, top_k=60, repetition_penalty=1.3, seed=11, max_tokens=TOKENS
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(
        tmp_path_factory.mktemp("model") / "llama",
        "llama",
        layers=6,
        hidden=256,  # wide enough that a 4-token chunk and 4 single steps round apart here
        heads=4,
        kv_heads=2,
        vocab=320,
        seed=5,
    )


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """n1-n3 hold stages; every origin follows the committed plans (moves its requests)."""
    loop = LoopThread()
    built = Mesh(loop, tmp_path_factory.mktemp("mesh"))
    try:
        for node_id in ("n1", "n2", "n3"):
            built.add_node(node_id, follow=True, resume_timeout_s=20.0)
        yield built
    finally:
        built.close()
        loop.close()


def run_and_switch(
    mesh: Mesh,
    origin: str,
    before: Assignment,
    after: Assignment | None,
    params: SamplingParams,
    *,
    switch,
) -> tuple[list[TokenEvent], FinalEvent | InferenceError, float]:
    """Stream a request on ``before``; after MOVE_AFTER tokens run ``switch()`` on the loop
    (it withdraws ``before`` its own way and commits ``after``). Returns the token events,
    the outcome and how long the stream paused at the switch."""
    plane = mesh.nodes[origin].plane

    async def run() -> tuple[list[TokenEvent], FinalEvent | InferenceError, float]:
        tokens: list[TokenEvent] = []
        arrivals: list[float] = []
        stream = plane.generate(
            before.plan_id,
            PROMPT,
            params,
            request_id=f"moved-{time.monotonic_ns()}",
            return_logits=True,
            prefill_chunk=CHUNK,
            ignore_eos=True,
        )
        try:
            async for event in stream:
                if isinstance(event, FinalEvent):
                    return tokens, event, _pause(arrivals)
                tokens.append(event)
                arrivals.append(time.monotonic())
                if len(tokens) == MOVE_AFTER:
                    await switch()
        except InferenceError as error:
            return tokens, error, _pause(arrivals)
        raise AssertionError("the stream ended without a FinalEvent")

    return mesh.loop.run(run(), timeout=120)


def _pause(arrivals: list[float]) -> float:
    gaps = np.diff(arrivals) if len(arrivals) > 1 else np.array([0.0])
    return float(gaps.max())


def assert_exact(model_dir: Path, tokens: list[TokenEvent], params: SamplingParams) -> None:
    expected, logits = mlx_lm_reference(model_dir, PROMPT, params, prefill_chunk=CHUNK)
    assert [event.token_id for event in tokens] == expected
    for index, (event, reference) in enumerate(zip(tokens, logits, strict=True)):
        assert event.logits is not None
        assert np.array_equal(event.logits, reference), f"token {index}: logits differ"


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_request_moved_to_another_layout_is_bit_identical_to_one_run(
    mesh: Mesh, model_dir: Path, params: SamplingParams
) -> None:
    """Plan A (n1: 0-2, n2: 3-5) is withdrawn after 9 tokens; plan B (n3: 0-0, n1: 1-5)
    takes over: the stream goes on with no error and the same bits as mlx-lm alone."""
    before = mesh.assignment_for(model_dir, [("n1", (0, 3)), ("n2", (3, 6))])
    after = mesh.assignment_for(model_dir, [("n3", (0, 1)), ("n1", (1, 6))])
    mesh.install(before)

    async def switch() -> None:
        await mesh.install_async(after)
        await mesh.uninstall_async(before.plan_id, "withdrawn: the mesh re-planned")

    tokens, outcome, _ = run_and_switch(mesh, "n2", before, after, params, switch=switch)
    try:
        assert isinstance(outcome, FinalEvent), outcome
        assert outcome.usage.resumes == 1 and outcome.usage.plan_id == after.plan_id
        assert outcome.usage.completion_tokens == TOKENS and outcome.finish_reason == "length"
        assert [event.index for event in tokens] == list(range(TOKENS))
        assert_exact(model_dir, tokens, params)
        assert mesh.nodes["n2"].plane.origin.requests_resumed >= 1
        mesh.wait_all_freed(after.plan_id)
    finally:
        mesh.uninstall(after.plan_id)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_request_moves_in_the_background_while_its_old_plan_still_serves(
    mesh: Mesh, model_dir: Path, params: SamplingParams
) -> None:
    """Plan B (n3: 0-2, n1: 3-5) becomes the active plan after 9 tokens while plan A (n1:
    0-1, n2: 2-3, n3: 4-5) still serves (a join's re-plan; a graceful leave alike): the origin
    starts the request on B with its 9 tokens and feeds B's first stage each token A delivers
    meanwhile; B samples every step with the request's sampler, catches up (fed, it needs no
    round trip) and the stream switches over to it. One stream, no error, every token and its
    logits the bits of one mlx-lm run, counted as a background move, and A's stages freed."""
    long = replace(params, max_tokens=LONG_TOKENS)
    before = mesh.assignment_for(model_dir, [("n1", (0, 2)), ("n2", (2, 4)), ("n3", (4, 6))])
    after = mesh.assignment_for(model_dir, [("n3", (0, 3)), ("n1", (3, 6))])
    mesh.install(before)
    origin = mesh.nodes["n2"].plane.origin
    moved_before = origin.requests_moved_in_background

    async def switch() -> None:
        await mesh.install_async(after)  # active now; A stays committed and serving

    tokens, outcome, _ = run_and_switch(mesh, "n2", before, after, long, switch=switch)
    try:
        assert isinstance(outcome, FinalEvent), outcome
        assert outcome.usage.resumes == 1 and outcome.usage.plan_id == after.plan_id, outcome
        assert origin.requests_moved_in_background == moved_before + 1
        assert [event.index for event in tokens] == list(range(LONG_TOKENS))
        assert_exact(model_dir, tokens, long)
        mesh.wait_all_freed(before.plan_id)  # the old attempt ended on A's stages
        mesh.wait_all_freed(after.plan_id)
    finally:
        mesh.uninstall(before.plan_id)
        mesh.uninstall(after.plan_id)


def test_a_background_move_the_new_plan_refuses_leaves_the_request_on_its_plan(
    mesh: Mesh, model_dir: Path
) -> None:
    """The origin's next plan is not served by its stages (committed on the origin only): the
    background move is refused and ends, and the request finishes on its plan, exactly."""
    before = mesh.assignment_for(model_dir, [("n1", (0, 3)), ("n2", (3, 6))])
    after = mesh.assignment_for(model_dir, [("n3", (0, 3)), ("n1", (3, 6))])
    mesh.install(before)
    origin = mesh.nodes["n2"].plane.origin
    abandoned_before = origin.catch_ups_abandoned

    async def switch() -> None:
        await mesh.install_async(after, ["n2"])

    tokens, outcome, _ = run_and_switch(mesh, "n2", before, after, GREEDY, switch=switch)
    try:
        assert isinstance(outcome, FinalEvent), outcome
        assert outcome.usage.resumes == 0 and outcome.usage.plan_id == before.plan_id
        assert origin.catch_ups_abandoned > abandoned_before
        assert_exact(model_dir, tokens, GREEDY)
        mesh.wait_all_freed(before.plan_id)
    finally:
        mesh.uninstall(before.plan_id)
        mesh.uninstall(after.plan_id)


def test_a_background_move_that_does_not_catch_up_in_time_ends_and_the_request_stays(
    mesh: Mesh, model_dir: Path
) -> None:
    """A move that has not caught up within the origin's catch_up_timeout_s (here a
    millisecond: the new plan cannot even prefill by then) ends on the new plan's stages, and
    the request finishes on its plan, exactly, with no move counted."""
    before = mesh.assignment_for(model_dir, [("n1", (0, 3)), ("n2", (3, 6))])
    after = mesh.assignment_for(model_dir, [("n3", (0, 3)), ("n1", (3, 6))])
    mesh.install(before)
    origin = mesh.nodes["n2"].plane.origin
    abandoned_before = origin.catch_ups_abandoned
    origin.catch_up_timeout_s = 0.001

    async def switch() -> None:
        await mesh.install_async(after)

    try:
        tokens, outcome, _ = run_and_switch(mesh, "n2", before, after, GREEDY, switch=switch)
        assert isinstance(outcome, FinalEvent), outcome
        assert outcome.usage.resumes == 0 and outcome.usage.plan_id == before.plan_id
        assert origin.catch_ups_abandoned == abandoned_before + 1  # tried once, then gave up
        assert_exact(model_dir, tokens, GREEDY)
        mesh.wait_all_freed(after.plan_id)  # the new attempt ended on the new plan's stages
    finally:
        origin.catch_up_timeout_s = DEFAULT_CATCH_UP_TIMEOUT_S
        mesh.uninstall(before.plan_id)
        mesh.uninstall(after.plan_id)


def test_a_background_move_whose_tokens_differ_is_a_defect_and_the_request_stays(
    mesh: Mesh, model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A new plan that computes other tokens than the ones the client has (here: other
    weights under the same vocabulary, as a corrupted stage would) is never switched to: the
    origin says so loudly, ends the move, and the request finishes on its plan, exactly."""
    other = make_random_model_dir(
        tmp_path / "other", "llama", layers=6, hidden=256, heads=4, kv_heads=2, vocab=320, seed=6
    )
    before = mesh.assignment_for(model_dir, [("n1", (0, 3)), ("n2", (3, 6))])
    after = mesh.assignment_for(other, [("n3", (0, 3)), ("n1", (3, 6))])
    mesh.install(before)
    origin = mesh.nodes["n2"].plane.origin
    abandoned_before = origin.catch_ups_abandoned

    async def switch() -> None:
        await mesh.install_async(after)

    # Long enough that the move catches up before the request ends on a busy host too (with
    # 24 tokens, a run beside another test's mesh ended first and nothing was compared).
    long = replace(GREEDY, max_tokens=LONG_TOKENS)
    with caplog.at_level(logging.ERROR, logger="meshd.dataplane"):
        tokens, outcome, _ = run_and_switch(mesh, "n2", before, after, long, switch=switch)
    try:
        assert isinstance(outcome, FinalEvent), outcome
        assert outcome.usage.resumes == 0 and outcome.usage.plan_id == before.plan_id
        assert origin.catch_ups_abandoned == abandoned_before + 1
        assert any("DEFECT" in record.getMessage() for record in caplog.records)
        assert_exact(model_dir, tokens, long)
        mesh.wait_all_freed(after.plan_id)
    finally:
        mesh.uninstall(before.plan_id)
        mesh.uninstall(after.plan_id)


def test_a_request_whose_stage_dies_goes_on_on_the_survivors(
    mesh: Mesh, model_dir: Path, tmp_path: Path
) -> None:
    """A stage node stops answering (its server and data plane close, as on kill -9): the
    origin notices the broken link, waits for the survivors' plan and goes on, exactly."""
    doomed = mesh.add_node("doomed", follow=True)
    before = mesh.assignment_for(model_dir, [("n1", (0, 2)), ("doomed", (2, 6))])
    after = mesh.assignment_for(model_dir, [("n1", (0, 2)), ("n3", (2, 6))])
    mesh.install(before)

    async def switch() -> None:
        await doomed.server.stop(0)
        await doomed.plane.close()
        await asyncio.sleep(0.3)  # the mesh notices and re-plans a moment later
        survivors = ["n1", "n2", "n3"]
        for name in survivors:
            mesh.nodes[name].committed.discard(before.plan_id)
            await mesh.nodes[name].plane.uninstall(before.plan_id, "member doomed was lost")
        await mesh.install_async(after, survivors)

    tokens, outcome, pause = run_and_switch(mesh, "n2", before, after, GREEDY, switch=switch)
    try:
        assert isinstance(outcome, FinalEvent), outcome
        assert outcome.usage.resumes == 1 and outcome.usage.paused_s >= 0.3
        assert_exact(model_dir, tokens, GREEDY)
        assert pause >= 0.3
    finally:
        mesh.nodes.pop("doomed")
        mesh.uninstall(after.plan_id)


def test_a_request_ends_at_once_when_the_mesh_can_no_longer_run_the_model(
    mesh: Mesh, model_dir: Path
) -> None:
    before = mesh.assignment_for(model_dir, [("n1", (0, 3)), ("n2", (3, 6))])
    mesh.install(before)
    refusal = "not enough memory in this mesh for llama: need 900 MB, have 600 MB"
    switched_at: list[float] = []

    async def switch() -> None:
        switched_at.append(time.monotonic())
        for node in mesh.nodes.values():
            node.committed.replace((), active="", refusal=refusal)
            await node.plane.uninstall(before.plan_id, "member n3 was lost")

    tokens, outcome, _ = run_and_switch(mesh, "n1", before, None, GREEDY, switch=switch)
    ended_after = time.monotonic() - switched_at[0]
    assert isinstance(outcome, InferenceError), outcome
    assert outcome.kind is ErrorKind.UNAVAILABLE
    assert refusal in str(outcome) and f"after {MOVE_AFTER} tokens" in str(outcome)
    assert len(tokens) == MOVE_AFTER
    assert ended_after < 3.0, f"the client waited {ended_after:.1f} s for the refusal"


def test_a_client_that_named_its_plan_is_not_moved(mesh: Mesh, model_dir: Path) -> None:
    before = mesh.assignment_for(model_dir, [("n1", (0, 3)), ("n2", (3, 6))])
    after = mesh.assignment_for(model_dir, [("n2", (0, 3)), ("n1", (3, 6))])
    mesh.install(before)
    plane = mesh.nodes["n3"].plane

    async def run() -> InferenceError | None:
        stream = plane.generate(before.plan_id, PROMPT, GREEDY, request_id="pinned", resume=False)
        try:
            async for event in stream:
                if isinstance(event, TokenEvent) and event.index == 2:
                    await mesh.install_async(after)
                    await mesh.uninstall_async(before.plan_id, "withdrawn")
        except InferenceError as error:
            return error
        return None

    try:
        error = mesh.loop.run(run(), timeout=60)
        assert error is not None and error.kind is ErrorKind.UNAVAILABLE
        assert "withdrawn" in str(error)
    finally:
        mesh.uninstall(after.plan_id)


def test_a_plan_that_keeps_a_nodes_layers_does_not_reload_them(mesh: Mesh, model_dir: Path) -> None:
    """n1 holds layers 0-2 in both plans (only its neighbour changes): installing the second
    plan adopts the weights the first holds (no stage built, nothing read), and a request
    moved from the first to the second gives the same bits."""
    before = mesh.assignment_for(model_dir, [("n1", (0, 3)), ("n2", (3, 6))])
    after = mesh.assignment_for(model_dir, [("n1", (0, 3)), ("n3", (3, 6))])
    mesh.install(before)
    loads = {name: node.plane.loads for name, node in mesh.nodes.items()}
    tokenizer = mesh.nodes["n1"].plane.tokenizer(before.plan_id)

    async def switch() -> None:
        await mesh.install_async(after)
        await mesh.uninstall_async(before.plan_id, "withdrawn: the mesh re-planned")

    tokens, outcome, _ = run_and_switch(mesh, "n2", before, after, GREEDY, switch=switch)
    try:
        assert isinstance(outcome, FinalEvent) and outcome.usage.resumes == 1, outcome
        assert_exact(model_dir, tokens, GREEDY)
        kept, n3 = mesh.nodes["n1"].plane.loads, mesh.nodes["n3"].plane.loads
        assert kept.stage_loads == loads["n1"].stage_loads  # n1 built no stage
        assert kept.bytes_loaded == loads["n1"].bytes_loaded and kept.layers_kept >= 3
        assert mesh.nodes["n1"].plane.tokenizer(after.plan_id) is tokenizer  # not loaded again
        assert n3.stage_loads == loads["n3"].stage_loads + 1  # n3 loaded its new range
        # n3 built its new range, reading it or taking it from the stage a plan left there
        gained = (n3.layers_loaded + n3.layers_kept) - (
            loads["n3"].layers_loaded + loads["n3"].layers_kept
        )
        assert gained == 3
    finally:
        mesh.uninstall(after.plan_id)


def test_a_moved_boundary_reads_only_the_layers_a_node_gains(mesh: Mesh, model_dir: Path) -> None:
    """Plan A (n1: 0-2, n2: 3-5) is replaced by plan B (n1: 0-3, n3: 4-5), with A withdrawn
    first, as after a lost member: n1 takes layers 0-2 and the embedding over from the stage
    A left and reads only layer 3; n3 reads its two layers. The request moved onto B gives
    the bits of one mlx-lm run."""
    before = mesh.assignment_for(model_dir, [("n1", (0, 3)), ("n2", (3, 6))])
    after = mesh.assignment_for(model_dir, [("n1", (0, 4)), ("n3", (4, 6))])
    mesh.install(before)
    loads = {name: node.plane.loads for name, node in mesh.nodes.items()}

    async def switch() -> None:
        await mesh.uninstall_async(before.plan_id, "member n2 was lost")
        await mesh.install_async(after)

    tokens, outcome, _ = run_and_switch(mesh, "n2", before, after, GREEDY, switch=switch)
    try:
        assert isinstance(outcome, FinalEvent) and outcome.usage.resumes == 1, outcome
        assert_exact(model_dir, tokens, GREEDY)
        n1, n3 = mesh.nodes["n1"].plane.loads, mesh.nodes["n3"].plane.loads
        assert n1.stage_loads == loads["n1"].stage_loads + 1
        assert n1.layers_loaded == loads["n1"].layers_loaded + 1  # layer 3 only
        assert n1.layers_kept == loads["n1"].layers_kept + 3
        # one layer's bytes: no more than n1 read per layer before (those loads had embeddings)
        per_layer_before = loads["n1"].bytes_loaded / loads["n1"].layers_loaded
        assert 0 < n1.bytes_loaded - loads["n1"].bytes_loaded <= per_layer_before
        gained = (n3.layers_loaded + n3.layers_kept) - (
            loads["n3"].layers_loaded + loads["n3"].layers_kept
        )
        assert gained == 2  # read, or taken from the stage an earlier plan left on n3
    finally:
        mesh.uninstall(after.plan_id)


def test_a_model_folder_rewritten_gives_another_tokenizer_key(tmp_path: Path) -> None:
    """The tokenizer a re-plan reuses is the one of the same files: a rewritten tokenizer (or
    config) in the same folder is loaded again; the weights do not count."""
    from meshd.inference.serving.loaded_stages import _tokenizer_key

    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    key = _tokenizer_key(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"xy")
    assert _tokenizer_key(tmp_path) == key
    (tmp_path / "tokenizer.json").write_text('{"version": 2}')
    assert _tokenizer_key(tmp_path) != key


def test_only_stages_holding_layers_a_new_stage_does_not_run_are_in_its_way(
    mesh: Mesh, model_dir: Path
) -> None:
    """What a node frees first when memory is short (``PlanInstaller._free_before_load``): an
    installed stage with layers the new one does not run; not one that contains the new stage
    whole (the new stage takes all of its layers from it and reads nothing)."""
    before = mesh.assignment_for(model_dir, [("n1", (0, 3)), ("n2", (3, 6))])
    grows = mesh.assignment_for(model_dir, [("n1", (0, 4)), ("n3", (4, 6))])
    inside = mesh.assignment_for(model_dir, [("n3", (0, 1)), ("n2", (1, 2)), ("n1", (2, 6))])
    shrinks = mesh.assignment_for(model_dir, [("n1", (0, 2)), ("n2", (2, 6))])
    mesh.install(before)
    try:
        n1, n2 = mesh.nodes["n1"].plane, mesh.nodes["n2"].plane
        assert n1.stages_to_free_for(grows) == [before.plan_id]
        assert n1.stages_to_free_for(inside) == [before.plan_id]  # 3-5 is not in 0-2
        assert n2.stages_to_free_for(inside) == [before.plan_id]  # 1 is not in 3-5
        assert n1.stages_to_free_for(shrinks) == []  # 0-1 with the embedding: inside 0-2
        assert n2.stages_to_free_for(shrinks) == [before.plan_id]  # it gains layer 2
        assert mesh.nodes["n3"].plane.stages_to_free_for(grows) == []  # it holds nothing
    finally:
        mesh.uninstall(before.plan_id)
