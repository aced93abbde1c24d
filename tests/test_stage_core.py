"""The stage core alone: every refusal, the ordering rules and the scheduler, without gRPC or MLX.

Each test feeds events to a :class:`StageCore` and checks the actions it answers with and the
steps it hands out, the way :mod:`meshd.inference.stage.runtime` drives it on a real node. Time is
an argument; nothing here starts a thread or opens a socket, and the core imports no MLX (checked
in a fresh interpreter).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.inference.assignment import Assignment, StageSpec
from meshd.inference.sampling import SamplingParams
from meshd.inference.stage.core import StageCore
from meshd.inference.stage_events import (
    ActivationFrame,
    Advanced,
    ComputeFailed,
    EndFrame,
    FailureKind,
    Finish,
    Hidden,
    Release,
    RequestStart,
    Sampled,
    SendActivation,
    SendFailure,
    SendToken,
    Skipped,
    StartFrame,
    TokenFrame,
    TokenRoute,
    Work,
    prefill_steps,
)

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=4)
T0 = 100.0


def plan_of(plan_id: str, *nodes: str) -> Assignment:
    last = len(nodes) - 1
    stages = tuple(
        StageSpec(node, f"10.0.0.{i + 1}:7000", i, i + 1, i == 0, i == last)
        for i, node in enumerate(nodes)
    )
    return Assignment(plan_id, Path("/models/m"), stages)


def start_of(
    prompt: tuple[int, ...] = (1, 2, 3, 4, 5),
    *,
    origin: str = "o",
    chunk: int = 2,
    sampling: SamplingParams | None = GREEDY,
    eos: frozenset[int] = frozenset({99}),
    generated: tuple[int, ...] = (),
    forwarded: bool = False,
    catch_up: bool = False,
) -> RequestStart:
    return RequestStart(
        origin=origin,
        prompt=() if forwarded else prompt,
        prompt_length=len(prompt),
        sampling=sampling,
        eos_ids=eos,
        prefill_chunk=chunk,
        generated=generated,
        catch_up=catch_up,
        invalid=None if sampling is not None else "top_p must be in (0, 1]",
    )


def core_on(node: str, *plans: Assignment, ready: bool = True, **options: object) -> StageCore:
    core = StageCore(node, **options)  # type: ignore[arg-type]
    for plan in plans:
        core.add_plan(plan)
        if ready:
            core.plan_loaded(plan.plan_id)
    return core


def failures(actions: list) -> list[SendFailure]:
    return [a for a in actions if isinstance(a, SendFailure)]


def only_failure(actions: list) -> SendFailure:
    (failure,) = failures(actions)
    return failure


def drain(core: StageCore, now: float = T0) -> list[Work]:
    """Every step the core hands out, one at a time, completing each as an advanced cache
    (what a first or middle stage's caller would do, minus the hidden states)."""
    done = []
    while batch := core.next_batch(now):
        (work,) = batch
        done.append(work)
        core.on_computed(work, Hidden(f"h{work.step}", 0.001), now)
    return done


def activation(plan: str, request: str, step: int, sender: str, start=None) -> ActivationFrame:
    return ActivationFrame(sender, plan, request, step, f"payload-{step}", 0.01, start)


# --- The schedule -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "chunk", "steps"),
    [
        (20, 256, (19, 1)),
        (45, 7, (7, 7, 7, 7, 7, 7, 2, 1)),
        (8, 7, (7, 1)),
        (1, 4, (1,)),
        (2, 1, (1, 1)),
    ],
)
def test_prefill_follows_mlx_lm_generate_step(length: int, chunk: int, steps: tuple) -> None:
    """All but the last context token in chunks, then the last token alone."""
    assert prefill_steps(length, chunk) == steps
    assert sum(steps) == length


def test_first_stage_hands_out_the_prompt_in_order_and_forwards_each_step() -> None:
    plan = plan_of("p", "a", "b")
    core = core_on("a", plan)
    prompt = (1, 2, 3, 4, 5)
    assert core.on_start(StartFrame("o", "p", "r", start_of(prompt)), None, T0) == []
    works = []
    while batch := core.next_batch(T0):
        (work,) = batch
        works.append(work)
        (sent,) = core.on_computed(work, Hidden(f"h{work.step}", 0.5), T0)
        assert isinstance(sent, SendActivation) and sent.to == "b" and sent.step == work.step
        assert (sent.start is not None) == (work.step == 0)
    assert [w.tokens for w in works] == [(1, 2), (3, 4), (5,)]
    assert [w.step for w in works] == [0, 1, 2]
    assert not any(w.head for w in works)  # the first of two stages has no head


def test_forwarded_start_carries_the_prompt_only_for_the_repetition_penalty() -> None:
    plan = plan_of("p", "a", "b")
    for penalty, keeps in ((1.0, False), (1.3, True)):
        core = core_on("a", plan)
        sampling = SamplingParams(repetition_penalty=penalty, max_tokens=4)
        core.on_start(StartFrame("o", "p", "r", start_of(sampling=sampling)), None, T0)
        (work,) = core.next_batch(T0)
        (sent,) = core.on_computed(work, Hidden("h", 0.1), T0)
        assert sent.start.prompt_length == 5
        assert bool(sent.start.prompt) is keeps


