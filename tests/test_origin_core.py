"""The origin core (`meshd.inference.origin.core`): one event at a time, and under seeded faults.

The hand-written cases pin each decision (start, take a token, move by replay, retry a plan
whose link broke, move in the background, ignore late frames, give up with a reason); the
seeded sweep (`tests/origin_sim.py`) checks the promise under thousands of fault schedules: a
request completes with exactly the undisturbed run's tokens, or fails in bounded time with a
reason, and never waits out a timeout for an event that cannot come.
"""

from __future__ import annotations

import time

import pytest

from meshd.inference.errors import ErrorKind
from meshd.inference.origin import core as origin_core
from meshd.inference.origin.core import (
    DELIVER,
    Connect,
    DroppedCandidate,
    Failed,
    FeedToken,
    Finished,
    Moving,
    OriginCore,
    Phase,
    PlanRef,
    PlanState,
    PlanView,
    Report,
    Resumed,
    SendEnd,
    SendStart,
    Timeouts,
)
from meshd.inference.stage_events import FailureKind, Finish
from tests.origin_sim import FAULTS, OriginViolation, simulate, token_of

pytestmark = pytest.mark.unit

SEEDS = 10_000
P1 = PlanRef("p1", ("a", "b", "c"))
P2 = PlanRef("p2", ("b", "d"))
SERVES_P1 = PlanView(P1, PlanState.READY)
SERVES_P2 = PlanView(P2, PlanState.READY)


def started(resume: bool = True, catch_up_s: float = 30.0) -> OriginCore:
    """A request whose first attempt's Start went out at t=0."""
    core = OriginCore(
        "r", P1, 0.0, timeouts=Timeouts(catch_up_s=catch_up_s, resume_s=60.0), resume=resume
    )
    assert core.begin() == (Connect(core.attempt),)
    assert core.on_connected(0, None, 0.0) == (SendStart(core.attempt),)
    return core


def give(core: OriginCore, number: int, count: int, now: float = 1.0) -> None:
    for _ in range(count):
        index = core.generated
        assert core.on_token(number, index, token_of(index), Finish.NONE, now) == (DELIVER,)


def of_type(decisions: tuple[object, ...], kind: type) -> list[object]:
    return [decision for decision in decisions if isinstance(decision, kind)]


def test_an_undisturbed_request_delivers_each_token_then_ends_every_stage() -> None:
    core = started()
    give(core, 0, 3)
    decisions = core.on_token(0, 3, token_of(3), Finish.LENGTH, 1.0)
    assert decisions[0] is DELIVER
    assert of_type(decisions, SendEnd) == [SendEnd(core.attempt, "finished (length)")]
    assert decisions[-1] == Finished("length")
    assert core.tokens == [token_of(i) for i in range(4)] and core.phase is Phase.DONE


def test_an_eos_ends_the_request_without_a_token_for_the_client() -> None:
    core = started()
    give(core, 0, 2)
    decisions = core.on_token(0, 2, 99, Finish.EOS, 1.0)
    assert DELIVER not in decisions and decisions[-1] == Finished("eos")
    assert core.generated == 3 and len(core.tokens) == 2


def test_a_lane_reset_on_the_origins_link_is_retried_on_the_same_plan_at_once() -> None:
    core = started()
    give(core, 0, 5)
    decisions = core.on_link_lost("a", "link to a broke: connection reset", 2.0)
    assert of_type(decisions, SendEnd) and of_type(decisions, Moving)
    assert core.wake_at(2.0) == 2.0  # due now: the transport reconnects at the next send
    (connect,) = core.on_tick(2.0, SERVES_P1)
    assert isinstance(connect, Connect) and connect.attempt.plan is P1
    assert connect.attempt.wire_id == "r~1"
    (start,) = core.on_connected(1, None, 2.01)
    assert isinstance(start, SendStart) and start.attempt.from_tokens == 5  # a replay
    decisions = core.on_token(1, 5, token_of(5), Finish.NONE, 2.1)
    assert decisions[-1] is DELIVER
    (resumed,) = of_type(decisions, Resumed)
    assert resumed.plan_id == "p1" and resumed.after_tokens == 5
    assert core.resumes == 1 and core.transport_retries == 0


