"""Continuous batching, measured on the product: real `meshd run` daemons vs one mlx-lm process.

Two loopback daemons (the embedded SmolLM2-135M-Instruct split in two stages: by memory, 15/15
layers, or with ``--strategy speed`` by the product's default strategy forced to a pipeline,
19/11, since the last stage also runs the head), each pinned to its own core with taskset to
stand in for two machines, serve N concurrent streaming chat requests over the OpenAI HTTP API
(greedy, ``--max-tokens`` each). The reference is one mlx-lm process pinned to the same cores,
decoding the same prompts with mlx-lm's own ``BatchGenerator`` (continuous batching in one
process). For each N: aggregate tokens/s (all completion tokens / wall time from the first
request sent to the last token), p50/p99 time to first token, p50/p99 inter-token latency (time
between two streamed chunks of one request), and the load average when the row started (this
machine is shared: read the numbers with it).

    .venv/bin/python benchmarks/bench_batching.py [--concurrency 1 4 8 16] [--max-tokens 64]
        [--strategy memory|speed]

Daemons announce on 127.0.0.1 only and talk over loopback; everything they create is in a
temporary directory removed at the end, and they are killed by PID.

``--scaling`` (run as root) measures one request alone instead, on the product: real ``meshd
run`` daemons, 1, 2 and 3 of them, each in its own network namespace (a bridge inside its own
namespace, tests/netns.py: nothing touches the machine's real interfaces) and each pinned with
taskset to its own core to stand in for a separate machine, against one mlx-lm process
(``stream_generate``) pinned to ONE such core (core 0): the fair "one machine vs a mesh of
such machines" baseline. The cores of a shared machine differ by a few percent, so mlx-lm is
timed on each core too, and a "same cores" column compares each mesh with one process timed
on the cores its stages ran on (averaged over the stages). This machine has 2 cores, so
with 3 nodes two of them share a core (with one request only one stage computes at a time,
so they rarely compete). Then the unpinned line: 2 loopback daemons that share every core
(what ``meshd demo`` does) vs one unpinned mlx-lm process (``--unpinned-rounds N`` runs only
this line, N rounds, to show its spread on a shared machine). Per row, medians over
``--runs`` greedy requests of ``--max-tokens``: decode tok/s (first streamed token to last),
time to first token, and the overhead per hop, ``(ms/token with k nodes - ms/token with 1
node) / k`` (k stages make a ring of k hops per token; the compute per token is the same
model either way). With ``--no-lanes-too`` the multi-node rows run again with ``--no-lanes``
(frames over the peer port's gRPC streams instead of lanes), so both are measured in one
run; with ``--loop-sends-too`` they run again with every frame sent by the daemons' loops
(``MESHD_LOOP_SENDS=1``: a decode step's frames no longer leave from the compute thread that
computed it), the baseline of that path in the same run; with ``--stream-first-too`` the
unpinned row runs again with each token's client stream before the next step's graph
(``MESHD_STREAM_FIRST=1``, the order before the origin let the step go first; it needs the
spare cores of an unpinned daemon to matter, so the pinned rows do not change). With
``--hop-trace`` the multi-node daemons trace their hops (``MESHD_HOP_TRACE``,
:mod:`meshd.runtime.hoptrace`) and each such row prints the median of every segment of a
hop, from one stage's finished step to the next stage's compute, per direction:

    sudo .venv/bin/python benchmarks/bench_batching.py --scaling [--runs 5] [--max-tokens 64]
        [--no-lanes-too] [--loop-sends-too] [--stream-first-too] [--hop-trace]
    .venv/bin/python benchmarks/bench_batching.py --unpinned-rounds 3 [--stream-first-too]
    sudo .venv/bin/python benchmarks/bench_batching.py --pinned-rounds 4 [--runs 3]

``--pinned-rounds N`` runs only the pinned 1- and 2-node lines, N times, each time next to
mlx-lm timed on each core, and prints the median ratio and its range: on a shared machine
whose speed drifts over the quarter of an hour a ``--scaling`` run takes, a ratio of two
timings a minute apart is the one to trust.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()  # before mlx.core (the profile measurement runs MLX)

from meshd.api.launcher import DaemonProcess
from meshd.inference.origin.runtime import STREAM_FIRST_ENV
from meshd.inference.stage.runtime import LOOP_SENDS_ENV
from meshd.mesh import security
from meshd.mesh.profiling import load_or_measure_profile
from meshd.models.store import ModelStore
from meshd.runtime import hoptrace

ON_LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1"]
LOOPBACK = [*ON_LOOPBACK, "--peer-port", "0"]  # any free port, peers found by mDNS
TOPICS = [
    "a lighthouse", "a dragon", "the sea", "a city at night", "a robot", "a garden",
    "a mountain", "a train", "a library", "a storm", "a cat", "the moon", "a market",
    "a river", "a forest", "a clock",
]  # fmt: skip


@contextlib.contextmanager
def bench_root(prefix: str, model: Path | None = None) -> Iterator[tuple[Path, Path]]:
    """A temporary folder for one benchmark and the model to run: ``model`` (an MLX model
    directory, left alone) or else the embedded default in a store inside the folder; the
    folder is removed afterwards, also when the benchmark fails."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root, (model.resolve() if model else ModelStore(root / "store").ensure_default().path)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def prompts_for(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Write a long story about {TOPICS[k % len(TOPICS)]}."}]
        for k in range(n)
    ]