def test_last_stage_samples_from_the_last_prompt_step_on() -> None:
    plan = plan_of("p", "a", "b")
    core = core_on("b", plan)
    start = start_of(forwarded=True)
    actions = core.on_activation(activation("p", "r", 0, "a", start), None, T0)
    assert actions == []
    (work,) = core.next_batch(T0)
    assert work.payload == "payload-0" and not work.head and work.sampler is None
    assert core.on_computed(work, Advanced(0.1), T0) == []
    for step in (1, 2):
        core.on_activation(activation("p", "r", step, "a"), None, T0)
    (work,) = core.next_batch(T0)
    assert work.step == 1 and not work.head
    core.on_computed(work, Advanced(0.1), T0)
    (work,) = core.next_batch(T0)
    assert work.step == 2 and work.head and work.sampler is not None
    assert work.sampler.sampling == GREEDY and work.sampler.draws == 0
    (token,) = core.on_computed(work, Sampled(7, b"", 0.2), T0)
    assert isinstance(token, SendToken)
    assert token.to == ("o", "a") and token.index == 0 and token.finish is Finish.NONE
    core.on_activation(activation("p", "r", 3, "a"), None, T0)
    (work,) = core.next_batch(T0)
    assert work.head and work.sampler is None  # the sampler is set up once


def test_tokens_go_to_the_origin_alone_when_it_is_the_first_stage() -> None:
    core = core_on("b", plan_of("p", "a", "b"))
    core.on_activation(activation("p", "r", 0, "a", start_of(origin="a", chunk=8)), None, T0)
    (work,) = core.next_batch(T0)
    core.on_computed(work, Advanced(0.1), T0)
    core.on_activation(activation("p", "r", 1, "a"), None, T0)
    (work,) = core.next_batch(T0)
    (token,) = core.on_computed(work, Sampled(7, b"", 0.2), T0)
    assert token.to == ("a",)


def test_a_decode_step_names_the_stage_its_hidden_states_go_to() -> None:
    """The compute thread sends a decode step's hidden states itself
    (meshd.inference.stage.runtime), to the node the core named when it handed the step out
    (Work.forward_to); the core's own action for the result names the same node. Prompt chunks,
    a last stage's steps and a single stage's name none (their frames go through the loop)."""
    plan = plan_of("p", "a", "b", "c")
    first = core_on("a", plan)
    first.on_start(StartFrame("o", "p", "r", start_of(chunk=2)), None, T0)  # steps 0-1 prompt
    for step in range(4):
        (work,) = first.next_batch(T0)
        assert work.step == step
        assert work.forward_to == ("b" if step >= 2 else None)  # decode steps only
        (sent,) = first.on_computed(work, Hidden("h", 0.1), T0)
        assert sent.to == "b"
        if step >= 2:
            first.on_token(TokenFrame("c", "p", "r", 7, step - 2, Finish.NONE), None, T0)

    middle = core_on("b", plan)
    middle.on_activation(activation("p", "r", 0, "a", start_of(forwarded=True, chunk=8)), None, T0)
    middle.on_activation(activation("p", "r", 1, "a"), None, T0)
    for step in range(2):
        (work,) = middle.next_batch(T0)
        assert work.forward_to == ("c" if step == 1 else None)
        middle.on_computed(work, Hidden("h", 0.1), T0)

    last = core_on("c", plan)
    last.on_activation(activation("p", "r", 0, "b", start_of(forwarded=True, chunk=8)), None, T0)
    last.on_computed(last.next_batch(T0)[0], Advanced(0.1), T0)
    last.on_activation(activation("p", "r", 1, "b"), None, T0)
    (work,) = last.next_batch(T0)
    assert work.head and work.forward_to is None

    single = core_on("a", plan_of("s", "a"))
    single.on_start(StartFrame("o", "s", "r", start_of(chunk=8)), None, T0)
    for work in single.next_batch(T0) + single.next_batch(T0):
        assert work.forward_to is None


def test_a_last_stage_names_the_first_stage_its_tokens_go_to() -> None:
    """The compute thread of a last stage sends a token that does not end its request to the
    first stage itself (meshd.inference.stage.runtime), as the core named it at hand-out
    (Work.token_to): the token's index, and what would end the request. The core's own
    action for the result is the same token to the same node."""
    plan = plan_of("p", "a", "b")
    last = core_on("b", plan)
    last.on_activation(activation("p", "r", 0, "a", start_of(forwarded=True, chunk=8)), None, T0)
    (work,) = last.next_batch(T0)
    assert work.token_to is None  # a prompt chunk samples nothing
    last.on_computed(work, Advanced(0.1), T0)
    for index in range(GREEDY.max_tokens):
        step = index + 1
        last.on_activation(activation("p", "r", step, "a"), None, T0)
        (work,) = last.next_batch(T0)
        assert work.token_to == TokenRoute("a", index, GREEDY.max_tokens, frozenset({99}))
        final = index + 1 == GREEDY.max_tokens
        assert work.token_to.carries(7) is not final
        assert not work.token_to.carries(99)  # an eos token ends the request
        (token,) = last.on_computed(work, Sampled(7, b"", 0.2), T0)[:1]
        assert isinstance(token, SendToken) and token.index == index
        # A final one goes from the loop (not the compute thread), to the first stage too:
        # it proves every stage computed the step before (what the first stage keeps).
        assert token.to == ("o", "a")
        assert (token.finish is Finish.NONE) is not final


