"""Control-plane benchmark on a 4-host network-namespace mesh (run as root).

Reports:
  * time from the last daemon starting until every node sees every other node and every
    link is measured (goal: under 2 s),
  * time from `kill -9` of one daemon until every survivor has dropped it (goal: under 2 s),
  * measured vs configured link bandwidth for tbf-shaped links.

    .venv/bin/python benchmarks/bench_mesh.py [--nodes 4] [--rounds 3]

Everything runs inside namespaces this script creates and removes; nothing is sent on
the machine's real interfaces.
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

from meshd.api.launcher import DaemonProcess, alive_ids, fully_meshed
from meshd.mesh import security
from meshd.mesh.profiling import load_or_measure_profile
from tests.netns import Mesh, cleanup_stale, require_root_and_netns


def start_daemons(
    mesh: Mesh, root: Path, token: str, profile: Path, probe_s: float
) -> list[DaemonProcess]:
    daemons = []
    for node in mesh.nodes:
        state = root / node.ns
        state.mkdir(parents=True)
        shutil.copyfile(profile, state / "profile.json")
        args = [
            "--interface",
            "eth0",
            "--join",
            token,
            "--link-probe-interval",
            str(probe_s),
            "--log-level",
            "WARNING",
        ]
        daemons.append(DaemonProcess(state, args, netns=node.ns))
    return daemons


def convergence_round(n: int, root: Path, profile: Path) -> tuple[float, float, float, float]:
    token = security.encode_join_token(security.create_mesh_secret("bench"))
    with Mesh(n) as mesh:
        daemons = start_daemons(mesh, root / f"r{time.monotonic_ns()}", token, profile, 30)
        try:
            for d in daemons:
                d.start()
            last_started = time.monotonic()
            # Time "startup" separately: python + imports before the daemon can do anything.
            for d in daemons:
                d.wait_ready()
            ready = time.monotonic() - last_started
            for d in daemons:
                d.wait_for(lambda s: fully_meshed(s, n), 60, "a full mesh")
            converged = time.monotonic() - last_started
            victim = daemons[-1]
            victim_id = victim.status().node_id
            os.killpg(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
            for d in daemons[:-1]:
                d.wait_for(lambda s: victim_id not in alive_ids(s), 30, "the victim lost")
            noticed = time.monotonic() - killed
            # Pull the cable of another host: noticed by the heartbeat gap.
            cut_id = daemons[-2].status().node_id
            mesh.link_down(n - 2)
            cut = time.monotonic()
            for d in daemons[:-2]:
                d.wait_for(lambda s: cut_id not in alive_ids(s), 30, "the cut host lost")
            cut_noticed = time.monotonic() - cut
            return ready, converged, noticed, cut_noticed
        finally:
            for d in daemons:
                d.kill()


def bandwidth_round(root: Path, profile: Path, rates: list[str]) -> list[tuple[str, float]]:
    token = security.encode_join_token(security.create_mesh_secret("bench"))
    out = []
    with Mesh(2) as mesh:
        daemons = start_daemons(mesh, root / "bw", token, profile, 1.0)
        try:
            for d in daemons:
                d.start()
            for d in daemons:
                d.wait_for(lambda s: fully_meshed(s, 2), 60, "a full mesh")
            src = daemons[0].status().node_id
            for rate in rates:
                mesh.limit_rate(0, rate, direction="egress")
                time.sleep(2.5)  # two probe intervals: the next measurement is under the cap
                samples = []
                for _ in range(3):
                    status = daemons[0].status()
                    samples += [m.bandwidth for m in status.links if m.src == src]
                    time.sleep(1.1)
                out.append((rate, statistics.median(samples)))
                mesh.clear_rate(0, direction="egress")
        finally:
            for d in daemons:
                d.kill()
    return out


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
        profile = root / "profile.json"
        print(f"{args.nodes}-host namespace mesh, {args.rounds} rounds")
        results = [convergence_round(args.nodes, root, profile) for _ in range(args.rounds)]
        for i, (ready, converged, noticed, cut) in enumerate(results):
            print(
                f"  round {i + 1}: API up {ready:.2f} s, all see all + links measured "
                f"{converged:.2f} s after the last start ({converged - ready:.2f} s after its "
                f"API was up), kill -9 noticed by all in {noticed * 1e3:.0f} ms, "
                f"cut cable noticed in {cut:.2f} s"
            )
        med = [statistics.median(col) for col in zip(*results, strict=True)]
        print(
            f"  median: API up {med[0]:.2f} s, converged {med[1]:.2f} s "
            f"({med[1] - med[0]:.2f} s after API up), kill -9 noticed {med[2] * 1e3:.0f} ms, "
            f"cut cable noticed {med[3]:.2f} s"
        )
        print("link bandwidth, measured vs configured (tbf on the sender's egress):")
        for rate, measured in bandwidth_round(
            root, profile, ["50mbit", "100mbit", "500mbit", "1gbit"]
        ):
            from tests.netns import parse_rate

            configured = parse_rate(rate) / 8
            print(
                f"  {rate:>8}: measured {measured * 8 / 1e6:8.1f} Mbit/s "
                f"({measured / configured * 100:5.1f}% of configured)"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
