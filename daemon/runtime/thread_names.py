"""Give this thread a name the kernel sees, so ``top -H``, ``ps -L``, perf and py-spy show
which of meshd's threads is working.

Why: before Python 3.14 a ``threading.Thread``'s name lives only inside Python; to the
kernel every thread of a daemon is "python" (or "meshd"), so a user asking which thread
burns CPU while the mesh is idle, or a benchmark splitting a daemon's CPU per token
(``bench_batching.py --thread-cpu``), cannot tell the compute thread from the asyncio loop.
Threads that a library starts later (MLX's stream thread, OpenBLAS's workers, gRPC's
pollers) inherit the name of the thread that started them, on Linux.

Linux keeps the first 15 bytes (``prctl(PR_SET_NAME)``); macOS 63 (``pthread_setname_np``).
Naming is best effort: where neither exists, or the call fails, the thread keeps its name.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Iterator
from functools import cache

log = logging.getLogger(__name__)

_PR_SET_NAME = 15  # linux/prctl.h
_PR_GET_NAME = 16
_LINUX_NAME_BYTES = 15  # the kernel's TASK_COMM_LEN, less the terminating NUL
_MACOS_NAME_BYTES = 63


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


def os_thread_name(name: str) -> bytes:
    """``name`` as the kernel will keep it on this platform: UTF-8, cut to its limit."""
    limit = _LINUX_NAME_BYTES if sys.platform.startswith("linux") else _MACOS_NAME_BYTES
    return name.encode("utf-8", "replace")[:limit]


def name_this_thread(name: str) -> bool:
    """Name the calling thread ``name`` for the OS; whether it took."""
    libc = _libc()
    if libc is None:
        return False
    encoded = os_thread_name(name)
    try:
        if sys.platform.startswith("linux"):
            return libc.prctl(_PR_SET_NAME, ctypes.c_char_p(encoded), 0, 0, 0) == 0
        if sys.platform == "darwin":
            return libc.pthread_setname_np(ctypes.c_char_p(encoded)) == 0
    except AttributeError:  # a libc without the call
        log.debug("this C library cannot name threads; %r keeps its name", name)
    return False


def this_thread_name() -> str | None:
    """The calling thread's name as the OS keeps it; None where it cannot be read."""
    libc = _libc()
    if libc is None:
        return None
    buffer = ctypes.create_string_buffer(_MACOS_NAME_BYTES + 1)
    try:
        if sys.platform.startswith("linux"):
            done = libc.prctl(_PR_GET_NAME, buffer, 0, 0, 0) == 0
        elif sys.platform == "darwin":
            this = libc.pthread_self
            this.restype = ctypes.c_void_p
            get = libc.pthread_getname_np
            get.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
            done = get(this(), buffer, len(buffer)) == 0
        else:
            return None
    except AttributeError:
        return None
    return buffer.value.decode("utf-8", "replace") if done else None


@contextlib.contextmanager
def named_while(name: str) -> Iterator[None]:
    """Name the calling thread ``name`` for the block, then give it its name back: the
    threads a library starts inside (OpenBLAS's workers, at load) are named ``name``."""
    previous = this_thread_name()
    named = name_this_thread(name)
    try:
        yield
    finally:
        if named and previous is not None:
            name_this_thread(previous)
