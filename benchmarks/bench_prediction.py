"""Predicted against measured, on the product: real `meshd run` daemons, before and after the
speed correction settles.

For each layout (one node; 2 and 3 nodes as a pipeline; 2 and 3 nodes as one tensor-parallel
group, where the model's heads divide), loopback daemons each pinned with taskset to its own
core (``benchmarks/bench_batching.py``'s launching and pinning; on a machine with fewer cores
the last nodes share the first ones) serve the model; for each concurrency C the model is
loaded with ``--concurrency C`` (the plan's prediction is for C) and C streaming chat
requests run at once, ``--rounds`` times (greedy, ``--max-tokens`` each, no prefix cache, a
prompt of about ``--prompt-tokens`` tokens). Each row compares, with the daemon's own rules
(:mod:`meshd.inference.prediction_check`, fed the client's timings):

* decode tokens/s per request: alone for C = 1, at the plan's concurrency for C > 1 (and the
  aggregate, C times that);
* prefill tokens/s and time to first token: requests whose prompt ran alone (so C = 1; the
  prediction scaled to each request's prompt);

with the error, (measured - predicted) / predicted. Two passes per layout: **before**, daemons
with ``--no-speed-correction`` (plans from the measured profile alone), and **after**, fresh
daemons that first serve ``--settle-requests`` requests alone and one round at the highest
concurrency, so each node's correction (:mod:`meshd.mesh.speed_correction`: its factor, and
the FLOP/s of each row a batched step adds) is published and the mesh re-plans with it; each
"after" row also lists the nodes' factors. Goal: within 25 % on a quiet machine.

    .venv/bin/python benchmarks/bench_prediction.py [--nodes 1 2 3] [--layouts pipeline tensor]
        [--concurrency 1 4 16] [--rounds 3] [--max-tokens 64] [--prompt-tokens 256]
        [--passes before after] [--model DIR] [--memory-budget 500MiB]

The planner leaves out a node that adds under 10 % (three nodes of one machine serving one
sequence as a pipeline run no faster than two), so each row names the plan's shape; give
``--memory-budget`` to make every node needed.

Daemons listen on 127.0.0.1 only (tensor-parallel groups need loopback trusted: they get
``--tensor-parallel-trusted-network 127.0.0.0/8``), in a temporary folder removed at the end;
they are killed by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_batching import (
    TOPICS,
    PinnedDaemon,
    bench_root,
    chat_chunks,
    has_text,
    loopback_networks,
    node_layouts,
)

from meshd.api import client, render
from meshd.api.demo import plan_committed
from meshd.api.launcher import DaemonProcess
from meshd.inference.prediction_check import FinishedRequest, PredictionComparison, compare
from meshd.mesh import security
from meshd.mesh.profiling import load_or_measure_profile
from meshd.wire import pb
from partitioner import Plan
from partitioner.humanize import format_token_rate, format_wait
from partitioner.model import ModelSpec
from partitioner.stage_units import tensor_parallel_degrees

FILLER = (
    "The story should have a clear beginning, a middle with a problem to solve, and an "
    "ending that surprises the reader. "
)


@dataclass(frozen=True)
class Layout:
    nodes: int
    parallelism: str  # "solo", "pipeline" or "tensor"

    @property
    def label(self) -> str:
        return "1 node" if self.nodes == 1 else f"{self.nodes} nodes {self.parallelism}"


def prompt(index: int, words: int) -> list[dict[str, str]]:
    """A chat asking for a story, padded to about ``words`` words (~1.3 tokens each)."""
    text = f"Write a long story about {TOPICS[index % len(TOPICS)]}. "
    while len(text.split()) < words:
        text += FILLER
    return [{"role": "user", "content": text}]


async def timed_request(http, url: str, messages, max_tokens: int) -> FinishedRequest:
    """One streaming chat request, timed as the origin times it (sent, first token, last)."""
    started = time.perf_counter()
    first = last = 0.0
    usage: dict = {}
    async for arrived, chunk in chat_chunks(http, url, messages, max_tokens):
        usage = chunk.get("usage") or usage
        if has_text(chunk):
            last = arrived
            first = first or last
    details = usage.get("prompt_tokens_details") or {}
    return FinishedRequest(
        plan_id="",  # filled in once the row knows its plan
        started_at=started,
        first_token_at=first or started,
        ended_at=last or started,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
    )


async def run_rounds(url: str, concurrency: int, rounds: int, max_tokens: int, words: int):
    import httpx

    finished: list[FinishedRequest] = []
    async with httpx.AsyncClient(timeout=900) as http:
        for round_index in range(rounds):
            batch = [
                timed_request(http, url, prompt(round_index * concurrency + k, words), max_tokens)
                for k in range(concurrency)
            ]
            finished += await asyncio.gather(*batch)
    return finished


# --- The mesh ---------------------------------------------------------------------------------


@contextlib.contextmanager
def mesh(
    root: Path,
    model: Path,
    layout: Layout,
    cpus: list[str],
    correction: bool,
    name: str,
    memory_budget: str | None = None,
) -> Iterator[list[DaemonProcess]]:
    """``layout.nodes`` pinned loopback daemons serving ``model`` as ``layout`` says, each
    with ``memory_budget`` where given."""
    token = security.encode_join_token(security.create_mesh_secret("bench-prediction"))
    daemons: list[DaemonProcess] = []
    try:
        for index, ((_, network), cpu) in enumerate(
            zip(loopback_networks(layout.nodes), cpus, strict=True)
        ):
            state = root / f"{name}-{index}"
            state.mkdir()
            shutil.copyfile(root / "profile" / "profile.json", state / "profile.json")
            args = [*network, "--join", token, "--name", f"p{index}", "--model", str(model),
                    "--strategy", "speed", "--context-length", "1024", "--no-prefix-cache",
                    "--tensor-parallel-trusted-network", "127.0.0.0/8",
                    "--log-level", "WARNING"]  # fmt: skip
            if layout.nodes > 1:
                args += ["--parallelism", layout.parallelism]
            if not correction:
                args.append("--no-speed-correction")
            if memory_budget:
                args += ["--memory-budget", memory_budget]
            daemons.append(PinnedDaemon(state, args, cpu).start())
        yield daemons
    finally:
        for daemon in daemons:
            daemon.kill()


def active_plan(status: pb.MeshStatus) -> Plan | None:
    text = status.agreement.plan_json
    return Plan.from_dict(json.loads(text)) if text else None


def serve_at(daemons: list[DaemonProcess], model: Path, layout: Layout, concurrency: int) -> Plan:
    """Load the model for ``concurrency`` and wait until every node serves that plan."""
    request = pb.LoadModelRequest(model=str(model), strategy="speed", context_length=1024,
                                  concurrency=concurrency)  # fmt: skip
    if layout.nodes > 1:
        request.parallelism = layout.parallelism
    client.load_model(daemons[0].api, request)

    def serving(status: pb.MeshStatus) -> bool:
        plan = active_plan(status)
        return (
            plan is not None
            and plan.concurrency == concurrency
            and status.agreement.converged
            and status.transitions.active_plan_loaded
        )

    for daemon in daemons:
        daemon.wait_for(serving, 300, f"a loaded plan for concurrency {concurrency}")
    plan = active_plan(daemons[0].status())
    assert plan is not None
    return plan


def measure_row(
    daemons: list[DaemonProcess], model: Path, layout: Layout, concurrency: int, args
) -> tuple[PredictionComparison, Plan, str]:
    plan = serve_at(daemons, model, layout, concurrency)
    url = daemons[0].status().http_url
    asyncio.run(run_rounds(url, 1, 1, 8, 8))  # warm-up: the tokenizer, the first caches
    finished = asyncio.run(
        run_rounds(url, concurrency, args.rounds, args.max_tokens, args.prompt_tokens * 3 // 4)
    )
    after = active_plan(daemons[0].status())
    changed = ""
    if after is not None and after.prediction != plan.prediction:
        changed = " (the plan changed during the row: compared with the newer one)"
        plan = after
    stamped = [dataclasses.replace(request, plan_id=plan.plan_id) for request in finished]
    return compare(plan, stamped), plan, changed


def shape(plan: Plan) -> str:
    """What the plan made of the layout's nodes: its stages and their nodes."""
    if len(plan.stages) == 1 and len(plan.stages[0].nodes) > 1:
        return f"one group of {len(plan.stages[0].nodes)}"
    return f"{len(plan.stages)} stage(s)"


