"""The data plane generates across real gRPC nodes exactly what one process generates.

Each "node" is a real grpc.aio server on 127.0.0.1 with mutual TLS under a temporary mesh
secret and its own DataPlane (its own compute thread), all on one asyncio loop that runs in a
background thread; the tests submit coroutines to it with a bound on every wait. Models are
random float32 llama and qwen3 (tiny, so a token takes a few ms), plus one test on the real
SmolLM2-135M answering with its chat template.
"""

# ruff: noqa: E402
from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()  # before mlx.core: float32 matmuls on OpenBLAS

import asyncio
import contextlib
import itertools
import json
import select
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from meshd.agreement.contract import PlanNotCommittedError
from meshd.inference.dataplane import (
    Assignment,
    DataPlane,
    DataPlaneError,
    FinalEvent,
    StageSpec,
    TokenEvent,
    mtls_channel_factory,
    start_server,
)
from meshd.inference.sampling import SamplingParams
from meshd.inference.shard import LocalPipeline, prefill_chunks
from meshd.mesh import security
from tests.support.random_model import make_random_model_dir

T = TypeVar("T")

LAYERS = 6
VOCAB = 320
PROMPT = [(index * 37 + 11) % 300 for index in range(20)]
STEPS = 24
WAIT_S = 60.0  # the longest any test waits for the loop thread
SPLITS = {
    1: [(0, 6)],
    2: [(0, 3), (3, 6)],
    3: [(0, 1), (1, 4), (4, 6)],  # uneven on purpose: a one-layer first stage
}
SAMPLED = SamplingParams(
    temperature=1.0, top_p=0.9, top_k=60, min_p=0.01, repetition_penalty=1.3, seed=7, max_tokens=20
)


