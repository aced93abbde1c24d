"""systemd's readiness protocol (sd_notify): one datagram to $NOTIFY_SOCKET.

A unit with `Type=notify` counts as started only when the daemon says `READY=1`, so
`systemctl start meshd` returns once the local API answers and units ordered after meshd
start against a daemon that serves. Without systemd (a terminal, launchd, tests) the
variable is unset and nothing is sent. The protocol is a single AF_UNIX datagram; an
address starting with "@" names an abstract socket (see sd_notify(3)).
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("meshd.service")

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"


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
