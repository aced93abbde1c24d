"""The compute side of the data plane: one thread per node runs every MLX computation.

Why a single dedicated thread: MLX work must never run on the trio thread (the daemon's core)
nor on the asyncio thread that moves gRPC frames, or every other request and the heartbeats
would stall behind a matrix multiplication. One thread per node (not a pool) because a node
has one model's worth of cores to give: two MLX evaluations at once only compete for them, and
a FIFO queue gives the order the pipeline needs for free: work for one request reaches a stage
in order over one stream, is queued in that order, and is computed in that order, while work
for other requests interleaves between its steps. A waiting worker blocks in
``SimpleQueue.get`` (a futex), it never spins, which matters when several stage processes
share a small machine.

What runs here: :class:`StageEngine` (this node's layers of one plan, the KV caches of its open
requests, and, on the last stage, each request's seeded sampler) and the activation codec
(:func:`encode_hidden`/:func:`decode_hidden`: raw little-endian bytes plus dtype and shape; no
pickle ever crosses the wire).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from meshd.inference.sampling import SamplingParams, TokenSampler

if TYPE_CHECKING:  # meshd.inference.shard imports mlx_lm (and transformers): loaded on first use
    from meshd.inference.shard import RequestCaches, StageModel

log = logging.getLogger("meshd.compute")

COMPUTE_CLOSE_TIMEOUT_S = 10.0

# dtype name on the wire -> (MLX dtype, numpy dtype used for the bytes). bfloat16 has no numpy
# dtype: its bytes travel as uint16 and are reinterpreted on arrival.
_WIRE_DTYPES: dict[str, tuple[mx.Dtype, type[np.generic]]] = {
    "float32": (mx.float32, np.float32),
    "float16": (mx.float16, np.float16),
    "bfloat16": (mx.bfloat16, np.uint16),
}
_WIRE_NAMES: dict[mx.Dtype, str] = {mx_dtype: name for name, (mx_dtype, _) in _WIRE_DTYPES.items()}


class ComputeWorker:
    """One thread that runs submitted jobs one at a time, in submission order.

    Jobs are plain callables; an exception a job lets escape is logged, never lost silently,
    and does not stop the worker. ``submit`` is safe from any thread (including the worker
    itself, which is how a single-stage pipeline chains its decode steps without a detour).
    """

    def __init__(self, name: str = "meshd-compute") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; raises RuntimeError once the worker is closed."""
        if self._closed:
            raise RuntimeError("the compute worker is closed; the data plane is shutting down")
        self._jobs.put(job)

    def run(self, job: Callable[[], object]) -> threading.Event:
        """Queue ``job`` and return an event set once it (and everything before it) ran."""
        done = threading.Event()

        def wrapped() -> None:
            try:
                job()
            finally:
                done.set()

        self.submit(wrapped)
        return done

    @property
    def is_worker_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self, timeout_s: float = COMPUTE_CLOSE_TIMEOUT_S) -> None:
        """Finish queued jobs, then stop the thread (waits at most ``timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        if not self.is_worker_thread:
            self._thread.join(timeout_s)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except BaseException:  # a job's bug must not kill every later request
                log.exception("a compute job failed")


# --- Activations on the wire ------------------------------------------------------------


def encode_hidden(hidden: mx.array) -> tuple[str, tuple[int, ...], bytes]:
    """``(dtype name, shape, raw bytes)`` of an evaluated array, for an Activation frame."""
    name = _WIRE_NAMES.get(hidden.dtype)
    if name is None:
        raise ValueError(
            f"hidden states of dtype {hidden.dtype} cannot be sent; supported: "
            f"{', '.join(_WIRE_DTYPES)}"
        )
    raw = hidden.view(mx.uint16) if hidden.dtype == mx.bfloat16 else hidden
    return name, tuple(hidden.shape), bytes(memoryview(raw))


def decode_hidden(dtype: str, shape: Sequence[int], data: bytes) -> mx.array:
    """The array :func:`encode_hidden` encoded; ValueError when the frame is inconsistent."""
    if dtype not in _WIRE_DTYPES:
        raise ValueError(
            f"unknown activation dtype {dtype!r}; expected one of {list(_WIRE_DTYPES)}"
        )
    mx_dtype, np_dtype = _WIRE_DTYPES[dtype]
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
    if len(shape) != 3 or len(data) != expected:
        raise ValueError(
            f"activation of shape {list(shape)} and dtype {dtype} needs {expected} bytes in 3 "
            f"dimensions, got {len(data)} bytes: sender and receiver disagree on the model"
        )
    array = mx.array(np.frombuffer(data, dtype=np_dtype).reshape(tuple(shape)))
    return array.view(mx_dtype) if dtype == "bfloat16" else array


# --- One stage of one plan ----------------------------------------------------------------


@dataclass(frozen=True)
class StageKey:
    """What identifies loaded weights: plans with equal keys on a node share one StageModel."""

    model_dir: Path
    layer_start: int
    layer_end: int
    has_embedding: bool
    has_head: bool


@dataclass(frozen=True)
class SampledToken:
    """What the last stage decided for one step of one request."""

    token_id: int
    index: int  # 0-based among the request's generated tokens
    eos: bool
    length: bool  # the max_tokens-th token
    logits: bytes  # float32 row, only when the request asked for it (debug), else b""

    @property
    def finished(self) -> bool:
        return self.eos or self.length


@dataclass
class _SamplerState:
    sampler: TokenSampler
    max_tokens: int
    eos_ids: frozenset[int]
    context: list[int] | None  # prompt + generated, kept only for the repetition penalty
    return_logits: bool
    generated: int = 0


@dataclass
class StageEngine:
    """This node's layers of one plan and the per-request state they need.

    Every method except the constructor and the read-only counters runs on the compute
    thread; the asyncio side only submits jobs that call them.
    """

    key: StageKey
    max_requests: int
    stage: StageModel | None = None
    load_error: str | None = None
    _caches: RequestCaches | None = None
    _samplers: dict[str, _SamplerState] = field(default_factory=dict)

    def load(self, shared: StageModel | None = None) -> None:
        """Load the stage's weights (or adopt ``shared``, identical weights already loaded)."""
        from meshd.inference.shard import RequestCaches, load_stage  # mlx_lm: loaded on first use

        try:
            self.stage = shared or load_stage(
                self.key.model_dir,
                self.key.layer_start,
                self.key.layer_end,
                has_embedding=self.key.has_embedding,
                has_head=self.key.has_head,
            )
        except Exception as error:
            self.load_error = f"{type(error).__name__}: {error}"
            raise
        self._caches = RequestCaches(self.stage, self.max_requests)

    @property
    def loaded(self) -> bool:
        return self.stage is not None

    @property
    def open_requests(self) -> int:
        """Requests whose KV caches this stage holds (read from any thread)."""
        return 0 if self._caches is None else len(self._caches)

    @property
    def weight_bytes(self) -> int:
        return 0 if self.stage is None else self.stage.nbytes

    def require_stage(self) -> StageModel:
        if self.stage is None or self._caches is None:
            why = self.load_error or "it has not finished loading"
            raise RuntimeError(f"this node's stage is not loaded ({why})")
        return self.stage

    def open_sampler(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: Sequence[int],
        eos_ids: frozenset[int],
        *,
        return_logits: bool,
    ) -> None:
        """Set up the seeded sampler of a request (last stage only, before its first logits)."""
        if request_id in self._samplers:
            return
        keep_context = params.repetition_penalty != 1.0
        self._samplers[request_id] = _SamplerState(
            sampler=TokenSampler(params),
            max_tokens=params.max_tokens,
            eos_ids=eos_ids,
            context=list(prompt) if keep_context else None,
            return_logits=return_logits,
        )

    def run(self, request_id: str, inputs: mx.array, *, wants_logits: bool) -> mx.array:
        """One chunk of one request through this stage, evaluated: hidden states, or on the
        last stage the logits of the chunk's last position when ``wants_logits``."""
        stage = self.require_stage()
        assert self._caches is not None
        cache = self._caches.get(request_id)
        logits = "last" if wants_logits else "none"
        output = stage.run(inputs, cache, logits=logits)
        mx.eval(output)
        return output

    def sample(self, request_id: str, logits: mx.array) -> SampledToken:
        """The request's next token from the last position's logits ``(1, 1, vocab)``."""
        state = self._samplers.get(request_id)
        if state is None:
            raise RuntimeError(f"request {request_id} has no sampler on this stage")
        row = logits.reshape(1, -1)
        token = state.sampler.sample(row, state.context or [])
        index = state.generated
        state.generated += 1
        if state.context is not None:
            state.context.append(token)
        raw_logits = b""
        if state.return_logits:
            raw_logits = bytes(memoryview(row.astype(mx.float32).reshape(-1)))
        return SampledToken(
            token_id=token,
            index=index,
            eos=token in state.eos_ids,
            length=state.generated >= state.max_tokens,
            logits=raw_logits,
        )

    def release(self, request_id: str) -> None:
        """Drop the request's KV caches and sampler (no error if it has none)."""
        if self._caches is not None:
            self._caches.release(request_id)
        self._samplers.pop(request_id, None)

    def release_all(self) -> None:
        """Drop every request's state (the plan is being uninstalled)."""
        from meshd.inference.shard import RequestCaches

        if self.stage is not None:
            self._caches = RequestCaches(self.stage, self.max_requests)
        self._samplers.clear()

    def unload(self) -> None:
        """Forget the weights and caches (they are freed once no other plan shares them)."""
        self.release_all()
        self._caches = None
        self.stage = None
