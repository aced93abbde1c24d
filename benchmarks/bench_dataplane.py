"""The mesh data plane with 1, 2 and 3 stage processes vs one mlx-lm process.

Side by side in one run, on SmolLM2-135M float32 (the embedded default) and, with
``--random-100m``, a random ~100M-parameter llama; prompt 128 / generate 64, greedy, EOS
ignored so every run generates the same number of tokens:

* decode tok/s and time to first token: ``mlx_lm.stream_generate`` in a process of its own;
  the mesh with 1, 2 and 3 stages, every stage a separate process
  (``python -m tests.support.stage_process --serve``)
  on loopback with mutual TLS, the first stage also
  being the origin (a client talking to its local daemon);
* per-hop overhead per token: decode time per token not spent computing (each stage adds its
  compute time to the frames it sends) divided by the hops per token (one per stage: the
  forward hops plus the token's way back), and the slowdown per hop vs the 1-stage mesh;
* aggregate throughput of 4 concurrent requests vs 1 request on 2 stages;
* peak RSS per node vs the weights it holds.

Goals: 2 stages decode at >= 90% of one process; < 1 ms per hop on loopback;
4 concurrent requests >= 1.5x one request's throughput on 2 stages.

Run: ``.venv/bin/python benchmarks/bench_dataplane.py [--store DIR] [--random-100m]
[--json OUT]`` (about 3 minutes for SmolLM2 on 2 cores; ``--store`` reuses a model store).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()  # before mlx.core (the baseline child runs this file too)

import argparse
import contextlib
import json
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshd.inference.assignment import Assignment, StageSpec
from meshd.inference.stage.model import even_layer_ranges
from meshd.mesh import security
from meshd.models.store import DEFAULT_MODEL, ModelStore
from tests.support.random_model import make_random_model_dir

# Importing the daemon package loads OpenBLAS before mlx.core in every node process too.
NODE_COMMAND = [sys.executable, "-m", "tests.support.stage_process", "--serve"]
COMMAND_TIMEOUT_S = 600.0
CONCURRENT_REQUESTS = 4
# Each node limited to one core, as if every stage had a machine of its own: on one 2-core
# machine a single request's stages already take turns using both cores.
# The daemon tells a data plane how many of the plan's stages share its machine (from the
# peers' machine fingerprints); here every stage runs on this machine. "Not shared" is the
# comparison: every stage uses every core however many requests are in flight.
NOT_SHARED = "cores not shared"

MIB = 1 << 20


def prompt_ids(vocab: int, length: int, variant: int = 0) -> list[int]:
    """A fixed, varied prompt of ``length`` ordinary token ids (``variant`` shifts it)."""
    return [
        100 + (index * 7919 + variant * 104729) % min(vocab - 100, 20000) for index in range(length)
    ]


# --- Child processes driven by JSON lines ------------------------------------------------------


class ChildProcess:
    """A child that prints one JSON line when ready, then answers one JSON line per command
    read from stdin, and exits when stdin closes."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self._log = log_path.open("w")
        self._process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=Path(__file__).resolve().parents[1],  # -m tests.support.stage_process
        )
        self._selector = selectors.DefaultSelector()
        assert self._process.stdout is not None
        self._selector.register(self._process.stdout, selectors.EVENT_READ)
        self.hello = self._read(120.0)

    def command(self, payload: dict[str, Any], timeout_s: float = COMMAND_TIMEOUT_S) -> Any:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(payload) + "\n")
        self._process.stdin.flush()
        reply = self._read(timeout_s)
        if isinstance(reply, dict) and reply.get("error"):
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return reply

    def _read(self, timeout_s: float) -> Any:
        assert self._process.stdout is not None
        if not self._selector.select(timeout_s):
            raise TimeoutError(f"{self.name} did not answer within {timeout_s:g} s")
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited (see {self._log.name})")
        return json.loads(line)

    def close(self) -> None:
        """Closing stdin makes the child exit; kill it (by its PID) if it does not."""
        with contextlib.suppress(OSError):
            assert self._process.stdin is not None
            self._process.stdin.close()
        try:
            self._process.wait(15)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5)
        self._selector.close()
        self._log.close()


