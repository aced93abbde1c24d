"""The stage runtime: carries out what the pure stage core decides.

:class:`meshd.inference.stage.core.StageCore` decides; this runs it on the asyncio thread:
it reads Start/Activation/Token/End frames into core events (with the agreement's fencing
verdict for each), sends the frames the core's actions name, frees caches on the compute
thread, and keeps the compute thread fed: the core's next steps go to it
(:func:`meshd.inference.stage.engine.run_step`), at most ``QUEUED_STEPS`` at a time, and each
result comes back here. So each decision about what runs next is taken late, the order of a
request's steps is the core's, and the compute thread does not wait for this loop between
two steps (of different requests, or of one request on a single stage). Frames that carry
hidden states on are built on the compute thread too, off this loop, and a decode step's are
sent from there the moment it is done, over the lane to the stage the core named when it
handed the step out (:meth:`StageRuntime._lanes_for`), as is a last stage's token to the
first stage; this loop then does its bookkeeping while the next stage computes.

Continuous batching: the decode steps ready at once (one position each, of one plan) run in
one forward pass on the requests' merged caches (:meth:`meshd.inference.stage.model.
RequestCaches.batch`, mlx-lm's batch caches); prefill chunks run alone, interleaved with
them. The frames of one batched step go to each node as one Bundle, and a bundle's frames are
read before the next steps are handed out, so a batch stays together down the pipeline. The
first stage runs its decoding requests in as many micro-batches as the plan has stages where
each gets at least MIN_MICRO_BATCH_ROWS rows (:func:`partitioner.cost.micro_batches`: the cost
model prices the same rule), each micro-batch a cohort that stays together round after round
(:mod:`meshd.inference.stage.cohorts`), so every stage has one to compute while the others
compute theirs, and no stage computes more steps a round than there are micro-batches.

Cores: stages of one plan on the same machine (the daemon knows from the peers' machine
fingerprints) take turns while one request runs, so each may use every core; with several
requests in flight they compute at the same time, and each then uses its share.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from meshd.inference.assignment import Assignment
from meshd.inference.fencing import FenceCheck
from meshd.inference.stage.core import StageCore
from meshd.inference.stage.engine import StageEngine, is_decode_step, run_step, run_steps
from meshd.inference.stage.prefix import PrefixCacheView
from meshd.inference.stage_events import (
    Action,
    ActivationFrame,
    Advanced,
    ComputeFailed,
    DropSlots,
    EndFrame,
    FailureKind,
    Hidden,
    Release,
    Sampled,
    SendActivation,
    SendFailure,
    SendToken,
    StartFrame,
    StepResult,
    TokenFrame,
    Verified,
    Work,
)
from meshd.inference.transport.frames import (
    failure_to_proto,
    finish_from_proto,
    sampled_token_frame,
    start_from_proto,
    start_to_proto,
    token_frame,
)
from meshd.inference.transport.lanes import Lane
from meshd.inference.transport.links import Transport, describe_error
from meshd.runtime import hoptrace
from meshd.runtime.compute import ComputeExecutor, Outcome
from meshd.wire import dataplane_pb2 as dp

log = logging.getLogger("meshd.dataplane")

# "1": every frame goes through the loop, none from the compute thread (an earlier path,
# kept as a benchmark's baseline: bench_batching.py --scaling --loop-sends-too).
LOOP_SENDS_ENV = "MESHD_LOOP_SENDS"

# Steps on the compute thread at once (running + waiting), each of another request: the next
# one waits there, so the thread goes on without waiting for this loop to hand it out, and the
# choice of what runs next is still made no more than one step ahead.
QUEUED_STEPS = 2

# Decode steps kept for the speed correction (meshd.mesh.speed_correction reads a window).
DECODE_STEPS_KEPT = 128
# Prompt chunks of fewer positions are not timed for it (a short chunk is not compute-bound).
MIN_TIMED_CHUNK = 32


@dataclass(eq=False)
class _Stage:
    """One plan's stage on this node, as the runtime needs it."""

    assignment: Assignment
    engine: StageEngine | None
    colocated_stages: int
    cached: set[str] = field(default_factory=set)  # requests whose KV caches the engine holds
    addresses: dict[str, str] = field(init=False)  # node -> data-plane address, per stage

    def __post_init__(self) -> None:
        self.addresses = {spec.node_id: spec.address for spec in self.assignment.stages}