@dataclass
class Row:
    n: int
    tokens: int
    wall_s: float
    ttft_s: list[float]
    itl_s: list[float]
    load: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def line(self, who: str) -> str:
        ttft = [pct(self.ttft_s, q) * 1e3 for q in (50, 99)]
        itl = [pct(self.itl_s, q) * 1e3 for q in (50, 99)]
        return (
            f"{who:<10} N={self.n:<3} {self.tokens_per_s:7.1f} tok/s  "
            f"TTFT p50 {ttft[0]:7.0f} ms p99 {ttft[1]:7.0f} ms"
            f"  ITL p50 {itl[0]:6.1f} ms p99 {itl[1]:6.1f} ms"
            f"  ({self.tokens} tokens, {self.wall_s:.1f} s, load {self.load:.2f})"
        )


def pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


T = TypeVar("T")


# --- The mesh ---------------------------------------------------------------------------------


class PinnedDaemon(DaemonProcess):
    """A daemon whose every thread runs on ``cpus`` (what a separate machine's cores are)."""

    def __init__(self, state_dir: Path, args: list[str], cpus: str) -> None:
        super().__init__(state_dir, args)
        self.cpus = cpus

    def command(self) -> list[str]:
        return ["taskset", "-c", self.cpus, *super().command()]


def start_mesh(
    root: Path,
    model: Path,
    cpus: list[str],
    max_n: int,
    strategy: str = "memory",
    extra_args: list[str] | None = None,
) -> list[DaemonProcess]:
    """Pinned loopback daemons splitting ``model`` into len(cpus) stages. ``strategy``:
    "memory" (layers in proportion to memory: equal halves here, the last stage also holding
    the head) or "speed" (forced to a pipeline: stages of equal predicted time, counting the
    head's compute, for ``max_n`` concurrent requests). ``extra_args``: more daemon flags
    (a later flag wins over the defaults here, e.g. ``--context-length``)."""
    placement = ["--strategy", "memory"]
    if strategy == "speed":
        placement = ["--strategy", "speed", "--parallelism", "pipeline"]
    profile = root / "profile"
    profile.mkdir()
    load_or_measure_profile(profile, memory_budget_override=None)
    token = security.encode_join_token(security.create_mesh_secret("bench-batching"))
    daemons: list[DaemonProcess] = []
    for i, cpu in enumerate(cpus):
        state = root / f"n{i}"
        state.mkdir()
        shutil.copyfile(profile / "profile.json", state / "profile.json")
        args = [*LOOPBACK, "--join", token, "--name", f"b{i}", "--model", str(model),
                *placement, "--context-length", "512", "--concurrency", str(max_n),
                "--log-level", "WARNING", *(extra_args or [])]  # fmt: skip
        daemon = PinnedDaemon(state, args, cpu) if cpu else DaemonProcess(state, args)
        daemons.append(daemon.start())
    for daemon in daemons:
        daemon.wait_for(
            lambda s: (
                bool(s.agreement.active_plan_id and s.agreement.plan_json)
                and len(json.loads(s.agreement.plan_json)["stages"]) == len(cpus)
            ),
            180,
            f"a committed {len(cpus)}-stage plan",
        )
    return daemons


async def chat_chunks(client, url: str, messages, max_tokens: int) -> AsyncIterator[tuple]:
    """One greedy streaming chat request through the OpenAI API: (arrival time, chunk) for
    each chunk, the usage in the last one."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            yield time.perf_counter(), chunk


def has_text(chunk: dict) -> bool:
    """Whether a streamed chat chunk carries generated text."""
    return bool(chunk.get("choices") and chunk["choices"][0]["delta"].get("content"))


async def one_request(client, url: str, messages, max_tokens: int, sent: float) -> tuple:
    times: list[float] = []
    tokens = 0
    async for arrived, chunk in chat_chunks(client, url, messages, max_tokens):
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if has_text(chunk):
            times.append(arrived)
    ttft = times[0] - sent if times else float("nan")
    return tokens, ttft, [b - a for a, b in itertools.pairwise(times)], times[-1]


async def mesh_row(url: str, n: int, max_tokens: int) -> Row:
    import httpx

    load = os.getloadavg()[0]
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(one_request(client, url, m, max_tokens, started) for m in prompts_for(n))
        )
    end = max(r[3] for r in results)
    return Row(n, sum(r[0] for r in results), end - started, [r[1] for r in results],
               [x for r in results for x in r[2]], load)  # fmt: skip


# --- One mlx-lm process -----------------------------------------------------------------------

REFERENCE = r"""
import json, sys, time
from meshd.runtime.blas import enable_fast_blas
enable_fast_blas()
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
model, tokenizer = load(sys.argv[1])
max_tokens = int(sys.argv[2])
for n in map(int, sys.argv[3:]):
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True)
               for m in json.loads(sys.stdin.readline())]
    stops = [[t] for t in tokenizer.eos_token_ids]
    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=stops,
                         completion_batch_size=max(n, 1), prefill_batch_size=max(n, 1))
    started = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[max_tokens] * n)
    times = {uid: [] for uid in uids}
    while any(len(t) < max_tokens for t in times.values()):
        responses = gen.next_generated()
        if not responses:
            break
        now = time.perf_counter()
        for r in responses:
            times[r.uid].append(now)
    gen.close()
    print(json.dumps({"n": n, "started": started, "times": list(times.values())}), flush=True)
