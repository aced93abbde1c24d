"""The inference data plane: pipeline-parallel generation across the nodes of a plan.

One :class:`DataPlane` per daemon: a thin facade that installs and uninstalls plans and
wires the roles together. It runs on the daemon's asyncio thread (the one that owns every
grpc.aio server and channel, see :mod:`meshd.runtime.bridge`); all its methods are asyncio
coroutines or plain methods to be called on that thread. Trio code reaches it with
``await bridge.run(plane.install, assignment)``; the client API handlers, which run on the
asyncio thread already, iterate :meth:`DataPlane.generate` directly.

The roles, one module each::

    transport      persistent gRPC streams per node pair, Hello, routing of frames
    origin         requests this node asks: validation, Start, Token -> events, stop strings
    stage_core     the stage's decisions, pure: fencing, per-request state, order, what next
    stage          runs the core: frames -> events, actions -> frames, steps -> compute thread
    engine         the MLX side: a stage's layers, KV caches, samplers, activation codec
    loaded_stages  what is loaded here and how a new load shares it: weights, tokenizer

How a request flows (origin O holds the request; stages S0..Sn-1 hold the layers)::

    O --Start(prompt, sampling, seed)--> S0 --Activation--> S1 --> ... --> Sn-1
    Sn-1 samples; Token --> O (the client's node)   and   Token --> S0 (the next step)
    O detokenizes, applies stop strings, and finally sends End to every stage.

* The prompt is prefilled in steps as mlx-lm's ``generate_step`` does: all but its last
  token in chunks of ``prefill_chunk`` tokens (S0 computes chunk i+1 while S1 computes
  chunk i), then the last token alone, which gives the first token; then one step per token.
  A request alone therefore computes exactly what one mlx-lm process computes with
  ``prefill_step_size=prefill_chunk``: the same tokens and bit-identical logits, on any CPU.
* Each stage keeps the KV cache of its layers per request and frees it on End (or when it
  finished the request itself, or when a peer of the request is lost, or after
  ``stage_idle_timeout_s`` without traffic).
* The last stage samples (per-request seeded :class:`meshd.inference.sampling.TokenSampler`,
  so the same seed gives the same tokens) and decides EOS and max_tokens. Each token goes to
  the origin and to the first stage only, as one frame when they are the same node. The
  origin owns stop strings and cancellation.
* Several requests interleave: each stage computes one step at a time, taking the requests
  whose input has arrived in turn, so with N stages up to N requests are computed at the
  same moment, and a long prompt's chunks alternate with other requests' steps. A
  single-stage plan feeds each sampled token to its next step without any frame, one step
  ahead on the compute thread.

Loading: a stage loads on the compute thread, so while a new plan loads, requests of a
draining plan on the same node wait (MLX evaluations stay on one thread). A new plan whose
stage on this node is identical to an installed one shares its weights instead, and one that
overlaps a loaded stage takes the layers they share (:mod:`meshd.inference.serving.loaded_stages`).

Tensor-parallel stages (:mod:`meshd.inference.tensor_parallel`): every member of the stage's
group starts its rank's runner process when the plan is installed (:class:`RunnerSupervisor`,
owned here, on this loop, as the runners must be) and stops it with the plan; the stage counts
as loaded once the group formed. Rank 0 is the stage's endpoint: its engine
(:class:`TensorParallelEngine`) hands each step to its runner. A lost member's runners are
killed at once (:meth:`DataPlane.member_lost`); the requests on the group end as UNAVAILABLE.

Epochs and fencing: every frame carries its plan id, and a node serves a frame only for a
plan that ``check_serving(plan_id)`` (the agreement's fencing, see
:mod:`meshd.inference.fencing`) says is committed here, installed and loaded, and only from
the node the plan says (see :mod:`meshd.inference.stage.core`). Requests that fail reach the
client as :class:`meshd.inference.errors.InferenceError`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from meshd.inference.assignment import Assignment
from meshd.inference.errors import ErrorKind, InferenceError
from meshd.inference.fencing import FenceCheck, ServedSource
from meshd.inference.generation_events import GenerationEvent
from meshd.inference.installed import InstalledPlan
from meshd.inference.origin.runtime import (
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_RESUME_TIMEOUT_S,
    STREAM_FIRST_ENV,
    Origin,
)
from meshd.inference.sampling import SamplingParams
from meshd.inference.serving.loaded_stages import LoadedStages, StageLoads
from meshd.inference.stage.engine import StageEngine, StageKey
from meshd.inference.stage.runtime import StageRuntime
from meshd.inference.tensor_parallel.engine import TensorParallelEngine
from meshd.inference.tensor_parallel.member import RunnerSupervisor
from meshd.inference.tensor_parallel.spec import TensorParallelSpec
from meshd.inference.transport.links import ChannelFactory, DataPlaneServicer, Transport
from meshd.models.info import every_layer_keeps_kv
from meshd.runtime.compute import ComputeExecutor
from meshd.runtime.lazy_imports import import_model_runtime
from meshd.wire import dataplane_pb2 as dp

log = logging.getLogger("meshd.dataplane")


class DataPlaneError(RuntimeError):
    """A plan cannot be installed as asked; the message says what and what to do."""


class DataPlane:
    """This node's part of the data plane: its stages, its links, its clients' requests.

    ``channel_factory(address)`` makes a mutual-TLS grpc.aio channel to a peer (see
    :func:`meshd.mesh.channels.peer_channel_factory`); ``check_serving(plan_id)``
    raises (any exception, with a message naming the plan and node) when the plan is not
    committed here; ``served()`` (optional) says which plan is active, so that the origin can
    move its requests to the next plan when theirs cannot carry them on (see
    :mod:`meshd.inference.origin.runtime`). Everything runs on the asyncio thread that calls it; MLX
    runs on ``compute`` (one thread per node, created here unless given).
    """

    def __init__(
        self,
        node_id: str,
        channel_factory: ChannelFactory,
        check_serving: FenceCheck,
        *,
        compute: ComputeExecutor | None = None,
        max_requests_per_stage: int = 64,
        max_queued_per_plan: int = 64,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        link_timeout_s: float = 5.0,
        first_token_timeout_s: float = 300.0,
        token_timeout_s: float = 60.0,
        stage_idle_timeout_s: float = 600.0,
        served: ServedSource | None = None,
        resume_timeout_s: float = DEFAULT_RESUME_TIMEOUT_S,
        report: Callable[[str], None] | None = None,
        runners: RunnerSupervisor | None = None,
        draft_tokens: int = 0,
        prefix_cache: bool = True,
        tokenizer_folder: Path | None = None,
    ) -> None:
        self.node_id = node_id
        self.max_requests_per_stage = max_requests_per_stage
        self.draft_tokens = draft_tokens
        self._owns_compute = compute is None
        self._compute = compute or ComputeExecutor(f"meshd-compute-{node_id}")
        self._plans: dict[str, InstalledPlan] = {}
        self._closed = False
        # A step a token lets this node start goes before the client's stream that token
        # wakes (let_start in the stream, hand_over in _on_token); MESHD_STREAM_FIRST=1, the
        # benchmark's baseline, turns both off.
        self._step_first = not _stream_first()
        self.transport = Transport(
            node_id, channel_factory, self, link_timeout_s=link_timeout_s, report=report
        )
        self.origin = Origin(
            node_id,
            self.transport,
            self._plans,
            check_serving,
            served=served,
            prefill_chunk=prefill_chunk,
            first_token_timeout_s=first_token_timeout_s,
            token_timeout_s=token_timeout_s,
            resume_timeout_s=resume_timeout_s,
            report=report,
            yield_to_compute=self._compute.let_start if self._step_first else None,
        )
        self.stage = StageRuntime(
            node_id,
            self.transport,
            self._compute,
            check_serving,
            max_requests=max_requests_per_stage,
            idle_timeout_s=stage_idle_timeout_s,
            max_queued=max_queued_per_plan,
            prefix_cache=prefix_cache,
        )
        self.runners = runners or RunnerSupervisor(node_id)
        self.runners.set_on_change(self._publish_runners)
        self.loaded_stages = LoadedStages(
            node_id, self._plans, self._compute, tokenizer_folder=tokenizer_folder
        )
        # What `meshd status` shows of this node's runners: replaced whole on every change,
        # read from the trio thread (never mutated once published).
        self.runner_status: tuple[dict[str, Any], ...] = ()
        self._handlers: dict[str, Callable[[str, dp.Frame], None]] = {
            "start": self.stage.on_start,
            "activation": self.stage.on_activation,
            "token": self._on_token,
            "end": self.stage.on_end,
            "failure": self.origin.on_failure,
            "bundle": self._on_bundle,
        }

    def servicer(self) -> DataPlaneServicer:
        return DataPlaneServicer(self.transport.serve_link, self.stats)

    @property
    def frames_received(self) -> int:
        return self.transport.frames_received

    @property
    def frames_sent(self) -> int:
        return self.transport.frames_sent

    @property
    def loads(self) -> StageLoads:
        """How this node moved between plans: what its stage loads read or kept."""
        return self.loaded_stages.loads

    # ---------------------------------------------------------------- plans

    async def install(
        self,
        assignment: Assignment,
        *,
        colocated_stages: int = 1,
        tensor_parallel: TensorParallelSpec | None = None,
    ) -> None:
        """Serve ``assignment``: load this node's stage (on the compute thread) and the
        tokenizer. Returns once loaded; raises (and installs nothing) when loading fails.

        ``colocated_stages``: the plan's stages on this machine, this one included (the
        daemon derives it from the peers' machine fingerprints). Plans already installed
        keep serving (a replaced plan drains until :meth:`uninstall`); a plan whose stage is
        identical shares the loaded weights. ``tensor_parallel``: the spec of this node's
        tensor-parallel stage, when it is a member of one (its runner starts here).
        """
        loop = self.transport.bind_loop()
        member_of = assignment.member_stage(self.node_id)
        if (member_of is not None and assignment.stages[member_of].tensor_parallel) != (
            tensor_parallel is not None
        ):
            raise DataPlaneError(
                f"plan {assignment.plan_id[:12]}: a member of a tensor-parallel stage is "
                "installed with that stage's group spec, and only a member is"
            )
        existing = self._plans.get(assignment.plan_id)
        if existing is not None:
            if existing.assignment != assignment:
                raise DataPlaneError(
                    f"plan {assignment.plan_id} is already installed with other stages; "
                    "uninstall it first"
                )
            await asyncio.shield(existing.ready)
            return
        plan = self._new_plan(assignment, loop)
        self._plans[assignment.plan_id] = plan
        self.stage.add_plan(assignment, plan.engine, colocated_stages)
        try:
            # One thread imports mlx_lm before two threads use it (meshd.runtime.lazy_imports).
            await asyncio.to_thread(import_model_runtime)
            # The tokenizer first, then the weights, not both at once: reading tokenizer.json
            # holds the GIL in C calls (json.load in mlx-lm, the Rust tokenizer's build), and
            # with the weights' load taking the CPU meanwhile those calls kept every loop of
            # the daemon from running for up to 1.5-3.5 s on a loaded host, its heartbeats
            # included: peers dropped it (meshd.runtime.stalls said so). Measured with three
            # daemons on two cores: stalls of 0.5 s or more in 5 of 6 installs at once, then
            # in 1 of 5. The cost: the tokenizer's load (0.3-1 s, nothing on a re-plan of the
            # same files) is no longer hidden behind the weights'.
            plan.tokenizer, plan.config = await self.loaded_stages.tokenizer_for(
                assignment.model_dir
            )
            if plan.engine is not None:  # a last stage holds structured outputs to it
                plan.engine.tokenizer = plan.tokenizer
            if tensor_parallel is not None:
                await self._start_runner(tensor_parallel, plan.engine)
            elif plan.engine is not None:
                await self.loaded_stages.load_engine(plan.engine)
        except BaseException as error:
            if self._plans.get(assignment.plan_id) is plan:
                del self._plans[assignment.plan_id]
            if tensor_parallel is not None:
                await asyncio.shield(self.runners.stop_plan(assignment.plan_id))
            plan.ready.set_exception(DataPlaneError(f"plan {assignment.plan_id}: {error}"))
            self.record_load_failure(assignment.plan_id, str(error))
            raise
        plan.ready.set_result(None)
        drafts = await self._drafts_for(assignment, plan)
        self.stage.plan_loaded(
            assignment.plan_id,
            vocab_size=plan.vocab_size,
            draft_tokens=drafts,
            prefix_trimmable=self._prefix_kind(assignment, plan, tensor_parallel),
        )
        log.info(
            "installed plan %s (stage %s of %d)",
            assignment.plan_id[:12],
            plan.index,
            len(assignment.stages),
        )

    @staticmethod
    def _prefix_kind(
        assignment: Assignment,
        plan: InstalledPlan,
        tensor_parallel: TensorParallelSpec | None,
    ) -> bool | None:
        """How this node's stage of ``plan`` keeps prefixes (:mod:`meshd.inference.stage.
        prefix`): cut at any position when every layer of the model keeps a KV cache (True),
        whole only (False), or not at all (None: a tensor-parallel group keeps none yet)."""
        engine = plan.engine
        if tensor_parallel is not None or not isinstance(engine, StageEngine):
            return None
        if engine.stage is None or any(stage.tensor_parallel for stage in assignment.stages):
            return None
        return every_layer_keeps_kv(plan.config or {}) and engine.stage.prefix_trimmable

    async def _drafts_for(self, assignment: Assignment, plan: InstalledPlan) -> int:
        """Tokens this node drafts per step for ``plan``'s greedy requests (speculative
        decoding, :mod:`meshd.inference.stage.drafting`): ``draft_tokens`` on the first stage of a
        plan of plain stages whose every layer keeps a KV cache (rejected drafts are taken
        back by dropping cache positions); 0 everywhere else."""
        stages = assignment.stages
        if (
            self.draft_tokens <= 0
            or assignment.stage_index(self.node_id) != 0
            or any(stage.tensor_parallel for stage in stages)
            or plan.engine is None
            or not every_layer_keeps_kv(plan.config or {})
        ):
            return 0
        engine = plan.engine
        can_roll_back = await self._compute.run(lambda: engine.can_roll_back)
        return self.draft_tokens if can_roll_back else 0

    def _new_plan(self, assignment: Assignment, loop: asyncio.AbstractEventLoop) -> InstalledPlan:
        index = assignment.stage_index(self.node_id)
        engine = None
        if index is not None:
            spec = assignment.stages[index]
            key = StageKey(
                assignment.model_dir,
                spec.layer_start,
                spec.layer_end,
                spec.has_embedding,
                spec.has_head,
            )
            if spec.tensor_parallel:
                engine = TensorParallelEngine(key, self.max_requests_per_stage, loop=loop)
            else:
                engine = StageEngine(key, self.max_requests_per_stage)
        ready: asyncio.Future[None] = loop.create_future()
        ready.add_done_callback(_retrieve_exception)
        return InstalledPlan(assignment, index, engine, ready)

    def stages_to_free_for(self, assignment: Assignment) -> list[str]:
        """Installed plans whose stage here would hold its weights next to ``assignment``'s
        (the installer frees them first when memory is short): see
        :meth:`LoadedStages.stages_to_free_for`."""
        return self.loaded_stages.stages_to_free_for(assignment)

    async def _start_runner(self, spec: TensorParallelSpec, engine: StageEngine | None) -> None:
        """Start this node's rank of a tensor-parallel stage; rank 0's engine runs on it.

        A draining plan's runner that holds one of the ports is stopped first: the new plan is
        committed, and its group can only form on its own ports (every member derives them
        from the plan id, so they cannot be moved here alone).
        """
        for plan_id, stage_index in self.runners.plans_holding_ports(spec):
            log.warning(
                "stopping the tensor-parallel runners of plan %s (stage %d): plan %s needs "
                "their ports",
                plan_id[:12],
                stage_index,
                spec.plan_id[:12],
            )
            await self.runners.stop_plan(plan_id)
        member = await self.runners.start(spec)
        if isinstance(engine, TensorParallelEngine):
            engine.attach(member)

    def member_lost(self, node_id: str, reason: str) -> list[str]:
        """The mesh lost ``node_id``: kill at once every runner here whose group it was in
        (MLX's collectives would hang on it), and close the link to it, which may sit on a
        connection the network cut; returns the affected stages' names."""
        self.transport.drop_peer(node_id)
        return self.runners.member_lost(node_id, reason)

    def abort_starting_runners(self, plan_id: str, reason: str) -> list[str]:
        """``plan_id`` was withdrawn while its groups formed: their runners stop waiting."""
        return self.runners.abort_starting(plan_id, reason)

    def _publish_runners(self) -> None:
        self.runner_status = tuple(self.runners.status())

    def record_load_failure(self, plan_id: str, reason: str) -> None:
        """This node cannot serve committed plan ``plan_id`` (its part could not be fetched
        or loaded): requests reaching it fail at once with ``reason`` instead of being told
        to wait for a load that will not happen."""
        self.stage.plan_failed(plan_id, reason)

    async def uninstall(self, plan_id: str, reason: str) -> None:
        """Stop serving ``plan_id``: its requests end now with ``reason`` (e.g. "stage n3
        lost; the mesh is re-planning, retry"), its caches and weights are released."""
        plan = self._plans.pop(plan_id, None)
        if plan is not None:
            self.loaded_stages.keep_spare(plan)
        self.origin.on_plan_removed(plan_id, reason)
        # The stage's requests end first (remove_plan's first, synchronous part), then the
        # runners stop, which also ends a step the compute thread may be waiting on.
        await asyncio.gather(
            self.stage.remove_plan(plan_id, reason), self.runners.stop_plan(plan_id)
        )
        if plan is not None:
            log.info("uninstalled plan %s: %s", plan_id[:12], reason)

    async def hand_over_stages(self, reason: str) -> list[str]:
        """This node is leaving and the mesh serves new requests without it: every plan with a
        stage here is uninstalled, so the requests running through that stage end with a
        ``FENCED`` failure naming ``reason`` and their origins move them to the plan they serve
        now (replaying their tokens there). Returns the plan ids handed over."""
        held = [plan_id for plan_id, plan in self._plans.items() if plan.index is not None]
        for plan_id in held:
            await self.uninstall(plan_id, reason)
        return held

    async def stage_requests_held(self) -> int:
        """Requests running through this node's stages (of every plan with a stage here): a
        leaving node waits for their origins to move them before it hands the rest over."""
        return sum(
            self.stage.core.open_requests(plan_id)
            for plan_id, plan in self._plans.items()
            if plan.index is not None
        )

    def active_requests(self, plan_id: str) -> int:
        """Requests of ``plan_id`` open on this node (as origin or as stage); the daemon can
        release a draining plan once this is 0 on every node."""
        return self.stage.core.open_requests(plan_id) + self.origin.count(plan_id)

    def tokenizer(self, plan_id: str) -> Any:
        """The mlx-lm TokenizerWrapper of an installed plan's model (chat template included)."""
        plan = self._plans.get(plan_id)
        if plan is None or plan.tokenizer is None:
            raise InferenceError(
                ErrorKind.NO_PLAN, f"plan {plan_id} is not installed (or still loading) here"
            )
        return plan.tokenizer

    def context_length(self, plan_id: str) -> int:
        """Tokens of KV cache an installed plan reserves per sequence (0: no limit)."""
        return self._installed(plan_id).assignment.context_length

    def context_error(self, plan_id: str, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why such a request does not fit the plan's context, or None when it fits."""
        return self._installed(plan_id).assignment.context_error(prompt_tokens, max_tokens)

    def _installed(self, plan_id: str) -> InstalledPlan:
        plan = self._plans.get(plan_id)
        if plan is None:
            raise InferenceError(ErrorKind.NO_PLAN, f"plan {plan_id} is not installed here")
        return plan

    def model_config(self, plan_id: str) -> Mapping[str, Any]:
        """The config.json of an installed plan's model (architecture, sizes)."""
        plan = self._plans.get(plan_id)
        if plan is None or plan.tokenizer is None:
            raise InferenceError(
                ErrorKind.NO_PLAN, f"plan {plan_id} is not installed (or still loading) here"
            )
        return plan.config

    @property
    def tokens_delivered(self) -> int:
        """Tokens this node's clients have received so far (for live tokens/s)."""
        return self.origin.tokens_delivered

    def encode_chat(
        self,
        plan_id: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt token ids for chat ``messages`` (and ``tools``) with the model's template."""
        tokenizer = self.tokenizer(plan_id)
        ids = tokenizer.apply_chat_template(
            [dict(message) for message in messages],
            tools=[dict(tool) for tool in tools] if tools else None,
            add_generation_prompt=True,
            tokenize=True,
        )
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    # ---------------------------------------------------------------- requests

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
        """Generate on the mesh; an async iterator of TokenEvents ending with one FinalEvent.

        Raises InferenceError at once (nothing sent) for bad arguments; a request that
        cannot be served raises InferenceError from the iterator. Closing the iterator
        early (the client went away) cancels the request on every stage.
        ``return_logits`` (debug, tests) attaches the last stage's logits to each token;
        ``ignore_eos`` (benchmarks) generates exactly ``max_tokens`` tokens; ``resume=False``
        keeps the request on ``plan_id`` (it fails instead of moving to the next plan).
        """
        return self.origin.generate(
            plan_id,
            prompt_tokens,
            params,
            request_id=request_id,
            return_logits=return_logits,
            prefill_chunk=prefill_chunk,
            ignore_eos=ignore_eos,
            resume=resume,
        )

    def cancel(self, request_id: str) -> bool:
        """End a request this node is the origin of (its final event says "cancelled")."""
        return self.origin.cancel(request_id)

    # ---------------------------------------------------------------- frames (LinkHandler)

    def on_frame(self, sender: str, frame: dp.Frame) -> None:
        handler = self._handlers.get(frame.WhichOneof("body") or "")
        if handler is None:
            log.warning("unexpected data-plane frame from %s: %s", sender, frame.WhichOneof("body"))
            return
        handler(sender, frame)

    def _on_bundle(self, sender: str, frame: dp.Frame) -> None:
        """The frames of one batched step, handled in order; the stage decides what to
        compute next only after the last (so the batch's rows can run together here)."""
        with self.stage.holding_steps():
            for inner in frame.bundle.frames:
                kind = inner.WhichOneof("body")
                if kind == "bundle":
                    log.warning("a bundle from %s holds a bundle: ignored", sender)
                    continue
                self.on_frame(sender, inner)

    def _on_token(self, sender: str, frame: dp.Frame) -> None:
        delivered = self.origin.on_token(sender, frame)
        self.stage.on_token(sender, frame)
        if delivered and self._step_first:
            self._compute.hand_over()  # the step it queued, then the stream it woke

    def on_peer_lost(self, peer: str, reason: str, since: float | None = None) -> None:
        """Every request that involves ``peer`` is over: frames to or from it may be lost.
        ``since``: when the link broke, where known; a request begun later is not touched."""
        if self._closed:
            return
        self.origin.on_peer_lost(peer, reason, since)
        self.stage.on_peer_lost(peer, reason, since)

    # ---------------------------------------------------------------- status and shutdown

    def stats(self) -> dp.StatsReply:
        """Open requests per plan, and this process's memory (current and peak RSS)."""
        reply = dp.StatsReply(
            node_id=self.node_id,
            rss_bytes=psutil.Process().memory_info().rss,
            peak_rss_bytes=_peak_rss_bytes(),
            frames_received=self.transport.frames_received,
            frames_sent=self.transport.frames_sent,
        )
        for plan in self._plans.values():
            spec = plan.stage(plan.index) if plan.index is not None else None
            reply.plans.append(
                dp.PlanStats(
                    plan_id=plan.plan_id,
                    stage_index=-1 if plan.index is None else plan.index,
                    layer_start=spec.layer_start if spec else 0,
                    layer_end=spec.layer_end if spec else 0,
                    weight_bytes=plan.engine.weight_bytes if plan.engine else 0,
                    open_requests=self.stage.caches_held(plan.plan_id),
                    origin_requests=self.origin.count(plan.plan_id),
                    batched_rows=plan.engine.batched_rows if plan.engine else 0,
                    batched_steps=plan.engine.batched_steps if plan.engine else 0,
                    drafted_tokens=plan.engine.drafted_tokens if plan.engine else 0,
                    accepted_tokens=plan.engine.accepted_tokens if plan.engine else 0,
                    queued_requests=self.stage.core.queued_requests(plan.plan_id),
                    reserved_tokens=self.stage.core.reserved_tokens(plan.plan_id),
                    budget_tokens=plan.assignment.kv_budget_tokens,
                    queue_limit=self.stage.core.max_queued,
                )
            )
        return reply

    async def close(self) -> None:
        """Abort every request, close every stream and stop the compute thread (if ours)."""
        if self._closed:
            return
        for plan_id in list(self._plans):
            await self.uninstall(plan_id, f"node {self.node_id} is shutting down")
        self.loaded_stages.close()
        self._closed = True
        await self.runners.close()
        await self.stage.close()
        await self.transport.close()
        if self._owns_compute:
            await self._compute.close()


def _retrieve_exception(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen (it is reported where it is awaited)."""
    if not future.cancelled():
        future.exception()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _stream_first() -> bool:
    """The benchmark's baseline: client streams before the next step (``MESHD_STREAM_FIRST``)."""
    return os.environ.get(STREAM_FIRST_ENV, "").strip() == "1"
