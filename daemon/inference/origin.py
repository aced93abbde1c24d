"""The origin: requests this node asks the mesh, from validation to the client's last event.

The origin is the node a client talks to. It checks the request (nothing is sent for bad
input), sends the Start to the plan's first stage, turns the Token frames the last stage
sends back into :class:`TokenEvent`s (detokenized, stop strings applied by
:class:`meshd.inference.sampling.StopChecker`) and ends with one :class:`FinalEvent`. On the
way out (finished, stopped, cancelled, the client gone, failed) it sends End to every stage,
so they free the request's caches.

Errors never hang a client: a request that cannot be served raises
:class:`meshd.inference.errors.InferenceError` from its event iterator, at once when a stage
reports a Failure or the link to a stage of the request breaks, when the plan is uninstalled
(with the agreement's reason), and as a last resort after ``first_token_timeout_s`` /
``token_timeout_s`` without a token. Bad arguments raise it (kind ``BAD_INPUT``) before
anything is sent.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from meshd.inference.errors import ErrorKind, InferenceError
from meshd.inference.fencing import FenceCheck
from meshd.inference.frames import failure_from_proto, finish_from_proto, start_to_proto
from meshd.inference.installed import InstalledPlan
from meshd.inference.sampling import MAX_SEED, SamplingParams, StopChecker
from meshd.inference.stage_events import FailureKind, Finish, RequestStart
from meshd.inference.transport import Transport
from meshd.wire import dataplane_pb2 as dp

DEFAULT_PREFILL_CHUNK = 256
MAX_ACTIVATION_BYTES = 32 << 20  # a prefill chunk is cut so its activation stays below this
MAX_REQUEST_ID_CHARS = 128

FinishReason = Literal["stop", "length", "eos", "cancelled"]

# How a stage's Failure reads to the client. A stage still loading, or one that moved to
# another plan, is worth a retry only while no token was generated (the router retries
# those); after that either is UNAVAILABLE (see _OriginRequest.error_of).
_FAILURE_KINDS: dict[FailureKind, ErrorKind] = {
    FailureKind.FENCED: ErrorKind.NO_PLAN,  # the stage has moved to another plan
    FailureKind.NOT_LOADED: ErrorKind.LOADING,
    FailureKind.OVERLOADED: ErrorKind.OVERLOADED,
    FailureKind.UNREACHABLE: ErrorKind.UNAVAILABLE,
    FailureKind.INTERNAL: ErrorKind.INTERNAL,
    FailureKind.BAD_REQUEST: ErrorKind.UNAVAILABLE,  # the stage's view of the plan differs
}


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
    """A local decision that ends a request: cancelled (``error`` None) or failed."""

    error: InferenceError | None


class _OriginRequest:
    """A request this node holds for a client: incoming frames -> events."""

    def __init__(
        self,
        request_id: str,
        plan: InstalledPlan,
        params: SamplingParams,
        prompt_tokens: int,
        seed: int,
    ) -> None:
        self.request_id = request_id
        self.plan_id = plan.plan_id
        self.nodes = frozenset(plan.assignment.node_ids)
        self.last_stage = plan.assignment.stages[-1]
        self.inbox: asyncio.Queue[tuple[float, dp.Frame | _Stop]] = asyncio.Queue()
        self._checker = StopChecker(plan.tokenizer, params.stop)
        self._prompt_tokens = prompt_tokens
        self._seed = seed
        self._started = time.perf_counter()
        self._first_at: float | None = None
        self._last_at: float | None = None
        self._decode_compute_s = 0.0
        self.generated = 0
        self.end_reason = "the client went away"

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
        if self._first_at is None:
            self._first_at = arrived_at
        else:
            self._decode_compute_s += token.compute_s
        self._last_at = arrived_at
        self.generated += 1
        finish = finish_from_proto(token.finish)
        if finish is Finish.EOS:
            return [self.final("eos")]
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
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self.generated,
            ttft_s=(first - self._started) if first is not None else 0.0,
            decode_s=(self._last_at - first) if first is not None and self._last_at else 0.0,
            total_s=now - self._started,
            decode_compute_s=self._decode_compute_s,
            seed=self._seed,
        )
        return FinalEvent(reason, usage, flushed)


@dataclass(frozen=True)
class _Options:
    return_logits: bool
    prefill_chunk: int
    ignore_eos: bool


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
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        first_token_timeout_s: float = 300.0,
        token_timeout_s: float = 60.0,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1 token, got {prefill_chunk}")
        self.node_id = node_id
        self._transport = transport
        self._plans = plans
        self._check_serving = check_serving
        self.prefill_chunk = prefill_chunk
        self.first_token_timeout_s = first_token_timeout_s
        self.token_timeout_s = token_timeout_s
        self._requests: dict[str, _OriginRequest] = {}
        self.tokens_delivered = 0  # tokens this node's clients received (live tokens/s)

    def count(self, plan_id: str) -> int:
        return sum(1 for request in self._requests.values() if request.plan_id == plan_id)

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
    ) -> AsyncIterator[GenerationEvent]:
        """See :meth:`meshd.inference.dataplane.DataPlane.generate`."""
        self._check_request(plan_id, prompt_tokens, params, request_id, prefill_chunk)
        options = _Options(return_logits, prefill_chunk or self.prefill_chunk, ignore_eos)
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
        request = self._requests.get(frame.request_id)
        if (
            request is not None
            and request.plan_id == frame.plan_id
            and sender == request.last_stage.node_id
        ):
            request.deliver(frame)

    def on_failure(self, sender: str, frame: dp.Frame) -> None:
        request = self._requests.get(frame.request_id)
        if request is None or request.plan_id != frame.plan_id:
            return
        if sender in request.nodes or sender == self.node_id:
            request.deliver(frame)

    def on_peer_lost(self, peer: str, reason: str) -> None:
        for request in list(self._requests.values()):
            if peer in request.nodes:
                plan = self._plans.get(request.plan_id)
                address = plan.assignment.address_of(peer) if plan is not None else None
                where = f" at {address}" if address else ""
                message = f"stage {peer}{where} unreachable: {reason}"
                request.deliver(_Stop(InferenceError(ErrorKind.UNAVAILABLE, message)))

    def on_plan_removed(self, plan_id: str, reason: str) -> None:
        for request in list(self._requests.values()):
            if request.plan_id == plan_id:
                request.deliver(_Stop(InferenceError(ErrorKind.UNAVAILABLE, reason)))

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
        request = _OriginRequest(request_id, plan, params, len(prompt), seed)
        self._requests[request_id] = request
        try:
            stages = [(spec.node_id, spec.address) for spec in plan.assignment.stages]
            error = await self._transport.connect(stages)
            if error is not None:
                raise request.failed(InferenceError(ErrorKind.UNAVAILABLE, error))
            start = self._start_frame(plan, request_id, prompt, params, seed, options)
            first = plan.stage(0)
            if not self._transport.send(first.node_id, first.address, start):
                message = f"stage {first.node_id} at {first.address} is lost"
                raise request.failed(InferenceError(ErrorKind.UNAVAILABLE, message))
            async for event in self._events(request):
                yield event
        finally:
            self._requests.pop(request_id, None)
            self._end_everywhere(plan, request_id, request.end_reason)

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
        plan: InstalledPlan,
        request_id: str,
        prompt: tuple[int, ...],
        params: SamplingParams,
        seed: int,
        options: _Options,
    ) -> dp.Frame:
        chunk = max(1, min(options.prefill_chunk, MAX_ACTIVATION_BYTES // (4 * plan.hidden_size)))
        start = RequestStart(
            origin=self.node_id,
            prompt=prompt,
            prompt_length=len(prompt),
            sampling=replace(params, seed=seed, stop=()),
            eos_ids=frozenset() if options.ignore_eos else frozenset(plan.tokenizer.eos_token_ids),
            prefill_chunk=chunk,
            return_logits=options.return_logits,
        )
        return dp.Frame(plan_id=plan.plan_id, request_id=request_id, start=start_to_proto(start))

    async def _events(self, request: _OriginRequest) -> AsyncIterator[GenerationEvent]:
        """Turn the request's incoming frames into events until the final one."""
        while True:
            timeout = self.first_token_timeout_s if request.generated == 0 else self.token_timeout_s
            try:
                async with asyncio.timeout(timeout):
                    arrived_at, item = await request.inbox.get()
            except TimeoutError:
                stage = request.last_stage
                message = (
                    f"no token from the mesh for {timeout:g} s (plan {request.plan_id[:12]}, "
                    f"last stage {stage.node_id} at {stage.address}); giving up"
                )
                raise request.failed(InferenceError(ErrorKind.UNAVAILABLE, message)) from None
            for event in self._events_of(request, item, arrived_at):
                yield event
                if isinstance(event, FinalEvent):
                    return

    def _events_of(
        self, request: _OriginRequest, item: dp.Frame | _Stop, arrived_at: float
    ) -> list[GenerationEvent]:
        if isinstance(item, _Stop):
            if item.error is not None:
                raise request.failed(item.error)
            return [request.final("cancelled")]
        if item.WhichOneof("body") == "failure":
            raise request.failed(request.error_of(item.failure))
        self.tokens_delivered += 1
        return request.on_token(item.token, arrived_at)

    def _end_everywhere(self, plan: InstalledPlan, request_id: str, reason: str) -> None:
        """Tell every stage the request is over (existing links only: no reconnect storms)."""
        frame = dp.Frame(plan_id=plan.plan_id, request_id=request_id, end=dp.End(reason=reason))
        for spec in plan.assignment.stages:
            self._transport.send(spec.node_id, spec.address, frame, open_new=False)
