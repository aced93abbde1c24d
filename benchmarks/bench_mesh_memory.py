"""Memory per node of a real mesh vs its share of the weights (daemons on loopback).

Starts N daemons that split the embedded default model (memory strategy: equal thirds
for 3 nodes), runs a chat request, then reads every node's MLX allocator counters and
RSS from `meshd status` and prints them next to the node's share of the weights and the
plan's prediction.

    .venv/bin/python benchmarks/bench_mesh_memory.py [--nodes 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.api import client
from meshd.api.demo import default_model_dir, plan_committed, start_local_mesh
from meshd.wire import pb

MIB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args()
    model = default_model_dir()
    root = Path(tempfile.mkdtemp(prefix="meshd-bench-"))
    daemons = start_local_mesh(root, args.nodes, model)
    try:
        for d in daemons:
            d.wait_ready()
            d.wait_for(plan_committed(args.nodes), 60, "a committed plan")
        request = pb.ChatRequest(
            messages=[pb.ChatMessage(role="user", content="What is the capital of France?")],
            sampling=pb.Sampling(max_tokens=64),
        )
        list(client.stream_generation(daemons[0].api, request))
        plan = json.loads(daemons[0].status().agreement.plan_json)
        total = sum(m["weights_bytes"] for m in plan["memory"])
        print(f"{args.nodes} daemons, SmolLM2-135M float32, after one chat request")
        print(
            f"{'node':14} {'layers':>7} {'weights MiB':>12} {'MLX now':>8} {'MLX peak':>9} "
            f"{'planned':>8} {'RSS':>6} {'peak RSS':>9}"
        )
        for d in daemons:
            status = d.status()
            mem = status.memory
            share = next(m for m in plan["memory"] if m["node"] == status.node_id)
            stage = plan["stages"][share["stage"]]
            print(
                f"{status.node_id:14} {stage['layer_start']:>3}-{stage['layer_end'] - 1:<3} "
                f"{share['weights_bytes'] / MIB:12.0f} {mem.mlx_active / MIB:8.0f} "
                f"{mem.mlx_peak / MIB:9.0f} {mem.planned / MIB:8.0f} {mem.rss / MIB:6.0f} "
                f"{mem.peak_rss / MIB:9.0f}"
            )
        print(f"weights in all stages: {total / MIB:.0f} MiB (tied embedding on first and last)")
    finally:
        for d in daemons:
            d.terminate()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
