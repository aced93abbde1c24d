"""Scratch directories in the system's temp directory, named after the process that made them.

A stage load builds mlx-lm's model from a view of the model's config files in a temporary
directory (:func:`meshd.inference.stage.shard.load_stage`). A daemon or runner killed while it
loads (`kill -9`, the OOM killer, a test's teardown) leaves that directory behind, and a
daemon that runs for months on a machine that rarely reboots would collect them. So each one
carries its creator's PID, and a daemon removes, when it starts, those whose creator is gone;
a directory of a live process, or of another program, is never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

SCRATCH_PREFIX = "meshd-scratch-"


@contextlib.contextmanager
def scratch_directory(purpose: str) -> Iterator[Path]:
    """A temporary directory ``meshd-scratch-<pid>-<purpose>-*``, removed on exit."""
    prefix = f"{SCRATCH_PREFIX}{os.getpid()}-{purpose}-"
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        yield Path(folder)


def remove_orphaned_scratch(temp_root: Path | None = None) -> int:
    """Remove the scratch directories whose creating process is gone; how many were."""
    root = temp_root or Path(tempfile.gettempdir())
    removed = 0
    try:
        entries = list(root.iterdir())
    except OSError:
        return 0
    for entry in entries:
        pid = _creator(entry.name)
        if pid is None or pid_alive(pid) or not entry.is_dir() or entry.is_symlink():
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed += not entry.exists()
    return removed


def _creator(name: str) -> int | None:
    if not name.startswith(SCRATCH_PREFIX):
        return None
    pid = name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
    return int(pid) if pid.isdigit() and int(pid) > 0 else None


def pid_alive(pid: int) -> bool:
    """True unless no process has this PID (a PID reused by another process counts as alive:
    leaving a directory behind is harmless, removing a live one is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
