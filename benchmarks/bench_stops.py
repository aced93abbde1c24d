"""Graceful stops of a whole mesh at once, repeated: does every daemon exit cleanly?

Each round starts --nodes daemons on loopback (as `meshd demo` does: mDNS on 127.0.0.1,
the embedded SmolLM2-135M split over all of them), waits until every node serves the plan,
sends one request, then SIGTERMs every daemon at the same moment and checks that each exits
with status 0 within its leave grace, and that no log holds an abort ("terminate called",
"Fatal Python error", a signal exit). Bounded: --rounds rounds, each with its own deadline.

    .venv/bin/python benchmarks/bench_stops.py --rounds 200 [--nodes 3] [--keep-failures DIR]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()

from meshd.api import client
from meshd.api.demo import default_model_dir, plan_committed, start_local_mesh
from meshd.wire import pb

ABNORMAL = ("terminate called", "Fatal Python error", "Segmentation fault", "Aborted")
ROUND_TIMEOUT_S = 120.0


def one_round(root: Path, nodes: int, model: Path) -> list[str]:
    """Problems of one round ([] when every daemon stopped cleanly)."""
    daemons = start_local_mesh(root, nodes, model, mesh_name=f"stops-{root.name}")
    problems: list[str] = []
    try:
        for daemon in daemons:
            daemon.wait_ready(ROUND_TIMEOUT_S)
        for daemon in daemons:
            daemon.wait_for(plan_committed(nodes), ROUND_TIMEOUT_S, "a committed plan")
        request = pb.GenerateRequest(
            prompt="The capital of France is", sampling=pb.Sampling(max_tokens=4)
        )
        list(client.stream_generation(daemons[-1].api, request, timeout_s=ROUND_TIMEOUT_S))
        for daemon in daemons:  # all at once, as `systemctl stop` on three machines would
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGTERM)
        for daemon in daemons:
            assert daemon.proc is not None
            try:
                code = daemon.proc.wait(60)
            except Exception:
                code = None
            log = daemon.log_path.read_text(errors="replace") if daemon.log_path.exists() else ""
            found = [word for word in ABNORMAL if word in log]
            if code != 0 or found:
                problems.append(
                    f"{daemon.state_dir.name}: exit {code}, {found or 'no abort in log'}"
                )
    finally:
        for daemon in daemons:
            daemon.kill()
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--keep-failures", type=Path, help="copy failed rounds' state here")
    args = parser.parse_args()
    if args.rounds < 1 or args.nodes < 1:
        parser.error("--rounds and --nodes must be at least 1")
    model = default_model_dir()
    failed = 0
    started = time.monotonic()
    for number in range(1, args.rounds + 1):
        root = Path(tempfile.mkdtemp(prefix=f"meshd-stops-{number}-"))
        round_start = time.monotonic()
        try:
            problems = one_round(root, args.nodes, model)
        except (TimeoutError, RuntimeError) as exc:
            problems = [f"round did not complete: {exc}"]
        if problems:
            failed += 1
            if args.keep_failures:  # the logs and state; not the sockets, which cannot be copied
                ignore = shutil.ignore_patterns("*.sock", "*.lock")
                shutil.copytree(root, args.keep_failures / root.name, ignore=ignore)
        shutil.rmtree(root, ignore_errors=True)
        print(
            f"round {number}: {'ABNORMAL ' + '; '.join(problems) if problems else 'clean'} "
            f"({time.monotonic() - round_start:.1f} s)",
            flush=True,
        )
    total = time.monotonic() - started
    print(f"{args.rounds - failed} of {args.rounds} rounds clean, {total:.0f} s in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
