"""glibc's malloc fastbins off in a daemon, so a hop does not pay for the forward pass's frees.

Why: a forward pass frees thousands of small blocks (MLX's graph nodes and temporaries) into
the computing thread's glibc fastbins, and the next request of a large block by that thread
(1 KiB or more: a hidden state's frame, OpenSSL's ~17 KB record buffer that CPython's ``ssl``
allocates for each write) first coalesces all of them, 0.6-0.7 ms of CPU (``perf record``
in ``benchmarks/bench_hop_floor.py``'s processes; there, the design whose computing thread
also writes its frames went from 0.89-0.99 ms a hop to 0.52-0.64 with fastbins off). In the
daemon this cost lands on a hop: a last stage's compute thread sending the token it just
sampled spent 0.65-0.77 ms of CPU in that one ``send``. Freed small blocks then go to the
thread's tcache and the small bins instead, which glibc keeps coalesced as it goes; Python's
own objects are not affected (pymalloc serves those).

Measured with pinned daemons in network namespaces (``bench_batching.py --scaling
--fastbins-too``, each baseline in the same run): the decode time per token not spent
computing (the daemons' own ``transport_s_per_token``) went from 2.56 ms to 2.02 ms with 2
daemons (two hops a token) and from 4.59 to 3.50 ms with 3; 4 interleaved rounds of 2
daemons gave medians of 2.35 and 1.89-1.99 ms. Decode tok/s did not move beyond this
machine's noise (a token takes 80-100 ms here).

Only where the process runs on glibc (Linux): macOS's allocator and musl have no fastbins.
A ``GLIBC_TUNABLES`` that names ``glibc.malloc.mxfast`` wins (the user chose; a benchmark's
baseline sets glibc's default, 128, that way).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger("meshd.runtime")

M_MXFAST = 1  # mallopt's parameter number for the fastbins' largest block (glibc's malloc.h)
TUNABLE = "glibc.malloc.mxfast"


def turn_fastbins_off() -> bool:
    """Stop glibc's malloc from keeping freed small blocks in fastbins; whether it did.
    Call it first thing in a daemon, before its threads start (glibc coalesces the main
    arena's fastbins then; the other arenas are not made yet)."""
    if sys.platform != "linux" or TUNABLE in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (musl has mallopt too)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if mallopt(M_MXFAST, 0) != 1:
        log.warning("glibc refused mallopt(M_MXFAST, 0): its fastbins stay on")
        return False
    return True
