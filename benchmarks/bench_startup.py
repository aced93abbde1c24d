"""What a daemon spends to start and serve its first answer, on the product: one real `meshd
run` daemon with the embedded model, from its start to its API answering, its plan committed,
the first streamed event of a short chat and the chat's end; the daemon's own CPU seconds at
each point (from /proc) and the wall time. Each round starts a daemon on a model store in each
of three states, in turn, so all are measured on the same machine in the same minutes:
"cold", with neither transformers' import tables (:mod:`meshd.runtime.import_tables`) nor the
model's kept tokenizer (:mod:`meshd.models.tokenizer_cache`), which the daemon then makes and
writes; "tables", with the import tables only; "kept", with both. Medians per column.

    .venv/bin/python benchmarks/bench_startup.py [--rounds 4] [--max-tokens 8]

Everything is in a temporary folder removed at the end (state, model store, a profile measured
once and given to each daemon as `meshd demo` does); the daemon listens on 127.0.0.1 only and
is killed by PID.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()

from meshd.api import client
from meshd.api.demo import plan_committed
from meshd.api.launcher import DaemonProcess
from meshd.mesh.profiling import PROFILE_SEED_ENV, seed_profile
from meshd.models.store import ModelStore
from meshd.models.tokenizer_cache import TOKENIZERS_FOLDER
from meshd.runtime.import_tables import IMPORT_TABLES_FOLDER
from meshd.wire import pb

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
POINTS = ("answers", "plan", "first event", "done")


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def one_start(root: Path, store: Path, model: Path, max_tokens: int) -> dict[str, tuple]:
    """(wall s, CPU s) at each of POINTS for one fresh daemon in a new state folder."""
    state = Path(tempfile.mkdtemp(prefix="state-", dir=root))
    daemon = DaemonProcess(
        state, [*LOOPBACK, "--model", str(model)], env={"MESHD_MODEL_STORE": str(store)}
    )
    started = time.monotonic()
    daemon.start()
    points: dict[str, tuple] = {}

    def mark(point: str) -> None:
        points[point] = (time.monotonic() - started, cpu_seconds(daemon.pid))

    try:
        daemon.wait_ready(60)
        mark("answers")
        daemon.wait_for(plan_committed(1), 120, "a committed plan")
        mark("plan")
        request = pb.ChatRequest(
            messages=[pb.ChatMessage(role="user", content="Say hello.")],
            sampling=pb.Sampling(max_tokens=max_tokens),
        )
        for _ in client.stream_generation(daemon.api, request, timeout_s=120):
            if "first event" not in points:
                mark("first event")
        mark("done")
    finally:
        daemon.kill()
        shutil.rmtree(state, ignore_errors=True)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="starts of each kind")
    parser.add_argument("--max-tokens", type=int, default=8)
    arguments = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-startup-"))
    try:
        os.environ[PROFILE_SEED_ENV] = str(seed_profile(root / "profile"))
        store = root / "store"
        model = ModelStore(store).ensure_default().path
        caches = {"tables": store / IMPORT_TABLES_FOLDER, "tokenizers": store / TOKENIZERS_FOLDER}
        removed = {"cold": ("tables", "tokenizers"), "tables": ("tokenizers",), "kept": ()}
        results: dict[str, list[dict[str, tuple]]] = {kind: [] for kind in removed}
        print(f"{time.strftime('%Y-%m-%d %H:%M')} load {os.getloadavg()[0]:.2f}", flush=True)
        one_start(root, store, model, arguments.max_tokens)  # a start that writes both caches
        for number in range(arguments.rounds):
            kinds = list(removed) if number % 2 else list(reversed(removed))
            for kind in kinds:
                # Each start writes what it did not find: the caches kept are there.
                for cache in removed[kind]:
                    shutil.rmtree(caches[cache], ignore_errors=True)
                points = one_start(root, store, model, arguments.max_tokens)
                results[kind].append(points)
                cells = "  ".join(f"{p} {w:.2f} s / {c:.2f} s CPU" for p, (w, c) in points.items())
                print(f"round {number + 1} {kind:<6}  {cells}", flush=True)
        print("medians (wall / CPU of the daemon):")
        for kind, rows in results.items():
            cells = "  ".join(
                f"{point} {statistics.median(r[point][0] for r in rows):.2f} s / "
                f"{statistics.median(r[point][1] for r in rows):.2f} s"
                for point in POINTS
            )
            print(f"  {kind:<6}  {cells}")
        print(f"load {os.getloadavg()[0]:.2f} at the end")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
