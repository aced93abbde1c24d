"""systemd's notification protocol (sd_notify): one datagram to $NOTIFY_SOCKET.

A unit with `Type=notify` counts as started only when the daemon says `READY=1`, so
`systemctl start meshd` returns once the local API answers and units ordered after meshd
start against a daemon that serves. After that the daemon keeps its supervisor informed:
`STATUS=` lines (serving, re-planning, no model; `systemctl status` shows the last one),
`WATCHDOG=1` pings while both of its event loops run (the unit's `WatchdogSec=` restarts a
daemon whose loops hang), and `STOPPING=1` when it starts to leave the mesh, with
`EXTEND_TIMEOUT_USEC=` covering the leave grace, so that a graceful leave is not killed
half-way even where the unit's stop timeout is shorter (a meshd.toml changed after the
install). Without systemd (a terminal, launchd, tests) the variable is unset and nothing is
sent. The protocol is a single AF_UNIX datagram; an address starting with "@" names an
abstract socket (see sd_notify(3)).
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("meshd.service")

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
# How long after the leave grace a stopping daemon may take to close its servers and exit.
STOP_MARGIN_S = 15.0


def notify(message: str) -> bool:
    """Send `message` (KEY=VALUE lines) to systemd; False when no manager listens.

    A failure to send is logged, never raised: the daemon serves whether or not its
    supervisor heard about it.
    """
    address = os.environ.get(NOTIFY_SOCKET_ENV, "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("could not notify systemd at %s: %s", os.environ[NOTIFY_SOCKET_ENV], exc)
        return False
    return True


def notify_ready(api_address: str) -> bool:
    """Tell systemd the daemon serves: called once, when the local API answers."""
    return notify(f"READY=1\nSTATUS=serving; local API on {api_address}\nMAINPID={os.getpid()}")


def supervised() -> bool:
    """Whether a service manager listens (systemd started this daemon with Type=notify)."""
    return bool(os.environ.get(NOTIFY_SOCKET_ENV))


def watchdog_interval_s() -> float | None:
    """The unit's `WatchdogSec=` as systemd passes it (WATCHDOG_USEC, for this process only,
    see sd_watchdog_enabled(3)); None when no watchdog is set."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1e6


def notify_status(text: str) -> bool:
    """One line of state for `systemctl status` (no newlines: the protocol splits on them)."""
    return notify("STATUS=" + " ".join(text.split()))


def notify_watchdog() -> bool:
    """The daemon is alive: both of its loops ran since the last ping."""
    return notify("WATCHDOG=1")


def notify_stopping(grace_s: float) -> bool:
    """The daemon leaves the mesh and then exits: give it the grace and a margin to do so."""
    extend_usec = int((grace_s + STOP_MARGIN_S) * 1e6)
    return notify(
        f"STOPPING=1\nSTATUS=leaving the mesh (up to {grace_s:g} s)\n"
        f"EXTEND_TIMEOUT_USEC={extend_usec}"
    )