def settle(daemons: list[DaemonProcess], model: Path, layout: Layout, args) -> None:
    """Requests alone, then a round at the highest concurrency (the steps of several rows
    give each node's row FLOP/s), until the nodes' corrections are published and the mesh
    re-planned with them."""
    serve_at(daemons, model, layout, 1)
    url = daemons[0].status().http_url
    asyncio.run(run_rounds(url, 1, args.settle_requests, args.max_tokens, 8))
    time.sleep(6)  # one more correction tick (meshd.node.SPEED_CORRECTION_EVERY_S)
    most = max(args.concurrency)
    if most > 1:
        serve_at(daemons, model, layout, most)
        asyncio.run(run_rounds(url, most, 1, args.max_tokens, 8))
        time.sleep(6)
    for daemon in daemons:
        daemon.wait_for(
            lambda s: s.agreement.converged and s.transitions.active_plan_loaded, 300, "re-plan"
        )


# --- Output -----------------------------------------------------------------------------------


def error(predicted: float, measured: float) -> str:
    if predicted <= 0 or measured <= 0:
        return "   -  "
    return f"{(measured - predicted) / predicted * 100:+5.0f}%"


def cell(predicted: float, measured: float, show) -> str:
    if measured <= 0:
        return f"{show(predicted):>15} / {'-':>15}        "
    return f"{show(predicted):>15} / {show(measured):>15} {error(predicted, measured)}"


