"""MLX's per-thread state is released by the thread that made it, before that thread ends.

Why: since mlx 0.31 every thread that evaluates arrays or creates a stream (importing
``mlx_lm.generate`` creates one) gets per-thread streams, each with a worker ``std::thread``.
When such a thread ends without releasing them, they are torn down later: by the thread's
exit handlers, which may run while the interpreter finalizes, or by MLX's static destructors
at process exit. Either way the process can abort at exit with "terminate called without an
active exception" (exit code 134), after all its work succeeded. Measured with mlx 0.32.4 on
this machine: a worker thread that evaluated one matmul, or only imported mlx-lm, aborted
the interpreter's exit in 7-40 % of runs; releasing the streams at the end of the thread
(``mx.clear_streams()``, MLX's documented remedy, ml-explore/mlx#3395) aborted none of 70.

Only at the very end of a thread: after ``clear_streams`` the thread's default stream is gone
("There is no Stream(cpu, 0) in current thread" on its next evaluation), while streams made
with ``mx.new_stream`` (mlx-lm's ``generation_stream``) stay usable in other threads. So the
threads the daemon owns release theirs as their last act: the compute thread
(:mod:`meshd.runtime.compute`) when it stops, and the short-lived thread that imports the
model runtime (:mod:`meshd.runtime.lazy_imports`). A worker pool's thread (``asyncio.to_thread``,
``trio.to_thread``) must not: it runs the next job afterwards.
"""

from __future__ import annotations

import sys


def release_thread_streams() -> None:
    """Release the calling thread's MLX streams, as its last MLX act (nothing when MLX was
    never imported, so callers need not know whether the work they ran touched MLX)."""
    mx = sys.modules.get("mlx.core")
    clear = getattr(mx, "clear_streams", None)
    if clear is not None:
        clear()
