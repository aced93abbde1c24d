"""The node's compute thread: every MLX evaluation of the daemon runs on it, one at a time.

Why one dedicated thread: MLX work must never run on the trio thread (the daemon's core) nor
on the asyncio thread that moves gRPC frames, or heartbeats and every other request would
stall behind a matrix multiplication. One thread, not a pool, because a node has one model's
worth of cores to give: two MLX evaluations at once only compete for them. Jobs run in
submission order, so work submitted for one request runs in the order it was submitted.

It is a ``concurrent.futures.ThreadPoolExecutor`` with one worker: an idle worker blocks in a
futex (it never spins, which matters when several stage processes share a small machine),
and results come back to the asyncio loop as futures (``loop.run_in_executor``), so whoever
submits a job owns its result and its errors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("meshd.compute")

T = TypeVar("T")

CLOSE_TIMEOUT_S = 10.0


class ComputeExecutor:
    """One worker thread for MLX; use it from one asyncio loop."""

    def __init__(self, name: str = "meshd-compute") -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue ``fn(*args)``; its result (or exception) arrives as an asyncio future on the
        running loop. RuntimeError once the executor is closed."""
        if self._closed:
            raise RuntimeError("the compute thread is closed: this node is shutting down")
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` after the jobs queued before it and return its result."""
        return await self.submit(fn, *args)

    def submit_then(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...],
        then: Callable[[concurrent.futures.Future[T]], None],
    ) -> None:
        """Queue ``fn(*args)``; once it ran, ``then(its future)`` runs on the calling loop.

        The hot path of the data plane: one hand-over back to the loop per job, and no
        asyncio future in between. RuntimeError once the executor is closed.
        """
        if self._closed:
            raise RuntimeError("the compute thread is closed: this node is shutting down")
        self._pool.submit(_run_then, asyncio.get_running_loop(), fn, args, then)

    def submit_detached(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue a job nobody awaits (freeing a request's caches): its error is logged, it is
        never lost silently. Does nothing once the executor is closed."""
        if self._closed:
            return
        self.submit(fn, *args).add_done_callback(_log_failure)

    async def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Let the running job finish, drop queued ones, stop the thread (bounded wait)."""
        if self._closed:
            return
        self._closed = True
        shutdown = asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)
        try:
            await asyncio.wait_for(shutdown, timeout_s)
        except TimeoutError:
            log.warning("the compute thread did not finish its job within %g s", timeout_s)


def _run_then(
    loop: asyncio.AbstractEventLoop,
    fn: Callable[..., T],
    args: tuple[Any, ...],
    then: Callable[[concurrent.futures.Future[T]], None],
) -> None:
    """Compute thread: run ``fn`` and hand its outcome, as a done future, to ``then`` on
    ``loop`` (a loop already closed means the node is gone: nobody is left to tell)."""
    outcome: concurrent.futures.Future[T] = concurrent.futures.Future()
    try:
        outcome.set_result(fn(*args))
    except BaseException as error:
        outcome.set_exception(error)
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(then, outcome)


def _log_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("a compute job failed", exc_info=future.exception())
