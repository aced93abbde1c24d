"""A core kept busy for a bounded time, by a child process (a loaded host, for tests and
benchmarks whose measurements vary most under load).

The child stops by itself after ``seconds`` plus a margin, so it never outlives a test or
benchmark that was killed before its cleanup ran; normally it is killed (by PID) on exit.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

MARGIN_S = 5.0


@contextlib.contextmanager
def busy_core(seconds: float) -> Iterator[subprocess.Popen[bytes]]:
    """A child process spinning on one core for at most ``seconds`` + MARGIN_S."""
    spin = f"import time\nend = time.monotonic() + {seconds + MARGIN_S}\n"
    spin += "while time.monotonic() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        yield child
    finally:
        child.kill()
        child.wait(10)