def test_a_lane_reset_between_stages_reads_as_unreachable_and_is_retried_too() -> None:
    core = started()
    give(core, 0, 2)
    core.on_failure(0, FailureKind.UNREACHABLE, "stage b unreachable: lane reset", 1.5)
    assert isinstance(core.on_tick(1.5, SERVES_P1)[0], Connect)


def test_a_loss_told_late_ends_only_the_attempts_begun_before_the_link_broke() -> None:
    """A listener tells a lane's loss up to its resume grace after the break: a request
    begun meanwhile went over a new link and must not be replayed for it."""
    core = OriginCore("r", P1, 5.0, timeouts=Timeouts(resume_s=60.0), resume=True)
    core.begin()
    core.on_connected(0, None, 5.0)
    give(core, 0, 3, now=5.5)
    assert core.on_link_lost("b", "its lane to us broke", 6.0, since=4.0) == ()
    assert core.phase is Phase.RUNNING and core.resumes == 0
    decisions = core.on_link_lost("b", "its lane to us broke", 6.5, since=5.0)
    assert of_type(decisions, SendEnd) and of_type(decisions, Moving)  # begun by 5.0: it used it


def test_transport_retries_back_off_then_the_request_waits_for_a_re_plan_and_fails() -> None:
    core = started()
    give(core, 0, 1)
    now = 1.0
    core.on_link_lost("b", "connection reset", now)
    for delay in origin_core.TRANSPORT_RETRY_DELAYS_S:
        now += delay
        assert core.wake_at(now) == now
        (connect,) = core.on_tick(now, SERVES_P1)
        assert isinstance(connect, Connect)
        now += 0.01
        assert of_type(core.on_connected(connect.attempt.number, "refused", now), Moving)
    assert core.on_tick(now + 5.0, SERVES_P1) == ()  # no more retries: a re-plan may come
    (failed,) = core.on_tick(1.0 + 60.0, SERVES_P1)  # its attempts ended already
    assert isinstance(failed, Failed) and failed.kind is ErrorKind.UNAVAILABLE
    assert "retries on plan p1 failed too" in failed.message and "refused" in failed.message


def test_a_killed_stage_moves_the_request_to_the_plan_without_it() -> None:
    core = started()
    give(core, 0, 4)
    core.on_link_lost("c", "connection reset", 1.0)
    (connect,) = core.on_tick(1.0, SERVES_P1)
    core.on_connected(connect.attempt.number, "connection refused", 1.01)
    core.on_plan_removed("p1", "node c lost", 2.0)
    assert core.on_tick(2.0, PlanView()) == ()  # no plan yet: waits
    assert core.on_tick(3.0, PlanView(P2, PlanState.LOADING)) == ()
    (connect,) = core.on_tick(4.0, SERVES_P2)
    assert connect.attempt.plan is P2
    (start,) = core.on_connected(connect.attempt.number, None, 4.0)
    assert start.attempt.from_tokens == 4 and not start.attempt.catch_up


def test_a_failure_that_cannot_move_ends_the_request_with_its_kind() -> None:
    core = started()
    decisions = core.on_failure(0, FailureKind.INTERNAL, "out of memory", 1.0)
    assert decisions[-1] == Failed(ErrorKind.INTERNAL, "out of memory")


def test_without_resume_a_broken_link_fails_at_once() -> None:
    core = started(resume=False)
    give(core, 0, 1)
    decisions = core.on_link_lost("a", "reset", 1.0)
    assert decisions[-1] == Failed(ErrorKind.UNAVAILABLE, "reset")


def test_a_stage_still_loading_is_asked_again_shortly() -> None:
    core = started()
    core.on_failure(0, FailureKind.NOT_LOADED, "loading", 0.1)
    assert core.on_tick(0.2, SERVES_P1) == ()
    assert isinstance(core.on_tick(0.1 + origin_core.SAME_PLAN_RETRY_S, SERVES_P1)[0], Connect)
    assert core.resumes == 0  # no token yet: nothing moved


def test_a_mesh_that_refuses_the_model_ends_a_moving_request_after_the_hold() -> None:
    core = started()
    give(core, 0, 1)
    core.on_plan_removed("p1", "withdrawn", 1.0)
    refusal = PlanView(refusal="not enough memory")
    assert core.on_tick(1.0, refusal) == ()
    decisions = core.on_tick(1.0 + origin_core.REFUSAL_HOLD_S, refusal)
    assert isinstance(decisions[-1], Failed) and "not enough memory" in decisions[-1].message


