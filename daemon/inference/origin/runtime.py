"""The origin: requests this node asks the mesh, from validation to the client's last event.

The origin is the node a client talks to. It checks the request (nothing is sent for bad
input), sends the Start to the plan's first stage, turns the Token frames the last stage
sends back into :class:`TokenEvent`s (detokenized, stop strings applied by
:class:`meshd.inference.sampling.StopChecker`) and ends with one :class:`FinalEvent`. On the
way out (finished, stopped, cancelled, the client gone, failed) it sends End to every stage,
so they free the request's caches.

Where a request runs and when it ends is decided by its pure core,
:class:`meshd.inference.origin.core.OriginCore`: starts, tokens taken or ignored, moves to the
next plan by replay or in the background, retries on the same plan after a broken link, and
every way a request fails. This module only does the I/O around it: it turns frames, lost
links, withdrawn plans and the passing of time into the core's events, and carries its
decisions out (links opened, frames sent, the client's events). The client's side of a
request (text, stop strings, timing) is :mod:`meshd.inference.origin.request`; what a client
gets, :mod:`meshd.inference.generation_events`. When the origin itself dies, its clients lose
their connection: the one loss nothing can undo.

Requests move, exactly. The origin holds the prompt and every token generated so far, and
the request's seed: a new attempt (on the next plan, or on the same one after a broken link)
starts with those tokens (:attr:`meshd.inference.stage_events.RequestStart.generated`), the
new stages prefill the prompt as the first run did and replay each generated token alone,
and the last stage's sampler resumes at the same position of the same seed, so the text goes
on exactly where it was. A move in the background (``catch_up``) runs a second attempt on the
plan served next while the first streams on, and switches over once it has caught up. Each
attempt has its own request id on the wire (``<id>~<n>``), so a late frame of an earlier
attempt is never taken for one of this.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import numpy as np

from meshd.inference.errors import ErrorKind, InferenceError
from meshd.inference.fencing import FenceCheck, ServedSource
from meshd.inference.generation_events import FinalEvent, GenerationEvent
from meshd.inference.installed import InstalledPlan
from meshd.inference.origin.core import (
    DELIVER,
    JUST_DELIVER,
    NO_PLAN_VIEW,
    Attempt,
    Connect,
    Decisions,
    DroppedCandidate,
    Failed,
    FeedToken,
    Finished,
    Moving,
    OriginCore,
    PlanRef,
    PlanState,
    PlanView,
    Report,
    Resumed,
    SendEnd,
    SendStart,
    Timeouts,
)
from meshd.inference.origin.request import (
    NOT_A_FRAME,
    Cancelled,
    Connected,
    LinkLost,
    LocalEvent,
    OriginRequest,
    PlanRemoved,
    RequestOptions,
)
from meshd.inference.sampling import MAX_SEED, SamplingParams
from meshd.inference.transport.frames import failure_from_proto, finish_from_proto
from meshd.inference.transport.links import Transport
from meshd.wire import dataplane_pb2 as dp

log = logging.getLogger("meshd.dataplane")

DEFAULT_PREFILL_CHUNK = 256
MAX_REQUEST_ID_CHARS = 128
DEFAULT_RESUME_TIMEOUT_S = 60.0
DEFAULT_CATCH_UP_TIMEOUT_S = 30.0  # a background move that has not caught up by then ends

# "1": a token's client stream runs before the next step builds its graph (an earlier order,
# kept as a benchmark's baseline: bench_batching.py --scaling --stream-first-too).
STREAM_FIRST_ENV = "MESHD_STREAM_FIRST"


class Origin:
    """The requests this node is the origin of (asyncio thread): each one's core decides,
    this carries the decisions out."""

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
        yield_to_compute: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``served``: the plans this node serves and the active one (None: requests never
        move); ``report``: where a moved request is told, in words (the event log);
        ``catch_up_timeout_s``: how long a background move may take to catch up (0: requests
        move only by replay); ``yield_to_compute``: awaited before a frame's events are made,
        so that a step the arriving token let this node's compute thread start goes first
        (:meth:`meshd.runtime.compute.ComputeExecutor.let_start`)."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1 token, got {prefill_chunk}")
        self.node_id = node_id
        self._transport = transport
        self._plans = plans
        self._served = served
        self._report = report or (lambda text: log.info("%s", text))
        self._check_serving = check_serving
        self._yield_to_compute = yield_to_compute
        self.prefill_chunk = prefill_chunk
        self.first_token_timeout_s = first_token_timeout_s
        self.token_timeout_s = token_timeout_s
        self.resume_timeout_s = resume_timeout_s
        self.catch_up_timeout_s = catch_up_timeout_s
        self._requests: dict[str, OriginRequest] = {}  # by the client's request id
        # Running attempts by wire id: their request and the attempt (frames are routed here).
        self._by_wire: dict[str, tuple[OriginRequest, Attempt]] = {}
        self._refs: dict[str, tuple[InstalledPlan, PlanRef]] = {}  # the core's view of plans
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
            if any(attempt.plan.plan_id == plan_id for attempt in request.core.attempts())
            or request.core.attempt.plan.plan_id == plan_id
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
        """See :meth:`meshd.inference.serving.dataplane.DataPlane.generate`."""
        self._check_request(plan_id, prompt_tokens, params, request_id, prefill_chunk)
        chunk = prefill_chunk or self.prefill_chunk
        options = RequestOptions(
            return_logits, chunk, ignore_eos, resume and self._served is not None
        )
        prompt = tuple(int(token) for token in prompt_tokens)
        return self._generate(plan_id, prompt, params, request_id, options)

    def cancel(self, request_id: str) -> bool:
        """End a request this node is the origin of (its final event says "cancelled")."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        request.deliver(Cancelled())
        return True

    # ------------------------------------------------------------ frames and losses

    def on_token(self, sender: str, frame: dp.Frame) -> bool:
        """Deliver a sampled token to its request's stream; whether one took it."""
        entry = self._by_wire.get(frame.request_id)
        if entry is None:
            return False
        request, attempt = entry
        plan = attempt.plan
        if plan.plan_id == frame.plan_id and sender == plan.nodes[-1]:
            request.deliver(frame, attempt.number)
            return True
        return False

    def on_failure(self, sender: str, frame: dp.Frame) -> None:
        entry = self._by_wire.get(frame.request_id)
        if entry is None:
            return
        request, attempt = entry
        plan = attempt.plan
        if plan.plan_id == frame.plan_id and (sender in plan.nodes or sender == self.node_id):
            request.deliver(frame, attempt.number)

    def on_peer_lost(self, peer: str, reason: str, since: float | None = None) -> None:
        for request in list(self._requests.values()):
            for attempt in request.core.attempts():
                if peer in attempt.plan.nodes:
                    address = request.plan_of(attempt).assignment.address_of(peer)
                    where = f" at {address}" if address else ""
                    message = f"stage {peer}{where} unreachable: {reason}"
                    request.deliver(LinkLost(peer, message, since))
                    break

    def on_plan_removed(self, plan_id: str, reason: str) -> None:
        for request in list(self._requests.values()):
            request.deliver(PlanRemoved(plan_id, reason))

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
        options: RequestOptions,
    ) -> AsyncIterator[GenerationEvent]:
        loop = self._transport.bind_loop()
        plan = await self._plan_for_request(plan_id)
        seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED)
        timeouts = Timeouts(
            first_token_s=self.first_token_timeout_s,
            token_s=self.token_timeout_s,
            resume_s=self.resume_timeout_s,
            catch_up_s=self.catch_up_timeout_s,
        )
        core = OriginCore(
            request_id, self._ref(plan), loop.time(), timeouts=timeouts, resume=options.resume
        )
        request = OriginRequest(request_id, plan, core, prompt, params, seed, options)
        self._requests[request_id] = request
        try:
            await self._carry_out(request, core.begin(), None, 0.0)
            async for event in self._events(request, loop):
                yield event
        finally:
            self._requests.pop(request_id, None)
            self._end(request)

    async def _events(
        self, request: OriginRequest, loop: asyncio.AbstractEventLoop
    ) -> AsyncIterator[GenerationEvent]:
        """Feed the core the request's frames, local events and the passing of time (a tick
        at its next deadline, and at least every ``poll_s``: the plans served here change
        without an event), and yield the client's events it decides, until the final one."""
        core = request.core
        inbox = request.inbox
        next_tick = loop.time()
        while True:
            now = loop.time()
            if now >= next_tick:
                decisions = core.on_tick(now, self._view(request))
                for event in await self._carry_out(request, decisions, None, 0.0):
                    yield event
                    if isinstance(event, FinalEvent):
                        return
                now = loop.time()
                next_tick = min(core.wake_at(now), now + core.poll_s)
            if inbox.empty():
                try:
                    async with asyncio.timeout_at(next_tick):
                        arrived_at, item, number = await inbox.get()
                except TimeoutError:
                    continue
            else:
                arrived_at, item, number = inbox.get_nowait()
            if number != NOT_A_FRAME and self._yield_to_compute is not None:
                await self._yield_to_compute()  # the next step first, this stream meanwhile
            now = loop.time()
            if number == NOT_A_FRAME:
                assert not isinstance(item, dp.Frame)
                decisions = self._local(request, item, now)
                frame = None
            else:
                assert isinstance(item, dp.Frame)
                frame = item
                if frame.WhichOneof("body") == "token":
                    token = frame.token
                    finish = finish_from_proto(token.finish)
                    decisions = core.on_token(number, token.index, token.token_id, finish, now)
                    if decisions is JUST_DELIVER:  # the hot path: one token to the client
                        self.tokens_delivered += 1
                        request.arrived(token, arrived_at)
                        for event in request.events_of(token):
                            yield event
                            if isinstance(event, FinalEvent):
                                return
                        continue
                else:
                    failure = frame.failure
                    kind = failure_from_proto(failure.kind)
                    decisions = core.on_failure(number, kind, failure.message, now)
            for event in await self._carry_out(request, decisions, frame, arrived_at):
                yield event
                if isinstance(event, FinalEvent):
                    return
            next_tick = min(next_tick, core.wake_at(now), now + core.poll_s)

    def _local(self, request: OriginRequest, item: LocalEvent, now: float) -> Decisions:
        core = request.core
        if isinstance(item, Cancelled):
            return core.cancel()
        if isinstance(item, LinkLost):
            return core.on_link_lost(item.node, item.message, now, item.since)
        if isinstance(item, PlanRemoved):
            return core.on_plan_removed(item.plan_id, item.reason, now)
        request.connecting.pop(item.number, None)
        return core.on_connected(item.number, item.error, now)

    async def _carry_out(
        self,
        request: OriginRequest,
        decisions: Decisions,
        frame: dp.Frame | None,
        arrived_at: float,
    ) -> list[GenerationEvent]:
        """Do what the core decided; the client's events (InferenceError when it failed)."""
        events: list[GenerationEvent] = []
        resumed: Resumed | None = None
        for decision in decisions:
            if decision is DELIVER:
                assert frame is not None
                self.tokens_delivered += 1
                paused = request.arrived(frame.token, arrived_at)
                if paused:
                    self.last_pause_s = paused
                if not any(isinstance(event, FinalEvent) for event in events):
                    events += request.events_of(frame.token)
            elif isinstance(decision, SendEnd):
                self._send_end(request, decision.attempt, decision.reason)
            elif isinstance(decision, Connect):
                events += await self._connect(request, decision.attempt)
            elif isinstance(decision, SendStart):
                events += await self._send_start(request, decision.attempt)
            elif isinstance(decision, FeedToken):
                events += await self._feed(request, decision)
            elif isinstance(decision, Finished):
                if decision.reason == "eos" and frame is not None:
                    paused = request.arrived(frame.token, arrived_at)
                    if paused:
                        self.last_pause_s = paused
                if not any(isinstance(event, FinalEvent) for event in events):
                    events.append(request.final(decision.reason))  # type: ignore[arg-type]
            elif isinstance(decision, Failed):
                raise request.failed(InferenceError(decision.kind, decision.message))
            elif isinstance(decision, Moving):
                request.interrupted()
                log.info(
                    "request %s moves on after %d tokens: %s",
                    request.request_id,
                    len(request.core.tokens),
                    decision.reason,
                )
            elif isinstance(decision, Resumed):
                resumed = decision
            elif isinstance(decision, DroppedCandidate):
                self.catch_ups_abandoned += 1
                log.info(
                    "request %s: background move ended (%s); it stays on plan %s",
                    request.request_id,
                    decision.reason,
                    request.core.attempt.plan.plan_id[:12],
                )
            elif isinstance(decision, Report):
                log.error("%s", decision.text)
                self._report(decision.text)
        if resumed is not None:
            self._resumed(request, resumed)
        return events

    async def _connect(self, request: OriginRequest, attempt: Attempt) -> list[GenerationEvent]:
        """Open the links of an attempt's plan: at once for the request's own attempt, in a
        task for a background one (the stream goes on meanwhile)."""
        plan = self._installed(request, attempt)
        self._by_wire[attempt.wire_id] = (request, attempt)
        stages = [(spec.node_id, spec.address) for spec in plan.assignment.stages]
        if attempt.catch_up:
            task = asyncio.create_task(self._connect_in_background(request, attempt, stages))
            request.connecting[attempt.number] = task
            return []
        error = await self._transport.connect(stages)
        now = asyncio.get_running_loop().time()
        decisions = request.core.on_connected(attempt.number, error, now)
        return await self._carry_out(request, decisions, None, 0.0)

    async def _connect_in_background(
        self, request: OriginRequest, attempt: Attempt, stages: list[tuple[str, str]]
    ) -> None:
        error = await self._transport.connect(stages)
        request.deliver(Connected(attempt.number, error))

    async def _send_start(self, request: OriginRequest, attempt: Attempt) -> list[GenerationEvent]:
        plan = request.plan_of(attempt)
        first = plan.stage(0)
        start = request.start_frame(self.node_id, attempt)
        if self._transport.send(first.node_id, first.address, start):
            if attempt.catch_up:
                log.info(
                    "request %s moves to plan %s in the background after %d tokens",
                    request.request_id,
                    plan.plan_id[:12],
                    attempt.from_tokens,
                )
            return []
        return await self._send_failed(request, attempt, first.node_id, first.address)

    async def _feed(self, request: OriginRequest, feed: FeedToken) -> list[GenerationEvent]:
        """Send a background attempt's first stage a token the client has (its next input)."""
        attempt = feed.attempt
        plan = request.plan_of(attempt)
        first = plan.stage(0)
        frame = dp.Frame(
            plan_id=plan.plan_id,
            request_id=attempt.wire_id,
            token=dp.Token(token_id=feed.token_id, index=feed.index),
        )
        if self._transport.send(first.node_id, first.address, frame, open_new=False):
            return []
        return await self._send_failed(request, attempt, first.node_id, first.address)

    async def _send_failed(
        self, request: OriginRequest, attempt: Attempt, node: str, address: str
    ) -> list[GenerationEvent]:
        now = asyncio.get_running_loop().time()
        message = f"stage {node} at {address} is lost"
        decisions = request.core.on_send_failed(attempt.number, message, now)
        return await self._carry_out(request, decisions, None, 0.0)

    def _send_end(self, request: OriginRequest, attempt: Attempt, reason: str) -> None:
        """Tell every stage the attempt is over (existing links only: no reconnect storms)."""
        if self._by_wire.get(attempt.wire_id, (None,))[0] is request:
            del self._by_wire[attempt.wire_id]
        task = request.connecting.pop(attempt.number, None)
        if task is not None:
            task.cancel()
        plan = request.plan_of(attempt)
        frame = dp.Frame(
            plan_id=plan.plan_id, request_id=attempt.wire_id, end=dp.End(reason=reason)
        )
        for spec in plan.assignment.stages:
            self._transport.send(spec.node_id, spec.address, frame, open_new=False)

    def _end(self, request: OriginRequest) -> None:
        """The request is over, however it ended: every attempt still running ends on its
        stages, and nothing of it stays registered."""
        core = request.core
        for decision in core.finish(request.end_reason):
            if isinstance(decision, SendEnd):
                self._send_end(request, decision.attempt, decision.reason)
        # Its last attempt again: an End may have been lost with a link that broke.
        self._send_end(request, core.attempt, request.end_reason)
        for task in request.connecting.values():
            task.cancel()
        request.connecting.clear()
        for wire_id in [w for w, (r, _) in self._by_wire.items() if r is request]:
            del self._by_wire[wire_id]

    def _resumed(self, request: OriginRequest, resumed: Resumed) -> None:
        """The first token after a move arrived: count it and say so in the event log."""
        self.requests_resumed += 1
        background = resumed.background
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
            f"request {request.request_id} moved to plan {resumed.plan_id[:12]}{how} and "
            f"resumed after {resumed.after_tokens} tokens, paused {self.last_pause_s:.2f} s "
            f"({resumed.reason})"
        )

    # ------------------------------------------------------------ plans as the core sees them

    def _ref(self, plan: InstalledPlan) -> PlanRef:
        cached = self._refs.get(plan.plan_id)
        if cached is not None and cached[0] is plan:
            return cached[1]
        ref = PlanRef(plan.plan_id, tuple(plan.assignment.node_ids))
        self._refs = {
            plan_id: entry for plan_id, entry in self._refs.items() if plan_id in self._plans
        }
        self._refs[plan.plan_id] = (plan, ref)
        return ref

    def _installed(self, request: OriginRequest, attempt: Attempt) -> InstalledPlan:
        """The installed plan an attempt runs on (remembered with the request, so that it
        still gets its Ends once withdrawn here)."""
        plan_id = attempt.plan.plan_id
        plan = request.installed.get(plan_id)
        if plan is None:
            plan = self._refs[plan_id][0]
            request.installed[plan_id] = plan
        return plan

    def _view(self, request: OriginRequest) -> PlanView:
        """The plans served here, as the request's core reads them."""
        if self._served is None:
            return NO_PLAN_VIEW
        view = self._served()
        plan = self._plans.get(view.active) if view.active else None
        if plan is None:
            return PlanView(None, PlanState.MISSING, refusal="" if view.active else view.refusal)
        ready = plan.ready
        if not ready.done():
            state = PlanState.LOADING
        elif ready.cancelled() or ready.exception() is not None:
            state = PlanState.FAILED
        else:
            state = PlanState.READY
        params = request.params
        fits = plan.assignment.context_error(len(request.prompt), params.max_tokens) is None
        return PlanView(self._ref(plan), state, fits)

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
