"""Tensor parallelism (TP=2) vs one process vs a 2-stage pipeline, on this machine's CPU cores.

Every configuration runs through the same runner processes and daemon-side API the mesh uses
(:mod:`meshd.inference.tensor_parallel`), so each pays the same daemon<->runner hop:

* ``one process, 1 core``: one runner holding the whole model, pinned to core 0 (``taskset``),
  one BLAS thread: what one rank of the others gets;
* ``one process, 2 cores``: the same, unpinned, default BLAS threads: this machine's best;
* ``pipeline, 2 stages``: two runners, layers split in half, pinned to cores 0 and 1; the hidden
  states go stage 0 -> this process -> stage 1 (what the data plane does between nodes);
* ``TP=2 pinned``: a 2-rank ``mx.distributed`` ring group, rank r pinned to core r, one BLAS
  thread each: every layer split over both cores, two all-reduces per layer;
* ``TP=2 unpinned``: the same with neither pinning nor a thread limit.

Reported: prefill tok/s (prompt of ``--prompt`` tokens), decode tok/s (``--generate`` greedy
steps), medians of ``--repeats`` runs, and for TP rank 0's relay time per step (sending each
step's input to the other rank: the price of rank 0 relaying rather than the previous stage
sending to every member). Models: ``large`` (random llama, hidden 2048, 8 layers, ~1.5 GB
float32: compute and memory traffic dominate) and ``small`` (hidden 576, 30 layers, ~440 MB, like
SmolLM2's shape: 60 all-reduces per token dominate).

With ``--failures N``: N times, ``kill -9`` of rank 1's runner during decoding, timed until rank
0's step fails and until both runners are gone.

Run: ``.venv/bin/python benchmarks/bench_tensor_parallel.py [--model large|small]
[--model-dir DIR] [--failures N] [--json OUT]`` (2-4 minutes per model on 2 cores).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from meshd.inference.tensor_parallel import (
    TensorParallelMember,
    TensorParallelSpec,
    build_group_spec,
)
from tests.support.ports import free_base_port
from tests.support.random_model import make_random_model_dir

MODELS: dict[str, dict[str, int]] = {
    "large": {"layers": 8, "hidden": 2048, "heads": 16, "kv_heads": 8, "intermediate": 5632},
    "small": {"layers": 30, "hidden": 576, "heads": 8, "kv_heads": 4, "intermediate": 1536},
}
VOCAB = 4096
SECRET = b"bench-secret-bench-secret-000000"
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1"}


@dataclass
class Result:
    name: str
    prefill_tok_s: float
    decode_tok_s: float
    relay_ms_per_step: float | None = None
    compute_ms_per_step: float | None = None


def specs_for(model_dir: Path, layers: int, sizes: list[int]) -> list[TensorParallelSpec]:
    """One spec per stage; ``sizes`` = ranks per stage; layers split evenly between stages."""
    plan_id = os.urandom(16).hex()
    base = free_base_port(plan_id, range(len(sizes)), max(sizes))
    bounds = np.linspace(0, layers, len(sizes) + 1).astype(int)
    specs = []
    for index, size in enumerate(sizes):
        nodes = [f"s{index}r{rank}" for rank in range(size)]
        specs.append(
            build_group_spec(
                plan_id=plan_id,
                stage_index=index,
                stage_nodes=nodes,
                layer_start=int(bounds[index]),
                layer_end=int(bounds[index + 1]),
                has_embedding=index == 0,
                has_head=index == len(sizes) - 1,
                model_dir=model_dir,
                addresses=dict.fromkeys(nodes, "127.0.0.1"),
                link="loopback (benchmark)",
                mesh_secret=SECRET,
                base_port=base,
            )
        )
    return specs


async def run_config(
    name: str,
    model_dir: Path,
    layers: int,
    sizes: list[int],
    cores: list[list[int] | None],
    env: dict[str, str],
    prompt_len: int,
    generate: int,
    repeats: int,
) -> Result:
    """Start the stages (ranks pinned to ``cores`` in order), measure, stop."""
    specs = specs_for(model_dir, layers, sizes)
    members: list[TensorParallelMember] = []
    placement = iter(cores)
    for spec in specs:
        for rank in range(spec.size):
            core = next(placement)
            prefix = ["taskset", "-c", ",".join(map(str, core))] if core else []
            members.append(TensorParallelMember(spec, rank, command_prefix=prefix, env=env))
    leaders = [m for m in members if m.rank == 0]
    try:
        await asyncio.gather(*(m.start() for m in members))
        rng = random.Random(0)

        async def step(request: str, tokens: list[int]) -> int:
            payload: Any = tokens
            for index, leader in enumerate(leaders):
                logits = "last" if index == len(leaders) - 1 else "none"
                payload = await leader.forward(request, payload, logits=logits)
            return int(np.argmax(np.array(payload)[0, -1]))

        await step("warm-up", [1, 2, 3, 4])
        await step("warm-up", [5])
        prefill, decode = [], []
        before = await leaders[0].stats()
        for repeat in range(repeats):
            prompt = [rng.randrange(300, VOCAB) for _ in range(prompt_len)]
            request = f"r{repeat}"
            started = time.perf_counter()
            token = await step(request, prompt)
            prefill.append(prompt_len / (time.perf_counter() - started))
            started = time.perf_counter()
            for _ in range(generate):
                token = await step(request, [token])
            decode.append(generate / (time.perf_counter() - started))
            for leader in leaders:
                await leader.release(request)
        after = await leaders[0].stats()
        steps = after["steps"] - before["steps"]
        relay = compute = None
        if specs[0].size > 1:
            relay = 1e3 * (after["relay_s"] - before["relay_s"]) / steps
            compute = 1e3 * (after["compute_s"] - before["compute_s"]) / steps
        return Result(name, statistics.median(prefill), statistics.median(decode), relay, compute)
    finally:
        await asyncio.gather(*(m.stop() for m in members), return_exceptions=True)


async def bench(model_dir: Path, shape: dict[str, int], args: argparse.Namespace) -> list[Result]:
    layers = shape["layers"]
    common = (model_dir, layers)
    timing = (args.prompt, args.generate, args.repeats)
    configs = [
        ("one process, 1 core", [1], [[0]], ONE_THREAD),
        ("one process, 2 cores", [1], [None], {}),
        ("pipeline, 2 stages", [1, 1], [[0], [1]], ONE_THREAD),
        ("TP=2 pinned", [2], [[0], [1]], ONE_THREAD),
        ("TP=2 unpinned", [2], [None, None], {}),
    ]
    results = []
    for name, sizes, cores, env in configs:
        result = await run_config(name, *common, sizes, cores, env, *timing)
        print(
            f"{name:22s} prefill {result.prefill_tok_s:8.1f} tok/s   decode "
            f"{result.decode_tok_s:6.2f} tok/s"
            + (
                f"   relay {result.relay_ms_per_step:.3f} ms/step, rank 0 compute+collectives "
                f"{result.compute_ms_per_step:.1f} ms/step"
                if result.relay_ms_per_step is not None
                else ""
            ),
            flush=True,
        )
        results.append(result)
    return results


async def _decode_until_failure(leader: TensorParallelMember, logits: Any) -> float:
    """Greedy steps until one fails; when it failed (monotonic seconds)."""
    while True:
        token = [int(np.argmax(np.array(logits)[0, -1]))]
        try:
            logits = await leader.forward("k", token)
        except Exception:
            return time.monotonic()


async def failure_timings(model_dir: Path, layers: int, trials: int) -> dict[str, list[float]]:
    """``kill -9`` of rank 1's runner during greedy decoding, ``trials`` times: seconds until
    the killed process is gone (the kernel frees its memory before it closes its sockets), until
    rank 0's step fails, and until both runners are gone (the heartbeat bound is 1.5 s)."""
    import signal

    import psutil

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    timings: dict[str, list[float]] = {"victim_gone_s": [], "error_s": [], "all_gone_s": []}
    for _ in range(trials):
        (spec,) = specs_for(model_dir, layers, [2])
        members = [TensorParallelMember(spec, rank) for rank in range(2)]
        await asyncio.gather(*(m.start() for m in members))
        leader = members[0]
        pids = [m.pid for m in members]
        try:
            logits = await leader.forward("k", [1, 2, 3])

            task = asyncio.ensure_future(_decode_until_failure(leader, logits))
            await asyncio.sleep(0.3)
            killed = time.monotonic()
            os.kill(pids[1], signal.SIGKILL)
            while not gone(pids[1]):
                await asyncio.sleep(0.001)
            timings["victim_gone_s"].append(time.monotonic() - killed)
            failed = await asyncio.wait_for(task, 30)
            while not all(gone(pid) for pid in pids):
                await asyncio.sleep(0.001)
            timings["error_s"].append(failed - killed)
            timings["all_gone_s"].append(time.monotonic() - killed)
        finally:
            await asyncio.gather(*(m.stop() for m in members), return_exceptions=True)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="large")
    parser.add_argument("--model-dir", type=Path, help="reuse (or create) the model here")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--generate", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--failures", type=int, default=0, help="also time N kill -9s of a rank mid-decoding"
    )
    args = parser.parse_args()
    if shutil.which("taskset") is None:
        raise SystemExit("taskset (util-linux) is needed to pin ranks to cores")
    shape = MODELS[args.model]
    temporary = None
    model_dir = args.model_dir
    if model_dir is None:
        temporary = tempfile.TemporaryDirectory(prefix="meshd-bench-tp-")
        model_dir = Path(temporary.name) / args.model
    if not (model_dir / "config.json").exists():
        print(f"writing a random {args.model} llama to {model_dir} ...", flush=True)
        make_random_model_dir(model_dir, "llama", vocab=VOCAB, **shape)
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    print(
        f"model {args.model}: {shape}, {size / 1e9:.2f} GB float32; prompt {args.prompt}, "
        f"generate {args.generate}, median of {args.repeats}; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        flush=True,
    )
    try:
        results = asyncio.run(bench(model_dir, shape, args))
        failures = {}
        if args.failures:
            failures = asyncio.run(failure_timings(model_dir, shape["layers"], args.failures))
            for name, values in failures.items():
                print(
                    f"kill -9 of rank 1 -> {name}: median {statistics.median(values) * 1e3:.0f} "
                    f"ms, max {max(values) * 1e3:.0f} ms over {len(values)}"
                )
    finally:
        if temporary is not None:
            temporary.cleanup()
    base = results[0]
    print("\nrelative to one process on 1 core (prefill / decode):")
    for result in results:
        print(
            f"  {result.name:22s} {result.prefill_tok_s / base.prefill_tok_s:5.2f}x / "
            f"{result.decode_tok_s / base.decode_tok_s:5.2f}x"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "results": [asdict(r) for r in results],
                    "failures": failures,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
