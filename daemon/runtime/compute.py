"""The node's compute thread: every MLX evaluation of the daemon runs on it, one at a time.

Why one dedicated thread: MLX work must never run on the trio thread (the daemon's core) nor
on the asyncio thread that moves gRPC frames, or heartbeats and every other request would
stall behind a matrix multiplication. One thread, not a pool, because a node has one model's
worth of cores to give: two MLX evaluations at once only compete for them. Jobs run in
submission order, so work submitted for one request runs in the order it was submitted.

Why not ``concurrent.futures.ThreadPoolExecutor`` (an earlier design used one): every job
of the data plane's hot path crosses here twice per hop, and the pool's bookkeeping is paid
on a core whose caches the last forward pass has just flushed. Traced inside two pinned
daemons (time marks around each step of a hop), the pool's ``submit`` took ~0.06 ms and the
result's way back (a ``Future``, its condition variable, then the loop) ~0.13 ms a hop. Here a
job is one tuple put on a ``queue.SimpleQueue`` (C, one futex wake) and its outcome one
:class:`Outcome` handed to the loop with ``call_soon_threadsafe``. The idle worker still
blocks in a futex and never spins, which matters when several stage processes share a small
machine; results still come back to the loop that submitted, so whoever submits a job owns
its result and its errors.

Who goes first: a job the worker has just been woken for needs the GIL to build its graph
before ``mx.eval`` releases it, and the loop that queued it usually has Python of its own to
run at that moment (an origin's client stream: detokenize, build the event, write it, ~0.4 ms
here). Left alone, the loop runs first and the step waits behind it: 0.34-0.5 ms of every
token's hop when the origin is also the first stage (traced). Work that can wait
awaits :meth:`ComputeExecutor.let_start` first: the loop idles until the job has built its
graph and handed it to MLX (the job calls :func:`computing`, between ``mx.async_eval`` and
the ``mx.eval`` that waits for it without the GIL), or has ended. Not at the job's start:
waking the loop writes to its socket, which lets go of the GIL, and the loop could take it
then, before the graph is built. A loop callback that cannot await (the origin's token
callback, which has just queued the next step and woken the client's stream) calls
:meth:`ComputeExecutor.hand_over`, the same wait with the loop thread blocked, so the step
starts before the loop's own next Python rather than after it.

Crossings (the only state two threads touch): the queue, which is thread-safe; a job's
``cancelled`` flag, which the loop sets (a cancelled awaiter) and the worker reads before it
runs the job; the worker's ``_busy`` flag, which only it writes; ``_starting``, the
waiters of :meth:`ComputeExecutor.let_start`, which the loop adds to and the worker takes
whole once its job computes (or ends); and ``_handing_over``, the ``threading.Event`` of
:meth:`ComputeExecutor.hand_over`, which the loop puts there and takes away and the worker
sets. All are plain attributes under the GIL; a waiter the worker missed gives up after
``LET_START_TIMEOUT_S``, and one told late finds its future done (or its event unwatched).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from meshd.runtime.device import follow_in_thread
from meshd.runtime.thread_names import name_this_thread

log = logging.getLogger("meshd.compute")

T = TypeVar("T")

CLOSE_TIMEOUT_S = 10.0
LET_START_TIMEOUT_S = 0.002  # a woken worker takes its job in ~0.05 ms; never wait longer


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """How a job ended: its value, or the exception it raised, or ``cancelled`` (the thread
    stopped before it ran)."""

    value: T | None = None
    error: BaseException | None = None
    cancelled: bool = False

    def result(self) -> T:
        """The value; the job's own exception re-raised; CancelledError when it never ran."""
        if self.cancelled:
            raise asyncio.CancelledError("the compute thread stopped before the job ran")
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


