"""The inference data plane: pipeline-parallel generation across the nodes of a plan.

One :class:`DataPlane` per daemon. It runs on the daemon's asyncio thread (the one that owns
every grpc.aio server and channel, see :mod:`meshd.runtime.bridge`); all its methods are asyncio
coroutines or plain methods to be called on that thread. Trio code reaches it with
``await bridge.run(plane.install, assignment)``; the client API handlers, which run on the
asyncio thread already, iterate :meth:`DataPlane.generate` directly. MLX never runs on the
asyncio thread: every computation goes to the node's single compute thread
(:class:`meshd.inference.engine.ComputeWorker`), so frames keep moving while a stage computes.

How a request flows (origin O holds the request; stages S0..Sn-1 hold the layers)::

    O --Start(prompt, sampling, seed)--> S0 --Activation--> S1 --> ... --> Sn-1
    Sn-1 samples; Token --> O (the client's node)   and   Token --> S0 (the next step)
    O detokenizes, applies stop strings, and finally sends End to every stage.

* The prompt is prefilled in chunks (``prefill_chunk`` tokens): S0 computes chunk i+1 while S1
  computes chunk i. Decode steps are chunks of one token. Each stage keeps the KV cache of its
  layers per request and frees it on End (or when it finished the request itself, or when a
  peer of the request is lost, or after ``stage_idle_timeout_s`` without traffic).
* The last stage samples (per-request seeded :class:`meshd.inference.sampling.TokenSampler`, so the
  same seed gives the same tokens) and decides EOS and max_tokens. Each token goes to the origin
  and to the first stage only, as one frame when they are the same node. The origin owns stop
  strings (:class:`meshd.inference.sampling.StopChecker`) and cancellation.
* Several requests interleave: each stage computes its queue in arrival order on its compute
  thread, so with N stages up to N requests are computed at the same moment. A single-stage
  plan chains its decode steps on the compute thread without a network round trip.

Transport: a persistent gRPC bidirectional stream per ordered node pair (``DataPlane/Link``),
opened lazily by the sender, reused by every request, reopened on the next send after a
failure. Frames are written in order, so a request's chunks reach each stage in order. The
stream's return direction carries frames only to an origin that is not a stage of the plan (it
has no address in the plan to be dialled at); such an origin opens streams to every stage
before it starts a request. Activations are raw float32 (or the stage's dtype) bytes with
dtype and shape, never pickle. Measured with ``benchmarks/bench_dataplane.py`` (stage processes
on loopback, 2 shared cores, SmolLM2 float32): 0.4-0.9 ms per hop per token, 2 stages at
0.91-0.98 of one mlx-lm process. Raw TLS sockets could save a few tenths of a millisecond per
hop (fewer thread wake-ups), but would need a second port in every address book; not worth it
at these numbers.

Loading: a stage loads on the compute thread, so while a new plan loads, requests of a
draining plan on the same node wait (MLX evaluations stay on one thread). A new plan whose
stage on this node is identical to an installed one shares its weights instead.

Epochs and fencing: every frame carries its plan id. For every Start, Activation and Token a
node calls ``check_serving(plan_id)`` (the agreement's fencing; it must be cheap and safe to
call from the asyncio thread) and answers work for a plan it does not serve with a Failure
that names the plan and the node; the origin ends the request with that message. A node also
checks that each frame comes from the node the plan says (previous stage, last stage, origin:
the sender is the TLS certificate's node id).

Errors never hang a client: a broken stream fails, at once, every request that involves the
peer ("stage n3 at 10.0.0.3:7000 unreachable: ..."); :meth:`DataPlane.uninstall` aborts a
withdrawn plan's requests with the agreement's reason; a stage that cannot compute reports a
Failure; and the origin gives up after ``first_token_timeout_s`` / ``token_timeout_s``
without a token, as a last resort. Bad arguments raise ValueError before anything is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import secrets
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import grpc
import mlx.core as mx
import numpy as np
import psutil

from meshd.inference.engine import (
    ComputeWorker,
    SampledToken,
    StageEngine,
    StageKey,
    decode_hidden,
    encode_hidden,
)
from meshd.inference.sampling import MAX_SEED, SamplingParams, StopChecker
from meshd.mesh import security
from meshd.runtime.blas import default_blas_threads, set_blas_threads
from meshd.runtime.lazy_imports import import_model_runtime
from meshd.wire import dataplane_pb2 as dp
from meshd.wire import dataplane_pb2_grpc as dp_grpc

log = logging.getLogger("meshd.dataplane")

T = TypeVar("T")

DEFAULT_PREFILL_CHUNK = 256
MAX_MESSAGE_BYTES = 64 << 20
MAX_ACTIVATION_BYTES = 32 << 20  # a prefill chunk is cut so its activation stays below this
MAX_REQUEST_ID_CHARS = 128
MAX_REMEMBERED_LOAD_FAILURES = 64
ENDED_REMEMBERED = 4096  # ids of ended requests kept to drop their late frames
# gRPC options for data-plane servers and channels: prompt chunks are large messages.
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    *security.CHANNEL_OPTIONS,
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 2_000),
]

FinishReason = Literal["stop", "length", "eos", "cancelled", "error"]
ChannelFactory = Callable[[str], grpc.aio.Channel]
FenceCheck = Callable[[str], None]

_FAILURE = dp.FailureKind


class DataPlaneError(RuntimeError):
    """The data plane cannot do what was asked; the message says what and what to do."""


# --- What a node is asked to serve -----------------------------------------------------------


@dataclass(frozen=True)
class StageSpec:
    """One stage of an assignment: which node holds which layers, and where to reach it."""

    node_id: str
    address: str
    layer_start: int
    layer_end: int
    has_embedding: bool
    has_head: bool


@dataclass(frozen=True)
class Assignment:
    """A committed plan as the data plane needs it: its id, the model and the ordered stages.

    Every node of the mesh installs the same assignment; a node that holds no stage can still
    be the origin of requests (it needs the tokenizer only).
    """

    plan_id: str
    model_dir: Path
    stages: tuple[StageSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        object.__setattr__(self, "stages", tuple(self.stages))
        _check_stages(self.plan_id, self.stages)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(stage.node_id for stage in self.stages)

    def stage_index(self, node_id: str) -> int | None:
        """Index of the stage ``node_id`` holds, or None."""
        return next((i for i, s in enumerate(self.stages) if s.node_id == node_id), None)

    @classmethod
    def from_plan(cls, plan: Any, model_dir: Path, addresses: Mapping[str, str]) -> Assignment:
        """From a :class:`partitioner.plan.Plan` and the peers' data-plane addresses."""
        stages = []
        for stage in plan.stages:
            if len(stage.nodes) != 1:
                raise DataPlaneError(
                    f"plan {plan.plan_id[:12]} has a tensor-parallel stage {stage.nodes}; the "
                    "data plane runs pipeline stages of one node each"
                )
            node = stage.nodes[0]
            if node not in addresses:
                raise DataPlaneError(f"no address known for node {node} of plan {plan.plan_id}")
            stages.append(
                StageSpec(
                    node_id=node,
                    address=addresses[node],
                    layer_start=stage.layer_start,
                    layer_end=stage.layer_end,
                    has_embedding=stage.has_embedding,
                    has_head=stage.has_head,
                )
            )
        return cls(plan_id=plan.plan_id, model_dir=Path(model_dir), stages=tuple(stages))

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan_id": self.plan_id,
            "model_dir": str(self.model_dir),
            "stages": [vars(stage).copy() for stage in self.stages],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Assignment:
        return cls(
            plan_id=data["plan_id"],
            model_dir=Path(data["model_dir"]),
            stages=tuple(StageSpec(**stage) for stage in data["stages"]),
        )