@pytest.mark.parametrize("why", ["single stage", "logits", "first stage"])
def test_only_a_last_stage_of_several_sends_tokens_from_its_compute_thread(why: str) -> None:
    if why == "single stage":
        core = core_on("a", plan_of("s", "a"))
        core.on_start(StartFrame("o", "s", "r", start_of(chunk=8)), None, T0)
    elif why == "logits":  # a debug request's logits go with its tokens, through the loop
        core = core_on("b", plan_of("s", "a", "b"))
        start = dataclasses.replace(start_of(forwarded=True, chunk=8), return_logits=True)
        core.on_activation(activation("s", "r", 0, "a", start), None, T0)
    else:
        core = core_on("a", plan_of("s", "a", "b"))
        core.on_start(StartFrame("o", "s", "r", start_of(chunk=8)), None, T0)
    works = core.next_batch(T0)
    assert works and all(work.token_to is None for work in works)


def test_a_single_stage_computes_one_token_ahead_and_stops_at_max_tokens() -> None:
    """As mlx-lm's generate_step: the step that follows a sampling step is on the compute
    thread before that step has finished (its input is the token it samples)."""
    core = core_on("a", plan_of("p", "a"))
    core.on_start(StartFrame("o", "p", "r", start_of(chunk=8)), None, T0)  # 4 tokens
    (chunk,) = core.next_batch(T0)
    assert chunk.tokens == (1, 2, 3, 4) and not chunk.head
    assert core.next_batch(T0) == []  # the last prompt token waits for the chunk
    core.on_computed(chunk, Advanced(0.1), T0)
    (last,) = core.next_batch(T0)
    assert last.tokens == (5,) and last.head and not last.follows
    (ahead,) = core.next_batch(T0)  # while the last prompt token computes
    assert ahead.follows and ahead.step == 2 and ahead.head and ahead.stop_ids == {99}
    assert core.next_batch(T0) == []  # one step ahead at most
    tokens = [core.on_computed(last, Sampled(10, b"", 0.1), T0)[0]]
    (ahead2,) = core.next_batch(T0)
    assert ahead2.follows and ahead2.step == 3
    tokens += core.on_computed(ahead, Sampled(11, b"", 0.1), T0)
    (ahead3,) = core.next_batch(T0)
    tokens += core.on_computed(ahead2, Sampled(12, b"", 0.1), T0)
    assert core.next_batch(T0) == []  # ahead3 gives the 4th and last token: nothing follows
    token, release = core.on_computed(ahead3, Sampled(13, b"", 0.1), T0)
    tokens.append(token)
    assert [t.index for t in tokens] == [0, 1, 2, 3]
    assert [t.token_id for t in tokens] == [10, 11, 12, 13]
    assert [t.finish for t in tokens] == [Finish.NONE] * 3 + [Finish.LENGTH]
    assert all(t.to == ("o",) for t in tokens) and release == Release("p", "r")
    assert core.open_requests("p") == 0


def test_an_eos_token_ends_the_request_and_the_step_after_it_is_void() -> None:
    core = core_on("a", plan_of("p", "a"))
    core.on_start(StartFrame("o", "p", "r", start_of((1,), chunk=8)), None, T0)
    (work,) = core.next_batch(T0)
    (ahead,) = core.next_batch(T0)
    token, release = core.on_computed(work, Sampled(99, b"", 0.1), T0)
    assert token.finish is Finish.EOS and isinstance(release, Release)
    assert core.on_computed(ahead, Skipped(), T0) == []  # the engine saw the EOS and skipped
    assert core.next_batch(T0) == []


def test_a_cancelled_single_stage_request_ignores_its_step_ahead() -> None:
    core = core_on("a", plan_of("p", "a"))
    core.on_start(StartFrame("o", "p", "r", start_of((1,), chunk=8)), None, T0)
    (work,) = core.next_batch(T0)
    (ahead,) = core.next_batch(T0)
    assert core.on_end(EndFrame("o", "p", "r")) == [Release("p", "r")]
    assert core.on_computed(work, Sampled(7, b"", 0.1), T0) == []
    assert core.on_computed(ahead, Sampled(8, b"", 0.1), T0) == []
    assert core.next_batch(T0) == []


def test_first_stage_continues_with_each_token_of_the_last_stage_in_order() -> None:
    core = core_on("a", plan_of("p", "a", "b"))
    core.on_start(StartFrame("o", "p", "r", start_of((1, 2), chunk=8)), None, T0)
    assert [w.tokens for w in drain(core)] == [(1,), (2,)]
    assert core.on_token(TokenFrame("b", "p", "r", 7, 0, Finish.NONE), None, T0) == []
    (work,) = core.next_batch(T0)
    assert work.tokens == (7,) and work.step == 2
    refused = only_failure(core.on_token(TokenFrame("b", "p", "r", 8, 5, Finish.NONE), None, T0))
    assert (
        refused.kind is FailureKind.BAD_REQUEST and "token 5 arrived, expected 1" in refused.message
    )


