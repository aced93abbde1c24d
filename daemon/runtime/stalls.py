"""Stalls: a loop of this daemon that did not run when it should have, said in words.

Why: peers count a node lost when its heartbeats stop for their ``--peer-timeout`` (1.5 s by
default). A node whose process did not run for that long is then dropped, and the mesh
re-plans around it, although nothing is wrong with the node itself: a host whose CPUs are
overloaded (measured here: two three-daemon meshes loading the default model at once on two
cores kept a daemon's loops from running for over 3 s), a machine that slept, a process
stopped with SIGSTOP, or a long call that held Python's GIL. Without a word from the node
that stalled, its own log shows nothing, and its peers' logs only say "no heartbeat".

Each loop that matters runs :func:`watch`: it sleeps ``period_s`` and measures how late it
woke. The asyncio loop carries the heartbeats, the peer port and the data plane; the trio
loop runs the agreement and answers ``meshd status``. A :class:`StallCounter` turns those
measurements into event-log lines: the first stall at once, later ones summed up at most
once every ``report_every_s``, so an overloaded host does not flood the log.

``MESHD_STALL_TRACE=DIR`` says what ran meanwhile: while the asyncio loop is stalled, every
thread's stack is written to ``DIR/stalls-<pid>.txt`` every half second, by a watchdog thread
of C (``faulthandler``) that needs no GIL. That is how the stalls of a plan's install were
traced to tokenizer.json being parsed while the weights loaded.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TextIO

PERIOD_S = 0.1  # how often each watcher wakes (a wake-up costs microseconds)
THRESHOLD_S = 0.5  # a wake this late is a stall: a third of the default peer timeout
REPORT_EVERY_S = 60.0
TRACE_ENV = "MESHD_STALL_TRACE"

log = logging.getLogger(__name__)


class StallCounter:
    """Stalls of one loop, and when to report them. Pure: owned by the watcher that feeds
    it, on that watcher's thread."""

    def __init__(
        self,
        loop_name: str,
        peer_timeout_s: float,
        *,
        threshold_s: float = THRESHOLD_S,
        report_every_s: float = REPORT_EVERY_S,
    ) -> None:
        self.loop_name = loop_name
        self.peer_timeout_s = peer_timeout_s
        self.threshold_s = threshold_s
        self.report_every_s = report_every_s
        self.stalls = 0  # every stall seen
        self._pending = 0  # stalls not reported yet
        self._worst = 0.0  # the longest of those
        self._reported_at: float | None = None

    def observe(self, late_s: float, now: float) -> str | None:
        """One wake-up ``late_s`` seconds late at ``now``; the line to report, if one is due."""
        if late_s >= self.threshold_s:
            self.stalls += 1
            self._pending += 1
            self._worst = max(self._worst, late_s)
        due = self._reported_at is None or now - self._reported_at >= self.report_every_s
        if not self._pending or not due:
            return None
        message = self._words(now)
        self._pending, self._worst, self._reported_at = 0, 0.0, now
        return message

    def _words(self, now: float) -> str:
        if self._pending == 1:  # always so for the first line: it goes out at the first stall
            what = f"this node's {self.loop_name} did not run for {self._worst:.1f} s"
        else:
            assert self._reported_at is not None
            what = (
                f"this node's {self.loop_name} stalled {self._pending} times in the last "
                f"{now - self._reported_at:.0f} s, the longest {self._worst:.1f} s"
            )
        why = "the host's CPUs overloaded, the machine asleep, or a long call holding Python's GIL"
        if self._worst >= self.peer_timeout_s:
            return (
                f"{what} ({why}): its peers may have counted it lost (after "
                f"{self.peer_timeout_s:g} s without a heartbeat) and re-planned without it"
            )
        return f"{what} ({why})"


async def watch(
    sleep: Callable[[float], Awaitable[object]],
    counter: StallCounter,
    report: Callable[[str], None],
    *,
    period_s: float = PERIOD_S,
    clock: Callable[[], float] = time.monotonic,
    trace: TextIO | None = None,
) -> None:
    """Forever: sleep ``period_s`` with the loop's own ``sleep`` (``asyncio.sleep`` or
    ``trio.sleep``), feed the lateness of each wake-up to ``counter`` and hand every line it
    returns to ``report`` (on this loop's thread). Ends when cancelled.

    ``trace`` (see :func:`open_trace`; one watcher per process at most, faulthandler has one
    timer): re-armed before each sleep, faulthandler writes every thread's stack there each
    ``threshold_s`` that this loop does not come back."""
    try:
        while True:
            due = clock() + period_s
            if trace is not None:
                faulthandler.dump_traceback_later(
                    period_s + counter.threshold_s, repeat=True, file=trace
                )
            await sleep(period_s)
            now = clock()
            message = counter.observe(now - due, now)
            if message is not None:
                report(message)
    finally:
        if trace is not None:
            faulthandler.cancel_dump_traceback_later()


def open_trace(environ: Mapping[str, str] = os.environ) -> TextIO | None:
    """The file ``MESHD_STALL_TRACE=DIR`` names for this process (``DIR/stalls-<pid>.txt``,
    appended to), or None: unset, or not writable (a warning says so; the daemon runs on)."""
    directory = environ.get(TRACE_ENV)
    if not directory:
        return None
    path = Path(directory) / f"stalls-{os.getpid()}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        trace = path.open("a")
    except OSError as error:
        log.warning("%s=%s: stall tracing stays off (%s)", TRACE_ENV, directory, error)
        return None
    log.warning("stall tracing is on: stacks of every thread go to %s during stalls", path)
    return trace
