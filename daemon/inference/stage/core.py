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
next". :mod:`meshd.inference.stage.runtime` carries the actions out.

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

Speculative decoding (``plan_loaded(draft_tokens=k)``): the first stage may run a step of
the token it received plus up to k tokens it guesses follow; the last stage sends on those
greedy decoding confirms, and the next step says how many drafted positions every stage drops
(``rollback``). The protocol in full: :mod:`meshd.inference.stage.drafting`.

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
  a gap is refused. Frames of a request that ended here are dropped (an End may overtake
  its Start; a late frame may follow a refusal).
* Copies: a frame this stage already acted on is dropped, not computed twice: an Activation
  of a step before the one it expects, a Token of an index it has, a Start identical to the
  one it holds or queues for that request. A lane resumed after a reset sends again only
  what its peer did not act on (:mod:`meshd.inference.transport.lanes`), so a copy is not expected;
  this keeps a frame that comes twice harmless all the same. A different Start under an
  open request's id is still refused.
* Admission (:mod:`meshd.inference.stage.admission`): a Start this stage can never run is
  refused (bad settings, a token outside the vocabulary, too long for the plan's context); a
  plan holds at most ``max_requests`` requests on this stage (``OVERLOADED``); on the first
  stage a Start waits, in order, until the plan's KV budget has room for it, in a queue of at
  most ``max_queued`` (``QUEUE_FULL`` when it is full).
* Bounds: a request silent for ``idle_timeout_s`` is dropped (its origin vanished without a
  word).

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

from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import replace

from meshd.inference.assignment import Assignment
from meshd.inference.stage import cohorts
from meshd.inference.stage.admission import (
    StartQueue,
    limit_error,
    reservation,
    start_error,
    token_error,
)
from meshd.inference.stage.drafting import DraftIndex, drafts_for
from meshd.inference.stage.prefix import (
    DEFAULT_MAX_SLOTS,
    PrefixCacheView,
    PrefixIndex,
    Slot,
    prefix_digest,
    token_bytes,
)
from meshd.inference.stage.state import StagePlan, StageRequest, StepInput
from meshd.inference.stage_events import (
    Action,
    ActivationFrame,
    ComputeFailed,
    DropSlots,
    EndFrame,
    FailureKind,
    Finish,
    Hidden,
    Release,
    RequestStart,
    Sampled,
    SendActivation,
    SendFailure,
    SendToken,
    Skipped,
    StartFrame,
    StepResult,
    TokenFrame,
    Verified,
    Work,
    request_steps,
)

ENDED_REMEMBERED = 4096  # ids of ended requests kept to drop their late frames
LOAD_FAILURES_REMEMBERED = 64


class StageCore:
    """The stages of every plan installed on node ``node_id``, and their open requests."""

    def __init__(
        self,
        node_id: str,
        *,
        max_requests: int = 64,
        idle_timeout_s: float = 600.0,
        max_queued: int = 64,
        prefix_cache: bool = True,
        max_slots: int = DEFAULT_MAX_SLOTS,
    ):
        if max_requests < 1:
            raise ValueError(f"max_requests must be at least 1, got {max_requests}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be at least 0, got {max_queued}")
        self.node_id = node_id
        self.max_requests = max_requests
        self.max_queued = max_queued
        self.idle_timeout_s = idle_timeout_s
        self.prefix_cache = prefix_cache  # the operator's switch for the whole node
        self.max_slots = max_slots
        self._prefixes: dict[tuple[object, ...], PrefixIndex] = {}  # by the layers they are of
        self._plans: dict[str, StagePlan] = {}
        self._load_failures: OrderedDict[str, str] = OrderedDict()
        self._ended: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._ready: deque[StageRequest] = deque()
        self._clock = 0.0  # the latest ``now`` an event brought (when a queued Start is admitted)
        # When the first step held for its cohort by the last next_batch stops waiting (None:
        # none held): the runtime asks again then, whatever frames come or not.
        self.cohort_wait_ends: float | None = None

    # ------------------------------------------------------------ plans

    def add_plan(self, assignment: Assignment) -> None:
        """A plan is being installed: frames for it are answered ``NOT_LOADED`` until
        :meth:`plan_loaded`."""
        if assignment.plan_id not in self._plans:
            index = assignment.stage_index(self.node_id)
            queue = StartQueue(assignment.kv_budget_tokens)
            self._plans[assignment.plan_id] = StagePlan(assignment, index, queue)
        self._load_failures.pop(assignment.plan_id, None)

    def plan_loaded(
        self,
        plan_id: str,
        vocab_size: int = 0,
        draft_tokens: int = 0,
        prefix_trimmable: bool | None = None,
        batches: bool = False,
    ) -> None:
        """The plan's stage is loaded here; ``vocab_size`` (when known) bounds the token ids
        the first stage accepts; ``draft_tokens``: how many tokens the first stage of a
        pipeline may draft per step (speculative decoding, see :meth:`on_token`);
        ``prefix_trimmable``: whether the stage's caches can be cut (its prefix cache reuses
        any common prefix, else only whole slots), None when the stage keeps no prefixes;
        ``batches``: whether the stage runs several requests' decode steps in one pass (a
        first stage of several then keeps micro-batch cohorts, :mod:`.cohorts`)."""
        plan = self._plans.get(plan_id)
        if plan is not None:
            plan.ready = True
            plan.batches = batches
            plan.vocab_size = vocab_size
            plan.draft_tokens = draft_tokens if plan.is_first else 0
            if self.prefix_cache and prefix_trimmable is not None and plan.index is not None:
                plan.prefix_key = _layers_of(plan)
                plan.prefix = self._prefixes.get(plan.prefix_key)
                if plan.prefix is None or plan.prefix.trimmable != prefix_trimmable:
                    plan.prefix = PrefixIndex(trimmable=prefix_trimmable, max_slots=self.max_slots)
                    self._prefixes[plan.prefix_key] = plan.prefix

    def prefix_slots(self, plan_id: str) -> list[int]:
        """The ids of the prefixes the plan's stage keeps here (what its engine must hold)."""
        plan = self._plans.get(plan_id)
        return plan.prefix.ids() if plan is not None and plan.prefix is not None else []

    def prefix_views(self) -> tuple[PrefixCacheView, ...]:
        """Every installed plan's stage's prefix cache here, as status shows it."""
        views = (self.prefix_view(plan_id) for plan_id in self._plans)
        return tuple(view for view in views if view is not None)

    def prefix_view(self, plan_id: str) -> PrefixCacheView | None:
        """The plan's stage's prefix cache here (None: it keeps none)."""
        plan = self._plans.get(plan_id)
        if plan is None or plan.prefix is None or plan.index is None:
            return None
        prefix, stats = plan.prefix, plan.prefix.stats
        return PrefixCacheView(
            plan.plan_id,
            plan.index,
            len(prefix),
            prefix.tokens,
            plan.kv_tokens or 0,
            stats.lookups,
            stats.hits,
            stats.reused_tokens,
            stats.evicted,
        )

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
            actions += self._drop(plan, request, FailureKind.FENCED, reason, keep=False)
        if plan.prefix is not None and not any(
            other.prefix is plan.prefix for other in self._plans.values()
        ):
            self._prefixes.pop(plan.prefix_key, None)  # its layers go with the plan
        while plan.queue.waiting:
            frame = plan.queue.waiting.popleft()
            self._remember_ended(plan.plan_id, frame.request_id)
            kind = FailureKind.FENCED
            actions.append(
                SendFailure(frame.start.origin, plan.plan_id, frame.request_id, kind, reason)
            )
        return actions

    def queued_requests(self, plan_id: str) -> int:
        """Starts waiting to be admitted on this (first) stage of ``plan_id``."""
        plan = self._plans.get(plan_id)
        return len(plan.queue.waiting) if plan is not None else 0

    def reserved_tokens(self, plan_id: str) -> int:
        """KV tokens the admitted requests of ``plan_id`` reserve here (first stage)."""
        plan = self._plans.get(plan_id)
        return plan.queue.reserved_tokens if plan is not None else 0

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
        if self._holds_copy_of(plan, frame):
            return []  # a copy of a Start acted on already (sent again)
        if refused := self._invalid_start(plan, frame):
            return refused
        refusal = plan.queue.wait_for_room(
            frame,
            already_open=frame.request_id in plan.requests,
            max_queued=self.max_queued,
            node_id=self.node_id,
        )
        if refusal is not None:
            return self._refuse(start.origin, frame, refusal.message, refusal.kind)
        if plan.queue.waits(frame):
            return []  # it waits for room
        return self._admit(plan, frame, now)

    @staticmethod
    def _holds_copy_of(plan: StagePlan, frame: StartFrame) -> bool:
        """The request is open or waiting here with this very Start."""
        request = plan.requests.get(frame.request_id)
        if request is not None:  # as the origin sent it (the kept prefix is this stage's)
            return replace(request.start, reuse=0, reuse_digest=b"") == frame.start
        return any(
            waiting.request_id == frame.request_id and waiting.start == frame.start
            for waiting in plan.queue.waiting
        )

    def _invalid_start(self, plan: StagePlan, frame: StartFrame | ActivationFrame) -> list[Action]:
        """The refusal of a Start this stage can never run, else nothing."""
        start = frame.start
        assert start is not None
        error = start_error(start, plan.assignment, first=plan.is_first, vocab_size=plan.vocab_size)
        return self._refuse(start.origin, frame, error) if error is not None else []

    def _admit(self, plan: StagePlan, frame: StartFrame, now: float) -> list[Action]:
        """Open a request on the first stage and queue its prompt's steps: those after the
        longest prefix this stage keeps of its context (the Start it forwards says which)."""
        start = frame.start
        context = start.prompt + start.generated
        found = self._kept_prefix(plan, start, context)
        if found is not None:
            length = found[1]
            start = replace(start, reuse=length, reuse_digest=prefix_digest(context, length))
        opened = self._open(plan, frame, start, now)
        if not isinstance(opened, StageRequest):
            return opened
        opened.reserved = plan.queue.reserve(start)
        actions = self._start_prefix(plan, opened, context[: start.reuse], found)
        if plan.draft_tokens and not plan.is_last and opened.drafts_allowed():
            opened.history = DraftIndex(context)
        offset = start.reuse
        for step, size in enumerate(_steps_of(start)):
            opened.inputs.append(StepInput(step, tokens=context[offset : offset + size]))
            offset += size
        opened.next_step = opened.chunk_steps + 1
        self._enqueue(opened)
        return actions

    def _kept_prefix(
        self, plan: StagePlan, start: RequestStart, context: tuple[int, ...]
    ) -> tuple[Slot, int] | None:
        """The first stage: the kept prefix a request starts from, and how many positions."""
        if plan.prefix is None or not start.prefix_cache or not _caches_everywhere(plan):
            return None
        return plan.prefix.lookup(token_bytes(context), limit=len(context) - 1)

    def _start_prefix(
        self,
        plan: StagePlan,
        request: StageRequest,
        kept: tuple[int, ...],
        found: tuple[Slot, int] | None,
    ) -> list[Action]:
        """A request opened on a stage that keeps prefixes: it starts from ``found`` (its
        ``kept`` positions), and the least recently used slots make room for it."""
        if plan.prefix is None or not request.start.prefix_cache:
            return []
        request.cached = list(kept)
        room = self._slot_room(plan)
        if found is not None:
            request.slot_use, dropped = plan.prefix.use(found[0], found[1], room=room)
        else:
            dropped = plan.prefix.evict_to(room)
        return [DropSlots(plan.plan_id, tuple(dropped))] if dropped else []

    def _follow_prefix(
        self, plan: StagePlan, frame: ActivationFrame, request: StageRequest
    ) -> list[Action]:
        """A later stage opens a request the first stage starts from a kept prefix: it starts
        from its own slot of that prefix, or cannot compute the request at all."""
        start = request.start
        if not start.reuse:
            return self._start_prefix(plan, request, (), None)
        slot = plan.prefix.follow(start.reuse_digest, start.reuse) if plan.prefix else None
        if slot is None:
            message = (
                f"node {self.node_id} keeps no cached prefix of the {start.reuse} positions "
                f"stage 0 starts request {frame.request_id} from"
            )
            return self._refuse(start.origin, frame, message, FailureKind.CACHE_MISS)
        kept = tuple(array("I", slot.tokens[: 4 * start.reuse]))
        return self._start_prefix(plan, request, kept, (slot, start.reuse))

    def _slot_room(self, plan: StagePlan) -> int | None:
        """KV tokens the kept prefixes may hold now: what the plan reserves here, less what
        its open requests may come to hold (None: no bound)."""
        total = plan.kv_tokens
        if total is None:
            return None
        return max(0, total - sum(reservation(r.start) for r in plan.requests.values()))

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
        actions: list[Action] = []
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
            if not isinstance(opened, StageRequest):
                return opened
            request = opened
            if started := self._follow_prefix(plan, frame, request):
                if request.ended:
                    return started  # refused: it cannot start where stage 0 does
                actions = started
        if frame.step < request.next_step:
            return actions  # a copy of a step it has (sent again)
        if frame.step != request.next_step:
            return self._refuse(
                origin, frame, f"step {frame.step} arrived, expected {request.next_step}"
            )
        request.next_step += 1
        request.last_activity = now
        request.inputs.append(
            StepInput(
                frame.step,
                payload=frame.payload,
                upstream_s=frame.upstream_s,
                rollback=frame.rollback,
                drafts=frame.drafts,
                positions=frame.tokens,
            )
        )
        self._enqueue(request)
        return actions

    def on_token(self, frame: TokenFrame, fence: str | None, now: float) -> list[Action]:
        """A sampled token, at the first stage of a multi-stage plan: the next step's input.
        From the last stage, or during a catch-up also from the origin (a token an older
        attempt delivered; see the module docstring). (The origin's own copy of a sampled
        token is not the core's business.)"""
        plan = self._plans.get(frame.plan_id)
        if plan is None or not plan.is_first or plan.is_last:
            return []
        request = plan.requests.get(frame.request_id)
        if request is None or request.ended:
            return []
        from_last = frame.sender == plan.node(len(plan.assignment.stages) - 1)
        if from_last:  # the step before this token ran on every stage
            proven = request.start.prompt_length + frame.index
            request.confirmed = max(request.confirmed, proven)
        if frame.finish is not Finish.NONE:
            request.decoded_all = True  # no step follows: its cohort no longer waits for it
            return []  # the request's last token: its origin ends it here
        catch_up = request.start.catch_up
        from_origin = catch_up and frame.sender == request.origin
        if not from_last and not from_origin:
            return []
        if refused := self._admission(request.origin, frame, plan, fence):
            return refused
        if frame.index < request.next_index:
            return []  # a copy of a token it has: the other sender's, or one sent again
        if frame.index != request.next_index:
            return self._refuse(
                request.origin, frame, f"token {frame.index} arrived, expected {request.next_index}"
            )
        if bad_token := token_error((frame.token_id,), plan.vocab_size, plan.plan_id):
            return self._refuse(request.origin, frame, bad_token)
        request.next_index += 1
        request.last_activity = now
        if request.history is not None:
            request.history.append(frame.token_id)
        pending = request.drafts
        if request.accepted < len(pending) and frame.token_id == pending[request.accepted]:
            request.accepted += 1  # a draft accepted: its position is in the caches already
            return []
        rollback = len(pending) - request.accepted  # the drafts the last stage rejected
        drafts = drafts_for(plan, request)
        request.drafts, request.accepted = drafts, 0
        step = StepInput(
            request.next_step, tokens=(frame.token_id, *drafts), rollback=rollback, drafts=drafts
        )
        request.inputs.append(step)
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

    def on_peer_lost(self, peer: str, reason: str, since: float | None = None) -> list[Action]:
        """Every request that involves ``peer`` is over: frames to or from it may be lost.
        ``since``: when the link broke, where known; a request opened after it came over
        another link and is not touched, however late the loss is told."""
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
                if since is not None and request.opened_at > since:
                    continue
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
        the others). Empty when nothing is ready. A first stage's decode step waits for the
        rest of its micro-batch cohort (:mod:`.cohorts`): it stays queued, ahead of the others.
        """
        self._clock = max(self._clock, now)
        batch: list[Work] = []
        taken: list[StageRequest] = []
        waiting: list[StageRequest] = []
        out: dict[str, set[int]] = {}  # by plan: cohorts with a member not back, before this call
        while self._ready and len(batch) < max_items:
            request = self._ready.popleft()
            request.queued = False
            if not request.can_run():
                continue
            plan = self._plans[request.plan_id]
            grouped = cohorts.groups_cohorts(plan) and cohorts.is_plain_decode(request)
            if grouped:
                if plan.plan_id not in out:
                    out[plan.plan_id] = cohorts.cohorts_out(plan)
                if cohorts.waits(plan, request, out[plan.plan_id], now):
                    waiting.append(request)
                    continue
            work = request.work(plan, request.inputs.popleft())
            if grouped:
                work = replace(work, cohort=request.cohort)
            request.track(work)
            batch.append(work)
            request.in_flight += 1
            request.last_activity = now
            taken.append(request)
        for request in reversed(waiting):
            request.queued = True
            self._ready.appendleft(request)
        self.cohort_wait_ends = cohorts.wait_ends(waiting)
        for request in taken:
            self._enqueue(request)
        return batch

    def on_computed(self, work: Work, result: StepResult, now: float) -> list[Action]:
        """A step finished on the compute thread: where its result goes."""
        self._clock = max(self._clock, now)
        plan = self._plans.get(work.plan_id)
        used = work.slot_use
        if used is not None and not used.take and plan is not None and plan.prefix is not None:
            plan.prefix.unpin(used.slot)  # the engine copied it (or failed to): it may go
        request = plan.requests.get(work.request_id) if plan is not None else None
        if plan is None or request is None or request.ended:
            return []  # dropped while it computed; its Release follows the step
        request.in_flight -= 1
        request.last_activity = now
        assert plan.index is not None
        if isinstance(result, ComputeFailed):
            message = f"stage {plan.index} on node {self.node_id} failed: {result.reason}"
            return self._drop(plan, request, result.kind, message, keep=False)
        actions: list[Action] = []
        if isinstance(result, Hidden):
            forward = request.forward_start() if work.step == 0 else None
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
        elif isinstance(result, Verified):
            for position, token in enumerate(result.tokens):
                spent = result.compute_s if position == 0 else 0.0  # the step's, counted once
                actions += self._on_sampled(plan, request, Sampled(token, b"", spent))
                if request.ended:
                    break
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
        plan: StagePlan | None,
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
        self, plan: StagePlan, frame: StartFrame | ActivationFrame, start: RequestStart, now: float
    ) -> StageRequest | list[Action]:
        """The stage's record of a new request, or the actions that refuse it."""
        if (plan.plan_id, frame.request_id) in self._ended:
            return []
        if frame.request_id in plan.requests:
            return self._refuse(start.origin, frame, f"request {frame.request_id} is already open")
        held = len(plan.requests)
        if full := limit_error(held, self.max_requests, plan.index, self.node_id):
            return self._refuse(start.origin, frame, full, FailureKind.OVERLOADED)
        if refused := self._invalid_start(plan, frame):
            return refused
        assert start.sampling is not None
        chunk_steps = len(_steps_of(start)) - 1
        request = StageRequest(
            plan_id=plan.plan_id,
            request_id=frame.request_id,
            origin=start.origin,
            start=start,
            sampling=start.sampling,
            chunk_steps=chunk_steps,
            last_activity=now,
            opened_at=now,
            next_index=len(start.generated),
        )
        plan.requests[request.request_id] = request
        return request

    def _on_sampled(self, plan: StagePlan, request: StageRequest, result: Sampled) -> list[Action]:
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
        if finish is Finish.NONE and plan.is_first and request.cached is not None:
            request.cached.append(result.token_id)  # the following step's position (1 stage)
        first = plan.node(0)
        targets = [request.origin]
        if first not in (request.origin, self.node_id):
            targets.append(first)  # the last token too: what the first stage keeps of it
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
                start.reuse if index == len(start.generated) else 0,
            )
        ]
        if finish is not Finish.NONE:
            actions += self._drop(plan, request, None, "")
        return actions

    def _enqueue(self, request: StageRequest) -> None:
        if not request.queued and request.can_run():
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
        self,
        plan: StagePlan,
        request: StageRequest,
        kind: FailureKind | None,
        message: str,
        *,
        keep: bool = True,
    ) -> list[Action]:
        """Forget a request on this stage, free its caches (or, with ``keep``, keep them as a
        prefix slot when this stage keeps prefixes and knows what they hold) and, when
        ``kind`` is given, tell its origin why."""
        if request.ended:
            return []
        request.ended = True
        request.inputs.clear()
        plan.requests.pop(request.request_id, None)
        self._remember_ended(plan.plan_id, request.request_id)
        used, request.slot_use = request.slot_use, None
        prefix = plan.prefix
        if used is not None and not used.take and prefix is not None:
            prefix.unpin(used.slot)  # its first step never went out
        kept: int | None = None
        dropped: list[int] = []
        held = len(request.cached or ())
        keep_positions = held
        if plan.is_first and not plan.is_last:
            keep_positions = min(held, max(request.confirmed, request.start.reuse))
        cuttable = prefix is not None and (prefix.trimmable or keep_positions == held)
        if keep and cuttable and request.start.prefix_cache and keep_positions:
            assert prefix is not None and request.cached is not None
            kept, dropped = prefix.insert(request.cached[:keep_positions])
        actions: list[Action] = [
            Release(plan.plan_id, request.request_id, kept, held, keep_positions)
        ]
        if kind is not None:
            actions.append(
                SendFailure(request.origin, plan.plan_id, request.request_id, kind, message)
            )
        if prefix is not None and kept is not None:
            dropped += prefix.evict_to(self._slot_room(plan))
        if dropped:
            actions.append(DropSlots(plan.plan_id, tuple(dropped)))
        if request.reserved:
            plan.queue.release(request.reserved)
            request.reserved = 0
            actions += self._admit_waiting(plan, self._clock)
        return actions

    def _admit_waiting(self, plan: StagePlan, now: float) -> list[Action]:
        """Admit the queue's head while the plan's KV budget has room for it (in order)."""
        actions: list[Action] = []
        if self._plans.get(plan.plan_id) is not plan:
            return actions  # the plan is being removed: its queue is refused there
        while (frame := plan.queue.next_admitted(running=bool(plan.requests))) is not None:
            actions += self._admit(plan, frame, now)
        return actions

    def _unqueue(self, plan: StagePlan, which: Callable[[StartFrame], bool]) -> list[StartFrame]:
        """Take the waiting Starts ``which`` selects out of the queue (they end here)."""
        taken = plan.queue.take(which)
        for frame in taken:
            self._remember_ended(plan.plan_id, frame.request_id)
        return taken

    def _remember_ended(self, plan_id: str, request_id: str) -> None:
        self._ended[(plan_id, request_id)] = None
        self._ended.move_to_end((plan_id, request_id))
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)


