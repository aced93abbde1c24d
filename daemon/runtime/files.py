"""Files written whole or not at all, and folders of cache files kept to a number."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (see :func:`replace_bytes`)."""
    replace_bytes(path, text.encode("utf-8"))


def replace_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` (making its folder) through a partial file beside it, named
    by this process and thread and renamed over ``path``: a reader, or a daemon killed
    mid-write, sees the old file or the new one, never half of one. The partial file is made
    new (never through a link planted at its name) and goes where the write fails. ``mode``:
    the file's permissions from its first byte (else the umask's).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    partial.unlink(missing_ok=True)  # a partial file of a killed process that had our PID
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    descriptor = os.open(partial, flags, 0o666 if mode is None else mode)
    try:
        with os.fdopen(descriptor, "wb") as opened:
            if mode is not None:
                os.fchmod(opened.fileno(), mode)
            opened.write(data)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def remove_oldest(folder: Path, pattern: str, kept: int) -> None:
    """Keep the ``kept`` newest files matching ``pattern`` in ``folder``, by modification time
    (for caches whose entries are never rewritten once read: age is when an entry was made).
    Files that go while we look (another process prunes too) are no error."""
    try:
        files = sorted(folder.glob(pattern), key=lambda file: file.stat().st_mtime_ns)
    except OSError:
        return
    for stale in files[:-kept] if kept > 0 else files:
        with contextlib.suppress(OSError):
            stale.unlink()