@dataclass(slots=True, eq=False)
class _Job:
    """One queued call and where its outcome goes: an awaiter's ``future`` or ``then``, both on
    ``loop``."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    loop: asyncio.AbstractEventLoop
    then: Callable[[Outcome[Any]], None] | None = None
    future: asyncio.Future[Any] | None = None
    cancelled: bool = False  # set on the loop by an awaiter that gave up; read by the worker


class ComputeExecutor:
    """One worker thread for MLX; use it from one asyncio loop."""

    def __init__(self, name: str = "meshd-compute") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started by the first job
        self._closed = False
        self._busy = False  # the worker runs a job (written by the worker only)
        self._starting: list[asyncio.Future[Any]] = []  # let_start's waiters
        self._handing_over: threading.Event | None = None  # hand_over's waiter

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue ``fn(*args)``; its result (or exception) arrives as an asyncio future on the
        running loop; cancelling that future before the job ran drops the job. RuntimeError
        once the executor is closed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        job = self._put(_Job(fn, args, loop, future=future))
        future.add_done_callback(lambda done: _drop_if_cancelled(done, job))
        return future

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` after the jobs queued before it and return its result."""
        return await self.submit(fn, *args)

    def submit_then(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        then: Callable[[Outcome[T]], None],
    ) -> None:
        """Queue ``fn(*args)``; once it ran, ``then(its Outcome)`` runs on the calling loop.

        The hot path of the data plane: one hand-over each way per job, no future in between.
        A job still queued when the executor closes is dropped (``then`` is not called: the
        node is going away). RuntimeError once the executor is closed.
        """
        self._put(_Job(fn, args, asyncio.get_running_loop(), then))

    def submit_detached(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue a job nobody awaits (freeing a request's caches): its error is logged, it is
        never lost silently. Does nothing once the executor is closed."""
        if self._closed:
            return
        self._put(_Job(fn, args, asyncio.get_running_loop(), _log_failure))

    async def let_start(self, timeout_s: float = LET_START_TIMEOUT_S) -> None:
        """Let a job that waits for an idle worker start before the caller goes on.

        Returns at once unless the worker is between jobs with one queued (it was just woken
        for it); then it waits, at most ``timeout_s``, until that job is computing (it called
        :func:`computing`) or over, so the caller resumes while the job computes, not before
        it. A worker busy with a job is never waited for: that could be a whole prefill
        chunk.
        """
        if not self._starting_soon():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._starting.append(waiter)
        try:
            if self._starting_soon():  # else the worker took it meanwhile
                async with asyncio.timeout(timeout_s):
                    await waiter
        except TimeoutError:
            pass  # it will start; the caller need not wait for it
        finally:
            with contextlib.suppress(ValueError):  # the worker took it off when it started
                self._starting.remove(waiter)

    def hand_over(self, timeout_s: float = LET_START_TIMEOUT_S) -> None:
        """:meth:`let_start` for a loop callback that cannot await: the loop thread itself
        waits (without the GIL, at most ``timeout_s``) until a job the worker was just woken
        for is computing. Returns at once otherwise.

        Why block a loop: the job needs the GIL to build its graph, so the loop's Python
        waits behind it either way once the worker has it; what this changes is only who
        goes first. Without it the loop runs on until it sleeps in ``epoll`` (its callback's
        return, the next iteration, the client stream it woke up to its ``let_start``), and
        the step waits that long: traced in 2 pinned daemons, a step the token
        queued at an origin that is also the first stage started 0.112-0.115 ms after its
        submission without this, 0.050-0.061 ms with it.
        """
        if not self._starting_soon():
            return
        event = threading.Event()
        self._handing_over = event
        try:
            if self._starting_soon():  # else the worker took it meanwhile
                event.wait(timeout_s)
        finally:
            self._handing_over = None

    def _starting_soon(self) -> bool:
        return not self._busy and not self._jobs.empty() and self._thread is not None

    async def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Let the running job finish, drop queued ones, stop the thread (bounded wait)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        if self._thread is None:
            return
        await asyncio.to_thread(self._thread.join, timeout_s)
        if self._thread.is_alive():
            log.warning("the compute thread did not finish its job within %g s", timeout_s)

    def _put(self, job: _Job) -> _Job:
        if self._closed:
            raise RuntimeError("the compute thread is closed: this node is shutting down")
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return job

    def _work(self) -> None:
        """The worker: run jobs in order until the close sentinel; after close, drop the rest
        (an awaiter's future is cancelled, a ``submit_then`` job is forgotten)."""
        _running_on.executor = self
        name_this_thread("meshd-compute")  # the OS's name, for top -H; MLX's threads inherit it
        follow_in_thread()  # the device the daemon chose (meshd.runtime.device)
        try:
            while (job := self._jobs.get()) is not None:
                self._busy = True
                outcome = self._run(job)
                self._tell_computing()  # a job that never said so
                # Idle before the hand-back: its socket write releases the GIL, and the loop
                # it wakes may queue the next job and ask let_start about it at once.
                self._busy = False
                if outcome is not None:
                    _hand_back(job, outcome)
        finally:
            _release_mlx_streams()

    def _run(self, job: _Job) -> Outcome[Any] | None:
        """The job's outcome; None for a job nobody waits for any more."""
        if job.cancelled:
            return None
        if self._closed:
            return Outcome(cancelled=True) if job.future is not None else None
        try:
            return Outcome(value=job.fn(*job.args))
        except BaseException as error:  # the owner gets it, the worker goes on
            return Outcome(error=error)

    def _tell_computing(self) -> None:
        """Worker: wake :meth:`let_start`'s waiters, if any, on their loop, and the loop
        thread in :meth:`hand_over`."""
        handing_over = self._handing_over
        if handing_over is not None:
            handing_over.set()
        if not self._starting:
            return
        waiters, self._starting = self._starting, []
        for waiter in waiters:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                waiter.get_loop().call_soon_threadsafe(_settle, waiter, Outcome())


_running_on = threading.local()  # .executor: the executor whose worker this thread is


def computing() -> None:
    """Inside a job, once its work is handed to MLX (after ``mx.async_eval``, before the
    ``mx.eval`` that waits for it): whoever waits in :meth:`ComputeExecutor.let_start` may
    run now, while this thread waits for MLX without the GIL. Nothing, off a worker."""
    executor: ComputeExecutor | None = getattr(_running_on, "executor", None)
    if executor is not None:
        executor._tell_computing()


def _hand_back(job: _Job, outcome: Outcome[Any]) -> None:
    """Compute thread: the outcome to the job's future or ``then``, on its loop (a closed loop
    means the node is gone: nobody is left to tell)."""
    with contextlib.suppress(RuntimeError):
        if job.future is not None:
            job.loop.call_soon_threadsafe(_settle, job.future, outcome)
        elif job.then is not None:
            job.loop.call_soon_threadsafe(job.then, outcome)


def _settle(future: asyncio.Future[T], outcome: Outcome[T]) -> None:
    """Loop: an awaited job's outcome into its future (unless its awaiter gave up)."""
    if future.done():
        return
    if outcome.cancelled:
        future.cancel()
    elif outcome.error is not None:
        future.set_exception(outcome.error)
    else:
        future.set_result(outcome.value)  # type: ignore[arg-type]


def _drop_if_cancelled(future: asyncio.Future[Any], job: _Job) -> None:
    if future.cancelled():
        job.cancelled = True


def _log_failure(outcome: Outcome[Any]) -> None:
    if outcome.error is not None:
        log.error("a compute job failed", exc_info=outcome.error)


def _release_mlx_streams() -> None:
    """A thread that used MLX destroys its streams itself before it ends, as MLX asks: left
    to the thread's exit, their destructors may run while the interpreter finalizes and abort
    the process."""
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        with contextlib.suppress(Exception):
            mx.clear_streams()