class LoopThread:
    """An asyncio loop on a daemon thread (like the daemon's grpc thread)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-grpc")
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = WAIT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class Node:
    node_id: str
    plane: DataPlane
    server: grpc.aio.Server
    address: str
    committed: set[str] = field(default_factory=set)


class Mesh:
    """In-process nodes; plans are installed (and committed) per test."""

    def __init__(self, loop: LoopThread, state_dir: Path) -> None:
        self.loop = loop
        self.state_dir = state_dir
        self.secret = security.create_mesh_secret("dataplane-test")
        self.nodes: dict[str, Node] = {}
        self._plan_ids = itertools.count()

    def add_node(self, node_id: str, **plane_options: Any) -> Node:
        credentials = security.load_or_create_node_credentials(
            self.state_dir / node_id, self.secret, node_id
        )
        committed: set[str] = set()

        def check_serving(plan_id: str) -> None:
            if plan_id not in committed:
                raise PlanNotCommittedError(
                    f"plan {plan_id} is not committed on node {node_id} (it serves "
                    f"{sorted(committed) or 'no plan'})"
                )

        async def start() -> Node:
            plane = DataPlane(
                node_id, mtls_channel_factory(credentials), check_serving, **plane_options
            )
            server, port = await start_server(plane, credentials)
            return Node(node_id, plane, server, f"127.0.0.1:{port}", committed)

        node = self.loop.run(start())
        self.nodes[node_id] = node
        return node

    def assignment(self, model_dir: Path, stage_nodes: Sequence[str], split: int) -> Assignment:
        ranges = SPLITS[split]
        assert len(ranges) == len(stage_nodes)
        return self.assignment_for(model_dir, list(zip(stage_nodes, ranges, strict=True)))

    def assignment_for(
        self, model_dir: Path, layout: Sequence[tuple[str, tuple[int, int]]]
    ) -> Assignment:
        last = len(layout) - 1
        stages = tuple(
            StageSpec(node, self.nodes[node].address, start, end, index == 0, index == last)
            for index, (node, (start, end)) in enumerate(layout)
        )
        return Assignment(f"plan-{next(self._plan_ids)}", model_dir, stages)

    def install(self, assignment: Assignment, nodes: Sequence[str] | None = None) -> None:
        """Commit and install ``assignment`` on ``nodes`` (default: every node)."""
        targets = [self.nodes[n] for n in (nodes or self.nodes)]
        for node in targets:
            node.committed.add(assignment.plan_id)

        async def install_all() -> None:
            await asyncio.gather(*(node.plane.install(assignment) for node in targets))

        self.loop.run(install_all())

    def uninstall(self, plan_id: str) -> None:
        async def uninstall_all() -> None:
            for node in self.nodes.values():
                node.committed.discard(plan_id)
                await node.plane.uninstall(plan_id, "test over")

        self.loop.run(uninstall_all())

    def generate(
        self,
        origin: str,
        plan_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        **options: Any,
    ) -> tuple[list[TokenEvent], FinalEvent]:
        plane = self.nodes[origin].plane
        request_id = options.pop("request_id", f"{origin}-{time.monotonic_ns()}")

        async def run() -> tuple[list[TokenEvent], FinalEvent]:
            stream = plane.generate(plan_id, prompt, params, request_id=request_id, **options)
            return await collect(stream)

        return self.loop.run(run())

    def open_requests(self, plan_id: str) -> dict[str, tuple[int, int]]:
        """Per node: (KV caches held, request records) for ``plan_id``."""

        async def read() -> dict[str, tuple[int, int]]:
            result = {}
            for node in self.nodes.values():
                caches = sum(
                    p.open_requests for p in node.plane.stats().plans if p.plan_id == plan_id
                )
                result[node.node_id] = (caches, node.plane.active_requests(plan_id))
            return result

        return self.loop.run(read())

    def wait_all_freed(self, plan_id: str, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (left := self.open_requests(plan_id)) and any(any(v) for v in left.values()):
            assert time.monotonic() < deadline, f"requests still open: {left}"
            time.sleep(0.02)

    def close(self) -> None:
        async def close_all() -> None:
            for node in self.nodes.values():
                await node.plane.close()
                await node.server.stop(0)

        self.loop.run(close_all())


async def collect(stream: AsyncIterator[Any]) -> tuple[list[TokenEvent], FinalEvent]:
    tokens: list[TokenEvent] = []
    async for event in stream:
        if isinstance(event, FinalEvent):
            return tokens, event
        tokens.append(event)
    raise AssertionError("the stream ended without a FinalEvent")


def tiny_model(root: Path, arch: str) -> Path:
    return make_random_model_dir(
        root / arch, arch, layers=LAYERS, hidden=64, heads=4, kv_heads=2, vocab=VOCAB, seed=11
    )


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: tiny_model(root, arch) for arch in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def mesh(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """n1..n3 hold stages; n4 holds none and is only ever an origin."""
    built = Mesh(loop, tmp_path_factory.mktemp("mesh"))
    try:
        for node_id in ("n1", "n2", "n3", "n4"):
            built.add_node(node_id)
        yield built
    finally:
        built.close()


@contextlib.contextmanager
def installed(mesh: Mesh, assignment: Assignment) -> Iterator[str]:
    mesh.install(assignment)
    try:
        yield assignment.plan_id
    finally:
        mesh.uninstall(assignment.plan_id)


# --- References computed in this process -------------------------------------------------------


def mlx_lm_greedy(
    model_dir: Path, prompt: list[int], steps: int
) -> tuple[list[int], list[np.ndarray]]:
    """mlx-lm's own model, greedy: tokens and the last-position logits before each token."""
    model, _ = load_model(model_dir)
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    tokens, rows = [], []
    for _ in range(steps):
        mx.eval(logits)
        rows.append(np.array(logits[0]))
        tokens.append(int(mx.argmax(logits[0]).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[:, -1, :]
    return tokens, rows


def local_tokens(model_dir: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    """LocalPipeline (one process) with the data plane's EOS rule: EOS ends, is not yielded."""
    pipeline = LocalPipeline.load(model_dir, SPLITS[1])
    eos = {_eos_id(model_dir)}
    tokens = list(pipeline.generate(prompt, params, eos_token_ids=eos))
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def _eos_id(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["eos_token_id"])


# --- Exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "stages", "origin"),
    [
        ("llama", ("n1",), "n1"),  # one stage: decode steps chain on the compute thread
        ("llama", ("n1", "n2"), "n1"),  # the origin is the first stage
        ("llama", ("n1", "n2", "n3"), "n4"),  # the origin holds no stage
        ("qwen3", ("n1", "n2"), "n2"),  # the origin is the last stage
        ("qwen3", ("n3", "n1", "n2"), "n1"),  # the origin is a middle stage
    ],
)
def test_greedy_tokens_and_logits_equal_mlx_lm(
    mesh: Mesh, models: dict[str, Path], arch: str, stages: tuple[str, ...], origin: str
) -> None:
    model_dir = models[arch]
    ref_tokens, ref_logits = mlx_lm_greedy(model_dir, PROMPT, STEPS)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS)
    with installed(mesh, mesh.assignment(model_dir, stages, len(stages))) as plan_id:
        events, final = mesh.generate(origin, plan_id, PROMPT, params, return_logits=True)
    assert final.error is None and final.finish_reason == "length"
    assert [event.token_id for event in events] == ref_tokens
    for step, (event, ref) in enumerate(zip(events, ref_logits, strict=True)):
        assert event.logits is not None
        assert np.array_equal(event.logits, ref), (
            f"step {step}: max diff {np.abs(event.logits - ref).max()}"
        )
    assert len(np.unique(ref_logits[1])) > 100, "logits should be varied, not constant"
    assert final.usage.completion_tokens == STEPS and final.usage.prompt_tokens == len(PROMPT)


def test_chunked_prefill_equals_local_pipeline_chunks(mesh: Mesh, models: dict[str, Path]) -> None:
    """A 45-token prompt in chunks of 7 over 3 stages: each stage's cache advances per chunk
    exactly as in one process with the same chunks."""
    model_dir = models["llama"]
    prompt = [(index * 13 + 5) % 300 for index in range(45)]
    pipeline = LocalPipeline.load(model_dir, SPLITS[3])
    caches = pipeline.make_caches()
    logits = pipeline.prefill(mx.array(prompt), caches, chunk_size=7)
    ref_rows, ref_tokens = [], []
    while len(ref_tokens) < 6 and _eos_id(model_dir) not in ref_tokens:
        ref_rows.append(np.array(logits[0]))
        ref_tokens.append(int(mx.argmax(logits[0]).item()))
        logits = pipeline.logits(mx.array([[ref_tokens[-1]]]), caches)[:, -1, :]
    assert len(prefill_chunks(mx.array(prompt), 7)) == 7

    params = SamplingParams(max_tokens=6)
    with installed(mesh, mesh.assignment(model_dir, ("n1", "n2", "n3"), 3)) as plan_id:
        events, final = mesh.generate(
            "n1", plan_id, prompt, params, return_logits=True, prefill_chunk=7
        )
    hit_eos = ref_tokens[-1] == _eos_id(model_dir)
    assert final.finish_reason == ("eos" if hit_eos else "length")
    assert [event.token_id for event in events] == ref_tokens[: len(ref_tokens) - hit_eos]
    for step, (event, ref) in enumerate(zip(events, ref_rows, strict=False)):
        assert np.array_equal(event.logits, ref), f"step {step}"


# --- Sampling ---------------------------------------------------------------------------------


def test_same_seed_same_output_as_one_process(mesh: Mesh, models: dict[str, Path]) -> None:
    model_dir = models["qwen3"]
    reference = local_tokens(model_dir, PROMPT, SAMPLED)
    with installed(mesh, mesh.assignment(model_dir, ("n1", "n2", "n3"), 3)) as plan_id:
        first, end_first = mesh.generate("n4", plan_id, PROMPT, SAMPLED)
        second, end_second = mesh.generate("n1", plan_id, PROMPT, SAMPLED)
        other_seed = SamplingParams(**{**vars(SAMPLED), "seed": 8})
        third, _ = mesh.generate("n1", plan_id, PROMPT, other_seed)
    tokens = [event.token_id for event in first]
    assert tokens == reference
    assert [event.token_id for event in second] == tokens
    assert (
        "".join(e.text for e in first) + end_first.text
        == "".join(e.text for e in second) + end_second.text
    )
    assert len(set(tokens)) > 3, "temperature 1 on random logits should vary"
    assert [event.token_id for event in third] != tokens
    assert end_first.usage.seed == SAMPLED.seed


def test_four_concurrent_requests_on_two_stages(mesh: Mesh, models: dict[str, Path]) -> None:
    model_dir = models["llama"]
    prompts = [[(index * (7 + k) + k) % 300 for index in range(12 + 3 * k)] for k in range(4)]
    params = [SamplingParams(**{**vars(SAMPLED), "seed": 100 + k}) for k in range(4)]
    references = [local_tokens(model_dir, p, s) for p, s in zip(prompts, params, strict=True)]
    with installed(mesh, mesh.assignment(model_dir, ("n1", "n2"), 2)) as plan_id:
        plane = mesh.nodes["n1"].plane

        async def run_all() -> list[tuple[list[TokenEvent], FinalEvent]]:
            streams = [
                plane.generate(plan_id, p, s, request_id=f"concurrent-{k}")
                for k, (p, s) in enumerate(zip(prompts, params, strict=True))
            ]
            return await asyncio.gather(*(collect(stream) for stream in streams))

        results = mesh.loop.run(run_all())
        mesh.wait_all_freed(plan_id)
    for (events, final), reference in zip(results, references, strict=True):
        assert final.error is None
        assert [event.token_id for event in events] == reference


def test_stop_string_is_trimmed_and_ends_the_request(mesh: Mesh, models: dict[str, Path]) -> None:
    model_dir = models["llama"]
    with installed(mesh, mesh.assignment(model_dir, ("n1", "n2"), 2)) as plan_id:
        events, final = mesh.generate("n1", plan_id, PROMPT, SAMPLED)
        text = "".join(event.text for event in events) + final.text
        assert len(text) > 12, text
        stop = text[8:11]
        cut = text.index(stop)
        params = SamplingParams(**{**vars(SAMPLED), "stop": (stop,)})
        stopped, stop_final = mesh.generate("n1", plan_id, PROMPT, params)
        mesh.wait_all_freed(plan_id)
    assert stop_final.finish_reason == "stop"
    assert "".join(event.text for event in stopped) + stop_final.text == text[:cut]
    assert len(stopped) < len(events)


# --- Fencing and errors -----------------------------------------------------------------------


def test_stage_refuses_a_plan_it_has_not_committed(mesh: Mesh, models: dict[str, Path]) -> None:
    assignment = mesh.assignment(models["llama"], ("n1", "n2"), 2)
    mesh.install(assignment, nodes=["n1", "n2"])
    try:
        mesh.nodes["n2"].committed.discard(assignment.plan_id)  # n2 has moved on
        started = time.monotonic()
        events, final = mesh.generate(
            "n1", assignment.plan_id, PROMPT, SamplingParams(max_tokens=5)
        )
        assert time.monotonic() - started < 5
        assert events == [] and final.finish_reason == "error"
        assert f"plan {assignment.plan_id} is not committed on node n2" in (final.error or "")
        # The origin's own fencing: n3 never committed the plan.
        _, final = mesh.generate("n3", assignment.plan_id, PROMPT, SamplingParams(max_tokens=5))
        assert "not committed on node n3" in (final.error or "")
        mesh.wait_all_freed(assignment.plan_id)
    finally:
        mesh.uninstall(assignment.plan_id)


def test_a_stage_still_loading_is_retryable_and_one_that_failed_is_not(
    mesh: Mesh, models: dict[str, Path]
) -> None:
    assignment = mesh.assignment(models["llama"], ("n1", "n2"), 2)
    mesh.install(assignment, nodes=["n1"])
    mesh.nodes["n2"].committed.add(assignment.plan_id)  # committed, not installed yet
    try:
        params = SamplingParams(max_tokens=5)
        events, final = mesh.generate("n1", assignment.plan_id, PROMPT, params)
        assert events == [] and final.finish_reason == "error" and final.stage_loading
        assert "not installed there yet" in (final.error or "")

        plane = mesh.nodes["n2"].plane
        mesh.loop.run(_record_failure(plane, assignment.plan_id, "its part could not be fetched"))
        _, final = mesh.generate("n1", assignment.plan_id, PROMPT, params)
        assert final.finish_reason == "error" and not final.stage_loading
        assert "n2 cannot serve plan" in (final.error or "")
        assert "its part could not be fetched" in (final.error or "")
        mesh.wait_all_freed(assignment.plan_id)
    finally:
        mesh.uninstall(assignment.plan_id)


async def _record_failure(plane: DataPlane, plan_id: str, reason: str) -> None:
    plane.record_load_failure(plan_id, reason)


def test_bad_arguments_raise_before_anything_is_sent(mesh: Mesh, models: dict[str, Path]) -> None:
    plane = mesh.nodes["n1"].plane
    with installed(mesh, mesh.assignment(models["llama"], ("n1", "n2"), 2)) as plan_id:
        sent = mesh.nodes["n2"].plane.frames_received
        for prompt, match in (([], "empty"), ([VOCAB], "not a token id"), ([-1], "not a token id")):
            with pytest.raises(ValueError, match=match):
                plane.generate(plan_id, prompt, SamplingParams(), request_id="bad")
        with pytest.raises(ValueError, match="request_id"):
            plane.generate(plan_id, PROMPT, SamplingParams(), request_id="")
        assert mesh.nodes["n2"].plane.frames_received == sent
        _, final = mesh.generate("n1", "no-such-plan", PROMPT, SamplingParams(max_tokens=2))
        assert final.finish_reason == "error" and "no-such-plan" in (final.error or "")


def test_uninstall_aborts_running_requests_with_its_reason(
    mesh: Mesh, models: dict[str, Path]
) -> None:
    assignment = mesh.assignment(models["llama"], ("n1", "n2"), 2)
    mesh.install(assignment)
    plane = mesh.nodes["n1"].plane

    async def run() -> tuple[list[TokenEvent], FinalEvent]:
        stream = plane.generate(
            assignment.plan_id, PROMPT, SamplingParams(max_tokens=4000), request_id="u"
        )
        events: list[TokenEvent] = []
        async for event in stream:
            if isinstance(event, FinalEvent):
                return events, event
            events.append(event)
            if len(events) == 3:
                await mesh.nodes["n2"].plane.uninstall(
                    assignment.plan_id, "stage n9 lost; the mesh is re-planning, retry"
                )
        raise AssertionError("no final event")

    try:
        events, final = mesh.loop.run(run(), timeout=20)
        assert final.finish_reason == "error" and "stage n9 lost" in (final.error or "")
        assert len(events) < 50
        mesh.wait_all_freed(assignment.plan_id)
    finally:
        mesh.uninstall(assignment.plan_id)


def test_caches_are_freed_after_finish_and_after_cancel(
    mesh: Mesh, models: dict[str, Path]
) -> None:
    with installed(mesh, mesh.assignment(models["qwen3"], ("n1", "n2", "n3"), 3)) as plan_id:
        mesh.generate("n4", plan_id, PROMPT, SamplingParams(max_tokens=5))
        mesh.wait_all_freed(plan_id)

        plane = mesh.nodes["n4"].plane

        async def leave_after(tokens: int) -> dict[str, tuple[int, int]]:
            stream = plane.generate(
                plan_id, PROMPT, SamplingParams(max_tokens=4000), request_id="gone"
            )
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == tokens:
                    break
            held = {n.node_id: n.plane.stats() for n in mesh.nodes.values()}
            await stream.aclose()  # the client went away
            return {k: sum(p.open_requests for p in v.plans) for k, v in held.items()}

        held = mesh.loop.run(leave_after(3))
        assert sum(held.values()) >= 2, f"caches should be open mid-request: {held}"
        mesh.wait_all_freed(plan_id)

        async def cancel_after(tokens: int) -> FinalEvent:
            stream = plane.generate(
                plan_id, PROMPT, SamplingParams(max_tokens=4000), request_id="c"
            )
            seen = 0
            async for event in stream:
                if isinstance(event, FinalEvent):
                    return event
                seen += 1
                if seen == tokens:
                    assert plane.cancel("c")
            raise AssertionError("no final event")

        final = mesh.loop.run(cancel_after(2))
        assert final.finish_reason == "cancelled"
        mesh.wait_all_freed(plan_id)


def test_lost_stage_ends_every_request_promptly(
    loop: LoopThread, models: dict[str, Path], tmp_path: Path
) -> None:
    """Stopping a stage's server mid-generation fails its requests at once, naming it."""
    mesh = Mesh(loop, tmp_path)
    try:
        for node_id in ("a", "b"):
            mesh.add_node(node_id)
        assignment = mesh.assignment(models["llama"], ("a", "b"), 2)
        mesh.install(assignment)
        plane = mesh.nodes["a"].plane
        lost = mesh.nodes["b"]

        async def run() -> tuple[list[FinalEvent], float]:
            streams = [
                plane.generate(
                    assignment.plan_id, PROMPT, SamplingParams(max_tokens=4000), request_id=f"r{k}"
                )
                for k in range(2)
            ]
            first_tokens = [await anext(stream) for stream in streams]
            assert all(isinstance(event, TokenEvent) for event in first_tokens)
            stopped_at = time.monotonic()
            await lost.server.stop(0)
            finals = [(await collect(stream))[1] for stream in streams]
            return finals, time.monotonic() - stopped_at

        finals, seconds = loop.run(run(), timeout=20)
        assert seconds < 2.0
        for final in finals:
            assert final.finish_reason == "error"
            assert f"stage b at {lost.address} unreachable" in (final.error or ""), final.error
        caches = sum(p.open_requests for p in plane.stats().plans)
        deadline = time.monotonic() + 5
        while caches and time.monotonic() < deadline:
            time.sleep(0.02)
            caches = loop.run(_open_caches(plane))
        assert caches == 0
    finally:
        mesh.close()


async def _open_caches(plane: DataPlane) -> int:
    return sum(p.open_requests for p in plane.stats().plans)


# --- A real model -----------------------------------------------------------------------------


def test_smollm2_in_three_stages_answers_paris(
    mesh: Mesh, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from meshd.models.store import ModelStore

    entry = ModelStore(tmp_path_factory.mktemp("store")).ensure_default()
    layout = [("n1", (0, 10)), ("n2", (10, 20)), ("n3", (20, entry.num_layers))]
    with installed(mesh, mesh.assignment_for(entry.path, layout)) as plan_id:
        plane = mesh.nodes["n1"].plane
        prompt = mesh.loop.run(_encode(plane, plan_id, "What is the capital of France?"))
        events, final = mesh.generate("n1", plan_id, prompt, SamplingParams(max_tokens=12))
    answer = "".join(event.text for event in events) + final.text
    assert "Paris" in answer, answer
    assert final.finish_reason in ("eos", "length")


async def _encode(plane: DataPlane, plan_id: str, question: str) -> list[int]:
    return plane.encode_chat(plan_id, [{"role": "user", "content": question}])


# --- A node in another process ----------------------------------------------------------------

# Importing the daemon package loads OpenBLAS first, as in this process: same logits.
NODE_COMMAND = [sys.executable, "-m", "tests.support.stage_process", "--serve"]


class RunnerProcess:
    """``meshd.inference.dataplane --serve`` in a child process, driven over its stdin/stdout."""

    def __init__(self, node_id: str, state_dir: Path, secret: security.MeshSecret) -> None:
        security.save_secret(state_dir, secret)
        argv = [*NODE_COMMAND, "--node-id", node_id, "--state-dir", str(state_dir)]
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=Path(__file__).resolve().parents[1],  # -m tests.support.stage_process
        )
        self.address = f"127.0.0.1:{self.read(60)['port']}"

    def read(self, timeout_s: float) -> Any:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        assert ready, f"the node process did not answer within {timeout_s} s"
        return json.loads(self.process.stdout.readline())

    def command(self, payload: dict[str, Any]) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(payload) + "\n")
        self.process.stdin.flush()
        return self.read(60)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def test_stage_in_another_process_then_killed(
    mesh: Mesh, models: dict[str, Path], tmp_path: Path
) -> None:
    """The stand-alone node serves the last stage bit-exactly; kill -9 fails the request fast."""
    model_dir = models["llama"]
    ref_tokens, ref_logits = mlx_lm_greedy(model_dir, PROMPT, 8)
    runner = RunnerProcess("p2", tmp_path / "p2", mesh.secret)
    try:
        stages = (
            StageSpec("n1", mesh.nodes["n1"].address, 0, 3, True, False),
            StageSpec("p2", runner.address, 3, 6, False, True),
        )
        assignment = Assignment("plan-process", model_dir, stages)
        assert runner.command({"install": assignment.to_dict()}) == {"installed": "plan-process"}
        mesh.install(assignment, nodes=["n1"])
        events, final = mesh.generate(
            "n1", assignment.plan_id, PROMPT, SamplingParams(max_tokens=8), return_logits=True
        )
        assert final.error is None
        assert [event.token_id for event in events] == ref_tokens
        assert all(np.array_equal(e.logits, r) for e, r in zip(events, ref_logits, strict=True))
        assert runner.command({"stats": True})["plans"][0]["stage_index"] == 1

        plane = mesh.nodes["n1"].plane

        async def kill_mid_generation() -> tuple[FinalEvent, float]:
            stream = plane.generate(
                assignment.plan_id, PROMPT, SamplingParams(max_tokens=4000), request_id="k"
            )
            assert isinstance(await anext(stream), TokenEvent)
            killed_at = time.monotonic()
            runner.process.kill()
            return (await collect(stream))[1], time.monotonic() - killed_at

        final, seconds = mesh.loop.run(kill_mid_generation(), timeout=20)
        assert final.finish_reason == "error" and seconds < 2.0
        assert f"stage p2 at {runner.address} unreachable" in (final.error or ""), final.error
        mesh.wait_all_freed(assignment.plan_id)
    finally:
        runner.stop()
        mesh.uninstall("plan-process")


