"""Planning time of the partitioner on synthetic meshes of 4 to 1000 nodes (not a test).

Goal: under 100 ms at 64 nodes and under 2 s at 1000 nodes. Each mesh mixes
Mac-like machines (8-192 GiB, 68-819 GB/s); meshes up to 16 nodes are fully linked, larger ones
link every node to its 8 ring neighbours plus 4 random peers (a full 1000-node mesh would be a
million measured links, which no daemon measures). The models are Llama 3.1 70B at 8 bits
(80 layers, ~73 GB, fits on the largest machines alone), Llama 3.1 405B at 4 bits (126
layers, ~226 GB, needs several machines), the latter also with 4 concurrent sequences, and a
Qwen3-235B-A22B-shaped MoE at 8 bits (94 layers, ~250 GB held, ~23 GB read per token) that can
shard: the fastest kind of link (0.1 ms, 40 Gbit/s) is marked trusted, so tensor-parallel
groups and hybrid layouts are searched too. Planning time includes reading and quantizing the
graph and hashing.

Run: .venv/bin/python benchmarks/bench_partitioner.py [--repeat N] [--sizes 64 1000]
(CPU time is reported beside wall time: on a busy machine it is the planner's own cost.)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import networkx as nx

from partitioner import ModelSpec, PlanOptions, plan_model

SIZES = (4, 16, 64, 256, 1000)
GIB = 2**30
MACHINES = (  # memory budget GiB, FLOP/s, memory bandwidth bytes/s
    (8, 2.6e12, 68e9),
    (16, 3.6e12, 100e9),
    (24, 4.5e12, 120e9),
    (32, 7e12, 150e9),
    (64, 9e12, 273e9),
    (96, 14e12, 400e9),
    (128, 17e12, 546e9),
    (192, 28e12, 819e9),
)
LINKS = ((0.1e-3, 40e9 / 8), (0.3e-3, 10e9 / 8), (0.5e-3, 1e9 / 8), (3e-3, 400e6 / 8))


def llama_70b_8bit() -> ModelSpec:
    return ModelSpec.uniform(
        "Llama-3.1-70B-8bit",
        80,
        909_180_928,
        hidden_size=8192,
        bytes_per_param=1.0625,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        context_length=8192,
    )


def llama_405b_4bit() -> ModelSpec:
    return ModelSpec.uniform(
        "Llama-3.1-405B-4bit",
        126,
        1_792_696_320,
        hidden_size=16384,
        bytes_per_param=0.5625,
        num_attention_heads=128,
        num_key_value_heads=8,
        vocab_size=128256,
        context_length=8192,
    )


def qwen3_moe_8bit() -> ModelSpec:
    """Sizes of examples/models/qwen3-235b-a22b-instruct-2507-8bit (meshd.models.info)."""
    layer, active, experts = 2_643_247_616, 236_765_696, 2_566_914_048
    base = ModelSpec.uniform(
        "Qwen3-235B-A22B-8bit",
        94,
        layer,
        hidden_size=4096,
        bytes_per_param=1.0625,
        num_attention_heads=64,
        num_key_value_heads=4,
        vocab_size=151936,
        context_length=8192,
    ).to_dict()
    return ModelSpec.from_dict(
        {
            **base,
            "layer_active_bytes": active,
            "layer_active_params": int(active / 1.0625),
            "layer_expert_bytes": experts,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "supports_tensor_parallel": True,
        }
    )


def synthetic_mesh(size: int, seed: int = 7) -> nx.DiGraph:
    rng = random.Random(seed * 100_003 + size)
    graph = nx.DiGraph()
    for index in range(size):
        memory, flops, bandwidth = rng.choice(MACHINES)
        graph.add_node(
            f"node-{index:04d}",
            memory_budget=memory * GIB,
            flops=flops * rng.uniform(0.9, 1.1),
            mem_bandwidth=bandwidth * rng.uniform(0.9, 1.1),
        )
    names = list(graph.nodes)
    for index, src in enumerate(names):
        if size <= 16:
            peers = [n for n in names if n != src]
        else:
            ring = [names[(index + k) % size] for k in range(-4, 5) if k]
            peers = ring + rng.sample(names, 4)
        for dst in peers:
            if dst != src:
                latency, bandwidth = rng.choice(LINKS)
                trusted = latency == LINKS[0][0]
                for u, v in ((src, dst), (dst, src)):
                    graph.add_edge(u, v, latency_s=latency, bandwidth=bandwidth, trusted=trusted)
    return graph


def time_plan(
    mesh: nx.DiGraph, model: ModelSpec, options: PlanOptions, repeat: int
) -> tuple[float, float, str]:
    """Median wall and CPU seconds of planning (CPU time is what a busy machine cannot
    inflate), and the plan in a few words."""
    times, cpu, summary = [], [], ""
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        plan = plan_model(mesh, model, options)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        per_token_ms = plan.prediction.decode_s_per_token * 1e3
        summary = (
            f"{len(plan.stages):>3} stages {len(plan.nodes):>3} nodes  "
            f"{per_token_ms:8.1f} ms/token  {plan.layout}"
        )
    return statistics.median(times), statistics.median(cpu), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (median reported)")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=list(SIZES), help="mesh sizes (nodes) to plan"
    )
    args = parser.parse_args()
    cases = (
        (llama_70b_8bit(), "memory", 1),
        (llama_70b_8bit(), "speed", 1),
        (llama_405b_4bit(), "memory", 1),
        (llama_405b_4bit(), "speed", 1),
        (llama_405b_4bit(), "speed", 4),
        (qwen3_moe_8bit(), "speed", 1),
    )
    print(f"median of {args.repeat} runs; 405B needs at least two nodes of any mesh here")
    header = f"{'nodes':>6} {'links':>7}  {'model':<20} {'strategy':<8} {'conc':>4}"
    print(f"{header} {'plan time':>10} {'CPU':>10}  result")
    for size in args.sizes:
        mesh = synthetic_mesh(size)
        for model, strategy, concurrency in cases:
            options = PlanOptions(strategy=strategy, concurrency=concurrency)
            seconds, cpu, summary = time_plan(mesh, model, options, args.repeat)
            print(
                f"{size:>6} {mesh.number_of_edges():>7}  {model.name:<20} {strategy:<8} "
                f"{concurrency:>4} {seconds * 1e3:>7.1f} ms {cpu * 1e3:>7.1f} ms  {summary}"
            )


if __name__ == "__main__":
    main()
