"""The agreement protocol at scale: 32, 64 and 128 simulated nodes with churn.

Runs the seeded simulator (`tests/agreement_sim.py`, the real `meshd.agreement.protocol`
state machine without sockets) on meshes of each size: every node starts within 0.3 s, then
churn (crashes, restarts, flapping links, graceful leaves, re-measured profiles, late joiners)
for a few simulated seconds, then a stable world. Safety is checked at every simulated event
(a violation aborts the run); the run reports, per mesh size, the simulated time from the
last change until every side serves one committed plan, the bound it must stay within, the
messages sent, and the wall time the simulation took.

    .venv/bin/python benchmarks/bench_agreement_scale.py [--nodes 32 64 128] [--seeds 5]

Prints a table and, with --json, one JSON object per run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.agreement.messages import AgreementConfig
from tests.agreement_sim import NetworkFaults, RunResult, scaled_run

# The daemon's own timing (AgreementConfig's defaults: 2 s join stability, 3 s start-up grace,
# retransmission every 0.5 s).
CONFIG = AgreementConfig()
FAULTS = NetworkFaults(drop_rate=0.05, duplicate_rate=0.02, max_delay_s=0.05, max_detect_s=0.3)


def one(seed: int, nodes: int, churn: int) -> tuple[RunResult, float]:
    started = time.perf_counter()
    result = scaled_run(seed, nodes, CONFIG, FAULTS, churn_events=churn)
    return result, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per mesh size")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--churn", type=int, default=8, help="churn events per run")
    parser.add_argument("--json", action="store_true", help="one JSON line per run")
    args = parser.parse_args()
    print(
        "nodes | seeds | converged | after last change (s): median / max | bound (s) | "
        "messages (median) | wall s per run (median)"
    )
    failed = 0
    for nodes in args.nodes:
        converged, messages, walls, bound = [], [], [], 0.0
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            result, wall = one(seed, nodes, args.churn)
            counts = dict(result.counts)
            bound = result.bound_s
            walls.append(wall)
            messages.append(counts.get("messages", 0))
            if result.converged_after_s is not None and not result.problems:
                converged.append(result.converged_after_s)
            else:
                failed += 1
            if args.json:
                print(
                    json.dumps(
                        {
                            "nodes": nodes,
                            "seed": seed,
                            "converged_after_s": result.converged_after_s,
                            "bound_s": result.bound_s,
                            "problems": list(result.problems[:3]),
                            "commits_after_convergence": result.commits_after_convergence,
                            "counts": counts,
                            "wall_s": round(wall, 2),
                        }
                    ),
                    flush=True,
                )
        times = f"{statistics.median(converged):.2f} / {max(converged):.2f}" if converged else "-"
        print(
            f"{nodes} | {args.seeds} | {len(converged)} | {times} | {bound:.2f} | "
            f"{statistics.median(messages):,.0f} | {statistics.median(walls):.1f}",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
