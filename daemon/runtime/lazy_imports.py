"""One guarded place that imports the model runtime: mlx-lm (which pulls in transformers).

Why: those imports cost ~0.8 s of CPU, so the daemon makes them only when a model is checked,
converted, shared or loaded, never while it joins the mesh (they would slow its link probes
and heartbeats). Worker threads may then need them at the same moment, e.g. loading a stage
while serving a peer its part, and concurrent first imports of one package can fail with
Python's "deadlock detected by _ModuleLock". So every lazy user calls
`import_model_runtime()` first: it imports everything once, under one lock.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_imported = False


def import_model_runtime() -> None:
    """Import mlx-lm once; later calls return at once (any thread).

    Callers then import their own modules that build on mlx-lm (the stage code) as usual:
    what trips the import deadlock detection is mlx-lm's and transformers' own import web.
    """
    global _imported
    if _imported:
        return
    with _lock:
        if _imported:
            return
        import mlx_lm.models.base
        import mlx_lm.models.cache
        import mlx_lm.sample_utils
        import mlx_lm.utils  # noqa: F401

        _imported = True