def _check_stages(plan_id: str, stages: Sequence[StageSpec]) -> None:
    """Contiguous layers from 0, embedding first, head last, one stage per node."""
    if not plan_id:
        raise ValueError("an assignment needs a plan id (the epoch its frames carry)")
    if not stages:
        raise ValueError(f"plan {plan_id} has no stages")
    if not stages[0].has_embedding or not stages[-1].has_head:
        raise ValueError(f"plan {plan_id}: the first stage must embed and the last hold the head")
    if any(s.has_embedding for s in stages[1:]) or any(s.has_head for s in stages[:-1]):
        raise ValueError(f"plan {plan_id}: only the first stage embeds, only the last has a head")
    nodes = [stage.node_id for stage in stages]
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"plan {plan_id}: a node holds more than one stage ({nodes})")
    expected = 0
    for stage in stages:
        if stage.layer_start != expected or stage.layer_end <= stage.layer_start:
            raise ValueError(
                f"plan {plan_id}: stage of {stage.node_id} holds layers "
                f"[{stage.layer_start}, {stage.layer_end}), expected a non-empty range from "
                f"layer {expected}"
            )
        expected = stage.layer_end


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
    """The last event of a request. ``text`` is held-back text flushed at the end (append it
    to the tokens' text); ``error`` says what went wrong when ``finish_reason == "error"``.
    ``stage_loading`` marks an error that a retry may cure: a stage has committed the plan but
    is still loading its layers, and no token was generated yet."""

    finish_reason: FinishReason
    usage: Usage
    text: str = ""
    error: str | None = None
    stage_loading: bool = False


GenerationEvent = TokenEvent | FinalEvent


# --- Streams between nodes -------------------------------------------------------------------


def _describe(error: BaseException) -> str:
    """A one-line reason for a failed stream."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    if isinstance(error, TimeoutError):
        return "no answer in time"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class _OutboundLink:
    """A persistent stream this node opened to ``peer``; frames are written in send order."""

    def __init__(self, plane: DataPlane, peer: str, address: str) -> None:
        self.peer = peer
        self.address = address
        self._plane = plane
        self._outbox: asyncio.Queue[dp.Frame] = asyncio.Queue()
        self._opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._opened.add_done_callback(_retrieve_exception)
        self.broken = False
        self._closing = False
        self._task = asyncio.create_task(self._run(), name=f"dataplane-link-{peer}")

    def send(self, frame: dp.Frame) -> bool:
        if self.broken:
            return False
        self._outbox.put_nowait(frame)
        return True

    async def wait_open(self, timeout_s: float) -> None:
        """Wait until the peer answered our Hello; DataPlaneError when it did not."""
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(self._opened)
        except TimeoutError:
            reason = f"no answer within {timeout_s:g} s"
            self._fail(reason)
            self._task.cancel()
            raise DataPlaneError(self.unreachable(reason)) from None

    def unreachable(self, reason: str) -> str:
        return f"stage {self.peer} at {self.address} unreachable: {reason}"

    async def close(self) -> None:
        self._closing = True
        self.broken = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task

    async def _run(self) -> None:
        channel = None
        try:
            channel = self._plane._channel_factory(self.address)
            call = dp_grpc.DataPlaneStub(channel).Link()
            await call.write(dp.Frame(hello=dp.Hello(node_id=self._plane.node_id)))
            async with asyncio.timeout(self._plane.link_timeout_s):
                reply = await call.read()
            self._check_hello(reply)
            self._opened.set_result(None)
            await self._pump(call)
        except asyncio.CancelledError:
            if not self._closing:
                self._fail("the link was cancelled")
            raise
        except Exception as error:
            self._fail(_describe(error))
        finally:
            if channel is not None:
                with contextlib.suppress(Exception):
                    await channel.close()

    def _check_hello(self, reply: Any) -> None:
        if reply is grpc.aio.EOF or not reply.HasField("hello"):
            raise DataPlaneError("the peer closed the stream without a Hello")
        if reply.hello.node_id != self.peer:
            raise DataPlaneError(
                f"{self.address} answered as node {reply.hello.node_id}, not {self.peer}: the "
                "plan's address book is stale"
            )

    async def _pump(self, call: Any) -> None:
        """Write queued frames and read returned ones until either direction ends."""
        writer = asyncio.create_task(self._write(call))
        reader = asyncio.create_task(self._read(call))
        try:
            done, _ = await asyncio.wait({writer, reader}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises the direction's error
            raise DataPlaneError("the peer closed the stream")
        finally:
            writer.cancel()
            reader.cancel()
            call.cancel()

    async def _write(self, call: Any) -> None:
        while True:
            frame = await self._outbox.get()
            await call.write(frame)

    async def _read(self, call: Any) -> None:
        while True:
            frame = await call.read()
            if frame is grpc.aio.EOF:
                return
            self._plane._on_frame(self.peer, frame)

    def _fail(self, reason: str) -> None:
        if self.broken and self._opened.done():
            return
        self.broken = True
        if not self._opened.done():
            self._opened.set_exception(DataPlaneError(self.unreachable(reason)))
        if not self._closing:
            self._plane._on_outbound_broken(self, reason)


def _retrieve_exception(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen (it is reported elsewhere)."""
    if not future.cancelled():
        future.exception()


class _InboundLink:
    """A stream a peer opened to us: we read its frames and may answer on it."""

    def __init__(self, peer: str, context: grpc.aio.ServicerContext) -> None:
        self.peer = peer
        self._context = context
        self._outbox: asyncio.Queue[dp.Frame] = asyncio.Queue()
        self.closed = False

    def send(self, frame: dp.Frame) -> bool:
        if self.closed:
            return False
        self._outbox.put_nowait(frame)
        return True

    async def write_forever(self) -> None:
        while True:
            frame = await self._outbox.get()
            await self._context.write(frame)


