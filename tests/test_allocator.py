"""glibc's fastbins off (meshd.runtime.allocator): freed small blocks no longer wait in them.

Each case runs in a fresh Python process (the setting is process-wide and cannot be undone):
it frees a thousand 48-byte blocks from C's malloc and reads glibc's ``mallinfo2().fsmblks``,
the bytes held in fastbins. glibc's default keeps most of them there (the thread's tcache
takes only the first few); with fastbins off, none; a ``GLIBC_TUNABLES`` that sets
``glibc.malloc.mxfast`` is the user's choice and is kept. A real ``meshd run`` says in its
log that it turned them off.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import ctypes, json, sys
sys.path.insert(0, {root!r})
from meshd.runtime import allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

turned_off = allocator.turn_fastbins_off() if {turn_off!r} else False
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.mallinfo2.restype = MallInfo2
blocks = [libc.malloc(48) for _ in range(1000)]
for block in blocks:
    libc.free(block)
print(json.dumps({{"turned_off": turned_off, "fastbin_bytes": libc.mallinfo2().fsmblks}}))
"""

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
    reason="glibc's allocator only (macOS and musl have no fastbins)",
)


def _probe(turn_off: bool, tunables: str | None = None) -> dict:
    root = os.path.join(os.path.dirname(__file__), "..", "daemon", "..")
    env = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    code = PROBE.format(root=os.path.abspath(root), turn_off=turn_off)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_freed_small_blocks_skip_the_fastbins_once_turned_off() -> None:
    default = _probe(turn_off=False)
    assert default["fastbin_bytes"] > 10_000, default  # glibc's default keeps them
    off = _probe(turn_off=True)
    assert off == {"turned_off": True, "fastbin_bytes": 0}


def test_the_users_glibc_tunable_wins() -> None:
    kept = _probe(turn_off=True, tunables="glibc.malloc.mxfast=128")
    assert kept["turned_off"] is False and kept["fastbin_bytes"] > 10_000, kept
    off_by_user = _probe(turn_off=True, tunables="glibc.malloc.mxfast=0")
    assert off_by_user == {"turned_off": False, "fastbin_bytes": 0}
