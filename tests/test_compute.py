"""The compute thread: one worker, jobs in order, errors to their owner, a bounded close."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest

from meshd.runtime.compute import ComputeExecutor, computing

pytestmark = pytest.mark.unit


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


def test_a_job_whose_awaiter_gave_up_before_it_ran_never_runs() -> None:
    async def main() -> list[str]:
        compute = ComputeExecutor("test-compute")
        ran: list[str] = []
        release = threading.Event()
        blocker = compute.submit(release.wait, 10)  # holds the thread while the next waits
        dropped = compute.submit(ran.append, "dropped")
        dropped.cancel()
        await asyncio.sleep(0)  # the cancellation reaches the job
        release.set()
        await blocker
        await compute.run(ran.append, "kept")
        await compute.close()
        return ran

    assert asyncio.run(main()) == ["kept"]


def test_close_lets_the_running_job_finish_and_cancels_the_queued_ones() -> None:
    async def main() -> tuple[bool, bool, list[int]]:
        compute = ComputeExecutor("test-compute")
        started = threading.Event()
        thens: list[int] = []

        def running() -> bool:
            started.set()
            time.sleep(0.2)
            return True

        first = compute.submit(running)
        queued = compute.submit(lambda: False)
        compute.submit_then(lambda: 1, (), lambda outcome: thens.append(outcome.result()))
        await asyncio.to_thread(started.wait, 10)
        await compute.close()
        await asyncio.sleep(0.05)  # any late hand-back would land now
        return await first, queued.cancelled(), thens

    finished, cancelled, thens = asyncio.run(main())
    assert finished and cancelled and thens == []


def test_a_failed_submit_then_job_hands_its_error_to_the_owner() -> None:
    async def main() -> BaseException | None:
        compute = ComputeExecutor("test-compute")
        outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def broken() -> None:
            raise ValueError("bad step")

        compute.submit_then(broken, (), outcome.set_result)
        done = await asyncio.wait_for(outcome, 10)
        await compute.close()
        with pytest.raises(ValueError, match="bad step"):
            done.result()
        return done.error

    assert isinstance(asyncio.run(main()), ValueError)


def test_let_start_lets_a_job_queued_for_the_idle_worker_start_first() -> None:
    """What the origin's stream relies on: a step it has just queued builds its graph and
    hands it to MLX before the stream's own Python runs, and a running job, which may be a
    whole prefill chunk, is never waited for."""

    async def main() -> None:
        compute = ComputeExecutor("test-compute")
        await compute.run(lambda: None)  # the worker is up and idle
        started = threading.Event()
        built = threading.Event()
        release = threading.Event()

        def step() -> None:
            started.set()
            time.sleep(0.05)  # lets go of the GIL before the graph is built: not yet
            built.set()
            computing()  # handed to MLX (the engine's mx.async_eval)
            release.wait(5)  # waiting for MLX, the GIL released (as in mx.eval)

        compute.submit_then(step, (), lambda outcome: outcome.result())
        # This thread held the GIL since the submit: the woken worker has not started it.
        assert not started.is_set()
        await compute.let_start(timeout_s=5.0)  # a loaded machine may wake threads late
        assert built.is_set(), "let_start returned before the queued job was computing"

        compute.submit_then(lambda: None, (), lambda outcome: outcome.result())
        waited = time.perf_counter()
        await compute.let_start(timeout_s=1.0)  # busy with `step`: nothing to wait for
        assert time.perf_counter() - waited < 0.5
        release.set()
        await compute.run(lambda: None)
        waited = time.perf_counter()
        await compute.let_start(timeout_s=1.0)  # idle, nothing queued
        assert time.perf_counter() - waited < 0.5
        await compute.close()

    asyncio.run(main())


def test_let_start_waits_for_the_job_end_at_the_latest_and_gives_up_in_time() -> None:
    async def main() -> None:
        compute = ComputeExecutor("test-compute")
        await compute.run(lambda: None)
        ended = threading.Event()

        def never_says_computing() -> None:
            time.sleep(0.05)
            ended.set()

        compute.submit_then(never_says_computing, (), lambda outcome: outcome.result())
        await compute.let_start(timeout_s=5.0)
        assert ended.is_set()  # woken when it ended
        assert compute._starting == []  # no waiter left behind
        computing()  # off a worker: nothing happens

        # A worker that never takes its job (here: stopped, an item queued behind its back)
        # is waited for at most the timeout.
        await compute.close()
        compute._jobs.put(None)
        waited = time.perf_counter()
        await compute.let_start(timeout_s=0.05)
        assert time.perf_counter() - waited < 1.0

    asyncio.run(main())


def test_hand_over_lets_the_woken_job_build_its_graph_before_the_loop_goes_on() -> None:
    """The origin's token callback cannot await: it hands the GIL over instead, so the step it
    has just queued starts before the loop's own Python; a busy or idle worker is not waited
    for, and a job that never says it computes is waited for at most the timeout."""

    async def main() -> None:
        compute = ComputeExecutor("test-compute")
        await compute.run(lambda: None)  # the worker is up and idle
        built = threading.Event()
        release = threading.Event()

        def step() -> None:
            time.sleep(0.05)  # lets go of the GIL before the graph is built: not yet
            built.set()
            computing()
            release.wait(5)

        compute.submit_then(step, (), lambda outcome: outcome.result())
        compute.hand_over(timeout_s=5.0)  # a loaded machine may wake threads late
        assert built.is_set(), "hand_over returned before the queued job was computing"
        assert compute._handing_over is None

        compute.submit_then(lambda: None, (), lambda outcome: outcome.result())
        waited = time.perf_counter()
        compute.hand_over(timeout_s=1.0)  # busy with `step`: nothing to wait for
        assert time.perf_counter() - waited < 0.5
        release.set()
        await compute.run(lambda: None)
        waited = time.perf_counter()
        compute.hand_over(timeout_s=1.0)  # idle, nothing queued
        assert time.perf_counter() - waited < 0.5

        await compute.close()
        compute._jobs.put(None)  # a worker that never takes its job
        waited = time.perf_counter()
        compute.hand_over(timeout_s=0.05)
        assert time.perf_counter() - waited < 1.0

    asyncio.run(main())
