"""Run grpc.aio on one dedicated asyncio thread and use it from trio.

grpcio has no trio support. Measured on this machine, the cleanest bridge is a
single asyncio event loop on its own thread that owns every grpc.aio server and
channel, with trio awaiting coroutines submitted to it (trio-asyncio breaks
grpc.aio streaming handlers). The rules this module enforces:

* trio -> asyncio: `await bridge.run(coro_fn, *args)` submits the coroutine with
  `run_coroutine_threadsafe` and waits for it without blocking the trio thread.
  When the trio caller is cancelled, the asyncio task is cancelled too (which
  cancels the RPC it was awaiting) and the caller waits, shielded and bounded,
  for it to finish, so nothing outlives its trio owner.
* asyncio -> trio: handlers call `bridge.call_soon_in_trio(fn, *args)` (fire and
  forget, e.g. `send_nowait` on a trio channel) or `await bridge.run_in_trio(afn)`
  which runs `afn` as a trio *system* task, so it survives the server's grace
  period when the trio side is being cancelled on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import trio

log = logging.getLogger(__name__)

T = TypeVar("T")

CANCEL_GRACE_S = 5.0


class AsyncioThread:
    """An asyncio event loop on a daemon thread, bound to one trio run."""

    def __init__(self, name: str = "meshd-grpc") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("AsyncioThread is not started: use `async with AsyncioThread()`")
        return self._loop

    async def __aenter__(self) -> AsyncioThread:
        self._trio_token = trio.lowlevel.current_trio_token()
        ready = threading.Event()

        def serve() -> None:
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
            loop.call_soon_threadsafe(loop.stop)
            await trio.to_thread.run_sync(self._thread.join, CANCEL_GRACE_S)
        self._loop = None

    async def _cancel_remaining_tasks(self) -> None:
        async def cancel_all() -> None:
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=CANCEL_GRACE_S)

        fut = asyncio.run_coroutine_threadsafe(cancel_all(), self.loop)
        with trio.move_on_after(CANCEL_GRACE_S + 1):
            await self._wait_future(fut)

    async def _wait_future(self, fut: concurrent.futures.Future[Any]) -> None:
        """Sleep in trio until a concurrent future is done (no thread blocked)."""
        done = trio.Event()
        token = self._trio_token
        assert token is not None

        def wake(_: concurrent.futures.Future[Any]) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        fut.add_done_callback(wake)
        await done.wait()

    async def run(self, coro_fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Run `coro_fn(*args)` on the asyncio thread and return its result.

        Cancellation of the trio caller cancels the asyncio task; the caller
        then waits (shielded, bounded) until that task has really finished.
        """
        loop = self.loop
        token = self._trio_token
        assert token is not None
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

    def call_soon_in_trio(self, fn: Callable[..., object], *args: Any) -> None:
        """From the asyncio thread: schedule a plain function on the trio thread."""
        assert self._trio_token is not None
        try:
            self._trio_token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            log.debug("trio run finished; dropped a call to %r", fn)

    async def run_in_trio(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """From the asyncio thread: run `afn` as a trio system task and await it."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future[T] = loop.create_future()

        def settle(outcome: Any) -> None:
            if result.done():
                return
            if isinstance(outcome, BaseException):
                result.set_exception(outcome)
            else:
                result.set_result(outcome)

        async def runner() -> None:
            try:
                value: Any = await afn(*args)
            except Exception as exc:  # delivered to the asyncio side, not lost
                value = exc
            except BaseException:
                loop.call_soon_threadsafe(settle, asyncio.CancelledError("trio is shutting down"))
                raise
            loop.call_soon_threadsafe(settle, value)

        self.call_soon_in_trio(trio.lowlevel.spawn_system_task, runner)
        return await result
