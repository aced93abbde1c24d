"""The stage core: what one node's pipeline stages decide, as a pure state machine.

Why a pure core: the stage's decisions (may this frame be served? in which order? what is
computed next? where does the result go? when is a request over?) are where the data plane's
correctness lives, and they must be testable without gRPC, mutual TLS or MLX, one event at a
time (``tests/test_stage_core.py``). This module does no I/O, starts nothing, reads no clock
and imports no MLX, asyncio or gRPC: time is the ``now`` argument, the outside world is the
events it is given (frames as values, compute results, lost peers, plan changes), and what
the node must do comes back as actions (``SendActivation``, ``SendToken``, ``SendFailure``,
``Release``; events and actions are the values of :mod:`meshd.inference.stage_events`), plus
:meth:`StageCore.next_batch`, the scheduler's answer to "what does the compute thread run
next". :mod:`meshd.inference.stage` carries the actions out.

A request's steps (the schedule of mlx-lm's ``generate_step``, so a request alone computes
exactly what one mlx-lm process computes): the prompt is prefilled as ``prompt[:-1]`` in
chunks of ``prefill_chunk`` tokens, then its last token alone; on a request resumed after
``n`` generated tokens each of them follows alone, as the request computed them the first
time (:func:`meshd.inference.stage_events.request_steps`), so the caches hold the same bits.
The last of these context steps, ``C``, gives the next token (the first, or token ``n``);
step ``C + 1 + i`` runs the ``i``-th token sampled from then on. Only steps ``>= C`` reach
the head. The first stage knows every prompt step from the Start; later stages receive the
steps as Activations, in order; the first stage learns each generated token from the last
stage's Token (a single stage feeds itself, with no frame at all).

A request moving in the background (``RequestStart.catch_up``: its origin runs it on an older
plan meanwhile) also learns generated tokens from its origin: the tokens the older attempt
delivers after this one started come as Tokens from the origin, and the first stage queues
each as the input of its next step at once, without waiting for the round trip through the
last stage, so the new plan catches up as fast as its stages compute. The last stage still
samples every step with the request's seeded sampler; whichever copy of a token index reaches
the first stage first is its input, the other copy is dropped. (Whether the two agree is the
origin's check: it compares every token of the new attempt with the one it delivered.)

Rules (each refusal ends the request on this node and tells its origin with a Failure):

* Fencing, for every Start, Activation and Token: the plan must be committed here (the
  agreement's verdict, given with the event), installed and loaded (a plan still loading is
  ``NOT_LOADED``, which the origin may retry; one that failed to load is ``INTERNAL`` with the
  reason), and hold a stage on this node.
* Senders: a Start comes from its origin to the first stage; an Activation from the
  previous stage of the plan; a Token that continues a request from its last stage, or
  from its origin when the Start said ``catch_up``; an End from the origin. The transport
  authenticates senders (TLS certificate = node id).
* Order: Activations arrive with consecutive steps, Tokens with consecutive indexes
  (during a catch-up, per sender: an index the other sender already gave is dropped);
  anything else is refused. Frames of a request that ended here are dropped (an End may
  overtake its Start; a late frame may follow a refusal).
* Bounds: a plan holds at most ``max_requests`` requests on this stage (``OVERLOADED``); a
  request silent for ``idle_timeout_s`` is dropped (its origin vanished without a word).
* Admission (first stage): the requests running at once reserve at most the KV tokens the
  plan reserved (:attr:`Assignment.kv_budget_tokens`: context length x concurrency), each its
  context plus the tokens it may still generate. A Start that does not fit waits, in arrival
  order, in the plan's queue of at most ``max_queued`` (a Start arriving to a full queue is
  refused ``QUEUE_FULL``, which the APIs answer 429 / RESOURCE_EXHAUSTED); the
  queue's head is admitted as soon as requests that ended free enough.

Scheduling: a request's steps run in order, one at a time, except on a single stage, whose
next step's input is the token its current step samples: that following step is handed out
at once and waits right behind it on the compute thread (as mlx-lm's ``generate_step``
computes one token ahead; the engine skips it when the token ended the request). Requests
whose next input has arrived wait in one round-robin queue: after each step handed out a
request goes to the back, so a long prompt's prefill chunks interleave with other requests'
steps and a short request's first token never waits for a long prompt to finish.
:meth:`StageCore.next_batch` may hand out steps of several requests at once (one per
request): the runtime runs the decode steps among them in one batched forward pass.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from meshd.inference.assignment import Assignment
from meshd.inference.sampling import SamplingParams
from meshd.inference.stage_events import (
    Action,
    ActivationFrame,
    ComputeFailed,
    EndFrame,
    FailureKind,
    Finish,
    Hidden,
    Release,
    RequestStart,
    Sampled,
    SamplerSetup,
    SendActivation,
    SendFailure,
    SendToken,
    Skipped,
    StartFrame,
    StepResult,
    TokenFrame,
    Work,
    request_steps,
)

ENDED_REMEMBERED = 4096  # ids of ended requests kept to drop their late frames
LOAD_FAILURES_REMEMBERED = 64


@dataclass(slots=True)
class _Input:
    step: int
    tokens: tuple[int, ...] | None = None
    payload: object = None
    upstream_s: float = 0.0
    follows: bool = False  # a single stage's next step: its input is the token sampled before


@dataclass(eq=False, slots=True)
class _Request:
    plan_id: str
    request_id: str
    origin: str
    start: RequestStart
    sampling: SamplingParams  # the Start's, validated
    chunk_steps: int  # C: prompt chunks before the step that samples
    last_activity: float
    next_step: int = 0  # the step whose input this stage expects next
    next_index: int = 0  # the index of the next generated token (sampled here / expected)
    inputs: deque[_Input] = field(default_factory=deque)
    sampler_opened: bool = False
    heads_out: int = 0  # steps handed out that sample a token
    in_flight: int = 0  # steps on the compute thread (2 only for a following step)
    queued: bool = False
    ended: bool = False
    reserved: int = 0  # KV tokens reserved at admission (first stage of a bounded plan)


@dataclass(eq=False, slots=True)
class _Plan:
    assignment: Assignment
    index: int | None
    ready: bool = False
    requests: dict[str, _Request] = field(default_factory=dict)
    vocab_size: int = 0  # the model's token ids are 0 <= id < vocab_size (0: unknown)

    def token_error(self, tokens: Sequence[int]) -> str | None:
        """Why ``tokens`` cannot be embedded (an id outside the vocabulary), or None. The
        embedding lookup checks no bounds: an id past the table reads outside it."""
        if not self.vocab_size:
            return None
        bad = next((token for token in tokens if not 0 <= token < self.vocab_size), None)
        if bad is None:
            return None
        return (
            f"token id {bad} is not a token of the model of plan {self.plan_id[:12]} "
            f"(0 <= id < {self.vocab_size})"
        )

    waiting: deque[StartFrame] = field(default_factory=deque)  # Starts not admitted yet, FIFO
    reserved_tokens: int = 0  # KV tokens the admitted requests reserve (first stage)

    @property
    def plan_id(self) -> str:
        return self.assignment.plan_id

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == len(self.assignment.stages) - 1

    def node(self, index: int) -> str:
        return self.assignment.stages[index].node_id


# --- The core ---------------------------------------------------------------------------------


class StageCore:
    """The stages of every plan installed on node ``node_id``, and their open requests."""

    def __init__(
        self,
        node_id: str,
        *,
        max_requests: int = 64,
        idle_timeout_s: float = 600.0,
        max_queued: int = 64,
    ):
        if max_requests < 1:
            raise ValueError(f"max_requests must be at least 1, got {max_requests}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be at least 0, got {max_queued}")
        self.node_id = node_id
        self.max_requests = max_requests
        self.max_queued = max_queued
        self.idle_timeout_s = idle_timeout_s
        self._plans: dict[str, _Plan] = {}
        self._load_failures: OrderedDict[str, str] = OrderedDict()
        self._ended: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._ready: deque[_Request] = deque()
        self._clock = 0.0  # the latest ``now`` an event brought (when a queued Start is admitted)

    # ------------------------------------------------------------ plans

    def add_plan(self, assignment: Assignment) -> None:
        """A plan is being installed: frames for it are answered ``NOT_LOADED`` until
        :meth:`plan_loaded`."""
        if assignment.plan_id not in self._plans:
            index = assignment.stage_index(self.node_id)
            self._plans[assignment.plan_id] = _Plan(assignment, index)
        self._load_failures.pop(assignment.plan_id, None)

    def plan_loaded(self, plan_id: str, vocab_size: int = 0) -> None:
        """The plan's stage is loaded here; ``vocab_size`` (when known) bounds the token ids
        the first stage accepts."""
        plan = self._plans.get(plan_id)
        if plan is not None:
            plan.ready = True
            plan.vocab_size = vocab_size

    def plan_failed(self, plan_id: str, reason: str) -> list[Action]:
        """This node cannot serve ``plan_id`` (its part could not be fetched or loaded):
        frames for it are refused at once with ``reason``, not told to wait for a load."""
        actions = self.remove_plan(plan_id, f"node {self.node_id} cannot serve it: {reason}")
        self._load_failures[plan_id] = reason
        while len(self._load_failures) > LOAD_FAILURES_REMEMBERED:
            self._load_failures.popitem(last=False)
        return actions

    def remove_plan(self, plan_id: str, reason: str) -> list[Action]:
        """Stop serving ``plan_id``: its requests here end, their origins are told ``reason``."""
        self._load_failures.pop(plan_id, None)
        plan = self._plans.pop(plan_id, None)
        if plan is None:
            return []
        actions: list[Action] = []
        for request in list(plan.requests.values()):
            actions += self._drop(plan, request, FailureKind.FENCED, reason)
        while plan.waiting:
            frame = plan.waiting.popleft()
            self._remember_ended(plan.plan_id, frame.request_id)
            kind = FailureKind.FENCED
            actions.append(
                SendFailure(frame.start.origin, plan.plan_id, frame.request_id, kind, reason)
            )
        return actions

    def queued_requests(self, plan_id: str) -> int:
        """Starts waiting to be admitted on this (first) stage of ``plan_id``."""
        plan = self._plans.get(plan_id)
        return len(plan.waiting) if plan is not None else 0

    def reserved_tokens(self, plan_id: str) -> int:
        """KV tokens the admitted requests of ``plan_id`` reserve here (first stage)."""
        plan = self._plans.get(plan_id)
        return plan.reserved_tokens if plan is not None else 0

    def has_plan(self, plan_id: str) -> bool:
        return plan_id in self._plans

    def open_requests(self, plan_id: str) -> int:
        plan = self._plans.get(plan_id)
        return len(plan.requests) if plan is not None else 0

    def total_open_requests(self) -> int:
        return sum(len(plan.requests) for plan in self._plans.values())

    # ------------------------------------------------------------ frames

    def on_start(self, frame: StartFrame, fence: str | None, now: float) -> list[Action]:
        """A request begins at the first stage. ``fence`` is None when the plan is committed
        here, else the agreement's reason why not."""
        start = frame.start
        if start.origin != frame.sender:
            return self._refuse(frame.sender, frame, "a Start must come from its origin")
        plan = self._plans.get(frame.plan_id)
        if refused := self._admission(start.origin, frame, plan, fence):
            return refused
        assert plan is not None and plan.index is not None
        if not plan.is_first:
            return self._refuse(
                start.origin,
                frame,
                f"node {self.node_id} holds stage {plan.index} of plan {plan.plan_id}, not the "
                "first: the origin has another view of the plan",
            )
        self._clock = max(self._clock, now)
        if refused := self._invalid_start(plan, frame):
            return refused
        if refused := self._wait_for_room(plan, frame):
            return refused
        if plan.waiting and plan.waiting[-1] is frame:
            return []  # it waits for room
        return self._admit(plan, frame, now)

    def _invalid_start(self, plan: _Plan, frame: StartFrame | ActivationFrame) -> list[Action]:
        """The refusal of a Start this stage can never run, else nothing. Checked before a
        Start may wait for room: queued, it would hold back every request behind it."""
        start = frame.start
        assert start is not None
        if start.sampling is None:
            return self._refuse(start.origin, frame, f"bad sampling parameters: {start.invalid}")
        if start.prefill_chunk < 1 or start.context_length < 1:
            return self._refuse(start.origin, frame, "a request needs a prompt and a chunk size")
        if plan.is_first and len(start.prompt) != start.prompt_length:
            return self._refuse(start.origin, frame, "the first stage needs the prompt's tokens")
        # Every stage checks: the first embeds the tokens, the last's repetition penalty
        # indexes its logits with them.
        if bad_token := plan.token_error(start.prompt + start.generated):
            return self._refuse(start.origin, frame, bad_token)
        too_long = plan.assignment.context_error(start.prompt_length, start.sampling.max_tokens)
        if too_long is not None:  # no KV cache grows past what the plan reserved
            return self._refuse(start.origin, frame, too_long)
        return []

    def _wait_for_room(self, plan: _Plan, frame: StartFrame) -> list[Action]:
        """Queue ``frame`` when the plan's KV budget has no room for it now (or others wait
        before it), refuse it when the queue is full; nothing when it may start at once."""
        budget = plan.assignment.kv_budget_tokens
        if not budget:
            return []
        if frame.request_id in plan.requests or any(
            waiting.request_id == frame.request_id for waiting in plan.waiting
        ):
            return self._refuse(
                frame.start.origin, frame, f"request {frame.request_id} is already open"
            )
        if not plan.waiting and plan.reserved_tokens + _reservation(frame.start) <= budget:
            return []
        if len(plan.waiting) >= self.max_queued:
            message = (
                f"queue full: plan {plan.plan_id[:12]} runs requests reserving "
                f"{plan.reserved_tokens} of its {budget} KV tokens and {len(plan.waiting)} wait "
                f"on node {self.node_id} (its limit); retry later"
            )
            return self._refuse(frame.start.origin, frame, message, FailureKind.QUEUE_FULL)
        plan.waiting.append(frame)
        return []

    def _admit(self, plan: _Plan, frame: StartFrame, now: float) -> list[Action]:
        """Open a request on the first stage and queue its prompt's steps."""
        start = frame.start
        opened = self._open(plan, frame, start, now)
        if not isinstance(opened, _Request):
            return opened
        if plan.assignment.kv_budget_tokens:
            opened.reserved = _reservation(start)
            plan.reserved_tokens += opened.reserved
        context = start.prompt + start.generated
        offset = 0
        for step, size in enumerate(_steps_of(start)):
            opened.inputs.append(_Input(step, tokens=context[offset : offset + size]))
            offset += size
        opened.next_step = opened.chunk_steps + 1
        self._enqueue(opened)
        return []

    def on_activation(self, frame: ActivationFrame, fence: str | None, now: float) -> list[Action]:
        """Hidden states of one step from the previous stage."""
        key = (frame.plan_id, frame.request_id)
        if key in self._ended:
            return []
        plan = self._plans.get(frame.plan_id)
        request = plan.requests.get(frame.request_id) if plan is not None else None
        if request is not None:
            origin = request.origin
        else:
            origin = frame.start.origin if frame.start is not None else frame.sender
        if refused := self._admission(origin, frame, plan, fence):
            return refused
        assert plan is not None and plan.index is not None
        if plan.index == 0 or plan.node(plan.index - 1) != frame.sender:
            return self._refuse(
                origin,
                frame,
                f"node {frame.sender} is not the previous stage of node {self.node_id}",
            )
        if request is None:
            if frame.start is None:
                return []  # a late frame of a request this stage already dropped
            opened = self._open(plan, frame, frame.start, now)
            if not isinstance(opened, _Request):
                return opened
            request = opened
        if frame.step != request.next_step:
            return self._refuse(
                origin, frame, f"step {frame.step} arrived, expected {request.next_step}"
            )
        request.next_step += 1
        request.last_activity = now
        request.inputs.append(
            _Input(frame.step, payload=frame.payload, upstream_s=frame.upstream_s)
        )
        self._enqueue(request)
        return []

    def on_token(self, frame: TokenFrame, fence: str | None, now: float) -> list[Action]:
        """A sampled token, at the first stage of a multi-stage plan: the next step's input.
        From the last stage, or during a catch-up also from the origin (a token an older
        attempt delivered; see the module docstring). (The origin's own copy of a sampled
        token is not the core's business.)"""
        plan = self._plans.get(frame.plan_id)
        if plan is None or not plan.is_first or plan.is_last:
            return []
        request = plan.requests.get(frame.request_id)
        if request is None or request.ended or frame.finish is not Finish.NONE:
            return []
        catch_up = request.start.catch_up
        from_origin = catch_up and frame.sender == request.origin
        if frame.sender != plan.node(len(plan.assignment.stages) - 1) and not from_origin:
            return []
        if refused := self._admission(request.origin, frame, plan, fence):
            return refused
        if catch_up and frame.index < request.next_index:
            return []  # the other sender's copy of this token came first
        if frame.index != request.next_index:
            return self._refuse(
                request.origin, frame, f"token {frame.index} arrived, expected {request.next_index}"
            )
        if bad_token := plan.token_error((frame.token_id,)):
            return self._refuse(request.origin, frame, bad_token)
        request.next_index += 1
        request.last_activity = now
        request.inputs.append(_Input(request.next_step, tokens=(frame.token_id,)))
        request.next_step += 1
        self._enqueue(request)
        return []

    def on_end(self, frame: EndFrame) -> list[Action]:
        """The origin ended the request (finished, stopped, cancelled or failed elsewhere)."""
        plan = self._plans.get(frame.plan_id)
        request = plan.requests.get(frame.request_id) if plan is not None else None
        if request is None:
            self._remember_ended(frame.plan_id, frame.request_id)  # End may overtake a Start
            if plan is not None:
                self._unqueue(
                    plan,
                    lambda waiting: (
                        waiting.request_id == frame.request_id
                        and frame.sender in (waiting.start.origin, self.node_id)
                    ),
                )
            return []
        assert plan is not None
        if frame.sender not in (request.origin, self.node_id):
            return []
        return self._drop(plan, request, None, "")

    # ------------------------------------------------------------ peers and links

    def on_peer_lost(self, peer: str, reason: str) -> list[Action]:
        """Every request that involves ``peer`` is over: frames to or from it may be lost."""
        actions: list[Action] = []
        for plan in list(self._plans.values()):
            involved = peer in plan.assignment.node_ids
            for frame in self._unqueue(plan, lambda w, hit=involved: hit or w.start.origin == peer):
                if frame.start.origin != peer:
                    message = _unreachable(plan.assignment, peer, reason)
                    actions.append(
                        SendFailure(
                            frame.start.origin,
                            plan.plan_id,
                            frame.request_id,
                            FailureKind.UNREACHABLE,
                            message,
                        )
                    )
            for request in list(plan.requests.values()):
                if request.origin == peer:
                    actions += self._drop(plan, request, None, "")
                elif involved:
                    message = _unreachable(plan.assignment, peer, reason)
                    actions += self._drop(plan, request, FailureKind.UNREACHABLE, message)
        return actions

    def on_unreachable(self, plan_id: str, request_id: str, peer: str) -> list[Action]:
        """A frame of the request could not be sent to ``peer``."""
        plan = self._plans.get(plan_id)
        request = plan.requests.get(request_id) if plan is not None else None
        if plan is None or request is None:
            return []
        message = _unreachable(plan.assignment, peer, "no link to it")
        return self._drop(plan, request, FailureKind.UNREACHABLE, message)

    # ------------------------------------------------------------ compute

    def next_batch(self, now: float, max_items: int = 1) -> list[Work]:
        """The steps to compute next: the first ``max_items`` requests of the round-robin
        queue whose next input has arrived, one step each (a request is queued again behind
        the others). Empty when nothing is ready."""
        self._clock = max(self._clock, now)
        batch: list[Work] = []
        taken: list[_Request] = []
        while self._ready and len(batch) < max_items:
            request = self._ready.popleft()
            request.queued = False
            if not self._can_run(request):
                continue
            plan = self._plans[request.plan_id]
            batch.append(self._work(plan, request, request.inputs.popleft()))
            request.in_flight += 1
            request.last_activity = now
            taken.append(request)
        for request in taken:
            self._enqueue(request)
        return batch

    def on_computed(self, work: Work, result: StepResult, now: float) -> list[Action]:
        """A step finished on the compute thread: where its result goes."""
        self._clock = max(self._clock, now)
        plan = self._plans.get(work.plan_id)
        request = plan.requests.get(work.request_id) if plan is not None else None
        if plan is None or request is None or request.ended:
            return []  # dropped while it computed; its Release follows the step
        request.in_flight -= 1
        request.last_activity = now
        assert plan.index is not None
        if isinstance(result, ComputeFailed):
            message = f"stage {plan.index} on node {self.node_id} failed: {result.reason}"
            return self._drop(plan, request, result.kind, message)
        actions: list[Action] = []
        if isinstance(result, Hidden):
            forward = self._forward_start(request) if work.step == 0 else None
            actions.append(
                SendActivation(
                    plan.node(plan.index + 1),
                    plan.plan_id,
                    request.request_id,
                    work.step,
                    result.payload,
                    result.compute_s,
                    forward,
                )
            )
        elif isinstance(result, Sampled):
            actions += self._on_sampled(plan, request, result)
        elif isinstance(result, Skipped):
            return []  # the step before ended the request: nothing happened
        if not request.ended:
            self._enqueue(request)
        return actions

    def sweep(self, now: float) -> list[Action]:
        """Drop requests silent for ``idle_timeout_s`` (their origin vanished without a word)."""
        self._clock = max(self._clock, now)
        deadline = now - self.idle_timeout_s
        actions: list[Action] = []
        for plan in list(self._plans.values()):
            for request in list(plan.requests.values()):
                if request.last_activity < deadline and not request.in_flight:
                    message = f"request idle for {self.idle_timeout_s:g} s on node {self.node_id}"
                    actions += self._drop(plan, request, FailureKind.INTERNAL, message)
        return actions

    # ------------------------------------------------------------ internals

    def _admission(
        self,
        origin: str,
        frame: StartFrame | ActivationFrame | TokenFrame,
        plan: _Plan | None,
        fence: str | None,
    ) -> list[Action]:
        """Fencing: refusal actions unless the plan is committed, loaded and has a stage here."""
        if fence is not None:
            return self._refuse(origin, frame, fence, FailureKind.FENCED)
        failure = self._load_failures.get(frame.plan_id)
        if plan is None and failure is not None:
            message = f"node {self.node_id} cannot serve plan {frame.plan_id}: {failure}"
            return self._refuse(origin, frame, message, FailureKind.INTERNAL)
        if plan is None or not plan.ready:
            message = (
                f"plan {frame.plan_id} is committed on node {self.node_id} but not installed "
                "there yet; retry once it is loaded"
            )
            return self._refuse(origin, frame, message, FailureKind.NOT_LOADED)
        if plan.index is None:
            message = f"node {self.node_id} holds no stage of plan {frame.plan_id}"
            return self._refuse(origin, frame, message)
        return []

    def _open(
        self, plan: _Plan, frame: StartFrame | ActivationFrame, start: RequestStart, now: float
    ) -> _Request | list[Action]:
        """The stage's record of a new request, or the actions that refuse it."""
        if (plan.plan_id, frame.request_id) in self._ended:
            return []
        if frame.request_id in plan.requests:
            return self._refuse(start.origin, frame, f"request {frame.request_id} is already open")
        if len(plan.requests) >= self.max_requests:
            message = (
                f"stage {plan.index} on node {self.node_id} already holds {len(plan.requests)} "
                "requests (its limit); retry when one has finished"
            )
            return self._refuse(start.origin, frame, message, FailureKind.OVERLOADED)
        if refused := self._invalid_start(plan, frame):
            return refused
        assert start.sampling is not None
        chunk_steps = len(_steps_of(start)) - 1
        request = _Request(
            plan_id=plan.plan_id,
            request_id=frame.request_id,
            origin=start.origin,
            start=start,
            sampling=start.sampling,
            chunk_steps=chunk_steps,
            last_activity=now,
            next_index=len(start.generated),
        )
        plan.requests[request.request_id] = request
        return request

    def _work(self, plan: _Plan, request: _Request, item: _Input) -> Work:
        head = plan.is_last and item.step >= request.chunk_steps
        if head and plan.is_first:
            # A single stage samples the next step's input itself: the step that follows is
            # ready now and waits right behind this one on the compute thread (as mlx-lm's
            # generate_step computes one token ahead), unless this one gives the last token.
            index = len(request.start.generated) + request.heads_out
            if index + 1 < request.sampling.max_tokens:
                request.inputs.append(_Input(item.step + 1, follows=True))
        request.heads_out += head
        sampler = None
        if head and not request.sampler_opened:
            request.sampler_opened = True
            start = request.start
            sampler = SamplerSetup(
                sampling=request.sampling,
                context=start.prompt + start.generated,
                draws=0 if request.sampling.greedy else len(start.generated),
                return_logits=start.return_logits,
            )
        return Work(
            plan.plan_id,
            request.request_id,
            item.step,
            item.tokens,
            item.payload,
            head,
            sampler,
            item.upstream_s,
            item.follows,
            request.start.eos_ids if item.follows else frozenset(),
        )

    def _on_sampled(self, plan: _Plan, request: _Request, result: Sampled) -> list[Action]:
        """The last stage sampled a token: it goes to the origin and, unless it ends the
        request, back to the first stage (a single stage's next step follows it already)."""
        start = request.start
        index = request.next_index
        request.next_index += 1
        if result.token_id in start.eos_ids:
            finish = Finish.EOS
        elif request.next_index >= request.sampling.max_tokens:
            finish = Finish.LENGTH
        else:
            finish = Finish.NONE
        first = plan.node(0)
        targets = [request.origin]
        if finish is Finish.NONE and first not in (request.origin, self.node_id):
            targets.append(first)
        actions: list[Action] = [
            SendToken(
                tuple(targets),
                plan.plan_id,
                request.request_id,
                result.token_id,
                index,
                finish,
                result.compute_s,
                result.logits,
            )
        ]
        if finish is not Finish.NONE:
            actions += self._drop(plan, request, None, "")
        return actions

    def _forward_start(self, request: _Request) -> RequestStart:
        """What the next stage gets of the Start: the tokens only where the last stage's
        repetition penalty needs them."""
        start = request.start
        if request.sampling.repetition_penalty != 1.0:
            return start
        return RequestStart(
            origin=start.origin,
            prompt=(),
            prompt_length=start.prompt_length,
            sampling=start.sampling,
            eos_ids=start.eos_ids,
            prefill_chunk=start.prefill_chunk,
            return_logits=start.return_logits,
            generated=start.generated,
        )

    def _can_run(self, request: _Request) -> bool:
        """A request's next step may start: its input is here, and its step before has
        finished, or is the one whose token this step follows (a single stage)."""
        if request.ended or not request.inputs:
            return False
        return request.in_flight == 0 or (request.in_flight == 1 and request.inputs[0].follows)

    def _enqueue(self, request: _Request) -> None:
        if not request.queued and self._can_run(request):
            request.queued = True
            self._ready.append(request)

    def _refuse(
        self,
        origin: str,
        frame: StartFrame | ActivationFrame | TokenFrame,
        message: str,
        kind: FailureKind = FailureKind.BAD_REQUEST,
    ) -> list[Action]:
        """End the request here (if open) and tell ``origin`` why."""
        self._remember_ended(frame.plan_id, frame.request_id)
        plan = self._plans.get(frame.plan_id)
        request = plan.requests.get(frame.request_id) if plan is not None else None
        actions: list[Action] = []
        if plan is not None and request is not None:
            actions += self._drop(plan, request, None, "")
        actions.append(SendFailure(origin, frame.plan_id, frame.request_id, kind, message))
        return actions

    def _drop(
        self, plan: _Plan, request: _Request, kind: FailureKind | None, message: str
    ) -> list[Action]:
        """Forget a request on this stage, free its caches and, when ``kind`` is given, tell
        its origin why."""
        if request.ended:
            return []
        request.ended = True
        request.inputs.clear()
        plan.requests.pop(request.request_id, None)
        self._remember_ended(plan.plan_id, request.request_id)
        actions: list[Action] = [Release(plan.plan_id, request.request_id)]
        if kind is not None:
            actions.append(
                SendFailure(request.origin, plan.plan_id, request.request_id, kind, message)
            )
        if request.reserved:
            plan.reserved_tokens -= request.reserved
            request.reserved = 0
            actions += self._admit_waiting(plan, self._clock)
        return actions

    def _admit_waiting(self, plan: _Plan, now: float) -> list[Action]:
        """Admit the queue's head while the plan's KV budget has room for it (in order)."""
        actions: list[Action] = []
        if self._plans.get(plan.plan_id) is not plan:
            return actions  # the plan is being removed: its queue is refused there
        budget = plan.assignment.kv_budget_tokens
        while plan.waiting and (
            plan.reserved_tokens + _reservation(plan.waiting[0].start) <= budget
            or not plan.requests
        ):
            actions += self._admit(plan, plan.waiting.popleft(), now)
        return actions

    def _unqueue(self, plan: _Plan, which: Callable[[StartFrame], bool]) -> list[StartFrame]:
        """Take the waiting Starts ``which`` selects out of the queue (they end here)."""
        taken = [frame for frame in plan.waiting if which(frame)]
        for frame in taken:
            plan.waiting.remove(frame)
            self._remember_ended(plan.plan_id, frame.request_id)
        return taken

    def _remember_ended(self, plan_id: str, request_id: str) -> None:
        self._ended[(plan_id, request_id)] = None
        self._ended.move_to_end((plan_id, request_id))
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)


def _steps_of(start: RequestStart) -> tuple[int, ...]:
    """The context steps of a request (see the module docstring)."""
    return request_steps(start.prompt_length, len(start.generated), start.prefill_chunk)


def _reservation(start: RequestStart) -> int:
    """KV tokens a request may come to hold: its context and the tokens it may still
    generate (a resumed request has generated some already)."""
    max_tokens = start.sampling.max_tokens if start.sampling is not None else 0
    return start.context_length + max(0, max_tokens - len(start.generated))


def _unreachable(assignment: Assignment, peer: str, reason: str) -> str:
    """ "stage n3 at 10.0.0.3:7000 unreachable: <reason>" (the address when the plan has it)."""
    address = assignment.address_of(peer)
    where = f" at {address}" if address else ""
    return f"stage {peer}{where} unreachable: {reason}"