# --- Assignments ------------------------------------------------------------------------------


def test_assignment_from_a_partitioner_plan_and_its_checks() -> None:
    from partitioner.plan import Plan, Prediction, Stage

    prediction = Prediction(0.1, 10.0, 0.1, 10.0, 0.5, 128, (0.05, 0.05), (0.2, 0.2), 0.001)

    def plan_of(*stages: Stage) -> Plan:
        return Plan("p" * 64, "v1", "speed", "m", 6, 4096, 1, stages, (), (), prediction, ())

    plan = plan_of(Stage(("a",), 0, 2, True, False), Stage(("b",), 2, 6, False, True))
    addresses = {"a": "10.0.0.1:7000", "b": "10.0.0.2:7000"}
    assignment = Assignment.from_plan(plan, Path("/models/m"), addresses)
    assert assignment.node_ids == ("a", "b") and assignment.stage_index("b") == 1
    assert assignment.stages[1] == StageSpec("b", "10.0.0.2:7000", 2, 6, False, True)
    assert Assignment.from_dict(assignment.to_dict()) == assignment

    with pytest.raises(DataPlaneError, match="tensor-parallel"):
        Assignment.from_plan(plan_of(Stage(("a", "b"), 0, 6, True, True)), Path("m"), addresses)
    with pytest.raises(DataPlaneError, match="no address known for node b"):
        Assignment.from_plan(plan, Path("m"), {"a": "10.0.0.1:7000"})
    with pytest.raises(ValueError, match="expected a non-empty range from layer 2"):
        Assignment(
            "x",
            Path("m"),
            (StageSpec("a", "", 0, 2, True, False), StageSpec("b", "", 3, 6, False, True)),
        )
    with pytest.raises(ValueError, match="more than one stage"):
        Assignment(
            "x",
            Path("m"),
            (StageSpec("a", "", 0, 2, True, False), StageSpec("a", "", 2, 6, False, True)),
        )


