"""One request the origin holds for a client (:mod:`meshd.inference.origin.runtime`): the client's
side of it (stop strings, text, timing, the final event's usage), its inbox of frames and
local events, and its :class:`meshd.inference.origin.core.OriginCore`, which decides where
the request runs and when it ends.

State and bookkeeping, no I/O: the origin carries the core's decisions out.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import numpy as np

from meshd.inference.errors import InferenceError
from meshd.inference.generation_events import (
    FinalEvent,
    FinishReason,
    GenerationEvent,
    TokenEvent,
    Usage,
)
from meshd.inference.installed import InstalledPlan
from meshd.inference.origin.core import Attempt, OriginCore
from meshd.inference.sampling import SamplingParams, StopChecker
from meshd.inference.stage_events import RequestStart
from meshd.inference.transport.frames import start_to_proto
from meshd.wire import dataplane_pb2 as dp

MAX_ACTIVATION_BYTES = 32 << 20  # a prefill chunk is cut so its activation stays below this


@dataclass(frozen=True)
class RequestOptions:
    """How the client asked for a request, beyond the sampling parameters."""

    return_logits: bool
    prefill_chunk: int
    ignore_eos: bool
    resume: bool


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The client cancelled the request."""


@dataclass(frozen=True, slots=True)
class LinkLost:
    """The link to ``node`` broke (``message`` says which stage, where, and why), at
    ``since`` (the loop's clock) where known."""

    node: str
    message: str
    since: float | None = None


@dataclass(frozen=True, slots=True)
class PlanRemoved:
    plan_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Connected:
    """A background attempt's links opened (``error`` None) or did not."""

    number: int
    error: str | None


LocalEvent = Cancelled | LinkLost | PlanRemoved | Connected
NOT_A_FRAME = -1  # the attempt number of an inbox item that is not a frame


class OriginRequest:
    """A request this node holds for a client: the client's side of it, its inbox, the plans
    its attempts run on, and its core."""

    def __init__(
        self,
        request_id: str,
        plan: InstalledPlan,
        core: OriginCore,
        prompt: tuple[int, ...],
        params: SamplingParams,
        seed: int,
        options: RequestOptions,
    ) -> None:
        self.request_id = request_id
        self.core = core
        self.prompt = prompt
        self.params = params
        self.seed = seed
        self.options = options
        self._checker = StopChecker(plan.tokenizer, params.stop)
        self._started = time.perf_counter()
        self._first_at: float | None = None
        self._last_at: float | None = None
        self._decode_compute_s = 0.0
        self.paused_s = 0.0
        self.cached_tokens = 0  # prompt positions the first token's stages did not compute
        self.interrupted_at: float | None = None  # set while a move is under way
        self.end_reason = "the client went away"
        # The installed plans of its attempts, by plan id (a withdrawn one still gets Ends).
        self.installed: dict[str, InstalledPlan] = {plan.plan_id: plan}
        # Links being opened for background attempts, by attempt number (tasks owned here).
        self.connecting: dict[int, asyncio.Task[None]] = {}
        # Frames (with their attempt's number) and local events, stamped with their arrival.
        self.inbox: asyncio.Queue[tuple[float, dp.Frame | LocalEvent, int]] = asyncio.Queue()

    def deliver(self, item: dp.Frame | LocalEvent, number: int = NOT_A_FRAME) -> None:
        """Queue a frame of attempt ``number``, or a local event, stamped with its arrival
        (timing is measured at arrival, not when the client gets round to reading it)."""
        self.inbox.put_nowait((time.perf_counter(), item, number))

    def plan_of(self, attempt: Attempt) -> InstalledPlan:
        return self.installed[attempt.plan.plan_id]

    def interrupted(self) -> None:
        """An attempt ended early; the pause runs from the last token (or now) on."""
        if self.interrupted_at is None:
            self.interrupted_at = self._last_at or time.perf_counter()

    def arrived(self, token: dp.Token, arrived_at: float) -> float:
        """Timing of a token the core took; the pause it ended (0 when none)."""
        if self._first_at is None:
            self._first_at = arrived_at
            self.cached_tokens = min(token.cached_positions, len(self.prompt))
        else:
            self._decode_compute_s += token.compute_s
        paused = 0.0
        if self.interrupted_at is not None:
            paused = arrived_at - self.interrupted_at
            self.paused_s += paused
            self.interrupted_at = None
        self._last_at = arrived_at
        return paused

    def events_of(self, token: dp.Token) -> list[GenerationEvent]:
        """The client's events for a token the core delivers: its text, and the final event
        when a stop string ends the request."""
        logits = np.frombuffer(token.logits, dtype=np.float32) if token.logits else None
        update = self._checker.add_token(token.token_id)
        events: list[GenerationEvent] = [
            TokenEvent(token.token_id, token.index, update.text, logits)
        ]
        if update.stopped:
            events.append(self.final("stop"))
        return events

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
            completion_tokens=self.core.generated,
            ttft_s=(first - self._started) if first is not None else 0.0,
            decode_s=(self._last_at - first) if first is not None and self._last_at else 0.0,
            total_s=now - self._started,
            decode_compute_s=self._decode_compute_s,
            seed=self.seed,
            resumes=self.core.resumes,
            paused_s=self.paused_s,
            plan_id=self.core.attempt.plan.plan_id,
            cached_tokens=self.cached_tokens,
        )
        return FinalEvent(reason, usage, flushed)

    def start_frame(self, origin: str, attempt: Attempt) -> dp.Frame:
        """The Start of ``attempt`` (a background one is fed the tokens delivered from then
        on); ``origin`` is this node."""
        plan = self.plan_of(attempt)
        options = self.options
        chunk = max(1, min(options.prefill_chunk, MAX_ACTIVATION_BYTES // (4 * plan.hidden_size)))
        start = RequestStart(
            origin=origin,
            prompt=self.prompt,
            prompt_length=len(self.prompt),
            sampling=replace(self.params, seed=self.seed, stop=()),
            eos_ids=frozenset() if options.ignore_eos else frozenset(plan.tokenizer.eos_token_ids),
            prefill_chunk=chunk,
            return_logits=options.return_logits,
            generated=tuple(self.core.tokens[: attempt.from_tokens]),
            catch_up=attempt.catch_up,
            prefix_cache=self.params.prefix_cache and self.core.prefix_cache,
        )
        return dp.Frame(
            plan_id=plan.plan_id, request_id=attempt.wire_id, start=start_to_proto(start)
        )
