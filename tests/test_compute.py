"""The compute thread: one worker, jobs in order, errors to their owner, a bounded close."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest

from meshd.runtime.compute import ComputeExecutor


def test_jobs_run_one_at_a_time_in_order_on_one_thread() -> None:
    async def main() -> tuple[list[int], set[int], int]:
        compute = ComputeExecutor("test-compute")
        order: list[int] = []
        threads: set[int] = set()
        running = 0
        overlap = 0

        def job(index: int) -> int:
            nonlocal running, overlap
            running += 1
            overlap = max(overlap, running)
            threads.add(threading.get_ident())
            time.sleep(0.002)
            order.append(index)
            running -= 1
            return index * 10

        results = await asyncio.gather(*(compute.run(job, index) for index in range(20)))
        assert results == [index * 10 for index in range(20)]
        await compute.close()
        return order, threads, overlap

    order, threads, overlap = asyncio.run(main())
    assert order == list(range(20)) and overlap == 1
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_an_error_reaches_the_awaiting_owner_and_the_worker_keeps_going() -> None:
    async def main() -> int:
        compute = ComputeExecutor("test-compute")

        def broken() -> None:
            raise ValueError("bad input")

        with pytest.raises(ValueError, match="bad input"):
            await compute.run(broken)
        value = await compute.run(lambda: 42)
        await compute.close()
        return value

    assert asyncio.run(main()) == 42


def test_a_detached_job_that_fails_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        compute = ComputeExecutor("test-compute")

        def broken() -> None:
            raise RuntimeError("release failed")

        compute.submit_detached(broken)
        await compute.run(lambda: None)  # after the detached job
        await asyncio.sleep(0)  # let its done-callback run
        await compute.close()

    with caplog.at_level(logging.ERROR, logger="meshd.compute"):
        asyncio.run(main())
    assert any("release failed" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


def test_after_close_nothing_more_is_accepted() -> None:
    async def main() -> None:
        compute = ComputeExecutor("test-compute")
        await compute.run(lambda: None)
        await compute.close()
        assert compute.closed
        with pytest.raises(RuntimeError, match="shutting down"):
            compute.submit(lambda: None)
        compute.submit_detached(lambda: None)  # ignored, not an error
        await compute.close()  # twice is fine

    asyncio.run(main())


def test_submit_then_hands_each_result_back_on_the_loop_in_order() -> None:
    async def main() -> list[tuple[int, bool]]:
        compute = ComputeExecutor("test-compute")
        loop_thread = threading.get_ident()
        seen: list[tuple[int, bool]] = []
        finished = asyncio.Event()

        def then(done: Any) -> None:
            seen.append((done.result(), threading.get_ident() == loop_thread))
            if len(seen) == 5:
                finished.set()

        for index in range(5):
            compute.submit_then(lambda value: value * 2, (index,), then)
        await asyncio.wait_for(finished.wait(), 10)
        await compute.close()
        return seen

    assert asyncio.run(main()) == [(0, True), (2, True), (4, True), (6, True), (8, True)]