class StageRuntime:
    """This node's stages of every installed plan: frames in, steps computed, frames out."""

    def __init__(
        self,
        node_id: str,
        transport: Transport,
        compute: ComputeExecutor,
        check_serving: FenceCheck,
        *,
        max_requests: int = 64,
        idle_timeout_s: float = 600.0,
        max_queued: int = 64,
        prefix_cache: bool = True,
    ) -> None:
        self.node_id = node_id
        self.core = StageCore(
            node_id,
            max_requests=max_requests,
            idle_timeout_s=idle_timeout_s,
            max_queued=max_queued,
            prefix_cache=prefix_cache,
        )
        self._transport = transport
        self._compute = compute
        self._check_serving = check_serving
        self._stages: dict[str, _Stage] = {}
        self._queued_steps = 0  # jobs submitted to the compute thread, not yet back
        self._holding = 0  # > 0 while the frames of a bundle are read: no step handed out
        self._outbox: dict[tuple[str, str | None, bool], list[dp.Frame]] | None = None
        self._sending: set[str] = set()  # requests whose step's frames the loop sends next
        self._compute_sends = os.environ.get(LOOP_SENDS_ENV, "").strip() != "1"
        self._sweeper: asyncio.Task[None] | None = None
        self._cohort_timer: asyncio.TimerHandle | None = None  # a held cohort's wait ends
        self._closed = False
        # The prefix caches as status shows them: replaced (never changed) by this loop when a
        # request ends or a plan comes or goes, read by any thread (the status, the dashboard).
        self.prefix_view: tuple[PrefixCacheView, ...] = ()
        # This node's recent decode steps, (plan id, rows, seconds of the forward pass), newest
        # last: what its speed correction compares with the cost model. Steps of one row and
        # batched steps are kept apart, DECODE_STEPS_KEPT of each, so that the one-row steps
        # its factor is taken from outlive a long busy spell. Replaced (never changed) after
        # each decode step, read by any thread.
        self.decode_steps: tuple[tuple[str, int, float], ...] = ()
        self._single_steps: collections.deque[tuple[str, int, float]] = collections.deque(
            maxlen=DECODE_STEPS_KEPT
        )
        self._batched_steps: collections.deque[tuple[str, int, float]] = collections.deque(
            maxlen=DECODE_STEPS_KEPT
        )
        # ...and its recent prompt chunks, (plan id, positions, seconds): compute-bound steps.
        self.prompt_chunks: tuple[tuple[str, int, float], ...] = ()
        self._prompt_chunks: collections.deque[tuple[str, int, float]] = collections.deque(
            maxlen=DECODE_STEPS_KEPT
        )

    # ------------------------------------------------------------ plans

    def add_plan(
        self, assignment: Assignment, engine: StageEngine | None, colocated_stages: int
    ) -> None:
        """A plan is being installed; frames for it are answered NOT_LOADED until loaded."""
        self._stages[assignment.plan_id] = _Stage(assignment, engine, max(1, colocated_stages))
        self.core.add_plan(assignment)
        self._start_sweeper()

    def plan_loaded(
        self,
        plan_id: str,
        vocab_size: int = 0,
        draft_tokens: int = 0,
        prefix_trimmable: bool | None = None,
    ) -> None:
        """The plan's stage is loaded; token ids outside ``vocab_size`` are refused; a first
        stage drafts up to ``draft_tokens`` tokens per step; ``prefix_trimmable``: how the
        stage keeps prefixes (:meth:`StageCore.plan_loaded`; None: it keeps none). The engine
        keeps the prefixes of these layers the core's index knows (an earlier plan of the
        same layers may have kept them), and no others."""
        stage = self._stages.get(plan_id)
        self.core.plan_loaded(
            plan_id,
            vocab_size=vocab_size,
            draft_tokens=draft_tokens,
            prefix_trimmable=prefix_trimmable,
            batches=stage is not None and stage.engine is not None and stage.engine.batchable,
        )
        if stage is not None and stage.engine is not None and not self._compute.closed:
            kept = self.core.prefix_slots(plan_id)
            done = self._compute.submit(stage.engine.keep_only_slots, kept)
            done.add_done_callback(partial(_log_failure, "freeing stale cached prefixes"))
        self.prefix_view = self.core.prefix_views()

    def plan_failed(self, plan_id: str, reason: str) -> None:
        self._carry_out(self.core.plan_failed(plan_id, reason))
        self._stages.pop(plan_id, None)

    async def remove_plan(self, plan_id: str, reason: str) -> None:
        """End the plan's requests here (their origins get ``reason``), free their caches and
        unload the stage's weights."""
        self._carry_out(self.core.remove_plan(plan_id, reason))
        self.prefix_view = self.core.prefix_views()
        stage = self._stages.pop(plan_id, None)
        if stage is not None and stage.engine is not None and not self._compute.closed:
            with contextlib.suppress(RuntimeError):
                await self._compute.run(stage.engine.unload)

    def caches_held(self, plan_id: str) -> int:
        """Requests whose KV caches this node's stage of ``plan_id`` holds."""
        stage = self._stages.get(plan_id)
        return len(stage.cached) if stage is not None else 0

    # ------------------------------------------------------------ frames

    def on_start(self, sender: str, frame: dp.Frame) -> None:
        start = start_from_proto(frame.start)
        event = StartFrame(sender, frame.plan_id, frame.request_id, start)
        self._carry_out(self.core.on_start(event, self._fence(frame.plan_id), time.monotonic()))
        self._pump()

    def on_activation(self, sender: str, frame: dp.Frame) -> None:
        activation = frame.activation
        start = start_from_proto(activation.start) if activation.HasField("start") else None
        event = ActivationFrame(
            sender,
            frame.plan_id,
            frame.request_id,
            activation.step,
            activation,
            activation.compute_s,
            start,
            activation.rollback,
            tuple(activation.draft_tokens),
            tuple(activation.tokens),
        )
        now = time.monotonic()
        self._carry_out(self.core.on_activation(event, self._fence(frame.plan_id), now))
        self._pump()

    def on_token(self, sender: str, frame: dp.Frame) -> None:
        token = frame.token
        event = TokenFrame(
            sender,
            frame.plan_id,
            frame.request_id,
            token.token_id,
            token.index,
            finish_from_proto(token.finish),
        )
        now = time.monotonic()
        self._carry_out(self.core.on_token(event, self._fence(frame.plan_id), now))
        self._pump()

    def on_end(self, sender: str, frame: dp.Frame) -> None:
        event = EndFrame(sender, frame.plan_id, frame.request_id)
        self._carry_out(self.core.on_end(event))
        self._pump()  # a request that ended may have made room for a queued one

    def on_peer_lost(self, peer: str, reason: str, since: float | None = None) -> None:
        self._carry_out(self.core.on_peer_lost(peer, reason, since))
        self._pump()

    @contextlib.contextmanager
    def holding_steps(self) -> Iterator[None]:
        """Read several frames (a bundle) before handing out the next steps, so the rows of
        one batched step upstream can run together here."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
            self._pump()

    def _fence(self, plan_id: str) -> str | None:
        """The agreement's verdict: None when ``plan_id`` is committed here, else why not."""
        try:
            self._check_serving(plan_id)
        except Exception as error:
            return str(error) or type(error).__name__
        return None

    # ------------------------------------------------------------ actions

    def _carry_out(self, actions: list[Action]) -> None:
        ended = False
        for action in actions:
            if isinstance(action, SendActivation):
                self._send_activation(action)
            elif isinstance(action, SendToken):
                self._send_token(action)
            elif isinstance(action, SendFailure):
                self._send_failure(action)
            elif isinstance(action, Release):
                self._release(action)
                ended = True
            elif isinstance(action, DropSlots):
                self._drop_slots(action)
        if ended:
            self.prefix_view = self.core.prefix_views()

    def _send_activation(self, action: SendActivation) -> None:
        stage = self._stages.get(action.plan_id)
        frame: dp.Frame = action.payload  # built on the compute thread (_step_job)
        if action.start is not None:
            frame.activation.start.CopyFrom(start_to_proto(action.start))
        address = stage.addresses.get(action.to) if stage is not None else None
        if address is None:
            self._unreachable(action.plan_id, action.request_id, action.to)
        elif self._outbox is not None:
            self._outbox.setdefault((action.to, address, False), []).append(frame)
        elif not self._transport.send(action.to, address, frame):
            self._unreachable(action.plan_id, action.request_id, action.to)

    def _send_token(self, action: SendToken) -> None:
        stage = self._stages.get(action.plan_id)
        frame = token_frame(action)
        for node in action.to:
            address = stage.addresses.get(node) if stage is not None else None
            if self._outbox is not None:
                self._outbox.setdefault((node, address, True), []).append(frame)
            elif not self._transport.route(node, address, frame) and address is not None:
                self._unreachable(action.plan_id, action.request_id, node)

    def _carry_out_bundled(self, actions: list[Action]) -> None:
        """Carry out the actions of one batched step, the frames to each node as one bundle
        (one frame per step per link, whatever the batch's size)."""
        self._outbox = {}
        try:
            self._carry_out(actions)
            outbox = self._outbox
        finally:
            self._outbox = None
        for (node, address, routed), frames in outbox.items():
            frame = frames[0] if len(frames) == 1 else dp.Frame(bundle=dp.Bundle(frames=frames))
            if routed:
                sent = self._transport.route(node, address, frame) or address is None
            else:
                assert address is not None
                sent = self._transport.send(node, address, frame)
            if not sent:
                for lost in frames:
                    self._unreachable(lost.plan_id, lost.request_id, node)

    def _send_failure(self, action: SendFailure) -> None:
        if action.kind is FailureKind.CACHE_MISS:
            log.info("request %s: %s; its origin runs it again", action.request_id, action.message)
        stage = self._stages.get(action.plan_id)
        failure = dp.Failure(
            kind=failure_to_proto(action.kind), node_id=self.node_id, message=action.message
        )
        frame = dp.Frame(plan_id=action.plan_id, request_id=action.request_id, failure=failure)
        address = stage.addresses.get(action.to) if stage is not None else None
        self._transport.route(action.to, address, frame)

    def _unreachable(self, plan_id: str, request_id: str, node: str) -> None:
        self._carry_out(self.core.on_unreachable(plan_id, request_id, node))
        self._pump()

    def _release(self, action: Release) -> None:
        """Free the request's caches after its queued step (the compute thread is FIFO)."""
        stage = self._stages.get(action.plan_id)
        if stage is None or stage.engine is None or self._compute.closed:
            return
        engine = stage.engine
        done = self._compute.submit(
            engine.release, action.request_id, action.keep_as, action.positions, action.keep
        )
        done.add_done_callback(partial(self._released, stage, action.request_id))

    def _drop_slots(self, action: DropSlots) -> None:
        """Free evicted prefixes after the queued steps (one may still copy one it keeps)."""
        stage = self._stages.get(action.plan_id)
        if stage is None or stage.engine is None or self._compute.closed:
            return
        done = self._compute.submit(stage.engine.drop_slots, action.slot_ids)
        done.add_done_callback(partial(_log_failure, "freeing evicted cached prefixes"))

    def _released(self, stage: _Stage, request_id: str, future: asyncio.Future[None]) -> None:
        stage.cached.discard(request_id)
        if not future.cancelled() and future.exception() is not None:
            log.error("freeing the caches of %s failed", request_id, exc_info=future.exception())

    # ------------------------------------------------------------ compute

    def _pump(self) -> None:
        """Give the compute thread the core's next steps, if it is idle and some are ready:
        the decode steps of one plan's requests run together (continuous batching,
        :func:`_jobs`), each prefill chunk alone."""
        while self._queued_steps < QUEUED_STEPS and not self._closed and not self._compute.closed:
            if self._holding:
                return
            works = self.core.next_batch(time.monotonic(), max_items=self.core.max_requests)
            self._wake_when_cohorts_stop_waiting()
            if not works:
                return
            for job in self._jobs(works):
                self._submit(job)

    def _wake_when_cohorts_stop_waiting(self) -> None:
        """Pump again when a step held for its cohort stops waiting (the core's deadline):
        no frame may come to wake this loop before then."""
        ends = self.core.cohort_wait_ends
        if self._cohort_timer is not None:
            self._cohort_timer.cancel()
            self._cohort_timer = None
        if ends is not None and not self._closed:
            delay = max(0.0, ends - time.monotonic())
            self._cohort_timer = asyncio.get_running_loop().call_later(delay, self._pump)

    def _jobs(self, works: list[Work]) -> list[list[Work]]:
        """The forward passes that compute ``works`` (one step each of other requests):
        decode steps of one plan with the same head run together when the stage can batch,
        on a first stage one pass per micro-batch cohort (``Work.cohort``, chosen by the
        core: :mod:`meshd.inference.stage.cohorts`), so each stage has one to compute while
        the others compute theirs; prefill chunks run alone (each request's prefill runs on
        its own caches, as mlx-lm's)."""
        if len(works) == 1:
            return [works]  # one step, one pass: what the rest would give, without its work
        jobs: list[list[Work]] = []
        batches: dict[tuple[str, bool, int | None], list[Work]] = {}
        for work in works:
            stage = self._stages.get(work.plan_id)
            engine = stage.engine if stage is not None else None
            if engine is not None and engine.batchable and is_decode_step(work):
                batches.setdefault((work.plan_id, work.head, work.cohort), []).append(work)
            else:
                jobs.append([work])
        return jobs + list(batches.values())

    def _submit(self, job: list[Work]) -> None:
        stage = self._stages.get(job[0].plan_id)
        if stage is None or stage.engine is None:
            reason = ComputeFailed(FailureKind.INTERNAL, "this node holds no loaded stage")
            for work in job:
                self._carry_out(self.core.on_computed(work, reason, time.monotonic()))
            return
        busy = self.core.total_open_requests() > 1
        share = stage.colocated_stages if busy else 1
        self._queued_steps += 1
        then = partial(self._computed, stage, job)
        lanes = self._lanes_for(stage, job)
        self._compute.submit_then(_steps_job, (stage.engine, job, share, lanes), then)
        if hoptrace.enabled:
            hoptrace.mark("step_submitted")

    def _lanes_for(self, stage: _Stage, job: list[Work]) -> dict[str, Lane] | None:
        """The open lanes the compute thread sends ``job``'s frames on itself, by node: when
        the core named each row's destination at hand-out (a decode step's hidden states to
        the next stage, ``Work.forward_to``; a last stage's token to the first stage,
        ``Work.token_to``) and a lane to it is open. None: the results' frames go through this
        loop (a prompt's chunks, speculative steps, a link without a lane). A token that ends
        its request, and a token's copy for an origin elsewhere, still go through the loop.

        Tokens go from the compute thread since the lanes keep their TLS record buffers
        (:mod:`meshd.runtime.tls_buffers`). Before, a token's ``send`` there was the thread's
        first large allocation after the forward pass (OpenSSL's record buffer) and paid for
        glibc's coalescing of the blocks the pass freed (0.65-0.77 ms of CPU): its hop took
        1.27-1.68 ms against ~1.0-1.2 ms from the loop. With the buffers kept, 0.66-0.72 ms
        (2 pinned daemons, interleaved rounds; docs/performance.md).

        Order: a request's frames on a link keep its steps' order. The compute thread sends
        in the order it computes, and the loop's sends of a step are made when its result
        comes back here; so a step goes from the compute thread only when no step of its
        request before it still has frames for the loop to send (``_sending``: the rows of
        the result being carried out, whose next steps :meth:`_computed` hands out first).
        """
        if not self._compute_sends:
            return None
        lanes: dict[str, Lane] = {}
        for work in job:
            node = _sent_to(work)
            if node is None or work.request_id in self._sending:
                return None  # its step before sends through the loop: this step follows it
            if node not in lanes:
                lane = self._transport.lane_to(node, stage.addresses.get(node))
                if lane is None:
                    return None
                lanes[node] = lane
        return lanes

    def _computed(self, stage: _Stage, job: list[Work], outcome: Outcome[_JobResult]) -> None:
        if hoptrace.enabled:
            hoptrace.mark("result_on_loop")
        self._queued_steps -= 1
        results: list[StepResult]
        sent: list[bool] | None = None
        if outcome.cancelled:
            failed = ComputeFailed(FailureKind.INTERNAL, "the compute thread stopped")
            results = [failed] * len(job)
        elif outcome.error is not None:
            failed = ComputeFailed(FailureKind.INTERNAL, describe_error(outcome.error))
            results = [failed] * len(job)
        else:
            results, sent, step_s = outcome.result()
            if step_s is not None:
                self._record_step(job, step_s)
        actions: list[Action] = []
        now = time.monotonic()
        for row, (work, result) in enumerate(zip(job, results, strict=True)):
            if not isinstance(result, ComputeFailed):
                stage.cached.add(work.request_id)
            decided = self.core.on_computed(work, result, now)
            if sent is not None and sent[row]:  # its frame left from the compute thread
                decided = _not_sent_again(decided, _sent_to(work))
            elif any(isinstance(action, SendActivation) for action in decided):
                self._sending.add(work.request_id)
            actions += decided
        if sent is not None:  # one frame (or bundle) per node the compute thread sent to
            went = {_sent_to(work) for work, row_sent in zip(job, sent, strict=True) if row_sent}
            self._transport.count_sent(len(went))
        try:
            self._pump()  # the compute thread's next step first, then the frames
        finally:
            self._sending.clear()
        if len(job) > 1 or isinstance(results[0], Verified):  # several tokens: one bundle
            self._carry_out_bundled(actions)
        else:
            self._carry_out(actions)

    def _record_step(self, job: list[Work], seconds: float) -> None:
        """Keep a decode step's or a prompt chunk's time (for the speed correction)."""
        plan_id = job[0].plan_id
        if is_decode_step(job[0]):
            kept = self._single_steps if len(job) == 1 else self._batched_steps
            kept.append((plan_id, len(job), seconds))
            self.decode_steps = (*self._single_steps, *self._batched_steps)
        else:
            self._prompt_chunks.append((plan_id, prompt_positions(job[0]), seconds))
            self.prompt_chunks = tuple(self._prompt_chunks)

    # ------------------------------------------------------------ housekeeping

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep_idle(), name="dataplane-sweeper")

    async def _sweep_idle(self) -> None:
        """Free requests whose origin vanished without a word (a last resort)."""
        interval = max(0.05, min(5.0, self.core.idle_timeout_s / 4))
        while not self._closed:
            await asyncio.sleep(interval)
            self._carry_out(self.core.sweep(time.monotonic()))
            self._pump()

    async def close(self) -> None:
        self._closed = True
        if self._cohort_timer is not None:
            self._cohort_timer.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper


