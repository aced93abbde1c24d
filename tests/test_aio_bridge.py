"""The asyncio-thread bridge: results, errors and cancellation cross in both directions."""

import asyncio
import threading

import pytest
import trio

from meshd.runtime.bridge import AsyncioThread


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