# --- One mlx-lm process ------------------------------------------------------------------------


def baseline_main(model_dir: Path) -> None:
    """Child mode: mlx_lm.stream_generate with EOS suppressed, one run per command
    ``{"prompt": [ids], "max_tokens": n}``; ``{"stats": true}`` answers the peak RSS."""
    import mlx.core as mx
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    blocked = mx.array(sorted(tokenizer.eos_token_ids))

    def no_eos(_tokens: mx.array, logits: mx.array) -> mx.array:
        logits[:, blocked] = -float("inf")
        return logits

    def run(prompt: list[int], max_tokens: int) -> dict[str, float]:
        start = time.perf_counter()
        first_at, count = 0.0, 0
        for _ in mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=max_tokens, logits_processors=[no_eos]
        ):
            count += 1
            if count == 1:
                first_at = time.perf_counter()
        end = time.perf_counter()
        return {"ttft_s": first_at - start, "decode_tps": (count - 1) / (end - first_at)}

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "stats" in command:
            reply: dict[str, Any] = {"peak_rss": _peak_rss()}
        else:
            reply = run(command["prompt"], command["max_tokens"])
        print(json.dumps(reply), flush=True)


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- A mesh of node processes -------------------------------------------------------------------


class MeshProcesses:
    """``stages`` node processes serving one plan; the first stage is the origin."""

    def __init__(
        self, model_dir: Path, stages: int, scratch: Path, variant: str | None = None
    ) -> None:
        self.stages = stages
        suffix = f", {variant}" if variant else ""
        self.label = f"mesh, {stages} stage{'s' if stages > 1 else ''}{suffix}"
        colocated = 1 if variant == NOT_SHARED else stages
        self.nodes: list[ChildProcess] = []
        secret = security.create_mesh_secret("bench")
        try:
            for index in range(stages):
                state_dir = scratch / f"mesh{stages}-node{index}"
                security.save_secret(state_dir, secret)
                argv = [*NODE_COMMAND, "--node-id", f"s{index}", "--state-dir", str(state_dir)]
                argv += ["--colocated-stages", str(colocated)]
                log_path = Path(f"{state_dir}.log")
                self.nodes.append(ChildProcess(f"node s{index}", argv, log_path))
            self.idle_rss = [int(node.command({"stats": True})["rss_bytes"]) for node in self.nodes]
            config = json.loads((model_dir / "config.json").read_text())
            self.assignment = self._assignment(model_dir, config["num_hidden_layers"])
            for node in self.nodes:
                node.command({"install": self.assignment.to_dict()})
        except BaseException:
            self.close()
            raise

    def _assignment(self, model_dir: Path, num_layers: int) -> Assignment:
        ranges = even_layer_ranges(num_layers, self.stages)
        specs = tuple(
            StageSpec(
                f"s{index}",
                f"127.0.0.1:{node.hello['port']}",
                start,
                end,
                index == 0,
                index == self.stages - 1,
            )
            for index, (node, (start, end)) in enumerate(zip(self.nodes, ranges, strict=True))
        )
        return Assignment(f"bench-{self.stages}-{os.getpid()}", model_dir, specs)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        """All ``prompts`` at once on the first stage; per-request usage and the wall time."""
        spec = {
            "plan_id": self.assignment.plan_id,
            "prompts": prompts,
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        reply = self.nodes[0].command({"generate": spec})
        for request in reply["requests"]:
            if request["error"]:
                raise RuntimeError(f"{self.stages} stages: {request['error']}")
        return reply

    def memory(self) -> list[dict[str, Any]]:
        rows = []
        for node, idle in zip(self.nodes, self.idle_rss, strict=True):
            stats = node.command({"stats": True})
            plan = stats["plans"][0]
            rows.append(
                {
                    "node": node.name.split()[-1],
                    "layers": f"{plan.get('layer_start', 0)}-{plan.get('layer_end', 0)}",
                    "weights": int(plan.get("weight_bytes", 0)),
                    "peak_rss": int(stats["peak_rss_bytes"]),
                    "idle_rss": idle,
                }
            )
        return rows

    def close(self) -> None:
        for node in self.nodes:
            node.close()


# --- Measurements ------------------------------------------------------------------------------


@dataclass
class Run:
    ttft_s: float
    decode_tps: float
    transport_ms_per_token: float = 0.0


@dataclass
class MeshResult:
    label: str
    stages: int
    ttft_s: float
    decode_tps: float
    transport_ms_per_token: float
    hop_ms: float
    nodes: list[dict[str, Any]] = field(default_factory=list)


def _median(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda run: run.decode_tps)[len(runs) // 2]


def _mesh_run(mesh: MeshProcesses, prompt: list[int], generate: int) -> Run:
    request = mesh.generate([prompt], generate)["requests"][0]
    return Run(
        request["ttft_s"], request["decode_tokens_per_s"], request["transport_s_per_token"] * 1000
    )


def _throughput(reply: dict[str, Any]) -> float:
    """Generated tokens per second of wall time, prompts included, all requests together."""
    return sum(r["completion_tokens"] for r in reply["requests"]) / reply["wall_s"]


def measure_speed(
    baseline: ChildProcess,
    meshes: list[MeshProcesses],
    prompt: list[int],
    generate: int,
    repeats: int,
) -> tuple[Run, list[MeshResult]]:
    """Every runner ``repeats`` times, round robin, so load from elsewhere hits all alike."""
    baseline.command({"prompt": prompt[:16], "max_tokens": 4})  # warm-up
    for mesh in meshes:
        mesh.generate([prompt[:16]], 4)
    baseline_runs: list[Run] = []
    mesh_runs: list[list[Run]] = [[] for _ in meshes]
    for _ in range(repeats):
        reply = baseline.command({"prompt": prompt, "max_tokens": generate})
        baseline_runs.append(Run(reply["ttft_s"], reply["decode_tps"]))
        for runs, mesh in zip(mesh_runs, meshes, strict=True):
            runs.append(_mesh_run(mesh, prompt, generate))
    results = []
    for runs, mesh in zip(mesh_runs, meshes, strict=True):
        best = _median(runs)
        results.append(
            MeshResult(
                mesh.label,
                mesh.stages,
                best.ttft_s,
                best.decode_tps,
                best.transport_ms_per_token,
                best.transport_ms_per_token / mesh.stages,
            )
        )
    return _median(baseline_runs), results


def measure_concurrency(
    mesh: MeshProcesses, prompts: list[list[int]], generate: int, repeats: int
) -> tuple[float, float]:
    """Median throughput of 1 request and of ``len(prompts)`` concurrent ones, alternated."""
    single, concurrent = [], []
    for _ in range(repeats):
        single.append(_throughput(mesh.generate(prompts[:1], generate)))
        concurrent.append(_throughput(mesh.generate(prompts, generate)))
    return statistics.median(single), statistics.median(concurrent)


# --- Report ------------------------------------------------------------------------------------


def bench_model(
    name: str, model_dir: Path, prompt_len: int, generate: int, repeats: int, scratch: Path
) -> dict[str, Any]:
    print(f"\n== {name}: prompt {prompt_len} / generate {generate}, median of {repeats}")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = prompt_ids(vocab, prompt_len)
    scratch.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        argv = [sys.executable, __file__, "--baseline", str(model_dir)]
        baseline = ChildProcess("mlx-lm", argv, scratch / "baseline.log")
        stack.callback(baseline.close)
        meshes = []
        for stages, variant in ((1, None), (2, None), (3, None), (2, NOT_SHARED)):
            mesh = MeshProcesses(model_dir, stages, scratch / f"mesh{len(meshes)}", variant)
            stack.callback(mesh.close)
            meshes.append(mesh)
        base, results = measure_speed(baseline, meshes, prompt, generate, repeats)
        prompts = [prompt_ids(vocab, prompt_len, k) for k in range(CONCURRENT_REQUESTS)]
        throughput = {
            mesh.label: measure_concurrency(mesh, prompts, generate, repeats)
            for mesh in (meshes[1], meshes[3])
        }
        for result, mesh in zip(results, meshes, strict=True):
            result.nodes = mesh.memory()
        base_peak = baseline.command({"stats": True})["peak_rss"]
    _print_speed(base, results)
    _print_throughput(throughput)
    _print_memory(base_peak, results)
    return {
        "model": name,
        "baseline": {**asdict(base), "peak_rss": base_peak},
        "mesh": [asdict(result) for result in results],
        "two_stage_throughput": {
            name: {"single": single, "concurrent": concurrent}
            for name, (single, concurrent) in throughput.items()
        },
    }


def _print_throughput(throughput: dict[str, tuple[float, float]]) -> None:
    print(
        f"2 stages, {CONCURRENT_REQUESTS} concurrent requests vs 1 "
        "(tok/s over wall time, prefill included):"
    )
    for name, (single, concurrent) in throughput.items():
        print(
            f"  {name:<30} 1 request {single:6.2f}  {CONCURRENT_REQUESTS} requests "
            f"{concurrent:6.2f}  = {concurrent / single:.2f}x"
        )


def _print_speed(base: Run, meshes: list[MeshResult]) -> None:
    one_stage_ms = 1000 / meshes[0].decode_tps
    print(
        f"{'runner':<30} {'TTFT s':>7} {'decode tok/s':>13} {'vs mlx-lm':>10} "
        f"{'transport ms/tok':>17} {'per hop ms':>11} {'slowdown/hop ms':>16}"
    )
    print(
        f"{'mlx_lm.stream_generate':<30} {base.ttft_s:>7.3f} {base.decode_tps:>13.2f} {1.0:>10.2f}"
    )
    for mesh in meshes:
        slowdown = (1000 / mesh.decode_tps - one_stage_ms) / mesh.stages if mesh.stages > 1 else 0.0
        print(
            f"{mesh.label:<30} {mesh.ttft_s:>7.3f} "
            f"{mesh.decode_tps:>13.2f} {mesh.decode_tps / base.decode_tps:>10.2f} "
            f"{mesh.transport_ms_per_token:>17.2f} {mesh.hop_ms:>11.2f} {slowdown:>16.2f}"
        )


def _print_memory(base_peak: int, meshes: list[MeshResult]) -> None:
    total = meshes[0].nodes[0]["weights"]
    print(
        f"peak RSS: mlx-lm one process {base_peak / MIB:.0f} MiB; weights {total / MIB:.0f} MiB"
        " (a tied embedding is held by the first and the last stage)"
    )
    print(
        f"{'mesh':<30} {'node':>5} {'layers':>7} {'weights MiB':>12} {'share':>6} "
        f"{'idle RSS MiB':>13} {'peak RSS MiB':>13} {'peak - weights':>15}"
    )
    for mesh in meshes:
        for node in mesh.nodes:
            print(
                f"{mesh.label:<30} {node['node']:>5} {node['layers']:>7} "
                f"{node['weights'] / MIB:>12.0f} {node['weights'] / total:>6.2f} "
                f"{node['idle_rss'] / MIB:>13.0f} {node['peak_rss'] / MIB:>13.0f} "
                f"{(node['peak_rss'] - node['weights']) / MIB:>15.0f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, help="model store root to (re)use for SmolLM2")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--generate", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per runner (median kept)")
    parser.add_argument("--random-100m", action="store_true", help="also a random ~100M llama")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--baseline", type=Path, help=argparse.SUPPRESS)  # child process mode
    args = parser.parse_args()
    if args.baseline:
        baseline_main(args.baseline)
        return

    results = []
    with tempfile.TemporaryDirectory(prefix="meshd-bench-dataplane-") as scratch_dir:
        scratch = Path(scratch_dir)
        store = ModelStore(args.store or scratch / "store")
        smollm = store.ensure_default()
        results.append(
            bench_model(
                DEFAULT_MODEL,
                smollm.path,
                args.prompt_tokens,
                args.generate,
                args.repeats,
                scratch / "smollm",
            )
        )
        if args.random_100m:
            random_dir = make_random_model_dir(
                scratch / "llama-100m",
                "llama",
                layers=12,
                hidden=768,
                heads=12,
                kv_heads=4,
                vocab=32000,
                intermediate=2048,
                seed=0,
            )
            results.append(
                bench_model(
                    "random-llama-100m",
                    random_dir,
                    args.prompt_tokens,
                    args.generate,
                    args.repeats,
                    scratch / "random",
                )
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
