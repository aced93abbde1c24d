"""One request the origin holds for a client (:mod:`meshd.inference.origin`): its prompt and
tokens so far, the attempt it runs now, a background move's second attempt, and how a
stage's failure reads to the client.

State and bookkeeping, no I/O, so the origin's flow of attempts and moves
(:mod:`meshd.inference.origin_moves`) reads apart from what a request remembers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import numpy as np

from meshd.inference.errors import ErrorKind, InferenceError
from meshd.inference.frames import failure_from_proto, finish_from_proto, start_to_proto
from meshd.inference.generation_events import (
    FinalEvent,
    FinishReason,
    GenerationEvent,
    TokenEvent,
    Usage,
)
from meshd.inference.installed import InstalledPlan
from meshd.inference.sampling import SamplingParams, StopChecker
from meshd.inference.stage_events import FailureKind, Finish, RequestStart
from meshd.wire import dataplane_pb2 as dp

MAX_ACTIVATION_BYTES = 32 << 20  # a prefill chunk is cut so its activation stays below this


# How a stage's Failure reads to the client when the request cannot move. A stage still
# loading, or one that moved to another plan, is worth a retry only while no token was
# generated (the router retries those); after that either is UNAVAILABLE (see error_of).
_FAILURE_KINDS: dict[FailureKind, ErrorKind] = {
    FailureKind.FENCED: ErrorKind.NO_PLAN,  # the stage has moved to another plan
    FailureKind.NOT_LOADED: ErrorKind.LOADING,
    FailureKind.OVERLOADED: ErrorKind.OVERLOADED,
    FailureKind.UNREACHABLE: ErrorKind.UNAVAILABLE,
    FailureKind.INTERNAL: ErrorKind.INTERNAL,
    FailureKind.BAD_REQUEST: ErrorKind.UNAVAILABLE,  # the stage's view of the plan differs
    # Not retried here: the client decides (429 / RESOURCE_EXHAUSTED), it knows its deadline.
    FailureKind.QUEUE_FULL: ErrorKind.OVERLOADED,
}
# Failures another attempt can get past: on the next plan, or on this one shortly (a stage
# still loading or full, or one that has not committed the plan yet or already left it: the
# origin asks again until its own view moves on).
MOVABLE_FAILURES = frozenset(
    {FailureKind.FENCED, FailureKind.NOT_LOADED, FailureKind.OVERLOADED, FailureKind.UNREACHABLE}
)
RETRY_SAME_PLAN = frozenset({FailureKind.FENCED, FailureKind.NOT_LOADED, FailureKind.OVERLOADED})


@dataclass(frozen=True)
class RequestOptions:
    """How the client asked for a request, beyond the sampling parameters."""

    return_logits: bool
    prefill_chunk: int
    ignore_eos: bool
    resume: bool


@dataclass(frozen=True)
class Stop:
    """A local decision that ends an attempt: cancelled (``error`` None) or failed;
    ``movable`` when the request may go on on another plan (a stage lost, the plan removed)."""

    error: InferenceError | None
    attempt: int | None = None  # None: whichever attempt runs (a cancellation)
    movable: bool = False


class Interrupted(Exception):
    """The plan a request runs on cannot carry it on; another attempt may
    (:mod:`meshd.inference.origin_moves`)."""

    def __init__(self, error: InferenceError, *, same_plan: bool = False) -> None:
        super().__init__(str(error))
        self.error = error
        self.same_plan = same_plan  # a stage still loading or full: this plan may, shortly


@dataclass(eq=False)
class Candidate:
    """A second attempt of a request on a newer plan, catching up in the background."""

    number: int
    plan: InstalledPlan
    wire_id: str
    started_at: float  # loop time
    from_tokens: int  # tokens the request had delivered when it started
    reached: int = 0  # tokens it has given so far (each equal to the delivered one)
    first_token: tuple[float, int] | None = None  # (loop time, index) of its first token

    def seconds_to_close(self, delivered: int, now: float) -> float | None:
        """How long it would take, at the pace it has kept since its first token while it
        shared the stages' cores with the old attempt, to give the ``delivered`` tokens it
        lacks; None before that pace is known. Alone it goes faster: this bounds the pause."""
        if self.first_token is None:
            return None
        since, first_index = self.first_token
        if self.reached - first_index < 2 or now <= since:
            return None
        pace = (self.reached - first_index) / (now - since)
        return (delivered - self.reached) / pace

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(self.plan.assignment.node_ids)

    @property
    def last_node(self) -> str:
        return self.plan.assignment.stages[-1].node_id


class OriginRequest:
    """A request this node holds for a client: its prompt and tokens so far, the plan it runs
    on now, and the incoming frames of its current attempt -> events."""

    def __init__(
        self,
        request_id: str,
        plan: InstalledPlan,
        prompt: tuple[int, ...],
        params: SamplingParams,
        seed: int,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.tokens: list[int] = []  # every token delivered so far, in order
        self._checker = StopChecker(plan.tokenizer, params.stop)
        self._seed = seed
        self._started = time.perf_counter()
        self._first_at: float | None = None
        self._last_at: float | None = None
        self._decode_compute_s = 0.0
        self.generated = 0
        self.end_reason = "the client went away"
        self.attempt = 0
        self.resumes = 0
        self.paused_s = 0.0
        self.interrupted_at: float | None = None  # set while a move is under way
        self.moving_since: float | None = None  # loop time the current streak of moves began
        self.interruption = ""
        self.report_pending = False  # a move to another plan: say so at its first token
        self.attempts_made = 0
        self.candidate: Candidate | None = None  # a background move under way
        self.moved_in_background: Candidate | None = None  # the last move, until reported
        self.catch_up_deadlines: dict[str, float] = {}  # plan id -> give up catching up then
        self.catch_up_not_before = 0.0  # loop time of the next try after a transient refusal
        # Links to a newer plan's stages being opened for a background move (task owned here).
        self.connecting: tuple[InstalledPlan, asyncio.Task[str | None]] | None = None
        # Frames of every attempt, told apart by wire id (a stop by attempt number).
        self.inbox: asyncio.Queue[tuple[float, dp.Frame | Stop]] = asyncio.Queue()
        self.bind(plan, 0)

    def new_attempt(self) -> tuple[int, str]:
        """The number and wire id of a new attempt (never one used before)."""
        self.attempts_made += 1
        number = self.attempts_made
        return number, f"{self.request_id}~{number}"

    def bind(self, plan: InstalledPlan, number: int) -> None:
        """Run attempt ``number`` (wire id ``<id>~<number>``, the first plain) on ``plan``."""
        self.attempt = number
        self.plan = plan
        self.plan_id = plan.plan_id
        self.nodes = frozenset(plan.assignment.node_ids)
        self.last_stage = plan.assignment.stages[-1]
        self.wire_id = self.request_id if number == 0 else f"{self.request_id}~{number}"
        self.awaiting_token = True

    def interrupted(self, reason: str, loop_time: float) -> None:
        """An attempt ended early; the pause runs from the last token (or now) on."""
        if self.interrupted_at is None:
            self.interrupted_at = self._last_at or time.perf_counter()
            self.moving_since = loop_time
        self.interruption = reason

    def deliver(self, item: dp.Frame | Stop) -> None:
        """Queue a frame or a local stop, stamped with its arrival (timing is measured at
        arrival, not when the client gets round to reading it)."""
        self.inbox.put_nowait((time.perf_counter(), item))

    def on_token(self, token: dp.Token, arrived_at: float) -> list[GenerationEvent]:
        """Events for one Token frame: the token's text, and the final event if it ends."""
        if token.index != self.generated:
            raise self.failed(
                InferenceError(
                    ErrorKind.INTERNAL,
                    f"token {token.index} arrived, expected {self.generated} (plan "
                    f"{self.plan_id[:12]}, last stage {self.last_stage.node_id})",
                )
            )
        self.awaiting_token = False
        if self._first_at is None:
            self._first_at = arrived_at
        else:
            self._decode_compute_s += token.compute_s
        if self.interrupted_at is not None:
            self.paused_s += arrived_at - self.interrupted_at
            self.interrupted_at = self.moving_since = None
        self._last_at = arrived_at
        self.generated += 1
        finish = finish_from_proto(token.finish)
        if finish is Finish.EOS:
            return [self.final("eos")]
        self.tokens.append(token.token_id)
        logits = np.frombuffer(token.logits, dtype=np.float32) if token.logits else None
        update = self._checker.add_token(token.token_id)
        events: list[GenerationEvent] = [
            TokenEvent(token.token_id, token.index, update.text, logits)
        ]
        if update.stopped:
            events.append(self.final("stop"))
        elif finish is Finish.LENGTH:
            events.append(self.final("length"))
        return events

    def error_of(self, failure: dp.Failure) -> InferenceError:
        kind = _FAILURE_KINDS[failure_from_proto(failure.kind)]
        if kind in (ErrorKind.LOADING, ErrorKind.NO_PLAN) and self.generated > 0:
            kind = ErrorKind.UNAVAILABLE  # mid-stream, the mesh became unavailable
        return InferenceError(kind, failure.message)

    def failed(self, error: InferenceError) -> InferenceError:
        self.end_reason = str(error)
        return error

    def final(self, reason: FinishReason) -> FinalEvent:
        flushed = self._checker.finish().text
        self.end_reason = f"finished ({reason})"
        now = time.perf_counter()
        first = self._first_at
        usage = Usage(
            prompt_tokens=len(self.prompt),
            completion_tokens=self.generated,
            ttft_s=(first - self._started) if first is not None else 0.0,
            decode_s=(self._last_at - first) if first is not None and self._last_at else 0.0,
            total_s=now - self._started,
            decode_compute_s=self._decode_compute_s,
            seed=self._seed,
            resumes=self.resumes,
            paused_s=self.paused_s,
            plan_id=self.plan_id,
        )
        return FinalEvent(reason, usage, flushed)

    def start_frame(
        self,
        origin: str,
        params: SamplingParams,
        seed: int,
        options: RequestOptions,
        candidate: Candidate | None = None,
    ) -> dp.Frame:
        """The Start of the current attempt, or of ``candidate`` (a background move, which is
        fed the tokens delivered from then on); ``origin`` is this node."""
        plan = candidate.plan if candidate is not None else self.plan
        wire_id = candidate.wire_id if candidate is not None else self.wire_id
        chunk = max(1, min(options.prefill_chunk, MAX_ACTIVATION_BYTES // (4 * plan.hidden_size)))
        start = RequestStart(
            origin=origin,
            prompt=self.prompt,
            prompt_length=len(self.prompt),
            sampling=replace(params, seed=seed, stop=()),
            eos_ids=frozenset() if options.ignore_eos else frozenset(plan.tokenizer.eos_token_ids),
            prefill_chunk=chunk,
            return_logits=options.return_logits,
            generated=tuple(self.tokens),
            catch_up=candidate is not None,
        )
        return dp.Frame(plan_id=plan.plan_id, request_id=wire_id, start=start_to_proto(start))