"""


def reference_rows(model: Path, ns: list[int], max_tokens: int, cpus: str) -> list[Row]:
    command = [sys.executable, "-c", REFERENCE, str(model), str(max_tokens), *map(str, ns)]
    if cpus:
        command = ["taskset", "-c", cpus, *command]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows = []
    assert process.stdin is not None and process.stdout is not None
    try:
        for n in ns:
            load = os.getloadavg()[0]
            process.stdin.write(json.dumps(prompts_for(n)) + "\n")
            process.stdin.flush()
            result = json.loads(process.stdout.readline())
            started, times = result["started"], result["times"]
            end = max(t[-1] for t in times if t)
            gaps = [b - a for t in times for a, b in itertools.pairwise(t)]
            first = [t[0] - started for t in times if t]
            rows.append(Row(n, sum(len(t) for t in times), end - started, first, gaps, load))
    finally:
        process.kill()
        process.wait()
    return rows


# --- One request: 1, 2, 3 nodes (--scaling) ----------------------------------------------------

SCALING_PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]

SINGLE_REFERENCE = r"""
import json, sys, time
from meshd.runtime.blas import enable_fast_blas
enable_fast_blas()
import mlx_lm
model, tokenizer = mlx_lm.load(sys.argv[1])
max_tokens, runs = int(sys.argv[2]), int(sys.argv[3])
prompt = tokenizer.apply_chat_template(json.loads(sys.argv[4]), add_generation_prompt=True)
for run in range(runs + 1):  # the first run warms up
    started = time.perf_counter()
    times = []
    for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        times.append(time.perf_counter())
    if run:
        print(json.dumps({"ttft_s": times[0] - started, "times": times}), flush=True)
