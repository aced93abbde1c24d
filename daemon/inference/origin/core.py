"""The origin core: what the origin decides for one request, as a pure state machine.

Why a pure core: where a request goes next (start it, take a token, move it to another plan
by replay or in the background, retry it on the same plan, give up) is where the origin's
correctness lives, and it must be testable without gRPC, mutual TLS or MLX, under thousands
of seeded fault schedules (``tests/origin_sim.py``, ``tests/test_origin_core.py``). So this
module does no I/O, starts nothing, reads no clock and imports no asyncio, gRPC or MLX, like
the stage's core (:mod:`meshd.inference.stage.core`): time is the ``now`` argument, the world
comes in as events, and what the origin must do goes out as decisions.
:mod:`meshd.inference.origin.runtime` carries the decisions out (frames, the client's events,
timers).

Events (methods of :class:`OriginCore`)::

    begin                    the request is admitted on its first plan
    on_connected             the links of an attempt opened (None) or did not (the reason)
    on_token                 a Token of one attempt (by number) came back from its last stage
    on_failure               a stage ended an attempt (its FailureKind and message)
    on_link_lost             the link to a node broke (a lane reset, a peer gone)
    on_plan_removed          a plan was withdrawn here
    on_tick                  time passed (``now``) and the plans served here are ``view``
    cancel / finish          the client cancelled; the client's side ended it (stop string,
                             client gone)

Decisions (returned as a tuple, the commonest one a shared constant)::

    Connect(attempt)         open the links to the attempt's plan's stages
    SendStart(attempt)       send its Start (the prompt and every token delivered so far)
    FeedToken(attempt, ...)  give a background attempt a token the client already has
    SendEnd(attempt, why)    tell every stage of an attempt that it is over
    DELIVER                  the token goes to the client
    Finished(reason)         the request ends normally ("eos", "length")
    Failed(kind, message)    the request ends with an error
    Moving(reason)           an attempt broke; the request pauses until it moves
    Resumed(...)             the first token after a move (for the event log and counts)
    Report(text)             a line for the event log (a defect)

The invariant (checked by the simulator): a request either completes with exactly the tokens
an undisturbed run gives (every attempt replays the tokens delivered so far, and the stages
are deterministic in the prefix and the seed), or fails within a bounded time with a reason;
it never waits out a timeout for an event that cannot come. In particular an attempt that
broke on a plan that stays the one served here (a lane reset, a refused connection: every
node is still a member, so no new plan will come) is retried on that plan at once, then with
backoff, by replay (:data:`TRANSPORT_RETRY_DELAYS_S`); only after those retries does the
request wait for the mesh to re-plan, bounded by ``resume_timeout_s``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from meshd.inference.errors import ErrorKind
from meshd.inference.stage_events import FailureKind, Finish

REFUSAL_HOLD_S = 1.0  # a refusal this old is the mesh's answer, not a step of a re-plan
RESUME_POLL_S = 0.01  # how often a moving request looks for its next plan
CATCH_UP_POLL_S = 0.1  # how often a running request looks for a newer plan to move to
SAME_PLAN_RETRY_S = 0.2  # a stage still loading or full: ask the same plan again after this
# A broken link on a plan that stays served here: retry on it after these pauses (the first
# at once: the transport reconnects at the next send), then wait for a re-plan.
TRANSPORT_RETRY_DELAYS_S = (0.0, 0.1, 0.3, 1.0, 2.0)
# A background move whose remaining gap it would close alone in this time switches over.
CLOSE_GAP_S = 0.5

# How a stage's Failure reads to the client when the request cannot move. A stage still
# loading, or one that moved to another plan, is worth a retry only while no token was
# generated (the router retries those); after that either is UNAVAILABLE (see error_kind).
FAILURE_KINDS: dict[FailureKind, ErrorKind] = {
    FailureKind.FENCED: ErrorKind.NO_PLAN,  # the stage has moved to another plan
    FailureKind.NOT_LOADED: ErrorKind.LOADING,
    FailureKind.OVERLOADED: ErrorKind.OVERLOADED,
    FailureKind.UNREACHABLE: ErrorKind.UNAVAILABLE,
    FailureKind.INTERNAL: ErrorKind.INTERNAL,
    FailureKind.BAD_REQUEST: ErrorKind.UNAVAILABLE,  # the stage's view of the plan differs
    # Not retried here: the client decides (429 / RESOURCE_EXHAUSTED), it knows its deadline.
    FailureKind.QUEUE_FULL: ErrorKind.OVERLOADED,
    FailureKind.CACHE_MISS: ErrorKind.UNAVAILABLE,  # retried without the cache at once
}
# Failures another attempt can get past: on the next plan, or on this one shortly.
MOVABLE_FAILURES = frozenset(
    {FailureKind.FENCED, FailureKind.NOT_LOADED, FailureKind.OVERLOADED, FailureKind.UNREACHABLE}
)
RETRY_SAME_PLAN = frozenset({FailureKind.FENCED, FailureKind.NOT_LOADED, FailureKind.OVERLOADED})


# --- Inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlanRef:
    """What the core knows of a plan: its id and its stages' nodes, first to last."""

    plan_id: str
    nodes: tuple[str, ...]

    @property
    def first(self) -> str:
        return self.nodes[0]

    @property
    def last(self) -> str:
        return self.nodes[-1]


