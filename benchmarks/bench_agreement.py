"""Agreement benchmark on a 4-host network-namespace mesh (run as root).

Reports, over several rounds:
  * time from the last daemon starting until every node reports the same committed plan
    (goal: under 3 s),
  * time from `kill -9` of one daemon until the survivors all report the same new plan
    (goal: under 3 s).

    .venv/bin/python benchmarks/bench_agreement.py [--nodes 4] [--rounds 3]

The model is a random-weight llama whose weights need three of the hosts' 120 MB budgets,
so the plan really spans several nodes. Everything runs inside namespaces this script
creates and removes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.api.launcher import DaemonProcess
from meshd.mesh import security
from meshd.mesh.profiling import load_or_measure_profile
from tests.netns import Mesh, cleanup_stale, require_root_and_netns
from tests.support.random_model import make_three_host_llama


def same_plan(daemons: list[DaemonProcess], members: int) -> str | None:
    seen = set()
    for d in daemons:
        view = d.status().agreement
        if not view.active_plan_id or len(view.members) != members:
            return None
        seen.add(view.active_plan_id)
    return seen.pop() if len(seen) == 1 else None


def wait_same_plan(daemons: list[DaemonProcess], members: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            plan = same_plan(daemons, members)
        except Exception:
            plan = None
        if plan:
            return plan
        time.sleep(0.02)
    raise TimeoutError(f"no common plan over {members} nodes within {timeout_s} s")


def one_round(n: int, root: Path, profile: Path, model: Path) -> tuple[float, float]:
    token = security.encode_join_token(security.create_mesh_secret("bench"))
    with Mesh(n) as mesh:
        daemons = []
        for node in mesh.nodes:
            state = root / f"{node.ns}"
            state.mkdir(parents=True)
            shutil.copyfile(profile, state / "profile.json")
            args = [
                "--interface",
                "eth0",
                "--join",
                token,
                "--model",
                str(model),
                "--memory-budget",
                "120MB",
                "--process-overhead",  # a simulated small machine: the budget is the model's
                "0",
                "--context-length",
                "256",
                "--log-level",
                "WARNING",
            ]
            daemons.append(DaemonProcess(state, args, netns=node.ns))
        try:
            for d in daemons:
                d.start()
            last_started = time.monotonic()
            wait_same_plan(daemons, n, 60)
            committed = time.monotonic() - last_started
            os.killpg(daemons[-1].pid, signal.SIGKILL)
            killed = time.monotonic()
            wait_same_plan(daemons[:-1], n - 1, 60)
            replanned = time.monotonic() - killed
            return committed, replanned
        finally:
            for d in daemons:
                d.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    require_root_and_netns()
    cleanup_stale()
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-"))
    try:
        load_or_measure_profile(root, memory_budget_override=None)
        model = make_three_host_llama(root / "tiny-llama")
        print(f"{args.nodes}-host namespace mesh, model needing 3 hosts, {args.rounds} rounds")
        results = []
        for i in range(args.rounds):
            committed, replanned = one_round(
                args.nodes, root / f"r{i}", root / "profile.json", model
            )
            results.append((committed, replanned))
            print(
                f"  round {i + 1}: same plan on all {args.nodes} nodes {committed:.2f} s after the "
                f"last start; after kill -9 the survivors agreed on a new plan in {replanned:.2f} s"
            )
        med = [statistics.median(col) for col in zip(*results, strict=True)]
        print(f"  median: first common plan {med[0]:.2f} s, re-plan after kill -9 {med[1]:.2f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
