"""One guarded place that imports the model runtime: mlx-lm (which pulls in transformers).

Why: those imports cost ~0.8 s of CPU, so the daemon makes them only when a model is checked,
converted, shared or loaded, never while it joins the mesh (they would slow its link probes
and heartbeats). Worker threads may then need them at the same moment, e.g. loading a stage
while serving a peer its part, and concurrent first imports of one package can fail with
Python's "deadlock detected by _ModuleLock". So every lazy user calls
`import_model_runtime()` first: it imports everything once, under one lock.

The imports run on a thread of their own that ends right after: importing ``mlx_lm.generate``
creates an MLX stream in the importing thread, and a thread that ends holding MLX streams can
make the process abort at exit (:mod:`meshd.runtime.mlx_threads`); this one releases them.
"""

from __future__ import annotations

import threading

from meshd.runtime.mlx_threads import release_thread_streams

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
        failure: list[BaseException] = []
        importer = threading.Thread(target=_import, args=(failure,), name="meshd-import-mlx-lm")
        importer.start()
        importer.join()
        if failure:
            raise failure[0]
        _imported = True


def _import(failure: list[BaseException]) -> None:
    try:
        import mlx_lm.models.base
        import mlx_lm.models.cache
        import mlx_lm.sample_utils
        import mlx_lm.utils  # noqa: F401
    except BaseException as error:
        failure.append(error)
    finally:
        release_thread_streams()
