"""The origin: requests this node asks the mesh, from validation to the client's last event.

The origin is the node a client talks to. It checks the request (nothing is sent for bad
input), sends the Start to the plan's first stage, turns the Token frames the last stage
sends back into :class:`TokenEvent`s (detokenized, stop strings applied by
:class:`meshd.inference.sampling.StopChecker`) and ends with one :class:`FinalEvent`. On the
way out (finished, stopped, cancelled, the client gone, failed) it sends End to every stage,
so they free the request's caches.

Requests move, exactly. The origin holds the prompt and every token generated so far, and
the request's seed. When the plan a request runs on cannot carry it on (a stage was lost or
cut off, a stage left or moved to a newer plan, the plan was withdrawn, a stage is still
loading or full), the origin ends it on that plan's stages and waits, bounded by
``resume_timeout_s``, for the plan this node serves next (:class:`meshd.inference.fencing.
ServedView`), then starts it there again with the tokens it has
(:attr:`meshd.inference.stage_events.RequestStart.generated`): the new stages prefill the
prompt as the first run did and replay each generated token alone, without sampling, and
the last stage's sampler resumes at the same position of the same seed, so the caches hold
the bits an uninterrupted run computed and the text goes on exactly where it was. The client
sees one stream: no error, no token lost or repeated, only a pause (:attr:`Usage.resumes`,
:attr:`Usage.paused_s`, and one line in the event log). Each attempt has its own request id
on the wire (``<id>~<n>``), so a late frame of an earlier attempt is never taken for one of
this.

Moves in the background ("catch-up"). A replay pauses the client for the whole replay. So
while the plan a request runs on can still serve it (a node leaving gracefully keeps serving;
a plan replaced after a join drains), and the plan this node serves next is loaded here, the
origin starts a second attempt there with the tokens it has and ``catch_up`` set, while the
first one keeps streaming. Each token the old attempt delivers from then on also goes to the
new plan's first stage, which takes it as the input of its next step without waiting for its
own last stage (:mod:`meshd.inference.stage_core`): the new plan computes the same steps as
the old one, sampling each with the request's seeded sampler, and catches up as fast as its
stages compute. Every token the new attempt gives for a position the client already has is
compared with the delivered one (a difference is a defect: said loudly, and the request stays
on the old attempt). The first token the new attempt gives that the client does not have yet
switches the stream over: the old attempt ends on the old stages, and the client saw one
stream with no pause beyond a token interval. Where the stages of both plans share cores (a
machine running several daemons), the new attempt gains on the old one slowly; so it takes
over as soon as its pace says it would close the remaining gap alone within ``CLOSE_GAP_S``,
and the client's pause stays under that. If the new attempt fails, or has not caught up
within ``catch_up_timeout_s``, it ends and the request stays on the old attempt (which moves
by replay when its plan goes); if the old attempt fails first, the new one simply carries
on, already part of the way.

When the mesh reports that it cannot run the model any more (a refusal that holds for
``REFUSAL_HOLD_S``), the request ends at once with that reason. When the origin itself dies,
its clients lose their connection: the one loss nothing can undo.

Errors never hang a client: a request that cannot be served raises
:class:`meshd.inference.errors.InferenceError` from its event iterator: when it cannot move
(no plan to move to in time, the client named the plan, or the data plane follows no
agreement), when a stage fails to compute, and as a last resort after
``first_token_timeout_s`` / ``token_timeout_s`` without a token. Bad arguments raise it (kind
``BAD_INPUT``) before anything is sent.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from meshd.inference.errors import ErrorKind, InferenceError
from meshd.inference.fencing import FenceCheck, ServedSource
from meshd.inference.frames import failure_from_proto, finish_from_proto, start_to_proto
from meshd.inference.installed import InstalledPlan
from meshd.inference.sampling import MAX_SEED, SamplingParams, StopChecker
from meshd.inference.stage_events import FailureKind, Finish, RequestStart
from meshd.inference.transport import Transport
from meshd.wire import dataplane_pb2 as dp

log = logging.getLogger("meshd.dataplane")

DEFAULT_PREFILL_CHUNK = 256
MAX_ACTIVATION_BYTES = 32 << 20  # a prefill chunk is cut so its activation stays below this
MAX_REQUEST_ID_CHARS = 128
DEFAULT_RESUME_TIMEOUT_S = 60.0
REFUSAL_HOLD_S = 1.0  # a refusal this old is the mesh's answer, not a step of a re-plan
RESUME_POLL_S = 0.01  # how often a moving request looks for its next plan (cheap: a dict lookup)
SAME_PLAN_RETRY_S = 0.2  # a stage still loading or full: ask the same plan again after this
DEFAULT_CATCH_UP_TIMEOUT_S = 30.0  # a background move that has not caught up by then ends
CATCH_UP_POLL_S = 0.1  # how often a waiting request looks for a newer plan to move to
# A background move whose remaining gap it would close alone in this time switches over at
# once: the old attempt ends, which gives the new one every core both shared.
CLOSE_GAP_S = 0.5

FinishReason = Literal["stop", "length", "eos", "cancelled"]

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
_MOVABLE = frozenset(
    {FailureKind.FENCED, FailureKind.NOT_LOADED, FailureKind.OVERLOADED, FailureKind.UNREACHABLE}
)
_RETRY_SAME_PLAN = frozenset({FailureKind.FENCED, FailureKind.NOT_LOADED, FailureKind.OVERLOADED})


# --- What a client gets ----------------------------------------------------------------------


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it made visible (stop strings are never in it)."""

    token_id: int
    index: int
    text: str
    logits: np.ndarray | None = None  # the last stage's float32 logits (return_logits only)