def _log_failure(what: str, future: asyncio.Future[None]) -> None:
    """A compute-thread job nobody awaits: its error goes to the log."""
    if not future.cancelled() and future.exception() is not None:
        log.error("%s failed", what, exc_info=future.exception())


# A job's results; for a job whose hidden states the compute thread sent itself, whether
# each row's went (None: the loop sends them all); for a decode step that every row ran, the
# seconds of its forward pass (None otherwise: a prompt chunk, a speculative or failed step).
_JobResult = tuple[list[StepResult], list[bool] | None, float | None]


def _steps_job(
    engine: StageEngine, job: list[Work], cores_share: int, lanes: dict[str, Lane] | None
) -> _JobResult:
    """Compute thread: one forward pass for the steps of ``job`` (one step alone, or the
    decode steps of several requests batched) and, for hidden states, the frames that carry
    them on (built here, off the asyncio thread; the loop adds only the forwarded Start of
    step 0). With ``lanes``, the frames of a decode step go out from here the moment it is
    done (:func:`_send_now`), and the loop's part of the hop (its wake-up, the core's
    bookkeeping) runs while the next stage already computes."""
    if hoptrace.enabled:
        hoptrace.mark("step_start")
    started = time.perf_counter()
    if len(job) == 1:
        results = [run_step(engine, job[0], cores_share)]
    else:
        results = run_steps(engine, job, cores_share)
    step_s: float | None = time.perf_counter() - started
    timed = all(is_decode_step(work) for work in job) or (
        len(job) == 1 and prompt_positions(job[0]) >= MIN_TIMED_CHUNK
    )
    if not timed or not all(isinstance(r, Hidden | Advanced | Sampled) for r in results):
        step_s = None
    with_frames = [_with_frame(work, result) for work, result in zip(job, results, strict=True)]
    if hoptrace.enabled:
        hoptrace.mark("step_done")
    sent = _send_now(job, with_frames, lanes) if lanes is not None else None
    return with_frames, sent, step_s