def test_tokens_that_do_not_continue_a_request_are_ignored() -> None:
    core = core_on("a", plan_of("p", "a", "b"))
    core.on_start(StartFrame("o", "p", "r", start_of((1, 2), chunk=8)), None, T0)
    drain(core)
    for frame in (
        TokenFrame("c", "p", "r", 7, 0, Finish.NONE),  # not the last stage
        TokenFrame("b", "p", "r", 7, 0, Finish.LENGTH),  # the request is over
        TokenFrame("b", "p", "other", 7, 0, Finish.NONE),  # unknown request
        TokenFrame("b", "q", "r", 7, 0, Finish.NONE),  # unknown plan
    ):
        assert core.on_token(frame, None, T0) == []
    assert core.next_batch(T0) == []
    middle = core_on("b", plan_of("p", "a", "b", "c"))
    assert middle.on_token(TokenFrame("c", "p", "r", 7, 0, Finish.NONE), None, T0) == []


def test_a_resumed_request_replays_its_tokens_one_at_a_time_and_continues_counting() -> None:
    """A request moved to another plan after 2 tokens: the prompt as the first run cut it,
    then each generated token alone (decode-shaped, no sampling), then the sampler resumes
    at position 2 with the whole context in its repetition window."""
    sampling = SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.2, max_tokens=5)
    start = start_of((1, 2, 3), chunk=2, sampling=sampling, generated=(7, 8))
    core = core_on("a", plan_of("p", "a"))
    core.on_start(StartFrame("o", "p", "r", start), None, T0)
    works = []
    while len(works) < 4:
        (work,) = core.next_batch(T0)
        works.append(work)
        if not work.head:
            core.on_computed(work, Advanced(0.1), T0)
    assert [w.tokens for w in works] == [(1, 2), (3,), (7,), (8,)]
    assert [w.head for w in works] == [False, False, False, True]
    assert works[3].sampler.context == (1, 2, 3, 7, 8) and works[3].sampler.draws == 2
    (token,) = core.on_computed(works[3], Sampled(9, b"", 0.1), T0)
    assert token.index == 2 and token.finish is Finish.NONE
    (work,) = core.next_batch(T0)
    (token,) = core.on_computed(work, Sampled(10, b"", 0.1), T0)
    assert token.index == 3
    (work,) = core.next_batch(T0)
    token, release = core.on_computed(work, Sampled(11, b"", 0.1), T0)
    assert token.index == 4 and token.finish is Finish.LENGTH  # 5 tokens in all
    assert release == Release("p", "r")


def test_a_catching_up_request_takes_known_tokens_from_its_origin_without_the_round_trip() -> None:
    """A request moving in the background (catch_up): the origin sends the tokens an older
    attempt delivered; the first stage queues each as its next step's input at once (several
    ahead of the last stage), drops the last stage's later copy of an index it has, and takes
    the last stage's token where the origin has none yet. Without catch_up, a Token from the
    origin is not the request's business."""
    sampling = SamplingParams(max_tokens=10)
    core = core_on("a", plan_of("p", "a", "b"))
    start = start_of((1, 2), chunk=8, sampling=sampling, generated=(7,), catch_up=True)
    core.on_start(StartFrame("o", "p", "r", start), None, T0)
    assert [w.tokens for w in drain(core)] == [(1,), (2,), (7,)]
    for index, token in ((1, 8), (2, 9)):  # delivered by the old attempt meanwhile
        assert core.on_token(TokenFrame("o", "p", "r", token, index, Finish.NONE), None, T0) == []
    assert [(w.step, w.tokens) for w in drain(core)] == [(3, (8,)), (4, (9,))]
    # the last stage's copies of indexes 1 and 2 come late: dropped, nothing to compute
    for index, token in ((1, 8), (2, 9)):
        assert core.on_token(TokenFrame("b", "p", "r", token, index, Finish.NONE), None, T0) == []
    assert core.next_batch(T0) == []
    # index 3 comes from the last stage first: taken; the origin's copy is dropped
    assert core.on_token(TokenFrame("b", "p", "r", 10, 3, Finish.NONE), None, T0) == []
    assert core.on_token(TokenFrame("o", "p", "r", 10, 3, Finish.NONE), None, T0) == []
    assert [(w.step, w.tokens) for w in drain(core)] == [(5, (10,))]
    refused = only_failure(core.on_token(TokenFrame("o", "p", "r", 12, 6, Finish.NONE), None, T0))
    assert refused.kind is FailureKind.BAD_REQUEST and "token 6 arrived, expected 4" in (
        refused.message
    )

    plain = core_on("a", plan_of("p", "a", "b"))
    plain.on_start(StartFrame("o", "p", "r", start_of((1, 2), chunk=8)), None, T0)
    drain(plain)
    assert plain.on_token(TokenFrame("o", "p", "r", 8, 0, Finish.NONE), None, T0) == []
    assert plain.next_batch(T0) == []  # the origin feeds only a request that catches up


# --- The scheduler ------------------------------------------------------------------------------