@dataclass(frozen=True)
class Usage:
    """Counts and timing of one request, measured at the origin."""

    prompt_tokens: int
    completion_tokens: int
    ttft_s: float  # request sent -> first token received
    decode_s: float  # first token -> last token
    total_s: float
    decode_compute_s: float  # compute on all stages for tokens after the first
    seed: int
    resumes: int = 0  # times the request moved to another plan and went on where it was
    paused_s: float = 0.0  # what those moves added: interruption -> the next token, in total
    plan_id: str = ""  # the plan that gave the last token

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    @property
    def transport_s_per_token(self) -> float:
        """Decode time per token not spent computing: hops, queues, serialization."""
        steps = self.completion_tokens - 1
        return (self.decode_s - self.decode_compute_s) / steps if steps > 0 else 0.0


@dataclass(frozen=True)
class FinalEvent:
    """The last event of a request that ended without an error. ``text`` is held-back text
    flushed at the end (append it to the tokens' text)."""

    finish_reason: FinishReason
    usage: Usage
    text: str = ""


GenerationEvent = TokenEvent | FinalEvent


# --- One request ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stop:
    """A local decision that ends an attempt: cancelled (``error`` None) or failed;
    ``movable`` when the request may go on on another plan (a stage lost, the plan removed)."""

    error: InferenceError | None
    attempt: int | None = None  # None: whichever attempt runs (a cancellation)
    movable: bool = False


class _Interrupted(Exception):
    """The plan a request runs on cannot carry it on; another attempt may (see module doc)."""

    def __init__(self, error: InferenceError, *, same_plan: bool = False) -> None:
        super().__init__(str(error))
        self.error = error
        self.same_plan = same_plan  # a stage still loading or full: this plan may, shortly


@dataclass(eq=False)
class _Candidate:
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


class _OriginRequest:
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
        self.candidate: _Candidate | None = None  # a background move under way
        self.moved_in_background: _Candidate | None = None  # the last move, until reported
        self.catch_up_deadlines: dict[str, float] = {}  # plan id -> give up catching up then
        self.catch_up_not_before = 0.0  # loop time of the next try after a transient refusal
        # Links to a newer plan's stages being opened for a background move (task owned here).
        self.connecting: tuple[InstalledPlan, asyncio.Task[str | None]] | None = None
        # Frames of every attempt, told apart by wire id (a stop by attempt number).
        self.inbox: asyncio.Queue[tuple[float, dp.Frame | _Stop]] = asyncio.Queue()
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

    def deliver(self, item: dp.Frame | _Stop) -> None:
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


@dataclass(frozen=True)
class _Options:
    return_logits: bool
    prefill_chunk: int
    ignore_eos: bool
    resume: bool


# --- The origin role --------------------------------------------------------------------------


