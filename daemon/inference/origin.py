"""The origin: requests this node asks the mesh, from validation to the client's last event.

The origin is the node a client talks to. It checks the request (nothing is sent for bad
input), sends the Start to the plan's first stage, turns the Token frames the last stage
sends back into :class:`TokenEvent`s (detokenized, stop strings applied by
:class:`meshd.inference.sampling.StopChecker`) and ends with one :class:`FinalEvent`. On the
way out (finished, stopped, cancelled, the client gone, failed) it sends End to every stage,
so they free the request's caches.

Requests move, exactly, from a plan that cannot carry them on to the next one, by replay or
in the background while the old plan still serves: :mod:`meshd.inference.origin_moves`. The
state of one request is :mod:`meshd.inference.origin_request`; what a client gets,
:mod:`meshd.inference.generation_events`. When the origin itself dies, its clients lose their
connection: the one loss nothing can undo.

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
from meshd.inference.frames import failure_from_proto
from meshd.inference.generation_events import FinalEvent, GenerationEvent, TokenEvent
from meshd.inference.installed import InstalledPlan
from meshd.inference.origin_moves import OriginMoves
from meshd.inference.origin_request import (
    MOVABLE_FAILURES,
    RETRY_SAME_PLAN,
    Interrupted,
    OriginRequest,
    RequestOptions,
    Stop,
)
from meshd.inference.sampling import MAX_SEED, SamplingParams
from meshd.inference.transport import Transport
from meshd.wire import dataplane_pb2 as dp

log = logging.getLogger("meshd.dataplane")

DEFAULT_PREFILL_CHUNK = 256
MAX_REQUEST_ID_CHARS = 128
DEFAULT_RESUME_TIMEOUT_S = 60.0
DEFAULT_CATCH_UP_TIMEOUT_S = 30.0  # a background move that has not caught up by then ends
CATCH_UP_POLL_S = 0.1  # how often a waiting request looks for a newer plan to move to

# "1": a token's client stream runs before the next step builds its graph (an earlier order,
# kept as a benchmark's baseline: bench_batching.py --scaling --stream-first-too).
STREAM_FIRST_ENV = "MESHD_STREAM_FIRST"


class Origin(OriginMoves):
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
        super().__init__(
            node_id,
            transport,
            plans,
            served=served,
            resume_timeout_s=resume_timeout_s,
            catch_up_timeout_s=catch_up_timeout_s,
            report=report,
        )
        self._check_serving = check_serving
        self._yield_to_compute = yield_to_compute
        self.prefill_chunk = prefill_chunk
        self.first_token_timeout_s = first_token_timeout_s
        self.token_timeout_s = token_timeout_s
        self._requests: dict[str, OriginRequest] = {}  # by the client's request id
        self.tokens_delivered = 0  # tokens this node's clients received (live tokens/s)

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
        request.deliver(Stop(None))
        return True

    # ------------------------------------------------------------ frames and losses

    def on_token(self, sender: str, frame: dp.Frame) -> bool:
        """Deliver a sampled token to its request's stream; whether one took it."""
        request = self._by_wire.get(frame.request_id)
        if request is None:
            return False
        candidate = request.candidate
        if frame.request_id == request.wire_id:
            plan_id, last = request.plan_id, request.last_stage.node_id
        elif candidate is not None and frame.request_id == candidate.wire_id:
            plan_id, last = candidate.plan.plan_id, candidate.last_node
        else:
            return False
        if plan_id == frame.plan_id and sender == last:
            request.deliver(frame)
            return True
        return False

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
                    request.deliver(Stop(error, number, movable=True))

    def on_plan_removed(self, plan_id: str, reason: str) -> None:
        for request in list(self._requests.values()):
            error = InferenceError(ErrorKind.UNAVAILABLE, reason)
            if request.plan_id == plan_id:
                request.deliver(Stop(error, request.attempt, movable=True))
            candidate = request.candidate
            if candidate is not None and candidate.plan.plan_id == plan_id:
                request.deliver(Stop(error, candidate.number, movable=True))

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
        self._transport.bind_loop()
        plan = await self._plan_for_request(plan_id)
        seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED)
        request = OriginRequest(request_id, plan, prompt, params, seed)
        self._requests[request_id] = request
        self._by_wire[request.wire_id] = request
        try:
            while True:
                try:
                    async for event in self._attempt(request, params, seed, options):
                        yield event
                    return
                except Interrupted as interruption:
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
        self, request: OriginRequest, params: SamplingParams, seed: int, options: RequestOptions
    ) -> AsyncIterator[GenerationEvent]:
        """One attempt on the request's current plan: Start, then its events; raises
        :class:`Interrupted` when the plan cannot carry the request on."""
        plan = request.plan
        stages = [(spec.node_id, spec.address) for spec in plan.assignment.stages]
        error = await self._transport.connect(stages)
        if error is not None:
            raise Interrupted(InferenceError(ErrorKind.UNAVAILABLE, error))
        start = request.start_frame(self.node_id, params, seed, options)
        first = plan.stage(0)
        if not self._transport.send(first.node_id, first.address, start):
            message = f"stage {first.node_id} at {first.address} is lost"
            raise Interrupted(InferenceError(ErrorKind.UNAVAILABLE, message))
        async for event in self._events(request, params, seed, options):
            yield event

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

    async def _events(
        self, request: OriginRequest, params: SamplingParams, seed: int, options: RequestOptions
    ) -> AsyncIterator[GenerationEvent]:
        """Turn the attempt's incoming frames into events until the final one; meanwhile
        start a background move when a newer plan is ready
        (:mod:`meshd.inference.origin_moves`)."""
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
            if self._yield_to_compute is not None:
                await self._yield_to_compute()  # the next step first, this stream meanwhile
            for event in self._events_of(request, item, arrived_at):
                if request.report_pending and isinstance(event, TokenEvent | FinalEvent):
                    request.report_pending = False
                    self._resumed(request)
                yield event
                if isinstance(event, FinalEvent):
                    return

    def _events_of(
        self, request: OriginRequest, item: dp.Frame | Stop, arrived_at: float
    ) -> list[GenerationEvent]:
        candidate = request.candidate
        if isinstance(item, Stop):
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
                raise Interrupted(item.error)
            raise request.failed(item.error)
        if candidate is not None and item.request_id == candidate.wire_id:
            if not self._candidate_frame(request, candidate, item, arrived_at):
                return []
            # It switched over: the frame is the request's current attempt's now.
            return self._delivered(request, item, arrived_at)
        if item.request_id != request.wire_id:
            return []
        if item.WhichOneof("body") == "failure":
            kind = failure_from_proto(item.failure.kind)
            error = request.error_of(item.failure)
            if kind in MOVABLE_FAILURES:
                if candidate is not None:
                    self._switch_over(request, str(error))
                    return []
                raise Interrupted(error, same_plan=kind in RETRY_SAME_PLAN)
            raise request.failed(error)
        return self._delivered(request, item, arrived_at)

    def _delivered(
        self, request: OriginRequest, frame: dp.Frame, arrived_at: float
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