def test_a_long_prompt_takes_turns_with_a_short_request() -> None:
    """Round robin over requests whose input is ready, one step in flight each."""
    core = core_on("a", plan_of("p", "a"))
    long_prompt = tuple(range(1, 42))  # 20 chunks of 2, then the last token
    core.on_start(StartFrame("o", "p", "long", start_of(long_prompt)), None, T0)
    core.on_start(StartFrame("o", "p", "short", start_of((1, 2, 3))), None, T0)
    order = []
    short_token_at = None
    while batch := core.next_batch(T0):
        (work,) = batch
        order.append(work.request_id)
        result = Sampled(5, b"", 0.1) if work.head else Advanced(0.1)
        actions = core.on_computed(work, result, T0)
        if work.request_id == "short" and any(isinstance(a, SendToken) for a in actions):
            short_token_at = short_token_at or len(order)
    assert order[:4] == ["long", "short", "long", "short"]
    assert short_token_at == 4  # after 2 of the long prompt's 21 steps, not all of them
    assert order.count("long") == 21 + GREEDY.max_tokens - 1


def test_a_batch_has_one_step_per_request_and_a_request_computes_one_step_at_a_time() -> None:
    core = core_on("b", plan_of("p", "a", "b", "c"))
    for request in ("r1", "r2"):
        core.on_activation(activation("p", request, 0, "a", start_of(forwarded=True)), None, T0)
        core.on_activation(activation("p", request, 1, "a"), None, T0)
    batch = core.next_batch(T0, max_items=4)
    assert [(w.request_id, w.step) for w in batch] == [("r1", 0), ("r2", 0)]
    assert core.next_batch(T0, max_items=4) == []  # both are computing
    core.on_computed(batch[1], Hidden("h", 0.1), T0)
    assert [(w.request_id, w.step) for w in core.next_batch(T0, max_items=4)] == [("r2", 1)]


def test_a_request_dropped_while_it_computes_gets_no_further_work() -> None:
    core = core_on("a", plan_of("p", "a", "b"))
    core.on_start(StartFrame("o", "p", "r", start_of()), None, T0)
    (work,) = core.next_batch(T0)
    actions = core.on_end(EndFrame("o", "p", "r"))
    assert actions == [Release("p", "r")]
    assert core.on_computed(work, Hidden("h", 0.1), T0) == []
    assert core.next_batch(T0) == []


# --- Fencing and refusals -----------------------------------------------------------------------


def test_a_fenced_plan_is_refused_with_the_agreements_reason() -> None:
    core = core_on("a", plan_of("p", "a", "b"))
    start = StartFrame("o", "p", "r", start_of())
    failure = only_failure(core.on_start(start, "plan p is not committed on node a", T0))
    assert failure.kind is FailureKind.FENCED and failure.to == "o"
    assert failure.message == "plan p is not committed on node a"
    assert core.next_batch(T0) == []
    later = core.on_activation(activation("p", "r", 0, "o"), None, T0)
    assert later == []  # the refused request's late frames are dropped


def test_a_plan_still_loading_is_refused_as_not_loaded_and_a_failed_one_with_its_reason() -> None:
    plan = plan_of("p", "a", "b")
    core = core_on("a", plan, ready=False)
    failure = only_failure(core.on_start(StartFrame("o", "p", "r1", start_of()), None, T0))
    assert failure.kind is FailureKind.NOT_LOADED and "not installed there yet" in failure.message
    core.plan_failed("p", "its part could not be fetched")
    failure = only_failure(core.on_start(StartFrame("o", "p", "r2", start_of()), None, T0))
    assert failure.kind is FailureKind.INTERNAL
    assert "node a cannot serve plan p: its part could not be fetched" in failure.message
    unknown = only_failure(core.on_start(StartFrame("o", "q", "r3", start_of()), None, T0))
    assert unknown.kind is FailureKind.NOT_LOADED  # committed (not fenced) but never installed
    core.add_plan(plan)  # installed again: the old failure no longer answers
    core.plan_loaded("p")
    assert core.on_start(StartFrame("o", "p", "r4", start_of()), None, T0) == []


def test_frames_a_node_must_not_serve_are_refused() -> None:
    core = core_on("a", plan_of("p", "a", "b"), plan_of("q", "x", "a"), plan_of("s", "x", "y"))
    cases = [
        (
            StartFrame("mallory", "p", "r1", start_of(origin="o")),
            "a Start must come from its origin",
        ),
        (StartFrame("o", "q", "r2", start_of()), "holds stage 1 of plan q, not the first"),
        (StartFrame("o", "s", "r3", start_of()), "node a holds no stage of plan s"),
        (StartFrame("o", "p", "r4", start_of(sampling=None)), "bad sampling parameters: top_p"),
        (StartFrame("o", "p", "r5", start_of(chunk=0)), "needs a prompt and a chunk size"),
        (StartFrame("o", "p", "r6", start_of(forwarded=True)), "needs the prompt's tokens"),
    ]
    for frame, words in cases:
        failure = only_failure(core.on_start(frame, None, T0))
        assert failure.kind is FailureKind.BAD_REQUEST and words in failure.message, failure
        assert failure.to == (frame.sender if "origin" in words else frame.start.origin)
    assert core.open_requests("p") == 0 and core.next_batch(T0) == []