class Origin:
    """The requests this node is the origin of (asyncio thread)."""

    def __init__(
        self,
        node_id: str,
        transport: Transport,
        plans: Mapping[str, InstalledPlan],
        check_serving: FenceCheck,
        *,
        served: ServedSource | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        first_token_timeout_s: float = 300.0,
        token_timeout_s: float = 60.0,
        resume_timeout_s: float = DEFAULT_RESUME_TIMEOUT_S,
        catch_up_timeout_s: float = DEFAULT_CATCH_UP_TIMEOUT_S,
        report: Callable[[str], None] | None = None,
    ) -> None:
        """``served``: the plans this node serves and the active one (None: requests never
        move); ``report``: where a moved request is told, in words (the event log);
        ``catch_up_timeout_s``: how long a background move may take to catch up (0: requests
        move only by replay)."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1 token, got {prefill_chunk}")
        self.node_id = node_id
        self._transport = transport
        self._plans = plans
        self._check_serving = check_serving
        self._served = served
        self._report = report or (lambda text: log.info("%s", text))
        self.prefill_chunk = prefill_chunk
        self.first_token_timeout_s = first_token_timeout_s
        self.token_timeout_s = token_timeout_s
        self.resume_timeout_s = resume_timeout_s
        self.catch_up_timeout_s = catch_up_timeout_s
        self._requests: dict[str, _OriginRequest] = {}  # by the client's request id
        self._by_wire: dict[str, _OriginRequest] = {}  # by the current attempt's wire id
        self.tokens_delivered = 0  # tokens this node's clients received (live tokens/s)
        self.requests_resumed = 0  # requests that moved to another plan and went on
        self.requests_moved_in_background = 0  # ...of them, moved while the old plan served
        self.catch_ups_abandoned = 0  # background moves that ended without switching over
        self.last_pause_s = 0.0

    def count(self, plan_id: str) -> int:
        """Requests running on ``plan_id`` here (a background move's new attempt included)."""
        return sum(
            1
            for request in self._requests.values()
            if request.plan_id == plan_id
            or (request.candidate is not None and request.candidate.plan.plan_id == plan_id)
        )

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def generate(
        self,
        plan_id: str,
        prompt_tokens: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str,
        return_logits: bool = False,
        prefill_chunk: int | None = None,
        ignore_eos: bool = False,
        resume: bool = True,
    ) -> AsyncIterator[GenerationEvent]:
        """See :meth:`meshd.inference.dataplane.DataPlane.generate`."""
        self._check_request(plan_id, prompt_tokens, params, request_id, prefill_chunk)
        chunk = prefill_chunk or self.prefill_chunk
        options = _Options(return_logits, chunk, ignore_eos, resume and self._served is not None)
        prompt = tuple(int(token) for token in prompt_tokens)
        return self._generate(plan_id, prompt, params, request_id, options)

    def cancel(self, request_id: str) -> bool:
        """End a request this node is the origin of (its final event says "cancelled")."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        request.deliver(_Stop(None))
        return True

    # ------------------------------------------------------------ frames and losses

    def on_token(self, sender: str, frame: dp.Frame) -> None:
        request = self._by_wire.get(frame.request_id)
        if request is None:
            return
        candidate = request.candidate
        if frame.request_id == request.wire_id:
            plan_id, last = request.plan_id, request.last_stage.node_id
        elif candidate is not None and frame.request_id == candidate.wire_id:
            plan_id, last = candidate.plan.plan_id, candidate.last_node
        else:
            return
        if plan_id == frame.plan_id and sender == last:
            request.deliver(frame)

    def on_failure(self, sender: str, frame: dp.Frame) -> None:
        request = self._by_wire.get(frame.request_id)
        if request is None:
            return
        candidate = request.candidate
        if frame.request_id == request.wire_id:
            plan_id, nodes = request.plan_id, request.nodes
        elif candidate is not None and frame.request_id == candidate.wire_id:
            plan_id, nodes = candidate.plan.plan_id, candidate.nodes
        else:
            return
        if plan_id == frame.plan_id and (sender in nodes or sender == self.node_id):
            request.deliver(frame)

    def on_peer_lost(self, peer: str, reason: str) -> None:
        for request in list(self._requests.values()):
            attempts = [(request.attempt, request.plan, request.nodes)]
            if request.candidate is not None:
                candidate = request.candidate
                attempts.append((candidate.number, candidate.plan, candidate.nodes))
            for number, plan, nodes in attempts:
                if peer in nodes:
                    address = plan.assignment.address_of(peer)
                    where = f" at {address}" if address else ""
                    message = f"stage {peer}{where} unreachable: {reason}"
                    error = InferenceError(ErrorKind.UNAVAILABLE, message)
                    request.deliver(_Stop(error, number, movable=True))

    def on_plan_removed(self, plan_id: str, reason: str) -> None:
        for request in list(self._requests.values()):
            error = InferenceError(ErrorKind.UNAVAILABLE, reason)
            if request.plan_id == plan_id:
                request.deliver(_Stop(error, request.attempt, movable=True))
            candidate = request.candidate
            if candidate is not None and candidate.plan.plan_id == plan_id:
                request.deliver(_Stop(error, candidate.number, movable=True))

    # ------------------------------------------------------------ internals

    def _check_request(
        self,
        plan_id: str,
        prompt_tokens: Sequence[int],
        params: SamplingParams,
        request_id: str,
        prefill_chunk: int | None,
    ) -> None:
        def bad(message: str) -> InferenceError:
            return InferenceError(ErrorKind.BAD_INPUT, message)

        if not isinstance(params, SamplingParams):
            raise bad(f"params must be SamplingParams, got {type(params).__name__}")
        if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
            raise bad(f"request_id must be 1-{MAX_REQUEST_ID_CHARS} characters")
        if request_id in self._requests:
            raise bad(f"request {request_id} is already running on this node")
        if len(prompt_tokens) == 0:
            raise bad("the prompt is empty: give at least one token")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise bad(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        plan = self._plans.get(plan_id)
        if plan is not None:
            too_long = plan.assignment.context_error(len(prompt_tokens), params.max_tokens)
            if too_long is not None:
                raise bad(too_long)
        vocab = plan.vocab_size if plan is not None else 0
        for token in prompt_tokens:
            if not isinstance(token, int | np.integer) or token < 0 or (vocab and token >= vocab):
                raise bad(
                    f"prompt token {token!r} is not a token id of this model "
                    f"(0 <= id < {vocab or 'vocab size'})"
                )

    async def _generate(
        self,
        plan_id: str,
        prompt: tuple[int, ...],
        params: SamplingParams,
        request_id: str,
        options: _Options,
    ) -> AsyncIterator[GenerationEvent]:
        self._transport.bind_loop()
        plan = await self._plan_for_request(plan_id)
        seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED)
        request = _OriginRequest(request_id, plan, prompt, params, seed)
        self._requests[request_id] = request
        self._by_wire[request.wire_id] = request
        try:
            while True:
                try:
                    async for event in self._attempt(request, params, seed, options):
                        yield event
                    return
                except _Interrupted as interruption:
                    if not options.resume:
                        raise request.failed(interruption.error) from None
                    await self._move(request, interruption)
        finally:
            self._requests.pop(request_id, None)
            self._by_wire.pop(request.wire_id, None)
            self._end_everywhere(request.plan, request.wire_id, request.end_reason)
            if request.candidate is not None:
                self._drop_candidate(request, request.end_reason, abandoned=False)
            if request.connecting is not None:
                request.connecting[1].cancel()

    async def _attempt(
        self, request: _OriginRequest, params: SamplingParams, seed: int, options: _Options
    ) -> AsyncIterator[GenerationEvent]:
        """One attempt on the request's current plan: Start, then its events; raises
        :class:`_Interrupted` when the plan cannot carry the request on."""
        plan = request.plan
        stages = [(spec.node_id, spec.address) for spec in plan.assignment.stages]
        error = await self._transport.connect(stages)
        if error is not None:
            raise _Interrupted(InferenceError(ErrorKind.UNAVAILABLE, error))
        start = self._start_frame(request, params, seed, options)
        first = plan.stage(0)
        if not self._transport.send(first.node_id, first.address, start):
            message = f"stage {first.node_id} at {first.address} is lost"
            raise _Interrupted(InferenceError(ErrorKind.UNAVAILABLE, message))
        async for event in self._events(request, params, seed, options):
            yield event

    async def _move(self, request: _OriginRequest, interruption: _Interrupted) -> None:
        """End the interrupted attempt everywhere and bind the request to the next plan."""
        failed = request.plan
        request.interrupted(str(interruption.error), asyncio.get_running_loop().time())
        self._end_everywhere(failed, request.wire_id, f"moving: {interruption.error}")
        self._by_wire.pop(request.wire_id, None)
        plan = await self._next_plan(request, failed, interruption)
        number, _ = request.new_attempt()
        if plan is not failed:
            request.resumes += 1
            request.report_pending = True
        request.bind(plan, number)
        self._by_wire[request.wire_id] = request
        log.info(
            "request %s moves to plan %s after %d tokens: %s",
            request.request_id,
            plan.plan_id[:12],
            len(request.tokens),
            interruption.error,
        )

    async def _next_plan(
        self, request: _OriginRequest, failed: InstalledPlan, interruption: _Interrupted
    ) -> InstalledPlan:
        """The plan to go on on: the active one once loaded here; the failed installation again
        only after a failure that a moment can cure (``_RETRY_SAME_PLAN``). InferenceError when
        the mesh refuses to run the model, or no token came for ``resume_timeout_s`` since the
        request was first interrupted."""
        assert self._served is not None
        loop = asyncio.get_running_loop()
        assert request.moving_since is not None
        deadline = request.moving_since + self.resume_timeout_s
        refused_since: float | None = None
        if interruption.same_plan:
            await asyncio.sleep(SAME_PLAN_RETRY_S)
        while True:
            view = self._served()
            candidate = self._plans.get(view.active) if view.active else None
            usable = candidate is not None and (candidate is not failed or interruption.same_plan)
            if usable and candidate.ready.done() and candidate.ready.exception() is None:
                return candidate
            now = loop.time()
            if not view.active and view.refusal:
                refused_since = now if refused_since is None else refused_since
                if now - refused_since >= REFUSAL_HOLD_S:
                    raise request.failed(
                        InferenceError(
                            ErrorKind.UNAVAILABLE,
                            f"request stopped after {request.generated} tokens: the mesh can no "
                            f"longer run the model ({view.refusal}); it was interrupted by: "
                            f"{interruption.error}",
                        )
                    )
            else:
                refused_since = None
            if now >= deadline:
                raise request.failed(
                    InferenceError(
                        ErrorKind.UNAVAILABLE,
                        f"request stopped after {request.generated} tokens: no plan to go on "
                        f"on within {self.resume_timeout_s:g} s after: {interruption.error}",
                    )
                )
            await asyncio.sleep(RESUME_POLL_S)

    async def _plan_for_request(self, plan_id: str) -> InstalledPlan:
        """The installed, committed, loaded plan; InferenceError when a request cannot start."""
        try:
            self._check_serving(plan_id)
        except Exception as error:
            raise InferenceError(ErrorKind.NO_PLAN, str(error)) from None
        plan = self._plans.get(plan_id)
        if plan is None:
            raise InferenceError(
                ErrorKind.NO_PLAN,
                f"plan {plan_id} is not installed on node {self.node_id}: the mesh has no "
                "committed plan for it here yet; retry once the plan is serving",
            )
        try:
            async with asyncio.timeout(self.first_token_timeout_s):
                await asyncio.shield(plan.ready)
        except Exception as error:
            raise InferenceError(
                ErrorKind.UNAVAILABLE,
                f"plan {plan_id} could not be loaded on node {self.node_id}: {error}",
            ) from None
        return plan

    def _start_frame(
        self,
        request: _OriginRequest,
        params: SamplingParams,
        seed: int,
        options: _Options,
        candidate: _Candidate | None = None,
    ) -> dp.Frame:
        """The Start of the request's current attempt, or of ``candidate`` (a background
        move, which is fed the tokens delivered from then on)."""
        plan = candidate.plan if candidate is not None else request.plan
        wire_id = candidate.wire_id if candidate is not None else request.wire_id
        chunk = max(1, min(options.prefill_chunk, MAX_ACTIVATION_BYTES // (4 * plan.hidden_size)))
        start = RequestStart(
            origin=self.node_id,
            prompt=request.prompt,
            prompt_length=len(request.prompt),
            sampling=replace(params, seed=seed, stop=()),
            eos_ids=frozenset() if options.ignore_eos else frozenset(plan.tokenizer.eos_token_ids),
            prefill_chunk=chunk,
            return_logits=options.return_logits,
            generated=tuple(request.tokens),
            catch_up=candidate is not None,
        )
        return dp.Frame(plan_id=plan.plan_id, request_id=wire_id, start=start_to_proto(start))

    async def _events(
        self, request: _OriginRequest, params: SamplingParams, seed: int, options: _Options
    ) -> AsyncIterator[GenerationEvent]:
        """Turn the attempt's incoming frames into events until the final one; meanwhile
        start a background move when a newer plan is ready (see the module docstring)."""
        loop = asyncio.get_running_loop()
        waited_since = loop.time()
        while True:
            if options.resume:
                self._catch_up_step(request, params, seed, options)
            first = request.awaiting_token
            timeout = self.first_token_timeout_s if first else self.token_timeout_s
            wait = min(timeout - (loop.time() - waited_since), CATCH_UP_POLL_S)
            try:
                async with asyncio.timeout(max(0.0, wait) if options.resume else timeout):
                    arrived_at, item = await request.inbox.get()
            except TimeoutError:
                if options.resume and loop.time() - waited_since < timeout:
                    continue  # a poll for a newer plan, not the token timeout
                stage = request.last_stage
                message = (
                    f"no token from the mesh for {timeout:g} s (plan {request.plan_id[:12]}, "
                    f"last stage {stage.node_id} at {stage.address}); giving up"
                )
                raise request.failed(InferenceError(ErrorKind.UNAVAILABLE, message)) from None
            waited_since = loop.time()
            for event in self._events_of(request, item, arrived_at):
                if request.report_pending and isinstance(event, TokenEvent | FinalEvent):
                    request.report_pending = False
                    self._resumed(request)
                yield event
                if isinstance(event, FinalEvent):
                    return

    def _events_of(
        self, request: _OriginRequest, item: dp.Frame | _Stop, arrived_at: float
    ) -> list[GenerationEvent]:
        candidate = request.candidate
        if isinstance(item, _Stop):
            if candidate is not None and item.attempt == candidate.number:
                assert item.error is not None
                self._drop_candidate(request, str(item.error))
                return []
            if item.attempt is not None and item.attempt != request.attempt:
                return []  # a stop meant for an attempt already over
            if item.error is None:
                return [request.final("cancelled")]
            if item.movable:
                if candidate is not None:  # the new attempt is part of the way already
                    self._switch_over(request, str(item.error))
                    return []
                raise _Interrupted(item.error)
            raise request.failed(item.error)
        if candidate is not None and item.request_id == candidate.wire_id:
            return self._candidate_frame(request, candidate, item, arrived_at)
        if item.request_id != request.wire_id:
            return []
        if item.WhichOneof("body") == "failure":
            kind = failure_from_proto(item.failure.kind)
            error = request.error_of(item.failure)
            if kind in _MOVABLE:
                if candidate is not None:
                    self._switch_over(request, str(error))
                    return []
                raise _Interrupted(error, same_plan=kind in _RETRY_SAME_PLAN)
            raise request.failed(error)
        return self._delivered(request, item, arrived_at)

    def _delivered(
        self, request: _OriginRequest, frame: dp.Frame, arrived_at: float
    ) -> list[GenerationEvent]:
        """A token of the request's current attempt: its events; a background move under way
        gets it as a known input."""
        token = frame.token
        if token.index < request.generated:
            # An attempt that took over while it caught up gives the client's tokens first.
            if token.token_id == request.tokens[token.index]:
                return []
            message = (
                f"DEFECT: plan {request.plan_id[:12]} gave token {token.token_id} at position "
                f"{token.index} of request {request.request_id}, where the client got "
                f"{request.tokens[token.index]} (please report this)"
            )
            log.error("%s", message)
            self._report(message)
            raise request.failed(InferenceError(ErrorKind.INTERNAL, message))
        self.tokens_delivered += 1
        before = request.paused_s
        events = request.on_token(frame.token, arrived_at)
        if request.paused_s != before:
            self.last_pause_s = request.paused_s - before
        candidate = request.candidate
        if candidate is not None and not any(isinstance(e, FinalEvent) for e in events):
            self._feed(request, candidate, frame.token)
        return events

    # ------------------------------------------------------------ background moves

    def _catch_up_step(
        self, request: _OriginRequest, params: SamplingParams, seed: int, options: _Options
    ) -> None:
        """Start a background move when the plan this node serves next is ready here and
        the request runs on another; end one that has not caught up in time."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        candidate = request.candidate
        if candidate is not None:
            deadline = request.catch_up_deadlines.get(candidate.plan.plan_id, now)
            if now >= deadline:
                self._drop_candidate(
                    request,
                    f"it did not catch up within {self.catch_up_timeout_s:g} s (it gave "
                    f"{candidate.reached} of the {request.generated} tokens delivered)",
                    give_up=True,
                )
            return
        if self._served is None or self.catch_up_timeout_s <= 0 or request.generated < 1:
            return
        if now < request.catch_up_not_before or request.interrupted_at is not None:
            return
        active = self._served().active
        if not active or active == request.plan_id:
            return
        plan = self._plans.get(active)
        if plan is None or not plan.ready.done():
            return  # not loaded here yet
        deadline = request.catch_up_deadlines.get(active)
        if deadline is not None and now >= deadline:
            return  # given up on this plan
        if plan.ready.exception() is not None:
            request.catch_up_deadlines[active] = now  # it failed to load: no move there
            return
        if plan.assignment.context_error(len(request.prompt), params.max_tokens) is not None:
            request.catch_up_deadlines[active] = now
            return
        connecting = request.connecting
        if connecting is None or connecting[0] is not plan:
            # Open the links without holding up the stream (the request owns the task).
            stages = [(spec.node_id, spec.address) for spec in plan.assignment.stages]
            if connecting is not None:
                connecting[1].cancel()
            request.connecting = (plan, asyncio.create_task(self._transport.connect(stages)))
            return
        if not connecting[1].done():
            return
        request.connecting = None
        error = connecting[1].result()
        if error is None:
            # The time a move may take runs from its first try on this plan.
            request.catch_up_deadlines.setdefault(active, now + self.catch_up_timeout_s)
            number, wire_id = request.new_attempt()
            candidate = _Candidate(number, plan, wire_id, now, len(request.tokens))
            request.candidate = candidate
            self._by_wire[wire_id] = request
            start = self._start_frame(request, params, seed, options, candidate)
            first = plan.stage(0)
            if self._transport.send(first.node_id, first.address, start):
                log.info(
                    "request %s moves to plan %s in the background after %d tokens",
                    request.request_id,
                    plan.plan_id[:12],
                    candidate.from_tokens,
                )
                return
            self._drop_candidate(request, f"stage {first.node_id} at {first.address} is lost")
            return
        request.catch_up_not_before = now + SAME_PLAN_RETRY_S  # a link did not open: again

    def _feed(self, request: _OriginRequest, candidate: _Candidate, token: dp.Token) -> None:
        """Send the new attempt's first stage a token the client has (its next input)."""
        if len(candidate.plan.assignment.stages) == 1:
            return  # a single stage computes its next input itself, one step ahead
        first = candidate.plan.stage(0)
        frame = dp.Frame(
            plan_id=candidate.plan.plan_id,
            request_id=candidate.wire_id,
            token=dp.Token(token_id=token.token_id, index=token.index),
        )
        if not self._transport.send(first.node_id, first.address, frame, open_new=False):
            self._drop_candidate(request, f"stage {first.node_id} at {first.address} is lost")

    def _candidate_frame(
        self, request: _OriginRequest, candidate: _Candidate, frame: dp.Frame, arrived_at: float
    ) -> list[GenerationEvent]:
        """A frame of the new attempt: a token the client has is checked, the first one it
        has not switches the stream over; a failure ends the background move."""
        if frame.WhichOneof("body") == "failure":
            kind = failure_from_proto(frame.failure.kind)
            transient = kind in _RETRY_SAME_PLAN
            self._drop_candidate(request, frame.failure.message, give_up=not transient)
            return []
        token = frame.token
        if token.index < request.generated and token.token_id == request.tokens[token.index]:
            # The new plan computed what the client has: it is catching up.
            candidate.reached = token.index + 1
            if candidate.first_token is None:
                candidate.first_token = (arrived_at, token.index)
            to_close = candidate.seconds_to_close(request.generated, arrived_at)
            if to_close is not None and to_close <= CLOSE_GAP_S:
                self._switch_over(
                    request,
                    f"plan {candidate.plan.plan_id[:12]} was {to_close:.2f} s from catching up",
                )
            return []
        if token.index != request.generated:
            delivered = (
                request.tokens[token.index] if token.index < len(request.tokens) else "none yet"
            )
            message = (
                f"DEFECT: plan {candidate.plan.plan_id[:12]} gave token {token.token_id} at "
                f"position {token.index} of request {request.request_id}, where plan "
                f"{request.plan_id[:12]} gave {delivered}; the request stays on plan "
                f"{request.plan_id[:12]} (please report this)"
            )
            log.error("%s", message)
            self._report(message)
            self._drop_candidate(request, "its tokens differ from the delivered ones", give_up=True)
            return []
        self._switch_over(request, f"plan {candidate.plan.plan_id[:12]} caught up")
        return self._delivered(request, frame, arrived_at)

    def _switch_over(self, request: _OriginRequest, reason: str) -> None:
        """The new attempt becomes the request's: the old one ends on its stages."""
        candidate = request.candidate
        assert candidate is not None
        request.candidate = None
        old_plan, old_wire = request.plan, request.wire_id
        self._by_wire.pop(old_wire, None)
        self._end_everywhere(old_plan, old_wire, f"moved to plan {candidate.plan.plan_id[:12]}")
        if request.interrupted_at is None:  # the pause runs from the last token on
            request.interrupted(reason, asyncio.get_running_loop().time())
        request.interruption = reason
        request.bind(candidate.plan, candidate.number)
        request.awaiting_token = False  # it has computed tokens already
        request.resumes += 1
        request.report_pending = True
        request.moved_in_background = candidate
        log.info(
            "request %s switches to plan %s (%s)",
            request.request_id,
            candidate.plan.plan_id[:12],
            reason,
        )

    def _drop_candidate(
        self, request: _OriginRequest, reason: str, *, give_up: bool = True, abandoned: bool = True
    ) -> None:
        """End the background move (the request goes on on its current attempt). With
        ``give_up`` no other is tried on that plan; else one is tried again shortly."""
        candidate = request.candidate
        if candidate is None:
            return
        request.candidate = None
        self._by_wire.pop(candidate.wire_id, None)
        self._end_everywhere(candidate.plan, candidate.wire_id, f"background move ended: {reason}")
        if not abandoned:
            return
        self.catch_ups_abandoned += 1
        loop_now = asyncio.get_running_loop().time()
        if give_up:
            request.catch_up_deadlines[candidate.plan.plan_id] = loop_now
        request.catch_up_not_before = loop_now + SAME_PLAN_RETRY_S
        log.info(
            "request %s: background move to plan %s ended (%s); it stays on plan %s",
            request.request_id,
            candidate.plan.plan_id[:12],
            reason,
            request.plan_id[:12],
        )

    def _resumed(self, request: _OriginRequest) -> None:
        """The first token after a move arrived: count it and say so in the event log."""
        self.requests_resumed += 1
        background = request.moved_in_background
        request.moved_in_background = None
        if background is None:
            how = ""
        else:
            self.requests_moved_in_background += 1
            took = asyncio.get_running_loop().time() - background.started_at
            how = (
                f" in the background (it caught up from token {background.from_tokens} in "
                f"{took:.2f} s)"
            )
        self._report(
            f"request {request.request_id} moved to plan {request.plan_id[:12]}{how} and "
            f"resumed after {request.generated - 1} tokens, paused {self.last_pause_s:.2f} s "
            f"({request.interruption})"
        )

    def _end_everywhere(self, plan: InstalledPlan, wire_id: str, reason: str) -> None:
        """Tell every stage the attempt is over (existing links only: no reconnect storms)."""
        frame = dp.Frame(plan_id=plan.plan_id, request_id=wire_id, end=dp.End(reason=reason))
        for spec in plan.assignment.stages:
            self._transport.send(spec.node_id, spec.address, frame, open_new=False)