class DataPlaneServicer(dp_grpc.DataPlaneServicer):
    """The gRPC face of a :class:`DataPlane`; add it to the daemon's peer server with
    ``dataplane_pb2_grpc.add_DataPlaneServicer_to_server(plane.servicer(), server)``."""

    def __init__(self, plane: DataPlane) -> None:
        self._plane = plane

    async def Link(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await self._plane._serve_link(context)

    async def Stats(self, request: dp.StatsRequest, context: grpc.aio.ServicerContext) -> Any:
        return self._plane.stats()


# --- Per-plan and per-request state ----------------------------------------------------------


@dataclass(eq=False)
class _InstalledPlan:
    assignment: Assignment
    index: int | None  # this node's stage, None when it holds none
    engine: StageEngine | None
    ready: asyncio.Future[None]
    tokenizer: Any = None
    config: dict[str, Any] = field(default_factory=dict)
    requests: dict[str, _StageRequest] = field(default_factory=dict)

    @property
    def plan_id(self) -> str:
        return self.assignment.plan_id

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == len(self.assignment.stages) - 1

    def stage(self, index: int) -> StageSpec:
        return self.assignment.stages[index]


@dataclass(eq=False)
class _StageRequest:
    """One request as one stage sees it."""

    request_id: str
    origin: str
    forward_start: dp.Start  # what the next stage gets with its first activation
    sampling: SamplingParams | None  # last stage only
    prompt: list[int]
    eos_ids: frozenset[int]
    return_logits: bool
    last_activity: float
    prefill_steps: int = 0
    next_input_step: int = 0
    next_token_index: int = 0
    ended: bool = False


@dataclass(frozen=True)
class _RequestOptions:
    return_logits: bool
    prefill_chunk: int
    ignore_eos: bool


@dataclass(frozen=True)
class _Stop:
    """A local decision that ends an origin request (cancel, lost stage, uninstall)."""

    reason: FinishReason
    message: str | None


class _OriginRequest:
    """A request this node holds for a client: incoming tokens -> events."""

    def __init__(
        self,
        request_id: str,
        plan: _InstalledPlan,
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

    def on_token(self, token: Any, arrived_at: float) -> list[GenerationEvent]:
        """Events for one Token frame: the token's text, and the final event if it ends."""
        if token.index != self.generated:
            return [self.final("error", f"token {token.index} arrived, expected {self.generated}")]
        if self._first_at is None:
            self._first_at = arrived_at
        else:
            self._decode_compute_s += token.compute_s
        self._last_at = arrived_at
        self.generated += 1
        if token.finish == dp.FINISH_EOS:
            return [self.final("eos")]
        logits = np.frombuffer(token.logits, dtype=np.float32) if token.logits else None
        update = self._checker.add_token(token.token_id)
        events: list[GenerationEvent] = [
            TokenEvent(token.token_id, token.index, update.text, logits)
        ]
        if update.stopped:
            events.append(self.final("stop"))
        elif token.finish == dp.FINISH_LENGTH:
            events.append(self.final("length"))
        return events

    def final(self, reason: FinishReason, error: str | None = None) -> FinalEvent:
        flushed = self._checker.finish().text
        self.end_reason = f"finished ({reason})" if error is None else error
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
        return FinalEvent(reason, usage, flushed, error)


# --- The data plane ---------------------------------------------------------------------------


class DataPlane:
    """This node's part of the data plane: its stages, its links, its clients' requests.

    ``channel_factory(address)`` makes a mutual-TLS grpc.aio channel to a peer (see
    :func:`mtls_channel_factory`); ``check_serving(plan_id)`` raises (any exception, with a
    message naming the plan and node) when the plan is not committed here. Everything runs on
    the asyncio thread that calls it; MLX runs on ``compute`` (one thread per node, created
    here unless given).
    """

    def __init__(
        self,
        node_id: str,
        channel_factory: ChannelFactory,
        check_serving: FenceCheck,
        *,
        compute: ComputeWorker | None = None,
        max_requests_per_stage: int = 64,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        link_timeout_s: float = 5.0,
        first_token_timeout_s: float = 300.0,
        token_timeout_s: float = 60.0,
        stage_idle_timeout_s: float = 600.0,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1 token, got {prefill_chunk}")
        self.node_id = node_id
        self._channel_factory = channel_factory
        self._check_serving = check_serving
        self._owns_compute = compute is None
        self._compute = compute or ComputeWorker(f"meshd-compute-{node_id}")
        self.max_requests_per_stage = max_requests_per_stage
        self.prefill_chunk = prefill_chunk
        self.link_timeout_s = link_timeout_s
        self.first_token_timeout_s = first_token_timeout_s
        self.token_timeout_s = token_timeout_s
        self.stage_idle_timeout_s = stage_idle_timeout_s
        # Pipeline stages of the active plan that run on this same machine (this one included),
        # set by the daemon from the peers' machine fingerprints; see _share_cores.
        self.colocated_stages = 1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._plans: dict[str, _InstalledPlan] = {}
        self._origins: dict[str, _OriginRequest] = {}
        self._outbound: dict[str, _OutboundLink] = {}
        self._inbound: dict[str, _InboundLink] = {}
        self._ended: OrderedDict[tuple[str, str], None] = OrderedDict()
        # Plans this node committed but could not load, and why: refused at once, not retried.
        self._load_failures: OrderedDict[str, str] = OrderedDict()
        self._sweeper: asyncio.Task[None] | None = None
        self._retired: set[asyncio.Future[None]] = set()  # links being closed (address moved)
        self._closed = False
        self.frames_received = 0
        self.tokens_delivered = 0  # tokens this node's clients received (live tokens/s)
        self.frames_sent = 0
        self._handlers: dict[str, Callable[[str, dp.Frame], None]] = {
            "start": self._on_start,
            "activation": self._on_activation,
            "token": self._on_token,
            "end": self._on_end,
            "failure": self._on_failure,
        }

    def servicer(self) -> DataPlaneServicer:
        return DataPlaneServicer(self)

    # ---------------------------------------------------------------- plans

    async def install(self, assignment: Assignment) -> None:
        """Serve ``assignment``: load this node's stage (on the compute thread) and the
        tokenizer. Returns once loaded; raises (and installs nothing) when loading fails.

        Plans already installed keep serving (a replaced plan drains until
        :meth:`uninstall`); a plan whose stage is identical shares the loaded weights.
        """
        self._bind_loop()
        existing = self._plans.get(assignment.plan_id)
        if existing is not None:
            if existing.assignment != assignment:
                raise DataPlaneError(
                    f"plan {assignment.plan_id} is already installed with other stages; "
                    "uninstall it first"
                )
            await asyncio.shield(existing.ready)
            return
        plan = self._new_plan(assignment)
        self._plans[assignment.plan_id] = plan
        try:
            # One thread imports mlx_lm before two threads use it (see meshd.runtime.lazy_imports).
            await asyncio.to_thread(import_model_runtime)
            loading = [asyncio.to_thread(_load_tokenizer, assignment.model_dir)]
            if plan.engine is not None:
                loading.append(self._load_engine(plan.engine))
            (plan.tokenizer, plan.config), *_ = await asyncio.gather(*loading)
        except BaseException as error:
            if self._plans.get(assignment.plan_id) is plan:
                del self._plans[assignment.plan_id]
            plan.ready.set_exception(DataPlaneError(f"plan {assignment.plan_id}: {error}"))
            self.record_load_failure(assignment.plan_id, str(error))
            raise
        plan.ready.set_result(None)
        self._start_sweeper()
        log.info(
            "installed plan %s (stage %s of %d)",
            assignment.plan_id[:12],
            plan.index,
            len(assignment.stages),
        )

    def _new_plan(self, assignment: Assignment) -> _InstalledPlan:
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
            engine = StageEngine(key, self.max_requests_per_stage)
        ready: asyncio.Future[None] = self._bind_loop().create_future()
        ready.add_done_callback(_retrieve_exception)
        return _InstalledPlan(assignment, index, engine, ready)

    async def _load_engine(self, engine: StageEngine) -> None:
        """Load on the compute thread, sharing weights with an installed identical stage."""
        twin = next(
            (
                p.engine
                for p in self._plans.values()
                if p.engine is not None and p.engine is not engine and p.engine.key == engine.key
            ),
            None,
        )
        await self._on_compute(lambda: engine.load(twin.stage if twin else None))

    def record_load_failure(self, plan_id: str, reason: str) -> None:
        """This node cannot serve committed plan ``plan_id`` (its part could not be fetched
        or loaded): requests reaching it fail at once with ``reason`` instead of being told
        to wait for a load that will not happen."""
        self._load_failures[plan_id] = reason
        while len(self._load_failures) > MAX_REMEMBERED_LOAD_FAILURES:
            self._load_failures.popitem(last=False)

    async def uninstall(self, plan_id: str, reason: str) -> None:
        """Stop serving ``plan_id``: its requests end now with ``reason`` (e.g. "stage n3
        lost; the mesh is re-planning, retry"), its caches and weights are released."""
        self._load_failures.pop(plan_id, None)
        plan = self._plans.pop(plan_id, None)
        if plan is None:
            return
        for origin in list(self._origins.values()):
            if origin.plan_id == plan_id:
                origin.deliver(_Stop("error", reason))
        for request in list(plan.requests.values()):
            self._drop_stage_request(
                plan, request, notify_origin=reason, kind=_FAILURE.FAILURE_FENCED
            )
        if plan.engine is not None and not self._closed:
            engine = plan.engine
            with contextlib.suppress(RuntimeError):
                await self._on_compute(lambda: (engine.unload(), mx.clear_cache()))
        log.info("uninstalled plan %s: %s", plan_id[:12], reason)

    def active_requests(self, plan_id: str) -> int:
        """Requests of ``plan_id`` open on this node (as origin or as stage); the daemon can
        release a draining plan once this is 0 on every node."""
        plan = self._plans.get(plan_id)
        stage_requests = len(plan.requests) if plan else 0
        origins = sum(1 for origin in self._origins.values() if origin.plan_id == plan_id)
        return stage_requests + origins

    def tokenizer(self, plan_id: str) -> Any:
        """The mlx-lm TokenizerWrapper of an installed plan's model (chat template included)."""
        plan = self._plans.get(plan_id)
        if plan is None or plan.tokenizer is None:
            raise DataPlaneError(f"plan {plan_id} is not installed (or still loading) here")
        return plan.tokenizer

    def model_config(self, plan_id: str) -> Mapping[str, Any]:
        """The config.json of an installed plan's model (architecture, sizes)."""
        plan = self._plans.get(plan_id)
        if plan is None or plan.config is None:
            raise DataPlaneError(f"plan {plan_id} is not installed (or still loading) here")
        return plan.config

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

    # ---------------------------------------------------------------- origin API

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
        """Generate on the mesh; an async iterator of TokenEvents ending with one FinalEvent.

        Raises ValueError at once (nothing sent) for bad arguments. A request that cannot be
        served ends with ``FinalEvent(finish_reason="error", error=...)``. Closing the
        iterator early (the client went away) cancels the request on every stage.
        ``return_logits`` (debug, tests) attaches the last stage's logits to each token;
        ``ignore_eos`` (benchmarks) generates exactly ``max_tokens`` tokens.
        """
        self._check_request(plan_id, prompt_tokens, params, request_id, prefill_chunk)
        options = _RequestOptions(
            return_logits=return_logits,
            prefill_chunk=prefill_chunk or self.prefill_chunk,
            ignore_eos=ignore_eos,
        )
        prompt = [int(token) for token in prompt_tokens]
        return self._generate(plan_id, prompt, params, request_id, options)

    def cancel(self, request_id: str) -> bool:
        """End a request this node is the origin of (its final event says "cancelled")."""
        origin = self._origins.get(request_id)
        if origin is None:
            return False
        origin.deliver(_Stop("cancelled", None))
        return True

    def _check_request(
        self,
        plan_id: str,
        prompt_tokens: Sequence[int],
        params: SamplingParams,
        request_id: str,
        prefill_chunk: int | None,
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
            raise ValueError(f"request_id must be 1-{MAX_REQUEST_ID_CHARS} characters")
        if request_id in self._origins:
            raise ValueError(f"request {request_id} is already running on this node")
        if len(prompt_tokens) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        plan = self._plans.get(plan_id)
        vocab = int(plan.config.get("vocab_size", 0)) if plan and plan.config else 0
        for token in prompt_tokens:
            if not isinstance(token, int | np.integer) or token < 0 or (vocab and token >= vocab):
                raise ValueError(
                    f"prompt token {token!r} is not a token id of this model "
                    f"(0 <= id < {vocab or 'vocab size'})"
                )

    async def _generate(
        self,
        plan_id: str,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        options: _RequestOptions,
    ) -> AsyncIterator[GenerationEvent]:
        self._bind_loop()
        plan, error = await self._plan_for_origin(plan_id)
        seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED)
        if plan is None:
            yield _unserved(error or "", len(prompt), seed)
            return
        origin = _OriginRequest(request_id, plan, params, len(prompt), seed)
        self._origins[request_id] = origin
        try:
            error = await self._connect_stages(plan)
            if error is not None:
                yield origin.final("error", error)
                return
            start = self._start_message(plan, request_id, prompt, params, seed, options)
            first = plan.stage(0)
            if not self._send(first.node_id, first.address, start):
                yield origin.final("error", f"stage {first.node_id} at {first.address} is lost")
                return
            async for event in self._events(origin):
                yield event
        finally:
            self._origins.pop(request_id, None)
            self._end_everywhere(plan, request_id, origin.end_reason)

    async def _plan_for_origin(self, plan_id: str) -> tuple[_InstalledPlan | None, str | None]:
        """The installed, committed, loaded plan, or why a request for it cannot start."""
        try:
            self._check_serving(plan_id)
        except Exception as error:
            return None, str(error)
        plan = self._plans.get(plan_id)
        if plan is None:
            return None, (
                f"plan {plan_id} is not installed on node {self.node_id}: the mesh has no "
                "committed plan for it here yet; retry once the plan is serving"
            )
        try:
            async with asyncio.timeout(self.first_token_timeout_s):
                await asyncio.shield(plan.ready)
        except Exception as error:
            return None, f"plan {plan_id} could not be loaded on node {self.node_id}: {error}"
        return plan, None

    async def _connect_stages(self, plan: _InstalledPlan) -> str | None:
        """Open (or reuse) a stream to every other stage; the first failure's message."""
        links = [
            self._link_to(spec.node_id, spec.address)
            for spec in plan.assignment.stages
            if spec.node_id != self.node_id
        ]
        results = await asyncio.gather(
            *(link.wait_open(self.link_timeout_s) for link in links), return_exceptions=True
        )
        errors = [str(result) for result in results if isinstance(result, BaseException)]
        return errors[0] if errors else None

    def _start_message(
        self,
        plan: _InstalledPlan,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        seed: int,
        options: _RequestOptions,
    ) -> dp.Frame:
        hidden = int(plan.config.get("hidden_size", 1))
        chunk = max(1, min(options.prefill_chunk, MAX_ACTIVATION_BYTES // (4 * hidden)))
        sampling = dp.Sampling(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            seed=seed,
            max_tokens=params.max_tokens,
        )
        start = dp.Start(
            origin_node_id=self.node_id,
            prompt_tokens=prompt,
            prompt_length=len(prompt),
            sampling=sampling,
            eos_token_ids=[] if options.ignore_eos else sorted(plan.tokenizer.eos_token_ids),
            prefill_chunk=chunk,
            return_logits=options.return_logits,
        )
        return dp.Frame(plan_id=plan.plan_id, request_id=request_id, start=start)

    async def _events(self, origin: _OriginRequest) -> AsyncIterator[GenerationEvent]:
        """Turn the request's incoming frames into events until the final one."""
        while True:
            timeout = self.first_token_timeout_s if origin.generated == 0 else self.token_timeout_s
            try:
                async with asyncio.timeout(timeout):
                    arrived_at, item = await origin.inbox.get()
            except TimeoutError:
                stage = origin.last_stage
                yield origin.final(
                    "error",
                    f"no token from the mesh for {timeout:g} s (plan {origin.plan_id[:12]}, "
                    f"last stage {stage.node_id} at {stage.address}); giving up",
                )
                return
            for event in self._events_of(origin, item, arrived_at):
                yield event
                if isinstance(event, FinalEvent):
                    return

    def _events_of(
        self, origin: _OriginRequest, item: dp.Frame | _Stop, arrived_at: float
    ) -> list[GenerationEvent]:
        if isinstance(item, _Stop):
            return [origin.final(item.reason, item.message)]
        if item.WhichOneof("body") == "failure":
            final = origin.final("error", item.failure.message)
            if item.failure.kind == _FAILURE.FAILURE_NOT_LOADED and origin.generated == 0:
                final = replace(final, stage_loading=True)
            return [final]
        self.tokens_delivered += 1
        return origin.on_token(item.token, arrived_at)

    def _end_everywhere(self, plan: _InstalledPlan | None, request_id: str, reason: str) -> None:
        """Tell every stage the request is over (existing links only: no reconnect storms)."""
        if plan is None:
            return
        frame = dp.Frame(plan_id=plan.plan_id, request_id=request_id, end=dp.End(reason=reason))
        for spec in plan.assignment.stages:
            self._send(spec.node_id, spec.address, frame, open_new=False)

    # ---------------------------------------------------------------- links

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise DataPlaneError("a DataPlane must be used from one asyncio loop only")
        return loop

    def _link_to(self, node_id: str, address: str) -> _OutboundLink:
        link = self._outbound.get(node_id)
        if link is None or link.broken or link.address != address:
            if link is not None and not link.broken:
                closing = asyncio.ensure_future(link.close())
                self._retired.add(closing)
                closing.add_done_callback(self._retired.discard)
            link = _OutboundLink(self, node_id, address)
            self._outbound[node_id] = link
        return link

    def _send(self, node_id: str, address: str, frame: dp.Frame, *, open_new: bool = True) -> bool:
        """Send ``frame`` to ``node_id`` (locally when it is this node); False when lost."""
        if node_id == self.node_id:
            self._bind_loop().call_soon(self._on_frame, self.node_id, frame)
            return True
        link = self._outbound.get(node_id)
        if link is None or link.broken or link.address != address:
            if not open_new or self._closed:
                return False
            link = self._link_to(node_id, address)
        self.frames_sent += 1
        return link.send(frame)

    def _send_to_origin(self, plan: _InstalledPlan | None, origin: str, frame: dp.Frame) -> bool:
        """Outbound stream when the origin is a stage of the plan, else the origin's own
        stream back to us; for one request the choice never changes, so frames stay ordered."""
        if plan is not None:
            index = plan.assignment.stage_index(origin)
            if index is not None:
                return self._send(origin, plan.stage(index).address, frame)
        return self._reply(origin, frame)

    def _reply(self, node_id: str, frame: dp.Frame) -> bool:
        """Best effort to a node we may have no address for: local, its stream, or ours."""
        if node_id == self.node_id:
            return self._send(node_id, "", frame)
        inbound = self._inbound.get(node_id)
        if inbound is not None and inbound.send(frame):
            self.frames_sent += 1
            return True
        outbound = self._outbound.get(node_id)
        if outbound is not None and outbound.send(frame):
            self.frames_sent += 1
            return True
        log.warning("no route to node %s for request %s: dropped", node_id, frame.request_id)
        return False

    async def _serve_link(self, context: grpc.aio.ServicerContext) -> None:
        """One inbound stream: Hello both ways, then dispatch frames until it ends."""
        self._bind_loop()
        peer = await self._accept_hello(context)
        link = _InboundLink(peer, context)
        await context.write(dp.Frame(hello=dp.Hello(node_id=self.node_id)))
        self._inbound[peer] = link
        writer = asyncio.create_task(link.write_forever())
        reason = "the peer closed the stream"
        try:
            while True:
                frame = await context.read()
                if frame is grpc.aio.EOF:
                    break
                self._on_frame(peer, frame)
        except asyncio.CancelledError:
            reason = "the stream was cancelled"
            raise
        except Exception as error:
            reason = _describe(error)
        finally:
            link.closed = True
            writer.cancel()
            if self._inbound.get(peer) is link:
                del self._inbound[peer]
                self._on_peer_lost(peer, f"its stream to us broke: {reason}")

    async def _accept_hello(self, context: grpc.aio.ServicerContext) -> str:
        try:
            async with asyncio.timeout(self.link_timeout_s):
                hello = await context.read()
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no Hello on a new link")
        if hello is grpc.aio.EOF or not hello.HasField("hello") or not hello.hello.node_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a link starts with a Hello")
        claimed = hello.hello.node_id
        certified = security.peer_node_id(context)
        if certified is not None and certified != claimed:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the TLS certificate names node {certified} but its Hello claims {claimed}",
            )
        return claimed

    def _on_outbound_broken(self, link: _OutboundLink, reason: str) -> None:
        if self._outbound.get(link.peer) is link:
            del self._outbound[link.peer]
        log.warning("data-plane link to %s (%s) broke: %s", link.peer, link.address, reason)
        self._on_peer_lost(link.peer, reason)

    def _on_peer_lost(self, peer: str, reason: str) -> None:
        """Every request that involves ``peer`` is over: frames to or from it may be lost."""
        if self._closed:
            return
        for origin in list(self._origins.values()):
            if peer in origin.nodes:
                message = _unreachable(self._plans.get(origin.plan_id), peer, reason)
                origin.deliver(_Stop("error", message))
        for plan in list(self._plans.values()):
            involved = peer in plan.assignment.node_ids
            for request in list(plan.requests.values()):
                if involved or request.origin == peer:
                    notify = _unreachable(plan, peer, reason) if request.origin != peer else None
                    self._drop_stage_request(
                        plan, request, notify_origin=notify, kind=_FAILURE.FAILURE_UNREACHABLE
                    )

    # ---------------------------------------------------------------- frames

    def _on_frame(self, sender: str, frame: dp.Frame) -> None:
        self.frames_received += 1
        handler = self._handlers.get(frame.WhichOneof("body") or "")
        if handler is None:
            log.warning("unexpected data-plane frame from %s: %s", sender, frame.WhichOneof("body"))
            return
        try:
            handler(sender, frame)
        except Exception:
            log.exception(
                "data-plane frame from %s for request %s failed", sender, frame.request_id
            )

    def _on_start(self, sender: str, frame: dp.Frame) -> None:
        start = frame.start
        if start.origin_node_id != sender:
            self._refuse(
                sender, frame, _FAILURE.FAILURE_BAD_REQUEST, "a Start must come from its origin"
            )
            return
        plan = self._admit(sender, frame)
        if plan is None:
            return
        if not plan.is_first:
            self._refuse(
                sender,
                frame,
                _FAILURE.FAILURE_BAD_REQUEST,
                f"node {self.node_id} holds stage {plan.index} of plan {plan.plan_id}, not the "
                "first: the origin has another view of the plan",
            )
            return
        request = self._open_stage_request(plan, sender, frame)
        if request is None:
            return
        tokens = list(start.prompt_tokens)
        chunk = max(1, start.prefill_chunk)
        pieces = [tokens[i : i + chunk] for i in range(0, len(tokens), chunk)]
        request.prefill_steps = len(pieces)
        for step, piece in enumerate(pieces):
            last_piece = step == len(pieces) - 1
            self._submit_step(plan, request, step, tokens=piece, wants_logits=last_piece)

    def _on_activation(self, sender: str, frame: dp.Frame) -> None:
        if (frame.plan_id, frame.request_id) in self._ended:
            return
        activation = frame.activation
        plan = self._plans.get(frame.plan_id)
        request = plan.requests.get(frame.request_id) if plan else None
        origin = request.origin if request else activation.start.origin_node_id or sender
        plan = self._admit(origin, frame)
        if plan is None:
            return
        if plan.index is None or plan.index == 0 or plan.stage(plan.index - 1).node_id != sender:
            self._refuse(
                origin,
                frame,
                _FAILURE.FAILURE_BAD_REQUEST,
                f"node {sender} is not the previous stage of node {self.node_id}",
            )
            return
        if request is None:
            if not activation.HasField("start"):
                return  # a late frame of a request this stage already dropped
            request = self._open_stage_request(plan, activation.start.origin_node_id, frame)
            if request is None:
                return
        if activation.step != request.next_input_step:
            self._refuse(
                origin,
                frame,
                _FAILURE.FAILURE_BAD_REQUEST,
                f"step {activation.step} arrived, expected {request.next_input_step}",
            )
            return
        request.next_input_step += 1
        request.last_activity = time.monotonic()
        self._submit_step(
            plan,
            request,
            activation.step,
            activation=activation,
            wants_logits=activation.wants_logits,
            upstream_s=activation.compute_s,
        )

    def _on_token(self, sender: str, frame: dp.Frame) -> None:
        origin = self._origins.get(frame.request_id)
        is_origin = origin is not None and origin.plan_id == frame.plan_id
        if is_origin and sender == origin.last_stage.node_id:
            origin.deliver(frame)
        plan = self._plans.get(frame.plan_id)
        if plan is None or not plan.is_first or plan.is_last:
            return  # not the first stage of a multi-stage plan (a single stage chains itself)
        request = plan.requests.get(frame.request_id)
        token = frame.token
        if request is None or request.ended or token.finish != dp.FINISH_NONE:
            return
        if sender != plan.stage(len(plan.assignment.stages) - 1).node_id:
            return
        if self._admit(request.origin, frame) is None:
            return
        if token.index != request.next_token_index:
            self._refuse(
                request.origin,
                frame,
                _FAILURE.FAILURE_BAD_REQUEST,
                f"token {token.index} arrived, expected {request.next_token_index}",
            )
            return
        request.next_token_index += 1
        request.last_activity = time.monotonic()
        step = request.prefill_steps + token.index
        self._submit_step(plan, request, step, tokens=[token.token_id], wants_logits=True)

    def _on_end(self, sender: str, frame: dp.Frame) -> None:
        plan = self._plans.get(frame.plan_id)
        request = plan.requests.get(frame.request_id) if plan else None
        if request is None:
            self._remember_ended(frame.plan_id, frame.request_id)  # End may overtake a Start
            return
        if sender in (request.origin, self.node_id):
            self._drop_stage_request(plan, request, notify_origin=None)

    def _on_failure(self, sender: str, frame: dp.Frame) -> None:
        origin = self._origins.get(frame.request_id)
        if origin is None or origin.plan_id != frame.plan_id:
            return
        if sender in origin.nodes or sender == self.node_id:
            origin.deliver(frame)

    def _admit(self, origin: str, frame: dp.Frame) -> _InstalledPlan | None:
        """Fencing: the plan must be committed, installed and hold a stage here."""
        try:
            self._check_serving(frame.plan_id)
        except Exception as error:
            self._refuse(origin, frame, _FAILURE.FAILURE_FENCED, str(error))
            return None
        plan = self._plans.get(frame.plan_id)
        failure = self._load_failures.get(frame.plan_id)
        if plan is None and failure is not None:
            self._refuse(
                origin,
                frame,
                _FAILURE.FAILURE_INTERNAL,
                f"node {self.node_id} cannot serve plan {frame.plan_id}: {failure}",
            )
            return None
        if plan is None or not plan.ready.done():
            self._refuse(
                origin,
                frame,
                _FAILURE.FAILURE_NOT_LOADED,
                f"plan {frame.plan_id} is committed on node {self.node_id} but not installed "
                "there yet; retry once it is loaded",
            )
            return None
        if plan.index is None:
            self._refuse(
                origin,
                frame,
                _FAILURE.FAILURE_BAD_REQUEST,
                f"node {self.node_id} holds no stage of plan {frame.plan_id}",
            )
            return None
        return plan

    def _refuse(self, origin: str, frame: dp.Frame, kind: int, message: str) -> None:
        """End the request here and tell its origin why."""
        self._remember_ended(frame.plan_id, frame.request_id)
        plan = self._plans.get(frame.plan_id)
        request = plan.requests.get(frame.request_id) if plan else None
        if plan is not None and request is not None:
            self._drop_stage_request(plan, request, notify_origin=None)
        failure = dp.Failure(kind=kind, node_id=self.node_id, message=message)
        reply = dp.Frame(plan_id=frame.plan_id, request_id=frame.request_id, failure=failure)
        self._send_to_origin(plan, origin, reply)

    def _open_stage_request(
        self, plan: _InstalledPlan, origin: str, frame: dp.Frame
    ) -> _StageRequest | None:
        start = frame.start if frame.HasField("start") else frame.activation.start
        key = (plan.plan_id, frame.request_id)
        if key in self._ended:
            return None
        if frame.request_id in plan.requests:
            self._refuse(
                origin,
                frame,
                _FAILURE.FAILURE_BAD_REQUEST,
                f"request {frame.request_id} is already open",
            )
            return None
        try:
            request = _new_stage_request(plan, frame.request_id, origin, start)
        except ValueError as error:
            self._refuse(
                origin, frame, _FAILURE.FAILURE_BAD_REQUEST, f"bad sampling parameters: {error}"
            )
            return None
        plan.requests[frame.request_id] = request
        return request

    def _drop_stage_request(
        self,
        plan: _InstalledPlan,
        request: _StageRequest,
        *,
        notify_origin: str | None,
        kind: int = _FAILURE.FAILURE_INTERNAL,
    ) -> None:
        """Forget a request on this stage, free its caches (on the compute thread, after any
        of its queued work), and optionally tell its origin why."""
        if request.ended:
            return
        request.ended = True
        plan.requests.pop(request.request_id, None)
        self._remember_ended(plan.plan_id, request.request_id)
        engine = plan.engine
        if engine is not None:
            with contextlib.suppress(RuntimeError):
                self._compute.submit(lambda: engine.release(request.request_id))
        if notify_origin is not None:
            failure = dp.Failure(kind=kind, node_id=self.node_id, message=notify_origin)
            frame = dp.Frame(plan_id=plan.plan_id, request_id=request.request_id, failure=failure)
            self._send_to_origin(plan, request.origin, frame)

    def _remember_ended(self, plan_id: str, request_id: str) -> None:
        self._ended[(plan_id, request_id)] = None
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)

    # ---------------------------------------------------------------- compute

    def _submit_step(
        self,
        plan: _InstalledPlan,
        request: _StageRequest,
        step: int,
        *,
        tokens: list[int] | None = None,
        activation: Any = None,
        wants_logits: bool,
        upstream_s: float = 0.0,
    ) -> None:
        """Queue one chunk of one request on the compute thread (safe from that thread too)."""
        engine = plan.engine
        assert engine is not None
        loop = self._loop
        assert loop is not None

        from meshd.inference.shard import TooManyRequests

        def job() -> None:
            if request.ended:
                return
            request.last_activity = time.monotonic()  # a long single-stage decode is not idle
            started = time.perf_counter()
            self._share_cores()
            try:
                inputs = (
                    mx.array([tokens])
                    if tokens is not None
                    else decode_hidden(activation.dtype, activation.shape, activation.data)
                )
                self._step(plan, engine, request, step, inputs, wants_logits, upstream_s, started)
            except TooManyRequests as error:
                loop.call_soon_threadsafe(
                    self._step_failed, plan, request, _FAILURE.FAILURE_OVERLOADED, str(error)
                )
            except Exception as error:
                message = f"stage {plan.index} on node {self.node_id} failed: {_describe(error)}"
                loop.call_soon_threadsafe(
                    self._step_failed, plan, request, _FAILURE.FAILURE_INTERNAL, message
                )

        try:
            self._compute.submit(job)
        except RuntimeError as error:
            self._step_failed(plan, request, _FAILURE.FAILURE_INTERNAL, str(error))

    def _step(
        self,
        plan: _InstalledPlan,
        engine: StageEngine,
        request: _StageRequest,
        step: int,
        inputs: mx.array,
        wants_logits: bool,
        upstream_s: float,
        started: float,
    ) -> None:
        """Compute thread: run the chunk; send hidden states on, or sample and send the token."""
        loop = self._loop
        assert loop is not None
        if plan.is_last and request.sampling is not None and step == 0:
            engine.open_sampler(
                request.request_id,
                request.sampling,
                request.prompt,
                request.eos_ids,
                return_logits=request.return_logits,
            )
        output = engine.run(request.request_id, inputs, wants_logits=wants_logits and plan.is_last)
        if not plan.is_last:
            frame = _activation_frame(
                plan, request, step, output, wants_logits, upstream_s, started
            )
            loop.call_soon_threadsafe(self._forward, plan, request, frame)
            return
        if not wants_logits:
            return  # a prompt chunk before the last one: the caches advanced, nothing to send
        sampled = engine.sample(request.request_id, output)
        compute_s = upstream_s + time.perf_counter() - started
        if sampled.finished:
            engine.release(request.request_id)
        elif plan.is_first:  # a single-stage plan: chain the next step without a round trip
            self._submit_step(plan, request, step + 1, tokens=[sampled.token_id], wants_logits=True)
        loop.call_soon_threadsafe(self._deliver_token, plan, request, sampled, compute_s)

    def _share_cores(self) -> None:
        """Compute thread: split the machine's cores among co-located stages when busy.

        Stages on one machine take turns while a single request runs, so each may use every
        core; with several requests in flight they compute at the same time, and each then
        uses its share of the cores instead of all of them competing for every core.
        """
        if self.colocated_stages <= 1:
            set_blas_threads(None)
            return
        in_flight = sum(len(plan.requests) for plan in list(self._plans.values()))
        if in_flight <= 1:
            set_blas_threads(None)
        else:
            set_blas_threads(default_blas_threads() // self.colocated_stages)

    def _forward(self, plan: _InstalledPlan, request: _StageRequest, frame: dp.Frame) -> None:
        if request.ended:
            return
        assert plan.index is not None
        nxt = plan.stage(plan.index + 1)
        if not self._send(nxt.node_id, nxt.address, frame):
            message = f"stage {nxt.node_id} at {nxt.address} unreachable"
            self._drop_stage_request(
                plan, request, notify_origin=message, kind=_FAILURE.FAILURE_UNREACHABLE
            )

    def _deliver_token(
        self, plan: _InstalledPlan, request: _StageRequest, sampled: SampledToken, compute_s: float
    ) -> None:
        """Loop thread: the token goes to the origin and, unless finished, to the first stage
        (one frame when both are the same node)."""
        if request.ended:
            return
        finish = (
            dp.FINISH_EOS if sampled.eos else dp.FINISH_LENGTH if sampled.length else dp.FINISH_NONE
        )
        token = dp.Token(
            token_id=sampled.token_id,
            index=sampled.index,
            finish=finish,
            compute_s=compute_s,
            logits=sampled.logits,
        )
        frame = dp.Frame(plan_id=plan.plan_id, request_id=request.request_id, token=token)
        first = plan.stage(0)
        self._send_to_origin(plan, request.origin, frame)
        if sampled.finished:
            request.ended = True
            plan.requests.pop(request.request_id, None)
            self._remember_ended(plan.plan_id, request.request_id)
            return
        if first.node_id in (request.origin, self.node_id):
            return  # the origin's frame is the first stage's too, or the stage chains itself
        if not self._send(first.node_id, first.address, frame):
            message = f"stage {first.node_id} at {first.address} unreachable"
            self._drop_stage_request(
                plan, request, notify_origin=message, kind=_FAILURE.FAILURE_UNREACHABLE
            )

    def _step_failed(
        self, plan: _InstalledPlan, request: _StageRequest, kind: int, message: str
    ) -> None:
        self._drop_stage_request(plan, request, notify_origin=message, kind=kind)

    async def _on_compute(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the compute thread (after the work queued before it) and await it."""
        loop = self._bind_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        def job() -> None:
            try:
                result = fn()
            except BaseException as error:
                loop.call_soon_threadsafe(settle, None, error)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        self._compute.submit(job)
        return await future

    # ---------------------------------------------------------------- housekeeping

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep_idle(), name="dataplane-sweeper")

    async def _sweep_idle(self) -> None:
        """Free requests whose origin vanished without a word (a last resort)."""
        interval = max(0.05, min(5.0, self.stage_idle_timeout_s / 4))
        while not self._closed:
            await asyncio.sleep(interval)
            deadline = time.monotonic() - self.stage_idle_timeout_s
            for plan in list(self._plans.values()):
                for request in list(plan.requests.values()):
                    if request.last_activity < deadline:
                        message = (
                            f"request idle for {self.stage_idle_timeout_s:g} s on node "
                            f"{self.node_id}"
                        )
                        self._drop_stage_request(plan, request, notify_origin=message)

    def stats(self) -> dp.StatsReply:
        """Open requests per plan, and this process's memory (current and peak RSS)."""
        reply = dp.StatsReply(
            node_id=self.node_id,
            rss_bytes=psutil.Process().memory_info().rss,
            peak_rss_bytes=_peak_rss_bytes(),
            frames_received=self.frames_received,
            frames_sent=self.frames_sent,
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
                    open_requests=plan.engine.open_requests if plan.engine else 0,
                    origin_requests=sum(
                        1 for o in self._origins.values() if o.plan_id == plan.plan_id
                    ),
                )
            )
        return reply

    async def close(self) -> None:
        """Abort every request, close every stream and stop the compute thread (if ours)."""
        if self._closed:
            return
        for plan_id in list(self._plans):
            await self.uninstall(plan_id, f"node {self.node_id} is shutting down")
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for link in list(self._outbound.values()):
            await link.close()
        self._outbound.clear()
        for inbound in self._inbound.values():
            inbound.closed = True
        if self._owns_compute:
            await asyncio.to_thread(self._compute.close)


# --- Helpers ----------------------------------------------------------------------------------


def _new_stage_request(
    plan: _InstalledPlan, request_id: str, origin: str, start: dp.Start
) -> _StageRequest:
    """The stage's record of a request; the last stage also builds its sampling params."""
    sampling = None
    if plan.is_last:
        s = start.sampling
        sampling = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            seed=s.seed,
            max_tokens=s.max_tokens,
        )
    forward = dp.Start()
    forward.CopyFrom(start)
    if start.sampling.repetition_penalty == 1.0:
        del forward.prompt_tokens[:]  # only the last stage's repetition penalty reads them
    return _StageRequest(
        request_id=request_id,
        origin=origin,
        forward_start=forward,
        sampling=sampling,
        prompt=list(start.prompt_tokens) if plan.is_last else [],
        eos_ids=frozenset(start.eos_token_ids),
        return_logits=start.return_logits,
        last_activity=time.monotonic(),
    )


def _activation_frame(
    plan: _InstalledPlan,
    request: _StageRequest,
    step: int,
    output: mx.array,
    wants_logits: bool,
    upstream_s: float,
    started: float,
) -> dp.Frame:
    """Compute thread: the Activation carrying ``output`` to the next stage."""
    dtype, shape, data = encode_hidden(output)
    activation = dp.Activation(
        step=step,
        wants_logits=wants_logits,
        dtype=dtype,
        shape=shape,
        data=data,
        compute_s=upstream_s + time.perf_counter() - started,
    )
    if step == 0:
        activation.start.CopyFrom(request.forward_start)
    return dp.Frame(plan_id=plan.plan_id, request_id=request.request_id, activation=activation)


def _unreachable(plan: _InstalledPlan | None, peer: str, reason: str) -> str:
    """ "stage n3 at 10.0.0.3:7000 unreachable: <reason>" (the address when the plan has it)."""
    index = plan.assignment.stage_index(peer) if plan is not None else None
    where = f" at {plan.stage(index).address}" if plan is not None and index is not None else ""
    return f"stage {peer}{where} unreachable: {reason}"


def _unserved(error: str, prompt_tokens: int, seed: int) -> FinalEvent:
    usage = Usage(prompt_tokens, 0, 0.0, 0.0, 0.0, 0.0, seed)
    return FinalEvent("error", usage, "", error)


def _load_tokenizer(model_dir: Path) -> tuple[Any, dict[str, Any]]:
    """mlx-lm's tokenizer wrapper (with the config's EOS ids, as mlx_lm.load does) + config."""
    from mlx_lm.utils import load_config, load_tokenizer

    config = load_config(model_dir)
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    return tokenizer, config


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


# --- Servers and channels (tests, benchmarks, the runner) -------------------------------------


def mtls_channel_factory(credentials: security.NodeCredentials) -> ChannelFactory:
    """Channels to peers over mutual TLS under the mesh CA, with data-plane message limits."""
    channel_credentials = security.channel_credentials(credentials)

    def factory(address: str) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(address, channel_credentials, options=CHANNEL_OPTIONS)

    return factory


async def start_server(
    plane: DataPlane, credentials: security.NodeCredentials, address: str = "127.0.0.1:0"
) -> tuple[grpc.aio.Server, int]:
    """A mutual-TLS grpc.aio server with only the data plane on it; returns it and its port."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    dp_grpc.add_DataPlaneServicer_to_server(plane.servicer(), server)
    port = server.add_secure_port(address, security.server_credentials(credentials))
    if port == 0:
        raise OSError(f"cannot listen on {address}: is the port taken?")
    await server.start()
    return server, port