def prompt_positions(work: Work) -> int:
    """Positions of a plain prompt chunk (0 for any other step: decode, speculative, a first
    step on a kept prefix)."""
    if work.follows or work.drafts or work.draft_limit or work.rollback:
        return 0
    if work.slot_use is not None:
        return 0
    if work.tokens is not None:
        return len(work.tokens) if len(work.tokens) > 1 else 0
    shape = getattr(work.payload, "shape", ())
    return int(shape[1]) if len(shape) == 3 and shape[1] > 1 else 0


def _send_now(job: list[Work], results: list[StepResult], lanes: dict[str, Lane]) -> list[bool]:
    """Compute thread: send ``job``'s hidden states to the stage the core named at hand-out,
    one frame (a bundle for several rows) per node; whether each row's went. A row whose
    frame did not go (a failed step, a lane that closed meanwhile) is left to the loop, which
    sends, or reports, what the core decides for it."""
    by_node: dict[str, list[tuple[int, dp.Frame]]] = {}
    for row, (work, result) in enumerate(zip(job, results, strict=True)):
        if isinstance(result, Hidden) and work.forward_to is not None:
            by_node.setdefault(work.forward_to, []).append((row, result.payload))  # type: ignore[arg-type]
        elif (token := _token_frame(work, result)) is not None:
            by_node.setdefault(token[0], []).append((row, token[1]))
    sent = [False] * len(job)
    for node, rows in by_node.items():
        frames = [frame for _, frame in rows]
        frame = frames[0] if len(frames) == 1 else dp.Frame(bundle=dp.Bundle(frames=frames))
        try:
            delivered = lanes[node].send_from_thread(frame)
        except Exception:  # the loop sends these rows' frames instead, and reports there
            log.exception("sending a step's frames to %s from the compute thread failed", node)
            delivered = False
        for row, _ in rows:
            sent[row] = delivered
    return sent