def test_a_request_id_is_opened_once() -> None:
    core = core_on("a", plan_of("p", "a", "b"))
    core.on_start(StartFrame("o", "p", "r", start_of()), None, T0)
    actions = core.on_start(StartFrame("o", "p", "r", start_of(prompt=(7, 8, 9))), None, T0)
    assert "request r is already open" in only_failure(actions).message
    assert Release("p", "r") in actions  # the refusal ends the open one too
    assert core.open_requests("p") == 0


def test_a_copy_of_a_frame_acted_on_is_dropped_not_computed_twice() -> None:
    """A frame that comes again (a lane resumed after a reset sends again what may not have
    arrived) changes nothing: the same Start, an earlier step, a token index it has."""
    first = core_on("a", plan_of("p", "a", "b"))
    first.on_start(StartFrame("o", "p", "r", start_of((1, 2), chunk=8)), None, T0)
    assert first.on_start(StartFrame("o", "p", "r", start_of((1, 2), chunk=8)), None, T0) == []
    assert [w.tokens for w in drain(first)] == [(1,), (2,)]  # each prompt step once
    token = TokenFrame("b", "p", "r", 7, 0, Finish.NONE)
    assert first.on_token(token, None, T0) == []
    assert first.on_token(token, None, T0) == []  # the copy
    (work,) = first.next_batch(T0)
    assert work.tokens == (7,) and first.next_batch(T0) == []
    assert first.open_requests("p") == 1

    middle = core_on("b", plan_of("p", "a", "b", "c"))
    opening = activation("p", "r", 0, "a", start_of(forwarded=True))
    assert middle.on_activation(opening, None, T0) == []
    assert middle.on_activation(activation("p", "r", 1, "a"), None, T0) == []
    assert middle.on_activation(opening, None, T0) == []  # step 0 again, with its Start
    assert middle.on_activation(activation("p", "r", 1, "a"), None, T0) == []
    assert [w.step for w in drain(middle)] == [0, 1]
    assert middle.open_requests("p") == 1


def test_a_stage_full_of_requests_refuses_more_as_overloaded() -> None:
    core = core_on("a", plan_of("p", "a", "b"), max_requests=2)
    for request in ("r1", "r2"):
        assert core.on_start(StartFrame("o", "p", request, start_of()), None, T0) == []
    failure = only_failure(core.on_start(StartFrame("o", "p", "r3", start_of()), None, T0))
    assert failure.kind is FailureKind.OVERLOADED and "2 requests (its limit)" in failure.message


def test_activations_only_from_the_previous_stage_and_in_order() -> None:
    core = core_on("b", plan_of("p", "a", "b", "c"))
    impostor = only_failure(
        core.on_activation(activation("p", "r", 0, "c", start_of(forwarded=True)), None, T0)
    )
    assert impostor.kind is FailureKind.BAD_REQUEST
    assert "node c is not the previous stage of node b" in impostor.message
    assert (
        core.on_activation(activation("p", "r2", 0, "a", start_of(forwarded=True)), None, T0) == []
    )
    skipped = only_failure(core.on_activation(activation("p", "r2", 2, "a"), None, T0))
    assert "step 2 arrived, expected 1" in skipped.message
    assert core.open_requests("p") == 0
    # A late activation without its Start (the request was dropped here) is dropped silently.
    assert core.on_activation(activation("p", "r9", 4, "a"), None, T0) == []


def test_an_end_may_overtake_its_start_and_only_the_origin_ends_a_request() -> None:
    core = core_on("a", plan_of("p", "a", "b"))
    assert core.on_end(EndFrame("o", "p", "early")) == []
    assert core.on_start(StartFrame("o", "p", "early", start_of()), None, T0) == []
    assert core.open_requests("p") == 0
    core.on_start(StartFrame("o", "p", "r", start_of()), None, T0)
    assert core.on_end(EndFrame("b", "p", "r")) == []  # a stage cannot end it
    assert core.open_requests("p") == 1
    assert core.on_end(EndFrame("o", "p", "r")) == [Release("p", "r")]


def test_a_loss_told_late_spares_the_requests_opened_after_the_link_broke() -> None:
    core = core_on("b", plan_of("p", "a", "b"))
    core.on_activation(activation("p", "r1", 0, "a", start_of(origin="o")), None, T0)
    core.on_activation(activation("p", "r2", 0, "a", start_of(origin="o")), None, T0 + 2)
    failure = only_failure(core.on_peer_lost("a", "its lane to us broke", since=T0 + 1))
    assert failure.request_id == "r1"  # r2 came over the link that replaced it
    assert core.open_requests("p") == 1


def test_a_lost_peer_ends_the_requests_it_is_part_of() -> None:
    core = core_on("b", plan_of("p", "a", "b"), plan_of("q", "b", "c"))
    core.on_activation(activation("p", "r1", 0, "a", start_of(origin="o")), None, T0)
    core.on_start(StartFrame("o", "q", "r2", start_of()), None, T0)
    core.on_start(StartFrame("z", "q", "r3", start_of(origin="z")), None, T0)
    actions = core.on_peer_lost("a", "its stream to us broke")
    failure = only_failure(actions)
    assert failure.request_id == "r1" and failure.kind is FailureKind.UNREACHABLE
    assert failure.message == "stage a at 10.0.0.1:7000 unreachable: its stream to us broke"
    assert core.open_requests("q") == 2
    assert core.on_peer_lost("z", "gone") == [Release("q", "r3")]  # its origin: no one to tell
    unreachable = core.on_unreachable("q", "r2", "c")
    assert (
        only_failure(unreachable).message == "stage c at 10.0.0.2:7000 unreachable: no link to it"
    )


