"""One daemon per state directory: an exclusive lock taken before anything in it is touched.

Why: the state directory holds one node's identity (node id, certificates) and its local API
socket. A second `meshd run` on the same directory (a second terminal, a service plus a
manual start) used to start far enough to unlink the running daemon's `api.sock` and, on
its way out, remove it again: the running daemon stayed in the mesh with a dead CLI. The
lock is taken first, so a second daemon stops before it writes, binds or removes anything.

The lock is an `flock` on `<state-dir>/meshd.lock`, held for the daemon's lifetime by an
open file; the kernel releases it when the process ends, however it ends (`kill -9`
included), so a stale lock file never blocks a restart. The file holds the holder's PID,
for the message only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = "meshd.lock"


class StateDirInUse(RuntimeError):
    """Another daemon holds this state directory; the message names it and what to do."""


@contextlib.contextmanager
def hold_state_dir(state_dir: Path) -> Iterator[None]:
    """Hold the state directory's lock for the duration of the block.

    Raises StateDirInUse at once (without waiting, and without touching anything else in
    the directory) when another process, or another daemon of this process, holds it.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / LOCK_FILE
    handle = open(path, "a+")  # noqa: SIM115 - held open for the whole block
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise StateDirInUse(
                f"another meshd (pid {holder}) is already running with the state directory "
                f"{state_dir}; stop it first (`meshd service stop`, or Ctrl-C where it runs), "
                "or give this daemon its own --state-dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # releases the lock
