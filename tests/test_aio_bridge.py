"""The asyncio-thread bridge: results, errors and cancellation cross in both directions."""

import asyncio
import gc
import threading

import pytest
import trio

from meshd.runtime.bridge import AsyncioThread

pytestmark = pytest.mark.unit


def test_result_and_error_cross_from_asyncio() -> None:
    async def main() -> None:
        async with AsyncioThread() as bridge:

            async def where() -> str:
                await asyncio.sleep(0.01)
                return threading.current_thread().name

            assert await bridge.run(where) == "meshd-grpc"

            async def boom() -> None:
                raise ValueError("from asyncio")

            with pytest.raises(ValueError, match="from asyncio"):
                await bridge.run(boom)

    trio.run(main)


def test_trio_cancellation_cancels_the_asyncio_task() -> None:
    cancelled = threading.Event()

    async def main() -> None:
        async with AsyncioThread() as bridge:

            async def forever() -> None:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    cancelled.set()
                    raise

            with trio.move_on_after(0.1):
                await bridge.run(forever)
            assert cancelled.is_set()

    trio.run(main)


def test_asyncio_side_can_run_trio_code() -> None:
    async def main() -> None:
        async with AsyncioThread() as bridge:
            trio_thread = threading.current_thread().name

            async def in_trio(x: int) -> tuple[int, str]:
                await trio.sleep(0.01)
                return x * 2, threading.current_thread().name

            async def handler() -> tuple[int, str]:
                return await bridge.run_in_trio(in_trio, 21)

            assert await bridge.run(handler) == (42, trio_thread)

            async def failing() -> None:
                raise KeyError("trio side")

            async def handler2() -> None:
                await bridge.run_in_trio(failing)

            with pytest.raises(KeyError):
                await bridge.run(handler2)

    trio.run(main)


def test_leftover_asyncio_tasks_are_cancelled_on_exit() -> None:
    cancelled = threading.Event()

    async def main() -> None:
        async with AsyncioThread() as bridge:

            async def spawn() -> None:
                async def orphan() -> None:
                    try:
                        await asyncio.sleep(3600)
                    except asyncio.CancelledError:
                        cancelled.set()
                        raise

                asyncio.get_running_loop().create_task(orphan())

            await bridge.run(spawn)
        assert cancelled.is_set()

    trio.run(main)


def test_cancelling_the_asyncio_caller_cancels_its_trio_task(caplog) -> None:
    """A client that goes away must not leave a trio task parked (WatchStatus did)."""
    ended = []

    async def main() -> None:
        async with AsyncioThread() as bridge:

            async def parked() -> None:
                try:
                    await trio.sleep_forever()
                finally:
                    ended.append(threading.current_thread().name)

            async def caller_goes_away() -> None:
                call = asyncio.ensure_future(bridge.run_in_trio(parked))
                await asyncio.sleep(0.05)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call

            await bridge.run(caller_goes_away)
            assert ended == [threading.current_thread().name]
            assert bridge.trio_calls_in_flight == 0

    trio.run(main)
    gc.collect()  # an outcome nobody read is reported when its future is collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_plain_calls_cross_with_their_result_and_error() -> None:
    async def main() -> None:
        async with AsyncioThread() as bridge:

            def refuse(text: str) -> None:
                raise ValueError(text)

            async def handler() -> str:
                with pytest.raises(ValueError, match="malformed"):
                    await bridge.call_in_trio(refuse, "malformed")
                return await bridge.call_in_trio(lambda: threading.current_thread().name)

            assert await bridge.run(handler) == threading.current_thread().name
            assert bridge.trio_calls_in_flight == 0

    trio.run(main)


def test_a_failing_handover_is_logged_and_trio_keeps_running(caplog) -> None:
    async def main() -> None:
        async with AsyncioThread() as bridge:
            delivered = trio.Event()

            def broken() -> None:
                raise KeyError("a bug")

            async def hand_over() -> None:
                bridge.call_soon_in_trio(broken)
                bridge.call_soon_in_trio(delivered.set)

            await bridge.run(hand_over)
            with trio.fail_after(5):
                await delivered.wait()

    trio.run(main)
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None


def test_trio_wakes_an_asyncio_waiter_and_a_failing_call_is_logged(caplog) -> None:
    """`call_soon` runs a plain function on the asyncio thread, in order; one that fails is
    logged there and the loop goes on; after the bridge closed, a call is dropped."""

    async def main() -> None:
        async with AsyncioThread() as bridge:
            woken = asyncio.Event()  # bound to the asyncio loop when it is awaited
            ran_on: list[str] = []

            async def wait_for_wake() -> list[str]:
                async with asyncio.timeout(5):
                    await woken.wait()
                return ran_on

            def broken() -> None:
                raise KeyError("a bug")

            def wake() -> None:
                ran_on.append(threading.current_thread().name)
                woken.set()

            async with trio.open_nursery() as nursery:
                results: list[list[str]] = []

                async def waiter() -> None:
                    results.append(await bridge.run(wait_for_wake))

                nursery.start_soon(waiter)
                await trio.sleep(0.05)  # the waiter waits on the asyncio side now
                bridge.call_soon(broken)
                bridge.call_soon(wake)
            assert results == [["meshd-grpc"]]
        bridge.call_soon(wake)  # closed: dropped, no error

    trio.run(main)
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