def _token_frame(work: Work, result: StepResult) -> tuple[str, dp.Frame] | None:
    """The node and frame of a sampled token the compute thread sends itself (one that does
    not end its request, of a step the core routed: ``Work.token_to``), else None."""
    route = work.token_to
    if route is None or not isinstance(result, Sampled) or not route.carries(result.token_id):
        return None
    frame = sampled_token_frame(
        work.plan_id,
        work.request_id,
        result.token_id,
        route.index,
        result.compute_s,
        logits=result.logits,  # b"": a request that asks for logits is not routed
        cached=route.cached,
    )
    return route.node, frame


def _sent_to(work: Work) -> str | None:
    """The node the compute thread may send ``work``'s frame to itself (None: the loop sends)."""
    if work.forward_to is not None:
        return work.forward_to
    return work.token_to.node if work.token_to is not None else None


def _not_sent_again(actions: list[Action], node: str | None) -> list[Action]:
    """``actions`` less what the compute thread sent ``node`` already: a step's hidden states,
    or its token (which may still go to an origin elsewhere)."""
    kept: list[Action] = []
    for action in actions:
        if isinstance(action, SendActivation):
            continue
        if isinstance(action, SendToken) and node in action.to:
            rest = tuple(to for to in action.to if to != node)
            if not rest:
                continue
            action = dataclasses.replace(action, to=rest)
        kept.append(action)
    return kept


def _with_frame(work: Work, result: StepResult) -> StepResult:
    if not isinstance(result, Hidden):
        return result
    hidden: Any = result.payload
    frame = dp.Frame(plan_id=work.plan_id, request_id=work.request_id)
    activation = frame.activation
    activation.step = work.step
    activation.dtype = hidden.dtype
    activation.shape.extend(hidden.shape)
    activation.data = hidden.data
    activation.compute_s = result.compute_s
    activation.rollback = work.rollback
    activation.draft_tokens.extend(work.drafts)
    activation.tokens.extend(work.positions)
    return Hidden(frame, result.compute_s)
