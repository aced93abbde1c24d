"""Memory per node of a real mesh against its budget, through rounds of joins and leaves.

Starts N daemons on loopback with one ``--memory-budget`` that split the embedded default
model (SmolLM2-135M float32, memory strategy), runs a chat request, and reads every node's
RSS, peak RSS, MLX's memory, the plan's prediction and the process overhead planned out of
the budget. With ``--rounds R`` another node then joins and leaves R times (a request and a
reading of every node after each change), as nodes come and go in a home mesh. Every
reading says whether the process was over its budget; the summary counts them. Goal: no
reading over budget (RSS now, and the kernel's peak RSS since the daemon started).

    .venv/bin/python benchmarks/bench_mesh_memory.py [--nodes 3] [--rounds 4]
        [--budget 640MiB] [--process-overhead SIZE]

``--process-overhead 0`` plans the whole budget for the model (how plans were made before
the process's own memory was counted), for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.api import client
from meshd.api.demo import default_model_dir, loopback_args
from meshd.api.launcher import DaemonProcess
from meshd.mesh import security
from meshd.wire import pb
from partitioner.humanize import parse_size

MIB = 2**20
PLAN_TIMEOUT_S = 180


@dataclass(frozen=True)
class Reading:
    moment: str
    node: str
    rss: int
    peak_rss: int
    budget: int
    mlx_active: int
    planned: int
    overhead: int
    beside_mlx: int

    @property
    def over(self) -> bool:
        return self.rss > self.budget

    @property
    def peak_over(self) -> bool:
        return self.peak_rss > self.budget


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3, help="nodes that stay")
    parser.add_argument("--rounds", type=int, default=0, help="times another node joins, leaves")
    parser.add_argument("--budget", default="640MiB", help="--memory-budget of every node")
    parser.add_argument("--context-length", default="256")
    parser.add_argument("--process-overhead", help="plan this overhead instead of measuring it")
    parser.add_argument("--json", type=Path, help="write every reading here")
    args = parser.parse_args()
    model = default_model_dir()
    budget = parse_size(args.budget)
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-memory-"))
    token = security.encode_join_token(security.create_mesh_secret("bench-memory"))
    env = {"MESHD_PROCESS_OVERHEAD": args.process_overhead or ""}
    extra = ["--memory-budget", str(budget), "--context-length", args.context_length]

    def daemon(index: int) -> DaemonProcess:
        return DaemonProcess(
            root / f"node{index}",
            [*loopback_args(token, f"bench-{index}", model), "--http", "off", *extra],
            env=env,
        )

    stay = [daemon(i).start() for i in range(args.nodes)]
    readings: list[Reading] = []
    try:
        for d in stay:
            d.wait_ready()
        _settle(stay, args.nodes, "start")
        readings += _read_all(stay, "start")
        for round_index in range(args.rounds):
            joiner = daemon(args.nodes).start()
            try:
                joiner.wait_ready()
                _settle([*stay, joiner], args.nodes + 1, f"round {round_index + 1} join")
                readings += _read_all([*stay, joiner], f"round {round_index + 1} joined")
            finally:
                joiner.terminate(timeout_s=30)
            _settle(stay, args.nodes, f"round {round_index + 1} leave")
            readings += _read_all(stay, f"round {round_index + 1} left")
    finally:
        for d in stay:
            d.terminate()
        shutil.rmtree(root, ignore_errors=True)
    _print(readings, args, budget)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in readings], indent=1))
    return 0


def _settle(daemons: list[DaemonProcess], members: int, what: str) -> None:
    """Wait for a plan over ``members`` nodes, loaded everywhere, then run one request."""

    def ready(status: pb.MeshStatus) -> bool:
        agreement = status.agreement
        return (
            len(agreement.members) == members
            and bool(agreement.active_plan_id)
            and not status.transitions.moving
        )

    for d in daemons:
        d.wait_for(ready, PLAN_TIMEOUT_S, f"a loaded plan over {members} nodes ({what})")
    request = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="What is the capital of France?")],
        sampling=pb.Sampling(max_tokens=32),
    )
    list(client.stream_generation(daemons[0].api, request))


def _read_all(daemons: list[DaemonProcess], moment: str) -> list[Reading]:
    time.sleep(0.5)
    readings = []
    for d in daemons:
        status = d.status()
        memory = status.memory
        readings.append(
            Reading(
                moment=moment,
                node=status.node_id,
                rss=memory.rss,
                peak_rss=memory.peak_rss,
                budget=memory.budget,
                mlx_active=memory.mlx_active,
                planned=memory.planned,
                overhead=memory.overhead,
                beside_mlx=memory.overhead_now,
            )
        )
    return readings


def _print(readings: list[Reading], args: argparse.Namespace, budget: int) -> None:
    print(
        f"{args.nodes} daemons (+1 joining and leaving {args.rounds} times), SmolLM2-135M "
        f"float32, --memory-budget {budget / MIB:.0f} MiB, process overhead "
        f"{args.process_overhead or 'measured'}, pid {os.getpid()}"
    )
    print(
        f"{'moment':18} {'node':14} {'RSS':>6} {'peak':>6} {'budget':>7} {'MLX':>5} "
        f"{'planned':>8} {'overhead':>9} {'beside MLX':>10}  over?"
    )
    for r in readings:
        print(
            f"{r.moment:18} {r.node:14} {r.rss / MIB:6.0f} {r.peak_rss / MIB:6.0f} "
            f"{r.budget / MIB:7.0f} {r.mlx_active / MIB:5.0f} {r.planned / MIB:8.0f} "
            f"{r.overhead / MIB:9.0f} {r.beside_mlx / MIB:10.0f}  "
            + ("RSS OVER" if r.over else ("peak over" if r.peak_over else "no"))
        )
    over = sum(r.over for r in readings)
    peak_over = sum(r.peak_over for r in readings)
    worst = max((r.rss / r.budget for r in readings), default=0.0)
    print(
        f"readings: {len(readings)}; RSS over budget in {over}, peak RSS over budget in "
        f"{peak_over}; highest RSS {100 * worst:.0f}% of the budget"
    )


if __name__ == "__main__":
    sys.exit(main())