def test_an_uninstalled_plan_ends_its_requests_with_the_reason() -> None:
    core = core_on("a", plan_of("p", "a", "b"))
    core.on_start(StartFrame("o", "p", "r", start_of()), None, T0)
    actions = core.remove_plan("p", "stage n9 lost; the mesh is re-planning, retry")
    assert Release("p", "r") in actions
    failure = only_failure(actions)
    assert failure.kind is FailureKind.FENCED and "stage n9 lost" in failure.message
    assert not core.has_plan("p")


def test_a_compute_failure_ends_the_request_naming_the_stage() -> None:
    core = core_on("a", plan_of("p", "a", "b"))
    core.on_start(StartFrame("o", "p", "r", start_of()), None, T0)
    (work,) = core.next_batch(T0)
    actions = core.on_computed(work, ComputeFailed(FailureKind.INTERNAL, "ValueError: bad"), T0)
    failure = only_failure(actions)
    assert failure.message == "stage 0 on node a failed: ValueError: bad"
    assert Release("p", "r") in actions and core.next_batch(T0) == []


def test_only_silent_requests_are_swept() -> None:
    core = core_on("a", plan_of("p", "a", "b"), idle_timeout_s=10.0)
    core.on_start(StartFrame("o", "p", "silent", start_of((1,))), None, T0)
    drain(core)
    core.on_start(StartFrame("o", "p", "busy", start_of((1,))), None, T0)
    (work,) = core.next_batch(T0 + 5)  # computing now
    actions = core.sweep(T0 + 12)
    failure = only_failure(actions)
    assert failure.request_id == "silent" and "idle for 10 s on node a" in failure.message
    assert core.open_requests("p") == 1  # the computing one stays
    core.on_computed(work, Hidden("h", 0.1), T0 + 30)
    assert core.sweep(T0 + 35) == []