def print_row(
    label: str, phase: str, concurrency: int, found: PredictionComparison, status: pb.MeshStatus
) -> None:
    decode = found.decode_alone if concurrency == 1 else found.decode_concurrent
    assert decode is not None
    total = decode.measured * concurrency
    factors = ", ".join(
        f"{c.node_id[:6]} {c.factor:.2f}x"
        + (f" rows {c.row_flops / 1e9:.0f} GFLOP/s" if c.row_flops else "")
        for c in status.speed_corrections
    )
    print(
        f"{label:<36} {phase:<6} C={concurrency:<3} "
        f"decode {cell(decode.predicted, decode.measured, format_token_rate)}  "
        f"aggregate {cell(decode.predicted * concurrency, total, format_token_rate)}  "
        f"prefill {cell(found.prefill.predicted, found.prefill.measured, format_token_rate)}  "
        f"TTFT {cell(found.ttft.predicted, found.ttft.measured, format_wait)}"
        f"{'  corrections: ' + factors if factors else ''}  load {os.getloadavg()[0]:.2f}",
        flush=True,
    )  # fmt: skip


def layouts_for(model: Path, nodes: list[int], kinds: list[str]) -> list[Layout]:
    from meshd.models.info import read_model_spec

    spec: ModelSpec = read_model_spec(model)
    degrees = tensor_parallel_degrees(spec)
    chosen = []
    for count in nodes:
        if count == 1:
            chosen.append(Layout(1, "solo"))
            continue
        for kind in kinds:
            if kind == "tensor" and count not in degrees:
                print(f"{count} nodes tensor: {spec.name}'s heads do not divide by {count}")
                continue
            chosen.append(Layout(count, kind))
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--layouts", nargs="+", default=["pipeline", "tensor"],
                        choices=["pipeline", "tensor"])  # fmt: skip
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=3, help="batches of C requests per row")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="about this many")
    parser.add_argument("--passes", nargs="+", default=["before", "after"],
                        choices=["before", "after"])  # fmt: skip
    parser.add_argument("--settle-requests", type=int, default=4,
                        help="'after': requests alone first, so corrections settle")  # fmt: skip
    parser.add_argument("--model", type=Path, help="an MLX model directory (default: SmolLM2)")
    parser.add_argument("--memory-budget", help="each node's budget, e.g. 500MiB: with SmolLM2 "
                        "in float32, three nodes are then needed")  # fmt: skip
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    with bench_root("meshd-bench-prediction-", args.model) as (root, model):
        (root / "profile").mkdir()
        load_or_measure_profile(root / "profile", memory_budget_override=None)
        print(
            f"{time.strftime('%Y-%m-%d %H:%M')} {cores} cores, model {model.name}, "
            f"max_tokens {args.max_tokens}, ~{args.prompt_tokens} prompt tokens, "
            f"{args.rounds} round(s); cells: predicted / measured error",
            flush=True,
        )
        for layout in layouts_for(model, args.nodes, args.layouts):
            cpus = node_layouts(cores, 1)[layout.nodes - 1]
            for phase in args.passes:
                name = f"{layout.nodes}{layout.parallelism}-{phase}"
                correction = phase == "after"
                budget = args.memory_budget
                with mesh(root, model, layout, cpus, correction, name, budget) as daemons:
                    for daemon in daemons:  # as many stages as the planner found worth them
                        daemon.wait_for(plan_committed(layout.nodes), 180, "a committed plan")
                    if correction:
                        settle(daemons, model, layout, args)
                    for concurrency in args.concurrency:
                        found, plan, changed = measure_row(
                            daemons, model, layout, concurrency, args
                        )
                        status = daemons[0].status()
                        label = f"{layout.label} ({shape(plan)})"
                        print_row(label, phase, concurrency, found, status)
                        if changed:
                            print(f"  {changed.strip()}", flush=True)
                    own = render.prediction_text(daemons[0].status())
                    print("  what `meshd status` shows on the first node now:", flush=True)
                    print("\n".join("    " + line for line in own.splitlines()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