class PlanState(enum.Enum):
    """How far this node has got with the plan served next."""

    READY = enum.auto()  # installed and loaded here: requests may run on it
    LOADING = enum.auto()
    FAILED = enum.auto()  # it could not be loaded here
    MISSING = enum.auto()  # committed, not installed here (yet)


@dataclass(frozen=True, slots=True)
class PlanView:
    """The plans served here now: the active one (new and moved requests go there), how far
    it is loaded, whether this request fits its context, and why the mesh runs no plan."""

    active: PlanRef | None = None
    state: PlanState = PlanState.MISSING
    fits: bool = True
    refusal: str = ""


NO_PLAN_VIEW = PlanView()


@dataclass(eq=False, slots=True)
class Attempt:
    """One run of the request on one plan (wire id ``<id>~<number>``, the first plain)."""

    number: int
    plan: PlanRef
    wire_id: str
    catch_up: bool = False
    started_at: float = 0.0
    from_tokens: int = 0  # tokens delivered when its Start went out
    sent: bool = False  # its Start went out (a background attempt is fed only then)
    reached: int = 0  # a background attempt: tokens it gave, each equal to the delivered one
    first_token: tuple[float, int] | None = None  # (time, index) of its first token

    def seconds_to_close(self, delivered: int, now: float) -> float | None:
        """How long a background attempt would take, at the pace it has kept since its first
        token while it shared the stages' cores with the old attempt, to give the
        ``delivered`` tokens it lacks; None before that pace is known."""
        if self.first_token is None:
            return None
        since, first_index = self.first_token
        if self.reached - first_index < 2 or now <= since:
            return None
        pace = (self.reached - first_index) / (now - since)
        return (delivered - self.reached) / pace


# --- Decisions ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Connect:
    attempt: Attempt


@dataclass(frozen=True, slots=True)
class SendStart:
    attempt: Attempt


@dataclass(frozen=True, slots=True)
class FeedToken:
    attempt: Attempt
    index: int
    token_id: int


@dataclass(frozen=True, slots=True)
class SendEnd:
    attempt: Attempt
    reason: str


class Deliver:
    """The token just given goes to the client (one shared instance: no allocation)."""

    __slots__ = ()


DELIVER = Deliver()


@dataclass(frozen=True, slots=True)
class Finished:
    reason: str  # "eos", "length", "cancelled"


@dataclass(frozen=True, slots=True)
class Failed:
    kind: ErrorKind
    message: str


@dataclass(frozen=True, slots=True)
class Moving:
    reason: str


@dataclass(frozen=True, slots=True)
class Resumed:
    plan_id: str
    after_tokens: int
    background: Attempt | None  # the attempt that caught up, for a background move
    reason: str


@dataclass(frozen=True, slots=True)
class Report:
    text: str


@dataclass(frozen=True, slots=True)
class DroppedCandidate:
    """A background move ended without switching over (for the counts and the log)."""

    reason: str


Decision = (
    Connect
    | SendStart
    | FeedToken
    | SendEnd
    | Deliver
    | Finished
    | Failed
    | Moving
    | Resumed
    | Report
    | DroppedCandidate
)
Decisions = tuple[Decision, ...]

