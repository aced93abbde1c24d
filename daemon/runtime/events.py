"""The daemon's event log: recent happenings in words, for the log and `meshd status`.

Every subsystem reports what a user should see (a peer joined, a plan was committed, a
model part was fetched) through the one `EventLog` the node owns. It lives here, below
every subsystem, because all of them write to it and none of them owns it. Use it from the
trio thread (where every writer runs); `lines()` returns a copy.
"""

from __future__ import annotations

import logging
import time
from collections import deque

log = logging.getLogger("meshd")


class EventLog:
    """Recent happenings in words, for logs and `meshd status`."""

    def __init__(self, size: int = 50) -> None:
        self._lines: deque[str] = deque(maxlen=size)

    def add(self, message: str, *args: object, level: int = logging.INFO) -> None:
        text = message % args if args else message
        log.log(level, text)
        self._lines.append(f"{time.strftime('%H:%M:%S')} {text}")

    def lines(self) -> list[str]:
        return list(self._lines)
