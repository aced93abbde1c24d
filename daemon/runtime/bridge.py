"""Run grpc.aio on one dedicated asyncio thread and use it from trio: every crossing owned.

grpcio has no trio support. Measured on this machine, the cleanest bridge is a single asyncio
event loop on its own thread that owns every grpc.aio server and channel, with trio awaiting
coroutines submitted to it (trio-asyncio breaks grpc.aio streaming handlers). Why trio stays
the core, and the rules every crossing follows, are in docs/architecture.md. This module is
the only place that crosses, and each way of crossing has an owner that receives the result,
the error and the cancellation:

* trio -> asyncio, `await bridge.run(coro_fn, *args)`: the trio caller owns the asyncio task.
  Cancelling the caller cancels the task (which cancels the RPC it was awaiting), and the
  caller waits, shielded and bounded, until the task has really finished.
* asyncio -> trio, `await bridge.run_in_trio(afn, *args)` (or `call_in_trio` for a plain
  function): the asyncio caller owns a trio *system* task (system tasks survive the servers'
  grace period while the trio side is being cancelled). Its result or exception is returned
  to the caller; cancelling the caller (a client that goes away, a keepalive timeout)
  cancels the trio task, and the caller waits, bounded, until it has ended. When the bridge
  closes, trio tasks whose callers are gone are cancelled before the loop stops.
* asyncio -> trio, `bridge.call_soon_in_trio(fn, *args)`: fire and forget for functions that
  only hand data over (set an event, `send_nowait`). The bridge owns these calls: an
  exception is a bug and is logged with its traceback, never turned into a TrioInternalError.
* trio waits for a `concurrent.futures.Future` of another thread (zeroconf's loop, the
  asyncio loop) with `wait_future`: cancelling the wait cancels the future.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import trio

from meshd.runtime.thread_names import name_this_thread

log = logging.getLogger(__name__)

T = TypeVar("T")

CANCEL_GRACE_S = 5.0


class BridgeClosedError(RuntimeError):
    """The trio side has finished (the daemon is stopping): nothing more can cross."""


async def wait_future(future: concurrent.futures.Future[T]) -> T:
    """trio side: the result of a future completed on another thread, without blocking.

    Cancelling the wait cancels the future (a coroutine submitted with
    `run_coroutine_threadsafe` is then cancelled on its loop).
    """
    token = trio.lowlevel.current_trio_token()
    finished = trio.Event()

    def wake(_: concurrent.futures.Future[T]) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(finished.set)

    future.add_done_callback(wake)
    try:
        await finished.wait()
    finally:
        if not future.done():
            future.cancel()
    return future.result()


class AsyncioThread:
    """An asyncio event loop on a daemon thread, bound to one trio run."""

    def __init__(self, name: str = "meshd-grpc") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        # Cancel scopes of the trio tasks that asyncio callers await (touched on trio only).
        self._trio_calls: set[trio.CancelScope] = set()
        self._trio_calls_idle = trio.Event()
        self._trio_calls_idle.set()
        # Crossings since start, by direction and the function that crossed: what a request
        # or a plan change costs in crossings is counted from these (docs/architecture.md).
        self._crossings: Counter[str] = Counter()
        self._crossings_lock = threading.Lock()  # counted from both threads

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("AsyncioThread is not started: use `async with AsyncioThread()`")
        return self._loop

    def crossings(self) -> dict[str, int]:
        """Crossings since start: "to asyncio <function>" / "to trio <function>" -> count."""
        with self._crossings_lock:
            return dict(self._crossings)

    def _count(self, direction: str, fn: Callable[..., object]) -> None:
        with self._crossings_lock:
            self._crossings[f"{direction} {_qualname(fn)}"] += 1

    @property
    def trio_calls_in_flight(self) -> int:
        """How many trio tasks asyncio callers are awaiting now (read on the trio thread)."""
        return len(self._trio_calls)

    async def __aenter__(self) -> AsyncioThread:
        self._trio_token = trio.lowlevel.current_trio_token()
        ready = threading.Event()

        def serve() -> None:
            name_this_thread(self._name)
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=serve, name=self._name, daemon=True)
        self._thread.start()
        await trio.to_thread.run_sync(ready.wait)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return
        with trio.CancelScope(shield=True):
            await self._cancel_remaining_tasks()
            await self._cancel_orphaned_trio_calls()
            loop.call_soon_threadsafe(loop.stop)
            await trio.to_thread.run_sync(self._thread.join, CANCEL_GRACE_S)
        self._loop = None

    async def _cancel_remaining_tasks(self) -> None:
        """Cancel every asyncio task; their `run_in_trio` waits cancel their trio tasks."""

        async def cancel_all() -> None:
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=CANCEL_GRACE_S)

        with trio.move_on_after(CANCEL_GRACE_S + 1):
            await wait_future(asyncio.run_coroutine_threadsafe(cancel_all(), self.loop))

    async def _cancel_orphaned_trio_calls(self) -> None:
        """Trio tasks still running although every asyncio caller is gone: a leak, cancelled."""
        if not self._trio_calls:
            return
        log.warning(
            "%d trio task(s) started from the asyncio thread were still running at shutdown "
            "after their callers had gone; cancelling them",
            len(self._trio_calls),
        )
        for scope in list(self._trio_calls):
            scope.cancel()
        with trio.move_on_after(CANCEL_GRACE_S):
            await self._trio_calls_idle.wait()

    # ------------------------------------------------------------ trio -> asyncio

    async def run(self, coro_fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Run `coro_fn(*args)` on the asyncio thread and return its result.

        Cancellation of the trio caller cancels the asyncio task; the caller then waits
        (shielded, bounded) until that task has really finished.
        """
        loop = self.loop
        token = self._token()
        self._count("to asyncio", coro_fn)
        finished = trio.Event()
        outcome: dict[str, Any] = {}
        tasks: list[asyncio.Task[None]] = []

        async def wrapper() -> None:
            try:
                outcome["value"] = await coro_fn(*args)
            except asyncio.CancelledError:
                outcome["error"] = RuntimeError("the asyncio side was cancelled")
            except BaseException as exc:
                outcome["error"] = exc
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(finished.set)

        loop.call_soon_threadsafe(lambda: tasks.append(loop.create_task(wrapper())))
        try:
            await finished.wait()
        except BaseException:
            # Runs after the task was created: call_soon_threadsafe keeps FIFO order.
            loop.call_soon_threadsafe(lambda: tasks[0].cancel())
            with trio.CancelScope(shield=True), trio.move_on_after(CANCEL_GRACE_S):
                await finished.wait()
            raise
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """From the trio thread: run ``fn(*args)`` on the asyncio thread (fire and forget).

        For functions that cannot fail by design (set an asyncio event); a failure is a bug,
        logged with its traceback there. After the loop has closed the call is dropped.
        """

        self._count("to asyncio", fn)
        try:
            self.loop.call_soon_threadsafe(_logged_call, fn, args, "trio to the asyncio thread")
        except RuntimeError:  # not started, or closed: nobody is left to wake
            log.debug("the asyncio loop is not running; dropped a call to %r", fn)

    # ------------------------------------------------------------ asyncio -> trio

    def call_soon_in_trio(self, fn: Callable[..., object], *args: Any) -> None:
        """From the asyncio thread: hand data to the trio thread (fire and forget).

        For functions that cannot fail by design (set an event, `send_nowait`); a failure is
        a bug, logged with its traceback here instead of crashing the trio run.
        """

        self._count("to trio", fn)
        try:
            self._token().run_sync_soon(_logged_call, fn, args, "the asyncio thread to trio")
        except trio.RunFinishedError:
            log.debug("trio run finished; dropped a call to %r", fn)

    async def call_in_trio(self, fn: Callable[..., T], *args: Any) -> T:
        """From the asyncio thread: run plain `fn(*args)` on the trio thread, return its result."""

        async def call() -> T:
            return fn(*args)

        self._count("to trio", fn)
        return await self._run_in_trio(call)

    async def run_in_trio(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """From the asyncio thread: run `afn(*args)` as a trio system task and await it.

        The task's exception is raised here. Cancelling this await cancels the trio task and
        waits (bounded) until it has ended, so no trio task outlives its asyncio caller.
        """
        self._count("to trio", afn)
        return await self._run_in_trio(afn, *args)

    async def _run_in_trio(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[T] = loop.create_future()
        scope = trio.CancelScope()

        def settle(value: Any, error: BaseException | None) -> None:  # asyncio thread
            if ended.done():
                return
            if error is not None:
                ended.set_exception(error)
            else:
                ended.set_result(value)

        def report(value: Any, error: BaseException | None) -> None:  # trio thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: no caller is left
                loop.call_soon_threadsafe(settle, value, error)

        async def runner() -> None:
            value: Any = None
            error: BaseException | None = None
            try:
                with scope:
                    value = await afn(*args)
                if scope.cancelled_caught:
                    error = asyncio.CancelledError("the trio side was cancelled")
            except Exception as exc:  # returned to the caller, which owns it
                error = exc
            except BaseException:  # trio is shutting down: tell the caller, then go
                report(None, asyncio.CancelledError("trio is shutting down"))
                raise
            finally:
                self._forget_trio_call(scope)
            report(value, error)

        def start() -> None:  # trio thread
            try:
                trio.lowlevel.spawn_system_task(runner, name=_name_of(afn))
            except RuntimeError as exc:  # "Nursery is closed to new arrivals": trio is ending
                report(None, BridgeClosedError(f"trio is shutting down: {exc}"))
                return
            self._trio_calls.add(scope)
            self._trio_calls_idle = trio.Event()

        try:
            self._token().run_sync_soon(start)
        except trio.RunFinishedError as exc:
            raise BridgeClosedError("the daemon is shutting down") from exc
        try:
            return await asyncio.shield(ended)
        except asyncio.CancelledError:
            with contextlib.suppress(trio.RunFinishedError):
                self._token().run_sync_soon(scope.cancel)
            await asyncio.wait({ended}, timeout=CANCEL_GRACE_S)
            if ended.done() and not ended.cancelled():
                ended.exception()  # retrieved: the caller is gone, and nobody else will read it
            raise

    def _forget_trio_call(self, scope: trio.CancelScope) -> None:
        self._trio_calls.discard(scope)
        if not self._trio_calls:
            self._trio_calls_idle.set()

    def _token(self) -> trio.lowlevel.TrioToken:
        if self._trio_token is None:
            raise RuntimeError("AsyncioThread is not started: use `async with AsyncioThread()`")
        return self._trio_token


def _logged_call(fn: Callable[..., object], args: tuple[Any, ...], crossing: str) -> None:
    """Run a fire-and-forget call handed across; its failure is a bug, logged with its
    traceback on the receiving thread, which goes on."""
    try:
        fn(*args)
    except Exception:
        log.exception("a call handed from %s failed: %r", crossing, fn)


def _qualname(fn: Callable[..., object]) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", type(fn).__qualname__)


def _name_of(fn: Callable[..., object]) -> str:
    return f"from asyncio: {getattr(fn, '__qualname__', repr(fn))}"
