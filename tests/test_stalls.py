"""A loop of the daemon that did not run is said in words: the counter's rules, the watcher on
real asyncio and trio loops, and a real daemon stopped with SIGSTOP for longer than its peers
wait for a heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
import trio

from meshd.api.launcher import DaemonProcess
from meshd.runtime.stalls import StallCounter, open_trace, watch

pytestmark = pytest.mark.integration

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]


def test_the_first_stall_is_reported_at_once_and_later_ones_summed_up() -> None:
    counter = StallCounter("asyncio loop", 1.5, threshold_s=0.5, report_every_s=60)
    assert counter.observe(0.01, now=1.0) is None  # on time
    assert counter.observe(0.49, now=2.0) is None  # late, but under the threshold
    first = counter.observe(0.8, now=3.0)
    assert first is not None and "asyncio loop did not run for 0.8 s" in first
    assert "counted it lost" not in first  # shorter than the peers' timeout
    assert counter.observe(2.0, now=10.0) is None  # within a minute of the last line
    assert counter.observe(0.6, now=20.0) is None
    assert counter.observe(0.0, now=62.9) is None
    summary = counter.observe(0.0, now=63.0)  # a minute on: the two stalls since, in one line
    assert summary is not None, "stalls waiting to be reported were never reported"
    assert "stalled 2 times in the last 60 s, the longest 2.0 s" in summary
    assert "may have counted it lost (after 1.5 s without a heartbeat)" in summary
    assert counter.stalls == 3
    assert counter.observe(0.0, now=200.0) is None  # nothing new: nothing to say


def test_the_watcher_measures_a_blocked_asyncio_loop() -> None:
    lines: list[str] = []
    counter = StallCounter("asyncio loop", 1.5, threshold_s=0.3)

    async def main() -> None:
        task = asyncio.create_task(watch(asyncio.sleep, counter, lines.append, period_s=0.02))
        await asyncio.sleep(0.1)
        assert not lines  # an idle loop wakes on time
        time.sleep(0.5)  # a call that blocks the loop
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(main())
    assert len(lines) == 1 and "did not run for 0." in lines[0], lines
    late = float(lines[0].split("did not run for ")[1].split(" s")[0])
    assert 0.4 <= late <= 1.5, lines


def test_the_watcher_measures_a_blocked_trio_loop() -> None:
    lines: list[str] = []
    counter = StallCounter("trio loop", 0.3, threshold_s=0.3)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, trio.sleep, counter, lines.append)
            await trio.sleep(0.3)
            assert not lines
            time.sleep(0.6)  # the trio thread itself blocked
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert len(lines) == 1, lines
    assert "trio loop did not run for" in lines[0] and "counted it lost" in lines[0], lines


def test_a_daemon_stopped_longer_than_the_peer_timeout_says_so_once_it_runs(
    daemons, mesh_token: str
) -> None:
    """SIGSTOP for 2 s (a machine asleep, a host out of CPU): once it runs again the daemon's
    event log says which loops did not run, for how long, and that peers may have dropped
    it; a daemon left alone says nothing of the kind."""
    daemon: DaemonProcess = daemons([*LOOPBACK, "--join", mesh_token])
    daemon.wait_ready()
    time.sleep(1.0)
    assert not [line for line in daemon.status().events if "did not run" in line]
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(2.0)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)

    def said(status) -> bool:  # the asyncio loop and the trio loop
        lines = [line for line in status.events if "did not run for" in line]
        return all(any(loop in line for line in lines) for loop in ("asyncio loop", "trio loop"))

    status = daemon.wait_for(said, 10, "both loops' stalls in the event log")
    lines = [line for line in status.events if "did not run for" in line]
    assert any("asyncio loop (heartbeats" in line for line in lines), lines
    assert any("trio loop (agreement, status)" in line for line in lines), lines
    for line in lines:
        late = float(line.split("did not run for ")[1].split(" s")[0])
        assert 1.8 <= late <= 6.0, line
        assert "may have counted it lost (after 1.5 s without a heartbeat)" in line, line
    assert "did not run for" in daemon.log_path.read_text()  # in its log file too


def _a_call_that_holds_the_loop() -> None:
    time.sleep(0.8)


def test_a_traced_stall_shows_what_ran_meanwhile(tmp_path, caplog) -> None:
    """MESHD_STALL_TRACE=DIR: while the loop is blocked, every thread's stack goes to
    DIR/stalls-<pid>.txt, the call that blocked it included; nothing is written while the
    loop runs; an unwritable directory leaves tracing off with a warning."""
    trace = open_trace({"MESHD_STALL_TRACE": str(tmp_path / "traces")})
    assert trace is not None
    counter = StallCounter("asyncio loop", 1.5)
    path = tmp_path / "traces" / f"stalls-{os.getpid()}.txt"

    async def main(block: bool) -> None:
        task = asyncio.create_task(
            watch(asyncio.sleep, counter, lambda line: None, period_s=0.05, trace=trace)
        )
        await asyncio.sleep(0.3)
        if block:
            _a_call_that_holds_the_loop()
        await asyncio.sleep(0.1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main(block=False))
        trace.flush()
        assert path.read_text() == ""  # a loop that runs on time leaves no stacks
        asyncio.run(main(block=True))
    finally:
        trace.close()
    text = path.read_text()
    assert "Timeout" in text and "_a_call_that_holds_the_loop" in text, text
    assert open_trace({}) is None
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level("WARNING"):
        assert open_trace({"MESHD_STALL_TRACE": str(blocker / "traces")}) is None
    assert "stall tracing stays off" in caplog.text