def test_the_core_imports_no_mlx_grpc_or_asyncio() -> None:
    code = (
        "import sys, meshd.inference.stage.core, meshd.inference.stage_events\n"
        "import meshd.inference.stage.admission, meshd.inference.stage.state\n"
        "print(sorted(m for m in ('mlx', 'mlx.core', 'grpc', 'asyncio') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


# --- The plan's context -------------------------------------------------------------------------


def test_a_request_longer_than_the_plans_context_is_refused_at_every_stage() -> None:
    """No KV cache grows past what the plan reserved: the first stage refuses a Start, a
    later stage the first Activation, whose prompt plus max_tokens exceeds the context."""
    base = plan_of("p", "a", "b")
    plan = Assignment(base.plan_id, base.model_dir, base.stages, context_length=8)
    too_long = start_of(prompt=(1, 2, 3, 4, 5), sampling=SamplingParams(max_tokens=4))
    first = core_on("a", plan)
    refusal = only_failure(first.on_start(StartFrame("o", "p", "r1", too_long), None, T0))
    assert refusal.kind is FailureKind.BAD_REQUEST and refusal.to == "o"
    assert "need 9 tokens of context" in refusal.message and "reserves 8" in refusal.message
    assert "(at most 3 for this prompt)" in refusal.message
    assert "the prompt alone fills it: shorten it below 8 tokens" in plan.context_error(9, 4)
    assert first.next_batch(T0) == []
    second = core_on("b", plan)
    forwarded = start_of(
        prompt=(1, 2, 3, 4, 5), sampling=SamplingParams(max_tokens=4), forwarded=True
    )
    frame = activation("p", "r1", 0, "a", start=forwarded)
    assert "need 9 tokens" in only_failure(second.on_activation(frame, None, T0)).message
    fits = start_of(prompt=(1, 2, 3, 4, 5), sampling=SamplingParams(max_tokens=3))
    assert first.on_start(StartFrame("o", "p", "r2", fits), None, T0) == []


# --- Token ids ----------------------------------------------------------------------------------


def test_token_ids_outside_the_vocabulary_are_refused_before_any_step() -> None:
    """An embedding lookup past the vocabulary reads outside the table (MLX checks no
    bounds: a fuzzed Start corrupted the daemon's heap). The first stage refuses a Start
    whose prompt or generated tokens are not ids of the model, and ignores such a token
    from the last stage, before anything is computed."""
    core = StageCore("a")
    core.add_plan(plan_of("p", "a", "b"))
    core.plan_loaded("p", vocab_size=50)
    for rid, start in (
        ("r1", start_of((1, 2, 50))),
        ("r2", start_of((1, 2), generated=(3, 4000))),
    ):
        refused = only_failure(core.on_start(StartFrame("o", "p", rid, start), None, T0))
        assert refused.kind is FailureKind.BAD_REQUEST and refused.to == "o"
        assert "0 <= id < 50" in refused.message, refused.message
    assert core.next_batch(T0) == []
    core.on_start(StartFrame("o", "p", "r3", start_of((1, 49), chunk=8)), None, T0)
    assert [w.tokens for w in drain(core)] == [(1,), (49,)]
    refused = only_failure(core.on_token(TokenFrame("b", "p", "r3", 50, 0, Finish.NONE), None, T0))
    assert "token id 50" in refused.message
    assert core.next_batch(T0) == []


# --- Admission: the plan's reserved KV memory, a FIFO queue ---------------------------------


def bounded_plan(context: int, concurrency: int) -> Assignment:
    plan = plan_of("p", "a", "b")
    return Assignment(plan.plan_id, plan.model_dir, plan.stages, context, concurrency)


def test_requests_beyond_the_reserved_kv_wait_in_order_and_a_full_queue_is_refused() -> None:
    """Each request reserves its prompt plus max_tokens (5 + 4 = 9 tokens) of the plan's
    context x concurrency (20 x 1): two run, the next two wait in arrival order, the fifth
    finds the queue (limit 2) full. As requests end, the queue's head starts, in order."""
    core = core_on("a", bounded_plan(20, 1), max_queued=2)
    for request in ("r1", "r2", "r3", "r4"):
        assert core.on_start(StartFrame("o", "p", request, start_of()), None, T0) == []
    assert core.open_requests("p") == 2 and core.queued_requests("p") == 2
    assert core.reserved_tokens("p") == 18
    failure = only_failure(core.on_start(StartFrame("o", "p", "r5", start_of()), None, T0))
    assert failure.kind is FailureKind.QUEUE_FULL and failure.message.startswith("queue full")
    assert failure.request_id == "r5"
    assert {w.request_id for w in drain(core)} == {"r1", "r2"}  # the queued ones do not run
    core.on_end(EndFrame("o", "p", "r2"))
    assert core.queued_requests("p") == 1 and core.open_requests("p") == 2
    assert {w.request_id for w in drain(core)} == {"r3"}  # r3 came first: it starts first
    core.on_end(EndFrame("o", "p", "r4"))  # its origin gave up while it waited
    core.on_end(EndFrame("o", "p", "r1"))
    assert core.queued_requests("p") == 0 and core.open_requests("p") == 1
    assert core.reserved_tokens("p") == 9
    core.on_end(EndFrame("o", "p", "r3"))
    assert core.reserved_tokens("p") == 0 and core.open_requests("p") == 0


def test_a_plan_without_a_kv_budget_admits_up_to_the_stage_limit() -> None:
    core = core_on("a", bounded_plan(0, 4), max_queued=0, max_requests=3)
    for request in ("r1", "r2", "r3"):
        assert core.on_start(StartFrame("o", "p", request, start_of()), None, T0) == []
    assert core.queued_requests("p") == 0
    failure = only_failure(core.on_start(StartFrame("o", "p", "r4", start_of()), None, T0))
    assert "3 requests (its limit)" in failure.message


def test_queued_requests_are_refused_when_the_plan_goes_or_the_origin_is_lost() -> None:
    core = core_on("a", bounded_plan(9, 1))
    core.on_start(StartFrame("o", "p", "r1", start_of()), None, T0)
    core.on_start(StartFrame("o2", "p", "r2", start_of(origin="o2")), None, T0)
    core.on_start(StartFrame("o", "p", "r3", start_of()), None, T0)
    assert core.queued_requests("p") == 2
    assert core.on_peer_lost("o2", "gone") == []  # nobody left to tell
    assert core.queued_requests("p") == 1
    actions = core.remove_plan("p", "superseded by plan q")
    refused = {f.request_id: f for f in failures(actions)}
    assert set(refused) == {"r1", "r3"} and refused["r3"].kind is FailureKind.FENCED
    assert core.queued_requests("p") == 0


def test_a_start_that_can_never_run_is_refused_at_once_not_queued_forever() -> None:
    """A Start the stage must refuse (past the context, bad sampling, ids outside the
    vocabulary) is refused when it arrives, even while the KV budget is full: queued, it
    would wait at the head of the queue for room it can never use and hold back every
    request behind it."""
    base = plan_of("p", "a")
    plan = Assignment(base.plan_id, base.model_dir, base.stages, context_length=8, concurrency=1)
    core = StageCore("a")
    core.add_plan(plan)
    core.plan_loaded("p", vocab_size=50)
    fits = start_of((1, 2, 3), sampling=SamplingParams(max_tokens=4))
    assert core.on_start(StartFrame("o", "p", "running", fits), None, T0) == []  # budget taken
    for rid, start in (
        ("too-long", start_of(tuple(range(1, 8)), sampling=SamplingParams(max_tokens=4))),
        ("bad-sampling", start_of((1, 2), sampling=None)),
        ("bad-token", start_of((1, 99), sampling=SamplingParams(max_tokens=2))),
    ):
        refused = only_failure(core.on_start(StartFrame("o", "p", rid, start), None, T0))
        assert refused.kind is FailureKind.BAD_REQUEST and refused.request_id == rid
    assert core.queued_requests("p") == 0
    waits = start_of((1, 2), sampling=SamplingParams(max_tokens=2))
    assert core.on_start(StartFrame("o", "p", "next", waits), None, T0) == []
    assert core.queued_requests("p") == 1  # a valid Start still waits for room