def test_no_token_for_the_token_timeout_fails_the_request() -> None:
    core = started(catch_up_s=0)
    give(core, 0, 1, now=1.0)
    assert core.wake_at(1.0) == 61.0
    assert core.on_tick(60.0, SERVES_P1) == ()
    assert isinstance(core.on_tick(61.0, SERVES_P1)[-1], Failed)


def test_late_and_duplicate_frames_are_ignored() -> None:
    core = started()
    give(core, 0, 3)
    assert core.on_token(0, 1, token_of(1), Finish.NONE, 1.0) == ()  # a duplicate
    core.on_link_lost("a", "reset", 1.0)
    core.on_connected(core.on_tick(1.0, SERVES_P1)[0].attempt.number, None, 1.0)
    assert core.on_token(0, 3, token_of(3), Finish.NONE, 1.1) == ()  # the old attempt's
    assert core.on_failure(0, FailureKind.INTERNAL, "late", 1.1) == ()
    assert core.on_token(1, 3, token_of(3), Finish.NONE, 1.2)[-1] is DELIVER


def test_a_background_move_catches_up_then_takes_over() -> None:
    core = started()
    give(core, 0, 3)
    (connect,) = core.on_tick(1.0, SERVES_P2)
    candidate = connect.attempt
    assert candidate.catch_up and candidate.plan is P2
    (start,) = core.on_connected(candidate.number, None, 1.0)
    assert start.attempt.from_tokens == 3
    decisions = core.on_token(0, 3, token_of(3), Finish.NONE, 1.1)
    assert decisions == (FeedToken(candidate, 3, token_of(3)), DELIVER)
    assert core.on_token(candidate.number, 3, token_of(3), Finish.NONE, 1.2) == ()
    decisions = core.on_token(candidate.number, 4, token_of(4), Finish.NONE, 1.3)
    assert of_type(decisions, SendEnd)[0].attempt.plan is P1  # the old attempt ends
    assert decisions[-1] is DELIVER and core.attempt is candidate
    assert of_type(decisions, Resumed)[0].background is candidate


def test_a_background_move_that_differs_is_a_defect_and_the_request_stays() -> None:
    core = started()
    give(core, 0, 3)
    candidate = core.on_tick(1.0, SERVES_P2)[0].attempt
    core.on_connected(candidate.number, None, 1.0)
    decisions = core.on_token(candidate.number, 1, 12345, Finish.NONE, 1.1)
    assert "DEFECT" in of_type(decisions, Report)[0].text
    assert of_type(decisions, DroppedCandidate) and core.candidate is None
    give(core, 0, 1)


def test_when_the_old_plan_fails_the_background_move_carries_on() -> None:
    core = started()
    give(core, 0, 3)
    candidate = core.on_tick(1.0, SERVES_P2)[0].attempt
    core.on_connected(candidate.number, None, 1.0)
    decisions = core.on_failure(0, FailureKind.FENCED, "handed over", 2.0)
    assert of_type(decisions, Moving) and core.attempt is candidate
    assert core.on_token(candidate.number, 3, token_of(3), Finish.NONE, 2.1)[-1] is DELIVER


def test_cancel_ends_every_attempt() -> None:
    core = started()
    decisions = core.cancel()
    assert decisions == (SendEnd(core.attempt, "finished (cancelled)"), Finished("cancelled"))
    assert core.cancel() == ()


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_alone_keeps_the_promise(fault: str) -> None:
    for seed in range(400):
        simulate(seed, faults=(fault,), n_faults=2)


def test_seeded_fault_schedules_keep_the_promise() -> None:
    started_at = time.perf_counter()
    for seed in range(SEEDS):
        simulate(seed)
    assert time.perf_counter() - started_at < 60, "the sweep must stay fast"


def test_the_simulator_catches_waiting_for_a_plan_after_a_lane_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the same-plan retry (the old behaviour) a lane reset waits out the resume
    timeout: the oracle must say so."""
    monkeypatch.setattr(origin_core, "TRANSPORT_RETRY_DELAYS_S", ())
    with pytest.raises(OriginViolation, match=r"could not come|although the mesh serves"):
        for seed in range(500):
            simulate(seed, faults=("lane_reset",), n_faults=1)