def test_stats_over_grpc(mesh: Mesh, models: dict[str, Path]) -> None:
    """The Stats RPC answers another member over mutual TLS with what the node holds."""
    from meshd.wire import dataplane_pb2, dataplane_pb2_grpc

    credentials = security.load_or_create_node_credentials(mesh.state_dir / "n1", mesh.secret, "n1")
    with installed(mesh, mesh.assignment(models["qwen3"], ("n1", "n2"), 2)) as plan_id:

        async def ask() -> Any:
            async with mtls_channel_factory(credentials)(mesh.nodes["n2"].address) as channel:
                stub = dataplane_pb2_grpc.DataPlaneStub(channel)
                return await stub.Stats(dataplane_pb2.StatsRequest(), timeout=5)

        reply = mesh.loop.run(ask())
    assert reply.node_id == "n2" and reply.peak_rss_bytes >= reply.rss_bytes > 0
    (plan,) = [p for p in reply.plans if p.plan_id == plan_id]
    assert (plan.stage_index, plan.layer_start, plan.layer_end) == (1, 3, 6)
    assert plan.weight_bytes > 0 and plan.open_requests == 0


# --- What a node accepts from whom ------------------------------------------------------------


async def _raw_link(mesh: Mesh, as_node: str, claims: str, to: str) -> Any:
    """A Link stream opened with ``as_node``'s certificate, saying Hello as ``claims``."""
    from meshd.wire import dataplane_pb2 as dp
    from meshd.wire import dataplane_pb2_grpc as dp_grpc

    credentials = security.load_or_create_node_credentials(
        mesh.state_dir / as_node, mesh.secret, as_node
    )
    channel = mtls_channel_factory(credentials)(mesh.nodes[to].address)
    call = dp_grpc.DataPlaneStub(channel).Link()
    await call.write(dp.Frame(hello=dp.Hello(node_id=claims)))
    return channel, call