def _steps_of(start: RequestStart) -> tuple[int, ...]:
    """The context steps of a request (see the module docstring), after its kept prefix."""
    return request_steps(
        start.prompt_length, len(start.generated), start.prefill_chunk, start.reuse
    )


def _layers_of(plan: StagePlan) -> tuple[object, ...]:
    """What identifies a plan's stage's layers here: plans with the same share their kept
    prefixes (the data plane shares their loaded weights too)."""
    assert plan.index is not None
    spec = plan.assignment.stages[plan.index]
    last = len(plan.assignment.stages) - 1
    return (
        str(plan.assignment.model_dir),
        spec.layer_start,
        spec.layer_end,
        plan.index == 0,
        plan.index == last,
    )


def _caches_everywhere(plan: StagePlan) -> bool:
    """Whether every stage of the plan can keep prefixes (a tensor-parallel group keeps
    none yet): only then may the first stage start a request from one."""
    return not any(spec.tensor_parallel for spec in plan.assignment.stages)


def _unreachable(assignment: Assignment, peer: str, reason: str) -> str:
    """ "stage n3 at 10.0.0.3:7000 unreachable: <reason>" (the address when the plan has it)."""
    address = assignment.address_of(peer)
    where = f" at {address}" if address else ""
    return f"stage {peer}{where} unreachable: {reason}"