NOTHING: Decisions = ()
JUST_DELIVER: Decisions = (DELIVER,)


class Phase(enum.Enum):
    RUNNING = enum.auto()  # an attempt runs (its links may still be opening)
    MOVING = enum.auto()  # between attempts: waiting for a plan, or a retry's pause
    DONE = enum.auto()


@dataclass(slots=True)
class Timeouts:
    """The origin's bounds (seconds)."""

    first_token_s: float = 300.0
    token_s: float = 60.0
    resume_s: float = 60.0
    catch_up_s: float = 30.0  # 0: moves by replay only


@dataclass(slots=True)
class _Move:
    """Between two attempts: what broke and what may be tried next."""

    failed: PlanRef
    reason: str
    kind: ErrorKind
    same_plan_at: float | None  # the failed plan may be tried again from then on
    transport: bool = False  # a broken link, not the plan, ended the attempt
    refused_since: float | None = None
    looked_at: float = float("-inf")  # the last time the view was looked at for a plan


@dataclass(slots=True)
class _CatchUps:
    deadlines: dict[str, float] = field(default_factory=dict)  # plan id -> give up then
    not_before: float = 0.0


class OriginCore:
    """The decisions for one request this node is the origin of."""

    def __init__(
        self,
        request_id: str,
        plan: PlanRef,
        now: float,
        *,
        timeouts: Timeouts,
        resume: bool,
    ) -> None:
        self.request_id = request_id
        self.timeouts = timeouts
        self.resume = resume
        self.tokens: list[int] = []  # every token delivered, in order (an EOS is not one)
        self.generated = 0  # tokens the stages generated (an EOS included)
        self.phase = Phase.RUNNING
        self.resumes = 0
        self.prefix_cache = True  # its Starts may use the stages' kept prefixes
        self.transport_retries = 0  # same-plan retries after broken links, this streak
        self.moving_since: float | None = None
        self.interruption = ""
        self._attempts_made = 0
        self.attempt = Attempt(0, plan, request_id, started_at=now)
        self.candidate: Attempt | None = None
        self._awaiting_token = True
        self._waited_since = now
        self._move: _Move | None = None
        self._report_pending: Attempt | bool | None = False  # True: moved by replay
        self._catch_ups = _CatchUps()

    # ------------------------------------------------------------ queries

    def attempt_of(self, number: int) -> Attempt | None:
        """The running attempt with this number (the request's or its background move's)."""
        if number == self.attempt.number and self.phase is Phase.RUNNING:
            return self.attempt
        candidate = self.candidate
        return candidate if candidate is not None and candidate.number == number else None

    def attempts(self) -> tuple[Attempt, ...]:
        """The attempts whose stages may hold the request now."""
        running = (self.attempt,) if self.phase is Phase.RUNNING else ()
        return running + ((self.candidate,) if self.candidate is not None else ())

    def wake_at(self, now: float) -> float:
        """When :meth:`on_tick` must run next at the latest: the core's next deadline (a
        token's, a retry's, a move's); besides, the view of the plans changes (see
        :attr:`poll_s`)."""
        if self.phase is Phase.DONE:
            return float("inf")
        move = self._move
        if move is not None:
            assert self.moving_since is not None
            wake = self.moving_since + self.timeouts.resume_s
            if move.same_plan_at is not None and move.same_plan_at > move.looked_at:
                wake = min(wake, move.same_plan_at)  # looked at since: it waits for the view
            if move.refused_since is not None and move.refused_since + REFUSAL_HOLD_S > now:
                wake = min(wake, move.refused_since + REFUSAL_HOLD_S)
            return wake
        timeout = self.timeouts.first_token_s if self._awaiting_token else self.timeouts.token_s
        wake = self._waited_since + timeout
        candidate = self.candidate
        if candidate is not None:
            wake = min(wake, self._catch_ups.deadlines.get(candidate.plan.plan_id, wake))
        elif self.resume and self._catch_ups.not_before > now:
            wake = min(wake, self._catch_ups.not_before)
        return wake

    @property
    def poll_s(self) -> float:
        """How often the plans served here must be looked at again (they change without an
        event: the origin reads them), for a move or a background move to start."""
        if self.phase is Phase.MOVING:
            return RESUME_POLL_S
        if self.phase is Phase.RUNNING and self.resume and self.timeouts.catch_up_s > 0:
            return CATCH_UP_POLL_S
        return float("inf")

    # ------------------------------------------------------------ events

    def begin(self) -> Decisions:
        """The request is admitted on its first plan: open its links."""
        return (Connect(self.attempt),)

    def on_connected(self, number: int, error: str | None, now: float) -> Decisions:
        """The links of attempt ``number`` opened (``error`` None) or did not."""
        attempt = self.attempt_of(number)
        if attempt is None or attempt.sent:
            return NOTHING
        if error is not None:
            if attempt is self.candidate:
                self._catch_ups.not_before = now + SAME_PLAN_RETRY_S  # again, shortly
                return self._drop_candidate(error, now, give_up=False)
            return self._interrupt(ErrorKind.UNAVAILABLE, error, now, transport=True)
        attempt.sent = True
        attempt.from_tokens = len(self.tokens)
        return (SendStart(attempt),)

    def on_send_failed(self, number: int, reason: str, now: float) -> Decisions:
        """A frame of attempt ``number`` could not go (its link broke meanwhile)."""
        attempt = self.attempt_of(number)
        if attempt is None:
            return NOTHING
        if attempt is self.candidate:
            return self._drop_candidate(reason, now, give_up=False)
        return self._interrupt(ErrorKind.UNAVAILABLE, reason, now, transport=True)

    def on_token(
        self, number: int, index: int, token_id: int, finish: Finish, now: float
    ) -> Decisions:
        """A Token of attempt ``number`` (from its last stage): the hot path."""
        attempt = self.attempt
        if number != attempt.number or self.phase is not Phase.RUNNING:
            candidate = self.candidate
            if candidate is not None and number == candidate.number:
                return self._candidate_token(candidate, index, token_id, finish, now)
            return NOTHING  # a late frame of an attempt that is over
        if index != self.generated:
            return self._out_of_order(index, token_id, now)
        self._awaiting_token = False
        self._waited_since = now
        self.generated += 1
        resumed = NOTHING
        if self.moving_since is not None:
            resumed = self._resumed()
        if finish is Finish.EOS:
            return resumed + self._finish("eos")
        self.tokens.append(token_id)
        feed = self._feed(index, token_id) if self.candidate is not None else NOTHING
        if finish is Finish.LENGTH:
            return resumed + feed + (DELIVER, *self._finish("length"))
        if resumed or feed:
            return resumed + feed + JUST_DELIVER
        return JUST_DELIVER

    def on_failure(self, number: int, kind: FailureKind, message: str, now: float) -> Decisions:
        """A stage ended attempt ``number``."""
        attempt = self.attempt_of(number)
        if attempt is None:
            return NOTHING
        if kind is FailureKind.CACHE_MISS:
            self.prefix_cache = False
            if attempt is self.candidate:
                return self._drop_candidate(message, now, give_up=False)
            return self._retry_without_cache(message, now)
        if attempt is self.candidate:
            return self._drop_candidate(message, now, give_up=kind not in RETRY_SAME_PLAN)
        error = self.error_kind(kind)
        if kind not in MOVABLE_FAILURES:
            return self._fail(error, message)
        return self._interrupt(
            error,
            message,
            now,
            same_plan=kind in RETRY_SAME_PLAN,
            transport=kind is FailureKind.UNREACHABLE,
        )

    def on_link_lost(
        self, node: str, reason: str, now: float, since: float | None = None
    ) -> Decisions:
        """The link to ``node`` broke (at ``since``, where known): every attempt through it
        begun before then may have lost its frames. One begun after it broke did not use it
        (its frames went over a new link), however late the loss is told."""

        def used_it(attempt: Attempt) -> bool:
            return node in attempt.plan.nodes and (since is None or attempt.started_at <= since)

        decisions: Decisions = NOTHING
        candidate = self.candidate
        if candidate is not None and used_it(candidate):
            decisions += self._drop_candidate(reason, now, give_up=False)
        if self.phase is Phase.RUNNING and used_it(self.attempt):
            decisions += self._interrupt(ErrorKind.UNAVAILABLE, reason, now, transport=True)
        return decisions

    def on_plan_removed(self, plan_id: str, reason: str, now: float) -> Decisions:
        """``plan_id`` was withdrawn here: its attempts are over."""
        decisions: Decisions = NOTHING
        candidate = self.candidate
        if candidate is not None and candidate.plan.plan_id == plan_id:
            decisions += self._drop_candidate(reason, now, give_up=True)
        if self.phase is Phase.RUNNING and self.attempt.plan.plan_id == plan_id:
            decisions += self._interrupt(ErrorKind.UNAVAILABLE, reason, now)
        move = self._move
        if move is not None and move.failed.plan_id == plan_id:
            move.same_plan_at = None  # it is gone: no retry there
        return decisions

    def on_tick(self, now: float, view: PlanView) -> Decisions:
        """Time passed: deadlines, a move's next plan, a background move to start or end."""
        if self.phase is Phase.MOVING:
            return self._next_plan(now, view)
        if self.phase is Phase.DONE:
            return NOTHING
        timeout = self.timeouts.first_token_s if self._awaiting_token else self.timeouts.token_s
        if now - self._waited_since >= timeout:
            last = self.attempt.plan.last
            return self._fail(
                ErrorKind.UNAVAILABLE,
                f"no token from the mesh for {timeout:g} s (plan "
                f"{self.attempt.plan.plan_id[:12]}, last stage {last}); giving up",
            )
        if self.resume:
            return self._catch_up_step(now, view)
        return NOTHING

    def cancel(self) -> Decisions:
        if self.phase is Phase.DONE:
            return NOTHING
        return self._finish("cancelled")

    def finish(self, reason: str) -> Decisions:
        """The client's side ended the request (a stop string, the client went away)."""
        if self.phase is Phase.DONE:
            return NOTHING
        return self._end_all(reason)

    def error_kind(self, kind: FailureKind) -> ErrorKind:
        error = FAILURE_KINDS[kind]
        if error in (ErrorKind.LOADING, ErrorKind.NO_PLAN) and self.generated > 0:
            return ErrorKind.UNAVAILABLE  # mid-stream, the mesh became unavailable
        return error

    # ------------------------------------------------------------ ends

    def _end_all(self, reason: str) -> Decisions:
        ends: list[Decision] = [SendEnd(attempt, reason) for attempt in self.attempts()]
        self.phase = Phase.DONE
        self.candidate = None
        return tuple(ends)

    def _finish(self, reason: str) -> Decisions:
        return (*self._end_all(f"finished ({reason})"), Finished(reason))

    def _fail(self, kind: ErrorKind, message: str) -> Decisions:
        return (*self._end_all(message), Failed(kind, message))

    def _out_of_order(self, index: int, token_id: int, now: float) -> Decisions:
        if index < self.generated and index < len(self.tokens):
            if token_id == self.tokens[index]:
                return NOTHING  # an attempt that took over gives the client's tokens first
            message = (
                f"DEFECT: plan {self.attempt.plan.plan_id[:12]} gave token {token_id} at "
                f"position {index} of request {self.request_id}, where the client got "
                f"{self.tokens[index]} (please report this)"
            )
            return (Report(message), *self._fail(ErrorKind.INTERNAL, message))
        return self._fail(
            ErrorKind.INTERNAL,
            f"token {index} arrived, expected {self.generated} (plan "
            f"{self.attempt.plan.plan_id[:12]}, last stage {self.attempt.plan.last})",
        )

    def _retry_without_cache(self, message: str, now: float) -> Decisions:
        """A stage lacked the kept prefix its first stage chose (their caches went apart):
        the request runs again on the same plan at once, without the prefix cache, by replay
        of what it delivered (nothing moved: no pause is counted)."""
        failed = self.attempt
        self._attempts_made += 1
        number = self._attempts_made
        self.attempt = Attempt(number, failed.plan, f"{self.request_id}~{number}", started_at=now)
        self._waited_since = now
        return (
            SendEnd(failed, f"again without the prefix cache: {message}"),
            Connect(self.attempt),
        )

    # ------------------------------------------------------------ moves by replay

    def _interrupt(
        self,
        kind: ErrorKind,
        reason: str,
        now: float,
        *,
        same_plan: bool = False,
        transport: bool = False,
    ) -> Decisions:
        """The request's attempt cannot go on: switch to a background attempt under way, or
        end it and wait for the next plan (or a retry on this one)."""
        if self.phase is not Phase.RUNNING:
            return NOTHING
        if not self.resume:
            return self._fail(kind, reason)
        if self.candidate is not None:  # the new attempt is part of the way already
            return self._switch_over(reason, now)
        failed = self.attempt
        if self.moving_since is None:
            self.moving_since = now
        self.interruption = reason
        retry_at: float | None = None
        if transport and self.transport_retries < len(TRANSPORT_RETRY_DELAYS_S):
            retry_at = now + TRANSPORT_RETRY_DELAYS_S[self.transport_retries]
            self.transport_retries += 1
        elif same_plan:
            retry_at = now + SAME_PLAN_RETRY_S
        self._move = _Move(failed.plan, reason, kind, retry_at, transport=transport)
        self.phase = Phase.MOVING
        return (SendEnd(failed, f"moving: {reason}"), Moving(reason))

    def _next_plan(self, now: float, view: PlanView) -> Decisions:
        """A moving request's next attempt: the active plan once ready here; the failed one
        again only when a retry there is due."""
        move = self._move
        assert move is not None and self.moving_since is not None
        move.looked_at = now
        active = view.active
        if active is not None and view.state is PlanState.READY:
            if active.plan_id != move.failed.plan_id:
                return self._new_attempt(active, now)
            if move.same_plan_at is not None and now >= move.same_plan_at:
                return self._new_attempt(active, now)
        if active is None and view.refusal:
            if move.refused_since is None:
                move.refused_since = now
            if now - move.refused_since >= REFUSAL_HOLD_S:
                return self._fail(
                    ErrorKind.UNAVAILABLE,
                    f"request stopped after {self.generated} tokens: the mesh can no longer "
                    f"run the model ({view.refusal}); it was interrupted by: {move.reason}",
                )
        else:
            move.refused_since = None
        if now >= self.moving_since + self.timeouts.resume_s:
            retried = (
                f" ({self.transport_retries} retries on plan {move.failed.plan_id[:12]} failed too)"
                if self.transport_retries
                else ""
            )
            return self._fail(
                ErrorKind.UNAVAILABLE,
                f"request stopped after {self.generated} tokens: no plan to go on on within "
                f"{self.timeouts.resume_s:g} s after: {move.reason}{retried}",
            )
        return NOTHING

    def _new_attempt(self, plan: PlanRef, now: float) -> Decisions:
        move = self._move
        assert move is not None
        if plan.plan_id != move.failed.plan_id or (move.transport and self.generated > 0):
            self.resumes += 1
            self._report_pending = True
        self._attempts_made += 1
        number = self._attempts_made
        self.attempt = Attempt(number, plan, f"{self.request_id}~{number}", started_at=now)
        self.phase = Phase.RUNNING
        self._move = None
        self._awaiting_token = True
        self._waited_since = now
        return (Connect(self.attempt),)

    def _resumed(self) -> Decisions:
        """The first token after a move: the streak of moves is over."""
        pending = self._report_pending
        self._report_pending = False
        self.moving_since = None
        self.transport_retries = 0
        if pending is False:
            return NOTHING  # a retry on the same plan before any token: nothing moved
        background = pending if isinstance(pending, Attempt) else None
        return (
            Resumed(self.attempt.plan.plan_id, self.generated - 1, background, self.interruption),
        )

    # ------------------------------------------------------------ background moves

    def _catch_up_step(self, now: float, view: PlanView) -> Decisions:
        """Start a background move when the plan served next is ready here and the request
        runs on another; end one that has not caught up in time."""
        catch_ups = self._catch_ups
        candidate = self.candidate
        if candidate is not None:
            deadline = catch_ups.deadlines.get(candidate.plan.plan_id, now)
            if now >= deadline:
                return self._drop_candidate(
                    f"it did not catch up within {self.timeouts.catch_up_s:g} s (it gave "
                    f"{candidate.reached} of the {self.generated} tokens delivered)",
                    now,
                    give_up=True,
                )
            return NOTHING
        if self.timeouts.catch_up_s <= 0 or self.generated < 1 or now < catch_ups.not_before:
            return NOTHING
        active = view.active
        if active is None or active.plan_id == self.attempt.plan.plan_id:
            return NOTHING
        if view.state in (PlanState.LOADING, PlanState.MISSING):
            return NOTHING
        deadline = catch_ups.deadlines.get(active.plan_id)
        if deadline is not None and now >= deadline:
            return NOTHING  # given up on this plan
        if view.state is PlanState.FAILED or not view.fits:
            catch_ups.deadlines[active.plan_id] = now
            return NOTHING
        # The time a move may take runs from its first try on this plan.
        catch_ups.deadlines.setdefault(active.plan_id, now + self.timeouts.catch_up_s)
        self._attempts_made += 1
        number = self._attempts_made
        wire_id = f"{self.request_id}~{number}"
        self.candidate = Attempt(number, active, wire_id, catch_up=True, started_at=now)
        return (Connect(self.candidate),)

    def _feed(self, index: int, token_id: int) -> Decisions:
        """A background attempt gets each delivered token as its next input."""
        candidate = self.candidate
        assert candidate is not None
        if not candidate.sent or len(candidate.plan.nodes) == 1:
            return NOTHING  # a single stage computes its next input itself
        return (FeedToken(candidate, index, token_id),)

    def _candidate_token(
        self, candidate: Attempt, index: int, token_id: int, finish: Finish, now: float
    ) -> Decisions:
        """A token of the background attempt: one the client has is checked, the first one
        it has not switches the stream over."""
        if index < self.generated and index < len(self.tokens) and token_id == self.tokens[index]:
            candidate.reached = index + 1
            if candidate.first_token is None:
                candidate.first_token = (now, index)
            to_close = candidate.seconds_to_close(self.generated, now)
            if to_close is not None and to_close <= CLOSE_GAP_S:
                return self._switch_over(
                    f"plan {candidate.plan.plan_id[:12]} was {to_close:.2f} s from catching up",
                    now,
                )
            return NOTHING
        if index != self.generated or self.phase is not Phase.RUNNING:
            delivered = self.tokens[index] if index < len(self.tokens) else "none yet"
            message = (
                f"DEFECT: plan {candidate.plan.plan_id[:12]} gave token {token_id} at "
                f"position {index} of request {self.request_id}, where plan "
                f"{self.attempt.plan.plan_id[:12]} gave {delivered}; the request stays on "
                f"plan {self.attempt.plan.plan_id[:12]} (please report this)"
            )
            return (
                Report(message),
                *self._drop_candidate("its tokens differ from the delivered ones", now, True),
            )
        switched = self._switch_over(f"plan {candidate.plan.plan_id[:12]} caught up", now)
        return switched + self.on_token(candidate.number, index, token_id, finish, now)

    def _switch_over(self, reason: str, now: float) -> Decisions:
        """The background attempt becomes the request's: the old one ends on its stages."""
        candidate = self.candidate
        assert candidate is not None
        self.candidate = None
        old = self.attempt
        ends: Decisions = (SendEnd(old, f"moved to plan {candidate.plan.plan_id[:12]}: {reason}"),)
        if self.moving_since is None:
            self.moving_since = now
        self.interruption = reason
        self.attempt = candidate
        self.phase = Phase.RUNNING
        self._move = None
        self._awaiting_token = False  # it has computed tokens already
        self._waited_since = now
        self.resumes += 1
        self._report_pending = candidate
        return (*ends, Moving(reason))

    def _drop_candidate(self, reason: str, now: float, give_up: bool = True) -> Decisions:
        """End the background move (the request goes on on its current attempt). With
        ``give_up`` no other is tried on that plan; else one is tried again shortly."""
        candidate = self.candidate
        if candidate is None:
            return NOTHING
        self.candidate = None
        if give_up:
            self._catch_ups.deadlines[candidate.plan.plan_id] = now
        self._catch_ups.not_before = max(self._catch_ups.not_before, now + SAME_PLAN_RETRY_S)
        return (SendEnd(candidate, f"background move ended: {reason}"), DroppedCandidate(reason))