def test_a_node_accepts_work_only_from_the_stage_the_plan_says(
    mesh: Mesh, models: dict[str, Path]
) -> None:
    from meshd.wire import dataplane_pb2 as dp

    with installed(mesh, mesh.assignment(models["llama"], ("n1", "n2"), 2)) as plan_id:

        async def impostor_activation() -> Any:
            channel, call = await _raw_link(mesh, "n3", "n3", "n2")
            async with channel:
                assert (await call.read()).hello.node_id == "n2"
                start = dp.Start(origin_node_id="n3", prompt_length=1, prefill_chunk=1)
                activation = dp.Activation(start=start, dtype="float32", shape=[1, 1, 64])
                activation.data = bytes(4 * 64)
                await call.write(dp.Frame(plan_id=plan_id, request_id="x", activation=activation))
                async with asyncio.timeout(5):
                    return await call.read()

        reply = mesh.loop.run(impostor_activation())
        assert reply.failure.kind == dp.FAILURE_BAD_REQUEST
        assert "node n3 is not the previous stage of node n2" in reply.failure.message

        async def forged_hello() -> grpc.StatusCode:
            channel, call = await _raw_link(mesh, "n3", "n1", "n2")
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async with asyncio.timeout(5):
                        await call.read()
                return refused.value.code()

        assert mesh.loop.run(forged_hello()) == grpc.StatusCode.PERMISSION_DENIED
        assert mesh.open_requests(plan_id)["n2"] == (0, 0)


def test_a_long_request_is_not_taken_for_an_idle_one(
    loop: LoopThread, models: dict[str, Path], tmp_path: Path
) -> None:
    """The idle sweeper frees only silent requests: a single stage chaining its own decode
    steps for longer than the idle timeout keeps going."""
    mesh = Mesh(loop, tmp_path)
    try:
        mesh.add_node("solo", stage_idle_timeout_s=0.2)
        assignment = mesh.assignment(models["llama"], ("solo",), 1)
        mesh.install(assignment)
        started = time.monotonic()
        events, final = mesh.generate(
            "solo", assignment.plan_id, PROMPT, SamplingParams(max_tokens=300), ignore_eos=True
        )
        assert time.monotonic() - started > 0.4, "the run must outlast the idle timeout"
        assert final.error is None and final.finish_reason == "length" and len(events) == 300
    finally:
        mesh.close()