"""


@dataclass
class Single:
    """Medians of one-request runs: time to first token and seconds per decoded token."""

    ttft_s: float
    s_per_token: float
    tokens: int
    load: float
    transport_s_per_token: float | None = None  # the daemons' own measure (final event)
    streamed: int = 0  # tokens streamed over every run, the warm-up's too (--thread-cpu)


def single_of(
    runs: list[tuple[float, list[float]]],
    load: float,
    transport: list[float] | None = None,
    streamed: int = 0,
) -> Single:
    import statistics

    per_token = [(t[-1] - t[0]) / (len(t) - 1) for _, t in runs if len(t) > 1]
    return Single(
        statistics.median(ttft for ttft, _ in runs),
        statistics.median(per_token),
        round(statistics.median(len(t) for _, t in runs)),
        load,
        statistics.median(transport) if transport else None,
        streamed,
    )


def reference_single(model: Path, cpus: str, runs: int, max_tokens: int) -> Single:
    load = os.getloadavg()[0]
    command = [sys.executable, "-c", SINGLE_REFERENCE, str(model), str(max_tokens), str(runs),
               json.dumps(SCALING_PROMPT)]  # fmt: skip
    if cpus:
        command = ["taskset", "-c", cpus, *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return single_of([(r["ttft_s"], r["times"]) for r in results], load)


def mesh_single(api: str, runs: int, max_tokens: int) -> Single:
    """``runs`` greedy requests one after the other over the gRPC API (a warm-up first)."""
    from meshd.api import client
    from meshd.wire import pb

    request = pb.ChatRequest(
        messages=[pb.ChatMessage(**m) for m in SCALING_PROMPT],
        sampling=pb.Sampling(temperature=0, max_tokens=max_tokens),
    )
    load = os.getloadavg()[0]
    results = []
    transport = []
    streamed = 0
    for run in range(runs + 1):
        started = time.perf_counter()
        times = []
        for event in client.stream_generation(api, request, timeout_s=300):
            if event.HasField("text"):
                times.append(time.perf_counter())
            elif event.HasField("done") and run:
                transport.append(event.done.transport_s_per_token)
        streamed += len(times)
        if run and times:
            results.append((times[0] - started, times))
    return single_of(results, load, transport, streamed)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) the threads of ``pid`` have used so far, summed per name
    the OS shows (meshd names its own: meshd, meshd-grpc, meshd-compute, which MLX's stream
    thread inherits, and meshd-blas for OpenBLAS's workers); empty where /proc is missing.
    A thread that ends between two readings takes its CPU with it."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    tasks = Path(f"/proc/{pid}/task")
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()  # field 3 onwards: utime is 14, stime 15
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return totals


def warm_request(api: str) -> None:
    """One short greedy request: what a mesh does once (the tokenizer's load, the first
    caches) is then behind it."""
    from meshd.api import client
    from meshd.wire import pb

    request = pb.ChatRequest(
        messages=[pb.ChatMessage(**m) for m in SCALING_PROMPT],
        sampling=pb.Sampling(temperature=0, max_tokens=8),
    )
    for _ in client.stream_generation(api, request, timeout_s=300):
        pass


def with_thread_cpu(daemons: list[DaemonProcess], labels: list[str], run: Callable[[], T]) -> T:
    """A warm-up request, then ``run()``, then each daemon's CPU per streamed token, per thread
    name (``--thread-cpu``): where a daemon's time goes besides MLX, next to what one mlx-lm
    process needs a token. The window holds every request of ``run`` (their prefill too)."""
    warm_request(daemons[0].api)
    before = [thread_cpu_s(daemon.pid) for daemon in daemons]
    result = run()
    after = [thread_cpu_s(daemon.pid) for daemon in daemons]
    tokens = getattr(result, "streamed", 0)
    if not tokens:
        return result
    for label, start, end in zip(labels, before, after, strict=True):
        used = {name: end[name] - start.get(name, 0.0) for name in end}
        parts = ", ".join(
            f"{name} {seconds / tokens * 1e3:.2f}"
            for name, seconds in sorted(used.items(), key=lambda item: -item[1])
            if seconds > 0
        )
        total = sum(used.values()) / tokens * 1e3
        print(f"  {label}: {total:.2f} ms of CPU a token ({parts})", flush=True)
    return result


def pinned_mesh_single(
    root: Path,
    model: Path,
    cpus: list[str],
    runs: int,
    max_tokens: int,
    extra_args: list[str] | None = None,
    hop_trace: Path | None = None,
    env: dict[str, str] | None = None,
    thread_cpu: bool = False,
    loopback: bool = False,
):
    """len(cpus) daemons, each pinned to its cpus (and in its own namespace unless
    ``loopback``); one request at a time."""
    measure = partial(mesh_single, runs=runs, max_tokens=max_tokens)
    return pinned_mesh(
        root, model, cpus, extra_args or [], measure, hop_trace, env, thread_cpu, loopback
    )


def pinned_mesh(
    root: Path,
    model: Path,
    cpus: list[str],
    extra_args: list[str],
    measure: Callable[[str], T],
    hop_trace: Path | None = None,
    env: dict[str, str] | None = None,
    thread_cpu: bool = False,
    loopback: bool = False,
) -> T:
    """len(cpus) daemons (``extra_args`` added to each), each pinned to its cpus (a taskset
    list: "0" or "4-7") and in its own network namespace, splitting ``model`` by memory:
    ``measure(first daemon's API)`` once they serve it, then they are killed. With
    ``loopback`` they share the loopback interface instead and dial each other by port
    (``--no-mdns --peer``): for machines without network namespaces, such as containers.
    With ``hop_trace``, the daemons trace their hops there (:mod:`meshd.runtime.hoptrace`) and
    the table of where a hop's time went is printed; with ``thread_cpu``, each daemon's CPU a
    token per thread (:func:`with_thread_cpu`)."""
    token = security.encode_join_token(security.create_mesh_secret("bench-pinned"))
    profile = root / "profile"
    if not profile.exists():
        profile.mkdir()
        load_or_measure_profile(profile, memory_budget_override=None)
    with contextlib.ExitStack() as stack:
        if loopback:
            from tests.netns import unique_prefix

            prefix = unique_prefix("lo")
            networks = loopback_networks(len(cpus))
        else:
            from tests.netns import Mesh

            mesh = stack.enter_context(Mesh(len(cpus)))
            prefix = mesh.prefix
            networks = [(node.ns, ["--interface", "eth0"]) for node in mesh.nodes]
        daemons: list[DaemonProcess] = []
        try:
            for index, ((netns, network), cpu) in enumerate(zip(networks, cpus, strict=True)):
                state = root / f"{prefix}-{index}"
                state.mkdir()
                shutil.copyfile(profile / "profile.json", state / "profile.json")
                args = [*network, "--join", token, "--name", f"s{index}", "--model", str(model),
                        "--strategy", "memory", "--log-level", "WARNING", *extra_args]  # fmt: skip
                daemon = PinnedDaemon(state, args, cpu)
                daemon.netns = netns
                daemon.env = dict(env or {})
                if hop_trace is not None:
                    daemon.env[hoptrace.ENV] = str(hop_trace)
                daemons.append(daemon.start())
            wait_for_stages(daemons, len(cpus))
            if thread_cpu:
                labels = [f"node {i} (cores {cpu})" for i, cpu in enumerate(cpus)]
                print(f"CPU a streamed token by thread, {len(cpus)} pinned node(s):")
                result = with_thread_cpu(daemons, labels, lambda: measure(daemons[0].api))
            else:
                result = measure(daemons[0].api)
            if hop_trace is not None:
                time.sleep(2 * hoptrace.FLUSH_INTERVAL_S)  # the daemons' last marks
                names = {hoptrace.process_name(d.pid): f"node {i} (cores {c})"
                         for i, (d, c) in enumerate(zip(daemons, cpus, strict=True))}  # fmt: skip
                hops = hoptrace.pair_hops(hoptrace.read_marks(hop_trace))
                print(f"where a hop's time goes, {len(cpus)} nodes (one request at a time):")
                print(hoptrace.summary(hops, names), flush=True)
            return result
        finally:
            for daemon in daemons:
                daemon.kill()


def loopback_networks(nodes: int) -> list[tuple[None, list[str]]]:
    """Per daemon: no namespace, and the arguments that put it on loopback with a peer port
    of its own, dialling every other daemon's (no multicast needed)."""
    from tests.support.ports import free_ports

    ports = free_ports(nodes)
    return [
        (
            None,
            [*ON_LOOPBACK, "--no-mdns", "--peer-port", str(port)]
            + [f"--peer=127.0.0.1:{other}" for other in ports if other != port],
        )
        for port in ports
    ]


def loopback_mesh_single(
    root: Path,
    model: Path,
    nodes: int,
    runs: int,
    max_tokens: int,
    env: dict[str, str] | None = None,
    thread_cpu: bool = False,
):
    """``nodes`` unpinned loopback daemons, as ``meshd demo`` starts them (with ``env`` added
    to their environment); one request (with ``thread_cpu``, each daemon's CPU a token per
    thread)."""
    from meshd.api.demo import loopback_args

    token = security.encode_join_token(security.create_mesh_secret("bench-scaling-lo"))
    daemons = [
        DaemonProcess(root / f"lo{i}", loopback_args(token, f"lo{i}", model), env=env).start()
        for i in range(nodes)
    ]
    try:
        wait_for_stages(daemons, nodes)
        if not thread_cpu:
            return mesh_single(daemons[0].api, runs, max_tokens)
        print(f"CPU a streamed token by thread, {nodes} unpinned node(s):")
        labels = [f"node {i}" for i in range(nodes)]
        return with_thread_cpu(
            daemons, labels, lambda: mesh_single(daemons[0].api, runs, max_tokens)
        )
    finally:
        for daemon in daemons:
            daemon.kill()


def wait_for_stages(daemons: list[DaemonProcess], stages: int) -> None:
    for daemon in daemons:
        daemon.wait_for(
            lambda s: (
                bool(s.agreement.active_plan_id and s.agreement.plan_json)
                and len(json.loads(s.agreement.plan_json)["stages"]) == stages
            ),
            180,
            f"a committed {stages}-stage plan",
        )


def unpinned_rounds(
    rounds: int,
    runs: int,
    max_tokens: int,
    stream_first_too: bool = False,
    thread_cpu: bool = False,
) -> int:
    """Only the unpinned line, ``rounds`` times: one mlx-lm process on every core, then two
    loopback daemons that share every core (what ``meshd demo`` does), alternating, so the
    spread of both on a shared machine shows next to their ratio; with ``stream_first_too``
    each round runs the daemons again with ``MESHD_STREAM_FIRST=1`` (the baseline order)."""
    ratios: dict[str, list[float]] = {}
    with bench_root("bench-unpinned-") as (root, model):
        print(f"one request, {max_tokens} greedy tokens, medians of {runs} runs per round")
        for round_number in range(1, rounds + 1):
            alone = reference_single(model, "", runs, max_tokens)
            variants = [("", {})] + (
                [(", stream first", {STREAM_FIRST_ENV: "1"})] if stream_first_too else []
            )
            if round_number % 2 == 0:
                variants.reverse()  # neither variant always runs right after mlx-lm
            for suffix, env in variants:
                folder = root / f"round{round_number}{suffix.strip(', ').replace(' ', '-')}"
                mesh = loopback_mesh_single(folder, model, 2, runs, max_tokens, env, thread_cpu)
                other = mesh.transport_s_per_token or 0.0
                ratios.setdefault(f"2 unpinned daemons{suffix}", []).append(
                    alone.s_per_token / mesh.s_per_token
                )
                print(
                    f"round {round_number}: mlx-lm on every core {1 / alone.s_per_token:.2f} "
                    f"tok/s, 2 unpinned daemons{suffix} {1 / mesh.s_per_token:.2f} tok/s = "
                    f"{alone.s_per_token / mesh.s_per_token:.2f}x (other ms {other * 1e3:.2f}, "
                    f"load {mesh.load:.2f})",
                    flush=True,
                )
    print_median_ratios(ratios, "of mlx-lm on every core")
    return 0


def print_median_ratios(ratios: dict[str, list[float]], against: str) -> None:
    """Per line, the median ratio over the rounds and its range: the figure to read."""
    for label, values in ratios.items():
        if values:
            print(
                f"{label}: median {statistics.median(values):.2f}x {against} "
                f"(range {min(values):.2f}-{max(values):.2f}, {len(values)} rounds)"
            )


def pinned_rounds(rounds: int, runs: int, max_tokens: int, thread_cpu: bool = False) -> int:
    """Only the pinned one- and two-node lines, ``rounds`` times, interleaved with mlx-lm on
    each core: each round times mlx-lm on core 0 and on core 1, one daemon on core 0 and two
    daemons on cores 0 and 1 (half the rounds in the reverse order), so a ratio divides two
    timings a minute apart, not two rows a quarter of an hour apart. This machine's speed
    drifts by more than the goals' margins over the length of one ``--scaling`` run; the
    median ratio over the rounds, with its range, is the figure to read."""
    from tests.netns import cleanup_stale, require_root_and_netns

    require_root_and_netns()
    cleanup_stale()
    if (os.cpu_count() or 1) < 2:
        print("--pinned-rounds needs 2 cores")
        return 2
    ratios: dict[str, list[float]] = {"1 node": [], "2 nodes": []}
    with bench_root("bench-pinned-") as (root, model):
        print(f"one request, {max_tokens} greedy tokens, medians of {runs} runs per timing")
        for number in range(1, rounds + 1):
            steps = ["mlx-lm", "mesh"] if number % 2 else ["mesh", "mlx-lm"]
            timed: dict[str, Single] = {}
            for step in steps:
                if step == "mlx-lm":
                    for cpu in ("0", "1"):
                        timed[f"core {cpu}"] = reference_single(model, cpu, runs, max_tokens)
                else:
                    for label, cpus in (("1 node", ["0"]), ("2 nodes", ["0", "1"])):
                        timed[label] = pinned_mesh_single(
                            root, model, cpus, runs, max_tokens, thread_cpu=thread_cpu
                        )
            same_cores = (timed["core 0"].s_per_token + timed["core 1"].s_per_token) / 2
            ratios["1 node"].append(timed["core 0"].s_per_token / timed["1 node"].s_per_token)
            ratios["2 nodes"].append(same_cores / timed["2 nodes"].s_per_token)
            other = (timed["2 nodes"].transport_s_per_token or 0.0) * 1e3
            speed = {label: 1 / single.s_per_token for label, single in timed.items()}
            print(
                f"round {number}: mlx-lm core 0 {speed['core 0']:.2f}, core 1 "
                f"{speed['core 1']:.2f} tok/s; 1 node {speed['1 node']:.2f} tok/s = "
                f"{ratios['1 node'][-1]:.2f}x; 2 nodes {speed['2 nodes']:.2f} tok/s = "
                f"{ratios['2 nodes'][-1]:.2f}x of the same cores (other ms {other:.2f}, "
                f"load {timed['2 nodes'].load:.2f})",
                flush=True,
            )
    print_median_ratios(ratios, "of mlx-lm on the same cores")
    return 0


def scaling_table(
    runs: int,
    max_tokens: int,
    streams_too: bool = False,
    hop_trace: bool = False,
    loop_sends_too: bool = False,
    stream_first_too: bool = False,
    thread_cpu: bool = False,
    model: Path | None = None,
    cores_per_node: int = 1,
    loopback: bool = False,
    max_nodes: int = 3,
) -> int:
    """The one-request table (see the module docstring); with ``model``, of that MLX model
    directory instead of the embedded default; with ``cores_per_node`` K, each node and each
    pinned mlx-lm process on K cores of its own (node i on cores iK..iK+K-1: a machine with
    cores to spare stands in for several machines with K cores each); with ``loopback``, the
    pinned daemons share loopback instead of a namespace each; ``max_nodes`` (1-3) ends the
    pinned rows there. Each row is printed as soon as it is measured, and the whole table at
    the end (a run cut short keeps what it measured); with ``streams_too``, the multi-node
    rows again with `--no-lanes` (frames over the peer port's gRPC streams), same run; with
    ``loop_sends_too``, again with every frame sent by the daemons' loops (``MESHD_LOOP_SENDS``,
    the path before decode steps' frames left from the compute thread); with
    ``stream_first_too``, the unpinned row again with ``MESHD_STREAM_FIRST`` (client streams
    before the next step's graph, the earlier order); with ``hop_trace``, the
    multi-node rows' daemons trace their hops and each row prints where a hop's time went
    (the trace costs the hop a few microseconds)."""
    if not loopback:
        from tests.netns import cleanup_stale, require_root_and_netns

        require_root_and_netns()
        cleanup_stale()
    cores = os.cpu_count() or 1
    layouts = node_layouts(cores, cores_per_node)[: max(1, max_nodes)]
    network = "loopback" if loopback else "a network namespace each"
    table = ScalingTable(
        f"one request, {max_tokens} greedy tokens, medians of {runs} runs; {cores} cores, "
        f"{cores_per_node} a node, pinned nodes on {network}"
    )
    with bench_root("bench-scaling-", model) as (root, model):
        print(f"model {model}", flush=True)
        per_core: dict[str, Single] = {}
        for cpu in dict.fromkeys(cpu for layout in layouts for cpu in layout):
            per_core[cpu] = reference_single(model, cpu, runs, max_tokens)
            table.add(f"mlx-lm, 1 process on cores {cpu}", per_core[cpu], None, 0, None)
        one_core = per_core[layouts[0][0]]
        variants: list[tuple[str, list[str], dict[str, str]]] = [("", [], {})]
        if streams_too:
            variants.append((", --no-lanes", ["--no-lanes"], {}))
        if loop_sends_too:
            variants.append((", loop sends", [], {LOOP_SENDS_ENV: "1"}))
        for cpus in layouts:
            shared = " (2 share cores)" if len(set(cpus)) < len(cpus) else ""
            # A token crosses each stage's share of the layers on that stage's core: one
            # process split that way would take the mean of its time on those cores.
            same_cores = sum(per_core[cpu].s_per_token for cpu in cpus) / len(cpus)
            for suffix, extra, env in variants if len(cpus) > 1 else variants[:1]:
                trace = root / f"hops-{len(cpus)}{suffix.strip(', -').replace(' ', '-')}"
                traced = trace if hop_trace and len(cpus) > 1 else None
                result = pinned_mesh_single(
                    root, model, cpus, runs, max_tokens, extra, traced, env, thread_cpu, loopback
                )
                label = f"{len(cpus)} node(s), cores {' '.join(cpus)}{shared}{suffix}"
                table.add(label, result, one_core, len(cpus), same_cores)
        every_core = reference_single(model, "", runs, max_tokens)
        table.add("mlx-lm, 1 process, every core", every_core, None, 0, None)
        unpinned = loopback_mesh_single(root, model, 2, runs, max_tokens, thread_cpu=thread_cpu)
        table.add("2 nodes unpinned (meshd demo)", unpinned, every_core, -2, None)
        if stream_first_too:
            env = {STREAM_FIRST_ENV: "1"}
            first = loopback_mesh_single(
                root / "stream-first", model, 2, runs, max_tokens, env, thread_cpu
            )
            table.add("2 nodes unpinned, stream first", first, every_core, -2, None)
    print()
    table.print_all()
    return 0


class ScalingTable:
    """The rows of ``--scaling``: each printed as it is measured, all of them at the end."""

    HEADER = (
        f"{'runner':<40} {'tok/s':>7} {'vs mlx-lm':>9} {'same cores':>10} {'TTFT ms':>8} "
        f"{'hop ms':>7} {'other ms':>8} {'hop ms':>7} {'load':>5}"
    )
    NOTES = (
        "vs mlx-lm: against one mlx-lm process on node 0's cores (pinned rows) or on every core",
        "same cores: against one mlx-lm process timed on the cores each stage ran on, averaged",
        "over the stages (the cores of this machine differ by a few percent)",
        "hop ms (first): (s/token with k pinned nodes - s/token with 1 node) / k hops per token",
        "other ms: the daemons' own measure of decode time per token not spent computing",
        "hop ms (second): (other ms with k pinned nodes - other ms with 1 node) / k; it does not",
        "move with the speed of the cores the stages compute on, which the first one does",
    )

    def __init__(self, title: str) -> None:
        self.title = title
        # (label, result, the baseline "vs mlx-lm" divides by, nodes, the same cores' baseline)
        self.rows: list[tuple[str, Single, Single | None, int, float | None]] = []

    def add(
        self, label: str, row: Single, base: Single | None, nodes: int, same_cores: float | None
    ) -> None:
        self.rows.append((label, row, base, nodes, same_cores))
        print(f"row: {self.line(*self.rows[-1])}", flush=True)

    def line(
        self, label: str, row: Single, base: Single | None, nodes: int, same_cores: float | None
    ) -> str:
        one_node = next((r for _, r, _, n, _ in self.rows if n == 1), None)
        versus = f"{base.s_per_token / row.s_per_token:9.2f}" if base else f"{1.0:9.2f}"
        fair = f"{same_cores / row.s_per_token:10.2f}" if same_cores else ""
        hop = measured = other = ""
        if row.transport_s_per_token is not None:
            other = f"{row.transport_s_per_token * 1e3:8.2f}"
        if nodes > 1 and one_node is not None:
            hop = f"{(row.s_per_token - one_node.s_per_token) / nodes * 1e3:7.2f}"
            if row.transport_s_per_token is not None and one_node.transport_s_per_token is not None:
                extra = row.transport_s_per_token - one_node.transport_s_per_token
                measured = f"{extra / nodes * 1e3:7.2f}"
        return (
            f"{label:<40} {1 / row.s_per_token:7.2f} {versus} {fair:>10} {row.ttft_s * 1e3:8.0f} "
            f"{hop:>7} {other:>8} {measured:>7} {row.load:5.2f}"
        )

    def print_all(self) -> None:
        print(self.title)
        print(self.HEADER)
        for row in self.rows:
            print(self.line(*row))
        print("\n".join(self.NOTES), flush=True)


def node_layouts(cores: int, per_node: int) -> list[list[str]]:
    """The taskset core lists of the 1-, 2- and 3-node rows: node i on cores
    i*per_node..(i+1)*per_node-1; where the machine has too few, the last nodes wrap around
    to the first cores (with one request only one stage computes at a time)."""
    sets = [
        str(i * per_node) if per_node == 1 else f"{i * per_node}-{(i + 1) * per_node - 1}"
        for i in range(max(1, cores // per_node))
    ]
    return [[sets[i % len(sets)] for i in range(nodes)] for nodes in (1, 2, 3)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-pin", action="store_true", help="daemons share every core")
    parser.add_argument("--scaling", action="store_true", help="one request on 1, 2, 3 nodes")
    parser.add_argument("--runs", type=int, default=5, help="requests per --scaling row")
    parser.add_argument(
        "--loop-sends-too",
        action="store_true",
        help="--scaling also runs the multi-node rows with every frame sent by the daemons' "
        "loops (MESHD_LOOP_SENDS=1), the baseline of frames sent from the compute thread",
    )
    parser.add_argument(
        "--stream-first-too",
        action="store_true",
        help="--scaling and --unpinned-rounds also run the unpinned daemons with each token's "
        "client stream before the next step (MESHD_STREAM_FIRST=1), the baseline of that order",
    )
    parser.add_argument(
        "--no-lanes-too", action="store_true",
        help="--scaling also runs the multi-node rows with --no-lanes (gRPC streams only)",
    )  # fmt: skip
    parser.add_argument(
        "--hop-trace", action="store_true",
        help="--scaling: the multi-node daemons trace their hops (MESHD_HOP_TRACE) and each "
             "row prints where a hop's time goes, segment by segment",
    )  # fmt: skip
    parser.add_argument(
        "--unpinned-rounds", type=int, default=0, metavar="N",
        help="only the unpinned line (2 daemons sharing every core vs one mlx-lm), N rounds",
    )  # fmt: skip
    parser.add_argument(
        "--pinned-rounds", type=int, default=0, metavar="N",
        help="only the pinned 1- and 2-node lines, N rounds interleaved with mlx-lm on each "
             "core (run as root)",
    )  # fmt: skip
    parser.add_argument(
        "--thread-cpu", action="store_true",
        help="--scaling, --pinned-rounds and --unpinned-rounds also print each daemon's CPU a "
             "streamed token, per thread (Linux)",
    )  # fmt: skip
    parser.add_argument(
        "--strategy", choices=["memory", "speed"], default="memory",
        help="how the daemons split the layers (see start_mesh)",
    )  # fmt: skip
    parser.add_argument(
        "--model", type=Path,
        help="an MLX model directory to run instead of the embedded default (--scaling)",
    )  # fmt: skip
    parser.add_argument(
        "--cores-per-node", type=int, default=1, metavar="K",
        help="--scaling: each node and each pinned mlx-lm process on K cores of its own",
    )  # fmt: skip
    parser.add_argument(
        "--max-nodes", type=int, default=3, choices=[1, 2, 3],
        help="--scaling: the pinned rows end at this many nodes",
    )  # fmt: skip
    parser.add_argument(
        "--loopback", action="store_true",
        help="--scaling: pinned daemons on loopback, dialling each other by port, instead of "
             "a network namespace each (machines without namespaces, such as containers)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.cores_per_node < 1:
        parser.error(f"--cores-per-node must be 1 or more, not {args.cores_per_node}")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model} is not an MLX model directory (no config.json)")
    if args.unpinned_rounds:
        return unpinned_rounds(
            args.unpinned_rounds, args.runs, args.max_tokens, args.stream_first_too, args.thread_cpu
        )
    if args.pinned_rounds:
        return pinned_rounds(args.pinned_rounds, args.runs, args.max_tokens, args.thread_cpu)
    if args.scaling:
        return scaling_table(
            args.runs,
            args.max_tokens,
            args.no_lanes_too,
            args.hop_trace,
            args.loop_sends_too,
            args.stream_first_too,
            args.thread_cpu,
            args.model,
            args.cores_per_node,
            args.loopback,
            args.max_nodes,
        )
    cores = os.cpu_count() or 1
    cpus = ["", ""] if args.no_pin or cores < 2 else ["0", "1"]
    all_cpus = "" if args.no_pin or cores < 2 else "0,1"
    print(f"{cores} cores; daemons pinned: {cpus}; load {os.getloadavg()}")
    with bench_root("bench-batching-") as (root, model):
        daemons: list[DaemonProcess] = []
        try:
            daemons = start_mesh(root, model, cpus, max(args.concurrency), args.strategy)
            status = daemons[0].status()
            stages = json.loads(status.agreement.plan_json)["stages"]
            print(
                f"strategy {args.strategy}: layers "
                + ", ".join(f"[{stage['layer_start']}, {stage['layer_end']})" for stage in stages)
            )
            url = status.http_url
            asyncio.run(mesh_row(url, 1, 8))  # warm-up: first request of each stage
            mesh_rows = [asyncio.run(mesh_row(url, n, args.max_tokens)) for n in args.concurrency]
        finally:
            for daemon in daemons:
                daemon.kill()
        ref_rows = reference_rows(model, args.concurrency, args.max_tokens, all_cpus)
    print()
    for mesh, ref in zip(mesh_rows, ref_rows, strict=True):
        print(mesh.line("2 stages"))
        print(ref.line("mlx-lm"))
        versus = mesh.tokens_per_s / ref.tokens_per_s
        scaling = mesh.tokens_per_s / mesh_rows[0].tokens_per_s
        print(f"{'':<10} mesh/mlx-lm {versus:.2f}x; mesh N={mesh.n} vs N=1: {scaling:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
