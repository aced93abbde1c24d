"""Keeping systemd informed while the daemon runs: its state in words, and a watchdog.

`systemctl status meshd` shows the last `STATUS=` line, so the daemon says what it is
doing whenever that changes: serving, loading, re-planning, refused, no model. With the
unit's `WatchdogSec=`, systemd restarts a daemon that stops pinging; the ping is sent from
the asyncio loop (heartbeats, peer port, data plane) at the request of the trio loop
(agreement, status), so it stops when either loop hangs, not only when the process dies.
Nothing is sent, and the task ends at once, when no service manager listens.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from meshd.service import notify
from meshd.wire import pb

log = logging.getLogger("meshd.service")

STATUS_CHECK_S = 1.0  # how often the state is looked at (a change is told within this)


async def keep_service_manager_informed(
    state_line: Callable[[], str], ping_from_asyncio: Callable[[], Awaitable[None]]
) -> None:
    """Send `state_line()` whenever it changes, and ping the watchdog (if the unit set one)
    through both loops at half its interval; runs until cancelled."""
    if not notify.supervised():
        return
    watchdog_s = notify.watchdog_interval_s()
    ping_every = watchdog_s / 2 if watchdog_s else None
    told = ""
    next_ping = trio.current_time()
    while True:
        line = state_line()
        if line != told:
            notify.notify_status(line)
            told = line
        if ping_every is not None and trio.current_time() >= next_ping:
            await ping_from_asyncio()  # returns only once the asyncio loop has run it
            next_ping = trio.current_time() + ping_every
        pause = STATUS_CHECK_S
        if ping_every is not None:
            pause = min(pause, max(0.0, next_ping - trio.current_time()))
        await trio.sleep(pause)


async def ping_watchdog() -> None:
    """Run on the asyncio loop: proof that it still runs."""
    notify.notify_watchdog()


def service_state_line(agreement: pb.AgreementStatus, moving: str) -> str:
    """The daemon's state in one line, as `systemctl status` shows it."""
    if not agreement.model:
        return "no model: load one with `meshd load MODEL`"
    if agreement.refusal and not agreement.active_plan_id:
        return f"refused: {agreement.refusal}"
    if not agreement.active_plan_id:
        return f"re-planning {agreement.model}: {agreement.reason or 'agreeing on a plan'}"
    plan = agreement.active_plan_id[:12]
    if moving:
        return f"loading {agreement.model}: {moving}"
    nodes = len(agreement.members)
    serving = f"serving {agreement.model} on {nodes} node{'s' if nodes != 1 else ''}, plan {plan}"
    if not agreement.converged:
        return f"{serving}; re-planning: {agreement.reason}"
    return serving
