"""The product, end to end: real `meshd run` daemons, TP=2 vs a pipeline vs one daemon.

Where ``benchmarks/bench_tensor_parallel.py`` drives the runner processes directly, this runs
what a user runs: daemons in network namespaces of their own (tests/netns.py: a bridge inside
its own namespace, nothing on the machine's interfaces), discovering each other over mDNS,
agreeing on a plan, and serving greedy requests through the local API. Layouts:

* ``one daemon, core 0``: one namespace, the daemon pinned to core 0 (``taskset``, which its
  runner and compute threads inherit) with one BLAS thread: one rank's share of the machine;
* ``one daemon, all cores``: the same, unpinned, default BLAS threads: this machine's best;
* ``pipeline, cores 0|1``: two daemons, ``--parallelism pipeline``, daemon i pinned to core i;
* ``TP=2, cores 0|1``: two daemons, ``--parallelism tensor`` over the bridge's subnet marked
  trusted (``--tensor-parallel-trusted-network``), daemon i and its runner pinned to core i.

Reported per layout: decode tok/s (the daemon's own ``decode_tokens_per_s``, and the client's
(tokens - 1) / (last token - first token)), time to first token, medians of ``--repeats``
requests of ``--generate`` greedy tokens after one warm-up request, and the load average of
the machine before and after (the benchmark shares it; numbers from a loaded machine say so).

Run as root (namespaces): ``.venv/bin/python benchmarks/bench_tensor_parallel_mesh.py
[--model small|large] [--generate 48] [--repeats 3] [--json OUT]`` (about 3-6 minutes).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.netns, tests.support

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

from meshd.api import client
from meshd.api.launcher import DaemonProcess
from meshd.mesh import security
from meshd.mesh.profiling import load_or_measure_profile
from meshd.wire import pb
from tests.netns import Mesh, cleanup_stale

# The two shapes of bench_tensor_parallel.py: "large" is compute- and memory-bound (hidden
# 2048, ~1.5 GB float32), "small" SmolLM2's shape (60 all-reduces per token dominate).
MODELS: dict[str, dict[str, int]] = {
    "large": {"layers": 8, "hidden": 2048, "heads": 16, "kv_heads": 8, "intermediate": 5632},
    "small": {"layers": 30, "hidden": 576, "heads": 8, "kv_heads": 4, "intermediate": 1536},
}
VOCAB = 4096
PROMPT = "tensor parallel stages split every layer of the model over a group of nodes, and "
PLAN_TIMEOUT_S = 240.0
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1"}


@dataclass
class Layout:
    name: str
    daemons: int
    parallelism: str
    pinned: bool


LAYOUTS = [
    Layout("one daemon, core 0", 1, "auto", True),
    Layout("one daemon, all cores", 1, "auto", False),
    Layout("pipeline, cores 0|1", 2, "pipeline", True),
    Layout("TP=2, cores 0|1", 2, "tensor", True),
]


@dataclass
class Result:
    layout: str
    plan: str
    decode_tok_s: float  # the daemon's decode_tokens_per_s, median
    client_decode_tok_s: float  # (tokens - 1) / (last - first token) at the client, median
    ttft_ms: float
    tokens: int
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    runs: list[dict] = field(default_factory=list)


class PinnedDaemon(DaemonProcess):
    """A daemon started under ``taskset -c CORES`` (inside its namespace): every thread and
    every process it starts (its tensor-parallel runner) stays on those cores."""

    def __init__(self, *args, cores: str | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cores = cores

    def command(self) -> list[str]:
        command = super().command()
        if self.cores is None:
            return command
        python = command.index(sys.executable)
        return [*command[:python], "taskset", "-c", self.cores, *command[python:]]


def make_model(root: Path, shape: str) -> Path:
    from meshd.runtime.blas import enable_fast_blas

    enable_fast_blas()
    from tests.support.random_model import make_random_model_dir

    return make_random_model_dir(
        root / f"llama-{shape}", "llama", vocab=VOCAB, max_shard_bytes=200_000_000, **MODELS[shape]
    )


def serving(layout: Layout, members: int):
    def check(status: pb.MeshStatus) -> bool:
        plan = json.loads(status.agreement.plan_json) if status.agreement.plan_json else {}
        if not plan or len(status.agreement.members) != members:
            return False
        if layout.parallelism == "tensor":
            runners = status.tensor_parallel_runners
            ready = bool(runners) and all(r.state == "ready" for r in runners)
            return plan.get("layout") == "tensor" and ready
        if layout.parallelism == "pipeline":
            return plan.get("layout") == "pipeline"
        return True

    return check


def one_request(daemon: DaemonProcess, tokens: int) -> dict:
    # return_logits: one event per token (text events merge or hold back a random model's
    # bytes), so the client can time every token; 16 KB per token, nothing next to a step
    request = pb.GenerateRequest(
        prompt=PROMPT, sampling=pb.Sampling(max_tokens=tokens), return_logits=True
    )
    started = time.perf_counter()
    stamps, done = [], None
    for event in client.stream_generation(daemon.api, request, timeout_s=600):
        if event.HasField("token"):
            stamps.append(time.perf_counter())
        elif event.HasField("done"):
            done = event.done
    assert done is not None, "the request ended without its done event"
    client_rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 2 else 0.0
    return {
        "completion_tokens": done.completion_tokens,
        "finish_reason": done.finish_reason,
        "decode_tok_s": done.decode_tokens_per_s,
        "client_decode_tok_s": client_rate,
        "ttft_ms": done.ttft_s * 1e3,
        "client_ttft_ms": (stamps[0] - started) * 1e3 if stamps else 0.0,
        "plan_id": done.plan_id,
    }


def run_layout(layout: Layout, mesh: Mesh, root: Path, model: Path, profile: Path, args) -> Result:
    token = security.encode_join_token(security.create_mesh_secret("bench"))
    subnet = mesh.nodes[0].ip.rsplit(".", 1)[0] + ".0/24"
    daemons = []
    for index, node in enumerate(mesh.nodes[: layout.daemons]):
        state = root / f"{layout.parallelism}-{layout.daemons}-{index}-{time.monotonic_ns()}"
        state.mkdir(parents=True)
        shutil.copyfile(profile, state / "profile.json")
        flags = ["--interface", "eth0", "--join", token, "--name", f"bench{index}"]
        flags += ["--model", str(model), "--parallelism", layout.parallelism]
        flags += ["--context-length", "512", "--log-level", "WARNING"]
        if layout.parallelism == "tensor":
            flags += ["--tensor-parallel-trusted-network", subnet]
        env = {"MESHD_MODEL_STORE": str(root / "store"), **(ONE_THREAD if layout.pinned else {})}
        cores = str(index % os.cpu_count()) if layout.pinned else None
        daemons.append(PinnedDaemon(state, flags, netns=node.ns, env=env, cores=cores).start())
    try:
        for daemon in daemons:
            daemon.wait_for(serving(layout, layout.daemons), PLAN_TIMEOUT_S, layout.name)
        plan = json.loads(daemons[0].status().agreement.plan_json)
        shape = " | ".join("+".join(s["nodes"]) for s in plan["stages"])
        one_request(daemons[0], 8)  # warm-up: caches, the runner's first step
        load_before = os.getloadavg()
        runs = [one_request(daemons[0], args.generate) for _ in range(args.repeats)]
        load_after = os.getloadavg()
    finally:
        for daemon in daemons:
            daemon.kill()
    return Result(
        layout=layout.name,
        plan=f"{plan.get('layout', '?')}: {shape}",
        decode_tok_s=statistics.median(r["decode_tok_s"] for r in runs),
        client_decode_tok_s=statistics.median(r["client_decode_tok_s"] for r in runs),
        ttft_ms=statistics.median(r["ttft_ms"] for r in runs),
        tokens=min(r["completion_tokens"] for r in runs),
        load_before=tuple(round(x, 2) for x in load_before),
        load_after=tuple(round(x, 2) for x in load_after),
        runs=runs,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="large")
    parser.add_argument("--model-dir", type=Path, help="a model directory to use instead")
    parser.add_argument("--generate", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", action="append", help="run only layouts containing this")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("this benchmark creates network namespaces: run it as root")
    cleanup_stale()
    layouts = [
        layout
        for layout in LAYOUTS
        if not args.only or any(word in layout.name for word in args.only)
    ]
    print(f"{os.cpu_count()} CPUs; load average at start {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="meshd-bench-tp-") as tmp:
        root = Path(tmp)
        model = args.model_dir or make_model(root, args.model)
        profile_dir = root / "profile"
        profile_dir.mkdir()
        load_or_measure_profile(profile_dir, memory_budget_override=None)
        results = []
        with Mesh(2) as mesh:
            for layout in layouts:
                result = run_layout(layout, mesh, root, model, profile_dir / "profile.json", args)
                results.append(result)
                print(
                    f"{result.layout:24} {result.decode_tok_s:7.2f} tok/s decode (client "
                    f"{result.client_decode_tok_s:6.2f}), ttft {result.ttft_ms:7.1f} ms, "
                    f"{result.tokens} tokens, plan {result.plan}, load {result.load_before} -> "
                    f"{result.load_after}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))


if __name__ == "__main__":
    main()
