"""Admission at a stage: whether a request may open here now, must wait for room, or is
refused, and why.

Pure, as the stage core that asks it (:mod:`meshd.inference.stage.core`): no I/O, no clock,
no MLX, asyncio or gRPC. It answers with messages and :class:`Refusal`s; the core ends the
request and tells its origin.

* Checks (every stage): a Start needs valid sampling settings, a prompt and a chunk size;
  the first stage needs the prompt's tokens; every token id must be one of the model's (the
  first stage embeds them, the last's repetition penalty indexes its logits with them); the
  prompt plus ``max_tokens`` must fit the context the plan reserved per sequence.
* Limits: a plan holds at most ``max_requests`` requests on a stage (``OVERLOADED``).
* The queue (first stage): the requests running at once reserve at most the KV tokens the
  plan reserved (:attr:`Assignment.kv_budget_tokens`: context length x concurrency), each its
  context plus the tokens it may still generate. A Start that does not fit waits, in arrival
  order, in the plan's queue of at most ``max_queued`` (a Start arriving to a full queue is
  refused ``QUEUE_FULL``, which the APIs answer 429 / RESOURCE_EXHAUSTED); the queue's head
  is admitted as soon as requests that ended free enough.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from meshd.inference.assignment import Assignment
from meshd.inference.stage_events import FailureKind, RequestStart, StartFrame


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused on this stage, and the kind of failure its origin reads."""

    message: str
    kind: FailureKind = FailureKind.BAD_REQUEST


def token_error(tokens: Sequence[int], vocab_size: int, plan_id: str) -> str | None:
    """Why ``tokens`` cannot be embedded (an id outside the vocabulary of ``vocab_size``
    tokens; 0: unknown, nothing is checked), or None. The embedding lookup checks no
    bounds: an id past the table reads outside it."""
    if not vocab_size:
        return None
    bad = next((token for token in tokens if not 0 <= token < vocab_size), None)
    if bad is None:
        return None
    return (
        f"token id {bad} is not a token of the model of plan {plan_id[:12]} "
        f"(0 <= id < {vocab_size})"
    )


def start_error(
    start: RequestStart, assignment: Assignment, *, first: bool, vocab_size: int
) -> str | None:
    """Why a stage (the ``first`` or a later one) can never run ``start``, or None. Checked
    before a Start may wait for room: queued, it would hold back every request behind it."""
    if start.sampling is None:
        return f"bad sampling parameters: {start.invalid}"
    if start.prefill_chunk < 1 or start.context_length < 1:
        return "a request needs a prompt and a chunk size"
    if first and len(start.prompt) != start.prompt_length:
        return "the first stage needs the prompt's tokens"
    # Every stage checks: the first embeds the tokens, the last's repetition penalty
    # indexes its logits with them.
    if bad_token := token_error(start.prompt + start.generated, vocab_size, assignment.plan_id):
        return bad_token
    # No KV cache grows past what the plan reserved.
    return assignment.context_error(start.prompt_length, start.sampling.max_tokens)


def limit_error(held: int, max_requests: int, stage: int | None, node_id: str) -> str | None:
    """Why a stage that holds ``held`` requests takes no other (``OVERLOADED``), or None."""
    if held < max_requests:
        return None
    return (
        f"stage {stage} on node {node_id} already holds {held} requests (its limit); retry "
        "when one has finished"
    )


def reservation(start: RequestStart) -> int:
    """KV tokens a request may come to hold: its context and the tokens it may still
    generate (a resumed request has generated some already)."""
    max_tokens = start.sampling.max_tokens if start.sampling is not None else 0
    return start.context_length + max(0, max_tokens - len(start.generated))


@dataclass(eq=False, slots=True)
class StartQueue:
    """A plan's KV budget on its first stage (0: no bound): what the admitted requests
    reserve, and the Starts that wait for room, in arrival order."""

    budget: int
    waiting: deque[StartFrame] = field(default_factory=deque)
    reserved_tokens: int = 0

    def wait_for_room(
        self, frame: StartFrame, *, already_open: bool, max_queued: int, node_id: str
    ) -> Refusal | None:
        """Queue ``frame`` when the budget has no room for it now (or others wait before
        it), refuse it when the queue is full; None when it may start at once or waits."""
        if not self.budget:
            return None
        if already_open or any(waiting.request_id == frame.request_id for waiting in self.waiting):
            return Refusal(f"request {frame.request_id} is already open")
        if not self.waiting and self.reserved_tokens + reservation(frame.start) <= self.budget:
            return None
        if len(self.waiting) >= max_queued:
            message = (
                f"queue full: plan {frame.plan_id[:12]} runs requests reserving "
                f"{self.reserved_tokens} of its {self.budget} KV tokens and {len(self.waiting)} "
                f"wait on node {node_id} (its limit); retry later"
            )
            return Refusal(message, FailureKind.QUEUE_FULL)
        self.waiting.append(frame)
        return None

    def waits(self, frame: StartFrame) -> bool:
        """``frame`` was just queued (by :meth:`wait_for_room`)."""
        return bool(self.waiting) and self.waiting[-1] is frame

    def reserve(self, start: RequestStart) -> int:
        """Reserve an admitted request's KV tokens; how many (0 without a budget)."""
        if not self.budget:
            return 0
        reserved = reservation(start)
        self.reserved_tokens += reserved
        return reserved

    def release(self, reserved: int) -> None:
        """A request that reserved ``reserved`` KV tokens ended."""
        self.reserved_tokens -= reserved

    def next_admitted(self, running: bool) -> StartFrame | None:
        """The queue's head, taken out, when the budget has room for it (or nothing else is
        ``running``: a request alone always runs); None while it must wait."""
        if self.waiting and (
            self.reserved_tokens + reservation(self.waiting[0].start) <= self.budget or not running
        ):
            return self.waiting.popleft()
        return None

    def take(self, which: Callable[[StartFrame], bool]) -> list[StartFrame]:
        """Take the waiting Starts ``which`` selects out of the queue."""
        taken = [frame for frame in self.waiting if which(frame)]
        for frame in taken:
            self.waiting.remove(frame)
        return taken
