"""The data plane generates across real gRPC nodes exactly what one mlx-lm process generates.

The guarantee (docs/architecture.md, "Exactness"): a request that runs alone on the mesh gives
the same tokens and bit-identical logits as mlx-lm's own ``generate_step`` in one process with
``prefill_step_size`` equal to the mesh's prefill chunk, on any CPU: the mesh runs mlx-lm's
schedule (all but the last prompt token in chunks, then the last one alone, then one token per
step), so every matrix multiplication has the shape mlx-lm's has, and OpenBLAS, whose rounding
depends on the shape (the row count) and on the CPU's kernels, rounds alike. What changes the
bits: a different prefill chunk size, or requests batched into one forward pass.

Each "node" is a real grpc.aio server on 127.0.0.1 with mutual TLS and its own DataPlane (see
``tests/support/dataplane_mesh.py``). Models are random float32 llama and qwen3 (tiny, so a
token takes a few ms), plus one test on the real SmolLM2-135M answering with its chat template.
"""

# ruff: noqa: E402
from meshd.runtime.blas import enable_fast_blas

enable_fast_blas()  # before mlx.core: float32 matmuls on OpenBLAS

import asyncio
import contextlib
import json
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from meshd.inference.assignment import Assignment, InvalidAssignment, StageSpec
from meshd.inference.errors import ErrorKind, InferenceError
from meshd.inference.generation_events import FinalEvent, TokenEvent
from meshd.inference.sampling import SamplingParams
from meshd.inference.serving.dataplane import DataPlane
from meshd.mesh import security
from meshd.mesh.channels import peer_channel_factory
from meshd.models.store import ModelEntry
from tests.support.dataplane_mesh import LoopThread, Mesh, collect, mlx_lm_reference
from tests.support.random_model import make_random_model_dir

pytestmark = pytest.mark.integration

LAYERS = 6
VOCAB = 320
PROMPT = [(index * 37 + 11) % 300 for index in range(20)]
STEPS = 24
SPLITS = {
    1: [(0, 6)],
    2: [(0, 3), (3, 6)],
    3: [(0, 1), (1, 4), (4, 6)],  # uneven on purpose: a one-layer first stage
}
SAMPLED = SamplingParams(
    temperature=1.0, top_p=0.9, top_k=60, min_p=0.01, repetition_penalty=1.3, seed=7, max_tokens=20
)


def assignment(mesh: Mesh, model_dir: Path, stage_nodes: tuple[str, ...]) -> Assignment:
    ranges = SPLITS[len(stage_nodes)]
    return mesh.assignment_for(model_dir, list(zip(stage_nodes, ranges, strict=True)))


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


def eos_ids(model_dir: Path) -> frozenset[int]:
    return frozenset({int(json.loads((model_dir / "config.json").read_text())["eos_token_id"])})


def finished(outcome: FinalEvent | InferenceError) -> FinalEvent:
    assert isinstance(outcome, FinalEvent), f"the request failed: {outcome!r}"
    return outcome


def failed(outcome: FinalEvent | InferenceError) -> InferenceError:
    assert isinstance(outcome, InferenceError), f"the request did not fail: {outcome!r}"
    return outcome


# --- Exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "stages", "origin"),
    [
        ("llama", ("n1",), "n1"),  # one stage: decode steps chain without frames
        ("llama", ("n1", "n2"), "n1"),  # the origin is the first stage
        ("llama", ("n1", "n2", "n3"), "n4"),  # the origin holds no stage
        ("qwen3", ("n1", "n2"), "n2"),  # the origin is the last stage
        ("qwen3", ("n3", "n1", "n2"), "n1"),  # the origin is a middle stage
    ],
)
def test_greedy_tokens_and_logits_equal_mlx_lm(
    mesh: Mesh, models: dict[str, Path], arch: str, stages: tuple[str, ...], origin: str
) -> None:
    """Bit-identical to mlx-lm's generate_step with the same prefill step size (see the
    module docstring for the guarantee and what changes it)."""
    model_dir = models[arch]
    params = SamplingParams(temperature=0.0, max_tokens=STEPS)
    ref_tokens, ref_logits = mlx_lm_reference(model_dir, PROMPT, params)
    with installed(mesh, assignment(mesh, model_dir, stages)) as plan_id:
        events, outcome = mesh.generate(origin, plan_id, PROMPT, params, return_logits=True)
    final = finished(outcome)
    assert final.finish_reason == "length"
    assert [event.token_id for event in events] == ref_tokens
    for step, (event, ref) in enumerate(zip(events, ref_logits, strict=True)):
        assert event.logits is not None
        assert np.array_equal(event.logits, ref), (
            f"step {step}: max diff {np.abs(event.logits - ref).max()}"
        )
    assert len(np.unique(ref_logits[1])) > 100, "logits should be varied, not constant"
    assert final.usage.completion_tokens == STEPS and final.usage.prompt_tokens == len(PROMPT)


def test_nodes_with_and_without_lanes_generate_exactly_together(
    loop: LoopThread, models: dict[str, Path], tmp_path: Path
) -> None:
    """A node that offers no lane (an older peer, or `--no-lanes`) in a plan with nodes that
    do: its links carry frames over their gRPC streams, the others' over lanes, and the
    request is still bit-identical to mlx-lm. The origin holds no stage, so the last
    stage's tokens come back over the connection the origin opened (a lane to a, the
    stream to b)."""
    mesh = Mesh(loop, tmp_path)
    try:
        mesh.add_node("a")
        mesh.add_node("b", lanes=False)
        mesh.add_node("o")
        params = SamplingParams(temperature=0.0, max_tokens=STEPS)
        ref_tokens, ref_logits = mlx_lm_reference(models["llama"], PROMPT, params)
        for stages in (("a", "b"), ("b", "a")):
            with installed(mesh, assignment(mesh, models["llama"], stages)) as plan_id:
                events, outcome = mesh.generate("o", plan_id, PROMPT, params, return_logits=True)
            assert finished(outcome).finish_reason == "length"
            assert [event.token_id for event in events] == ref_tokens
            for event, ref in zip(events, ref_logits, strict=True):
                assert np.array_equal(event.logits, ref)
        transports = {n: mesh.nodes[n].plane.transport for n in ("a", "b", "o")}
        assert transports["o"]._outbound["a"].lane is not None
        assert transports["o"]._outbound["b"].lane is None
        assert transports["a"]._outbound["b"].lane is None
        assert transports["b"]._outbound["a"].lane is None  # nor does it dial lanes
    finally:
        mesh.close()


def test_chunked_prefill_equals_mlx_lm_with_the_same_step_size(
    mesh: Mesh, models: dict[str, Path]
) -> None:
    """A 45-token prompt in chunks of 7 over 3 stages (44 = 6 x 7 + 2, then 1): each stage's
    cache advances per chunk exactly as in mlx-lm's generate_step with prefill_step_size 7."""
    model_dir = models["llama"]
    prompt = [(index * 13 + 5) % 300 for index in range(45)]
    params = SamplingParams(max_tokens=6)
    eos = eos_ids(model_dir)
    ref_tokens, ref_logits = mlx_lm_reference(
        model_dir, prompt, params, prefill_chunk=7, eos_ids=eos
    )
    with installed(mesh, assignment(mesh, model_dir, ("n1", "n2", "n3"))) as plan_id:
        events, outcome = mesh.generate(
            "n1", plan_id, prompt, params, return_logits=True, prefill_chunk=7
        )
    final = finished(outcome)
    assert final.finish_reason == ("length" if len(ref_tokens) == 6 else "eos")
    assert [event.token_id for event in events] == ref_tokens
    for step, (event, ref) in enumerate(zip(events, ref_logits, strict=True)):
        assert np.array_equal(event.logits, ref), f"step {step}"


# --- Sampling ---------------------------------------------------------------------------------


def test_same_seed_same_output_as_one_process(mesh: Mesh, models: dict[str, Path]) -> None:
    model_dir = models["qwen3"]
    reference, _ = mlx_lm_reference(model_dir, PROMPT, SAMPLED, eos_ids=eos_ids(model_dir))
    with installed(mesh, assignment(mesh, model_dir, ("n1", "n2", "n3"))) as plan_id:
        first, end_first = mesh.generate("n4", plan_id, PROMPT, SAMPLED)
        second, end_second = mesh.generate("n1", plan_id, PROMPT, SAMPLED)
        other_seed = SamplingParams(**{**vars(SAMPLED), "seed": 8})
        third, _ = mesh.generate("n1", plan_id, PROMPT, other_seed)
    tokens = [event.token_id for event in first]
    assert tokens == reference
    assert [event.token_id for event in second] == tokens
    assert (
        "".join(e.text for e in first) + finished(end_first).text
        == "".join(e.text for e in second) + finished(end_second).text
    )
    assert len(set(tokens)) > 3, "temperature 1 on random logits should vary"
    assert [event.token_id for event in third] != tokens
    assert finished(end_first).usage.seed == SAMPLED.seed


def test_four_concurrent_requests_on_two_stages(mesh: Mesh, models: dict[str, Path]) -> None:
    model_dir = models["llama"]
    prompts = [[(index * (7 + k) + k) % 300 for index in range(12 + 3 * k)] for k in range(4)]
    params = [SamplingParams(**{**vars(SAMPLED), "seed": 100 + k}) for k in range(4)]
    eos = eos_ids(model_dir)
    references = [
        mlx_lm_reference(model_dir, p, s, eos_ids=eos)[0]
        for p, s in zip(prompts, params, strict=True)
    ]
    with installed(mesh, assignment(mesh, model_dir, ("n1", "n2"))) as plan_id:
        plane = mesh.nodes["n1"].plane

        async def run_all() -> list[tuple[list[TokenEvent], Any]]:
            streams = [
                plane.generate(plan_id, p, s, request_id=f"concurrent-{k}")
                for k, (p, s) in enumerate(zip(prompts, params, strict=True))
            ]
            return await asyncio.gather(*(collect(stream) for stream in streams))

        results = mesh.loop.run(run_all())
        mesh.wait_all_freed(plan_id)
    for (events, outcome), reference in zip(results, references, strict=True):
        finished(outcome)
        assert [event.token_id for event in events] == reference


def test_a_long_prompt_does_not_hold_back_a_short_request(
    mesh: Mesh, models: dict[str, Path]
) -> None:
    """A long prompt's prefill chunks interleave with other requests' steps on every
    stage, so a short request that arrives right after a long one gets all its tokens before
    the long one's first; both still get exactly what each would get alone."""
    model_dir = models["llama"]
    long_prompt = [(index * 11 + 3) % 300 for index in range(600)]
    short_prompt = PROMPT[:5]
    chunk = 4  # 150 chunks for the long prompt, 2 steps for the short one
    params = SamplingParams(max_tokens=3)
    eos = eos_ids(model_dir)
    long_ref, _ = mlx_lm_reference(model_dir, long_prompt, params, prefill_chunk=chunk, eos_ids=eos)
    short_ref, _ = mlx_lm_reference(
        model_dir, short_prompt, params, prefill_chunk=chunk, eos_ids=eos
    )
    with installed(mesh, assignment(mesh, model_dir, ("n1", "n2"))) as plan_id:
        plane = mesh.nodes["n1"].plane
        arrivals: list[tuple[str, str]] = []

        async def consume(name: str, prompt: list[int]) -> list[int]:
            stream = plane.generate(
                plan_id, prompt, params, request_id=f"interleave-{name}", prefill_chunk=chunk
            )
            tokens = []
            async for event in stream:
                arrivals.append((name, type(event).__name__))
                if isinstance(event, TokenEvent):
                    tokens.append(event.token_id)
            return tokens

        async def both() -> list[list[int]]:
            return await asyncio.gather(
                consume("long", long_prompt), consume("short", short_prompt)
            )

        long_tokens, short_tokens = mesh.loop.run(both())
        mesh.wait_all_freed(plan_id)
    assert long_tokens == long_ref and short_tokens == short_ref
    first_long = arrivals.index(("long", "TokenEvent")) if long_ref else len(arrivals)
    assert arrivals.index(("short", "FinalEvent")) < first_long, arrivals


def test_stop_string_is_trimmed_and_ends_the_request(mesh: Mesh, models: dict[str, Path]) -> None:
    model_dir = models["llama"]
    with installed(mesh, assignment(mesh, model_dir, ("n1", "n2"))) as plan_id:
        events, outcome = mesh.generate("n1", plan_id, PROMPT, SAMPLED)
        text = "".join(event.text for event in events) + finished(outcome).text
        assert len(text) > 12, text
        stop = text[8:11]
        cut = text.index(stop)
        params = SamplingParams(**{**vars(SAMPLED), "stop": (stop,)})
        stopped, stop_outcome = mesh.generate("n1", plan_id, PROMPT, params)
        mesh.wait_all_freed(plan_id)
    stop_final = finished(stop_outcome)
    assert stop_final.finish_reason == "stop"
    assert "".join(event.text for event in stopped) + stop_final.text == text[:cut]
    assert len(stopped) < len(events)


# --- Fencing and errors -----------------------------------------------------------------------


def test_stage_refuses_a_plan_it_has_not_committed(mesh: Mesh, models: dict[str, Path]) -> None:
    plan = assignment(mesh, models["llama"], ("n1", "n2"))
    mesh.install(plan, nodes=["n1", "n2"])
    try:
        mesh.nodes["n2"].committed.discard(plan.plan_id)  # n2 has moved on
        started = time.monotonic()
        events, outcome = mesh.generate("n1", plan.plan_id, PROMPT, SamplingParams(max_tokens=5))
        assert time.monotonic() - started < 5
        error = failed(outcome)
        assert events == [] and error.kind is ErrorKind.NO_PLAN
        assert f"plan {plan.plan_id} is not committed on node n2" in str(error)
        # The origin's own fencing: n3 never committed the plan.
        _, outcome = mesh.generate("n3", plan.plan_id, PROMPT, SamplingParams(max_tokens=5))
        error = failed(outcome)
        assert error.kind is ErrorKind.NO_PLAN and "not committed on node n3" in str(error)
        mesh.wait_all_freed(plan.plan_id)
    finally:
        mesh.uninstall(plan.plan_id)


def test_a_stage_still_loading_is_retryable_and_one_that_failed_is_not(
    mesh: Mesh, models: dict[str, Path]
) -> None:
    plan = assignment(mesh, models["llama"], ("n1", "n2"))
    mesh.install(plan, nodes=["n1"])
    mesh.nodes["n2"].committed.add(plan.plan_id)  # committed, not installed yet
    try:
        params = SamplingParams(max_tokens=5)
        events, outcome = mesh.generate("n1", plan.plan_id, PROMPT, params)
        error = failed(outcome)
        assert events == [] and error.kind is ErrorKind.LOADING and error.kind.retryable
        assert "not installed there yet" in str(error)

        plane = mesh.nodes["n2"].plane
        mesh.loop.run(_record_failure(plane, plan.plan_id, "its part could not be fetched"))
        _, outcome = mesh.generate("n1", plan.plan_id, PROMPT, params)
        error = failed(outcome)
        assert error.kind is ErrorKind.INTERNAL and not error.kind.retryable
        assert "n2 cannot serve plan" in str(error)
        assert "its part could not be fetched" in str(error)
        mesh.wait_all_freed(plan.plan_id)
    finally:
        mesh.uninstall(plan.plan_id)


async def _record_failure(plane: DataPlane, plan_id: str, reason: str) -> None:
    plane.record_load_failure(plan_id, reason)


def test_bad_arguments_raise_before_anything_is_sent(mesh: Mesh, models: dict[str, Path]) -> None:
    plane = mesh.nodes["n1"].plane
    with installed(mesh, assignment(mesh, models["llama"], ("n1", "n2"))) as plan_id:
        sent = mesh.nodes["n2"].plane.frames_received
        for prompt, match in (([], "empty"), ([VOCAB], "not a token id"), ([-1], "not a token id")):
            with pytest.raises(InferenceError, match=match) as refused:
                plane.generate(plan_id, prompt, SamplingParams(), request_id="bad")
            assert refused.value.kind is ErrorKind.BAD_INPUT
        with pytest.raises(InferenceError, match="request_id"):
            plane.generate(plan_id, PROMPT, SamplingParams(), request_id="")
        assert mesh.nodes["n2"].plane.frames_received == sent
        _, outcome = mesh.generate("n1", "no-such-plan", PROMPT, SamplingParams(max_tokens=2))
        error = failed(outcome)
        assert error.kind is ErrorKind.NO_PLAN and "no-such-plan" in str(error)


def test_uninstall_aborts_running_requests_with_its_reason(
    mesh: Mesh, models: dict[str, Path]
) -> None:
    plan = assignment(mesh, models["llama"], ("n1", "n2"))
    mesh.install(plan)
    plane = mesh.nodes["n1"].plane

    async def run() -> tuple[list[TokenEvent], Any]:
        stream = plane.generate(
            plan.plan_id, PROMPT, SamplingParams(max_tokens=4000), request_id="u"
        )
        events: list[TokenEvent] = []
        try:
            async for event in stream:
                if isinstance(event, FinalEvent):
                    return events, event
                events.append(event)
                if len(events) == 3:
                    await mesh.nodes["n2"].plane.uninstall(
                        plan.plan_id, "stage n9 lost; the mesh is re-planning, retry"
                    )
        except InferenceError as error:
            return events, error
        raise AssertionError("no final event")

    try:
        events, outcome = mesh.loop.run(run(), timeout=20)
        error = failed(outcome)
        assert error.kind is ErrorKind.UNAVAILABLE and "stage n9 lost" in str(error)
        assert len(events) < 50
        mesh.wait_all_freed(plan.plan_id)
    finally:
        mesh.uninstall(plan.plan_id)


def test_caches_are_freed_after_finish_and_after_cancel(
    mesh: Mesh, models: dict[str, Path]
) -> None:
    with installed(mesh, assignment(mesh, models["qwen3"], ("n1", "n2", "n3"))) as plan_id:
        mesh.generate("n4", plan_id, PROMPT, SamplingParams(max_tokens=5))
        mesh.wait_all_freed(plan_id)

        plane = mesh.nodes["n4"].plane

        async def leave_after(tokens: int) -> dict[str, int]:
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
        plan = assignment(mesh, models["llama"], ("a", "b"))
        mesh.install(plan)
        plane = mesh.nodes["a"].plane
        lost = mesh.nodes["b"]

        async def run() -> tuple[list[Any], float]:
            streams = [
                plane.generate(
                    plan.plan_id, PROMPT, SamplingParams(max_tokens=4000), request_id=f"r{k}"
                )
                for k in range(2)
            ]
            first_tokens = [await anext(stream) for stream in streams]
            assert all(isinstance(event, TokenEvent) for event in first_tokens)
            stopped_at = time.monotonic()
            await lost.server.stop(0)
            outcomes = [(await collect(stream))[1] for stream in streams]
            return outcomes, time.monotonic() - stopped_at

        outcomes, seconds = loop.run(run(), timeout=20)
        assert seconds < 2.0
        for outcome in outcomes:
            error = failed(outcome)
            assert error.kind is ErrorKind.UNAVAILABLE
            assert f"stage b at {lost.address} unreachable" in str(error), error
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


def test_smollm2_in_three_stages_answers_paris(mesh: Mesh, default_model_entry: ModelEntry) -> None:
    entry = default_model_entry
    layout = [("n1", (0, 10)), ("n2", (10, 20)), ("n3", (20, entry.num_layers))]
    with installed(mesh, mesh.assignment_for(entry.path, layout)) as plan_id:
        plane = mesh.nodes["n1"].plane
        prompt = mesh.loop.run(_encode(plane, plan_id, "What is the capital of France?"))
        events, outcome = mesh.generate("n1", plan_id, prompt, SamplingParams(max_tokens=12))
    final = finished(outcome)
    answer = "".join(event.text for event in events) + final.text
    assert "Paris" in answer, answer
    assert final.finish_reason in ("eos", "length")


async def _encode(plane: DataPlane, plan_id: str, question: str) -> list[int]:
    return plane.encode_chat(plan_id, [{"role": "user", "content": question}])


# --- A node in another process ----------------------------------------------------------------

# Importing the daemon package loads OpenBLAS first, as in this process: same logits.
NODE_COMMAND = [sys.executable, "-m", "tests.support.stage_process", "--serve"]


class RunnerProcess:
    """``tests.support.stage_process --serve`` in a child process, driven over its stdin/stdout."""

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
    params = SamplingParams(max_tokens=8)
    ref_tokens, ref_logits = mlx_lm_reference(model_dir, PROMPT, params)
    runner = RunnerProcess("p2", tmp_path / "p2", mesh.secret)
    try:
        stages = (
            StageSpec("n1", mesh.nodes["n1"].address, 0, 3, True, False),
            StageSpec("p2", runner.address, 3, 6, False, True),
        )
        plan = Assignment("plan-process", model_dir, stages)
        assert runner.command({"install": plan.to_dict()}) == {"installed": "plan-process"}
        mesh.install(plan, nodes=["n1"])
        events, outcome = mesh.generate("n1", plan.plan_id, PROMPT, params, return_logits=True)
        finished(outcome)
        assert [event.token_id for event in events] == ref_tokens
        assert all(np.array_equal(e.logits, r) for e, r in zip(events, ref_logits, strict=True))
        assert runner.command({"stats": True})["plans"][0]["stage_index"] == 1

        plane = mesh.nodes["n1"].plane

        async def kill_mid_generation() -> tuple[Any, float]:
            stream = plane.generate(
                plan.plan_id, PROMPT, SamplingParams(max_tokens=4000), request_id="k"
            )
            assert isinstance(await anext(stream), TokenEvent)
            killed_at = time.monotonic()
            runner.process.kill()
            return (await collect(stream))[1], time.monotonic() - killed_at

        outcome, seconds = mesh.loop.run(kill_mid_generation(), timeout=20)
        error = failed(outcome)
        assert seconds < 2.0
        assert f"stage p2 at {runner.address} unreachable" in str(error), error
        mesh.wait_all_freed(plan.plan_id)
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
    built = Assignment.from_plan(plan, Path("/models/m"), addresses)
    assert built.node_ids == ("a", "b") and built.stage_index("b") == 1
    assert built.stages[1] == StageSpec("b", "10.0.0.2:7000", 2, 6, False, True)
    assert built.address_of("a") == "10.0.0.1:7000" and built.address_of("z") is None
    assert Assignment.from_dict(built.to_dict()) == built

    # A hybrid: stage 0 is a tensor-parallel group (rank 0 "a" is its endpoint; "b" holds a
    # rank and needs no data-plane address), stage 1 one node.
    from partitioner.plan import ExpertShard

    hybrid = plan_of(
        Stage(("a", "b"), 0, 2, True, False, (ExpertShard("a", 0, 3), ExpertShard("b", 3, 8))),
        Stage(("c",), 2, 6, False, True),
    )
    built = Assignment.from_plan(hybrid, Path("m"), {"a": "10.0.0.1:7000", "c": "10.0.0.3:7000"})
    assert built.node_ids == ("a", "c") and built.member_ids == ("a", "b", "c")
    assert built.stages[0].members == ("a", "b") and built.stages[0].tensor_parallel
    assert built.stages[0].experts == (("a", 0, 3), ("b", 3, 8))
    assert built.stage_index("b") is None and built.member_stage("b") == 0
    assert Assignment.from_dict(built.to_dict()) == built
    with pytest.raises(InvalidAssignment, match="endpoint is its rank 0"):
        StageSpec("b", "", 0, 6, True, True, members=("a", "b"))
    with pytest.raises(InvalidAssignment, match="more than one stage"):
        Assignment(
            "x",
            Path("m"),
            (
                StageSpec("a", "", 0, 2, True, False, members=("a", "b")),
                StageSpec("b", "", 2, 6, False, True),
            ),
        )
    with pytest.raises(InvalidAssignment, match="no address known for node b"):
        Assignment.from_plan(plan, Path("m"), {"a": "10.0.0.1:7000"})
    with pytest.raises(InvalidAssignment, match="non-empty range starting at layer 2"):
        Assignment(
            "x",
            Path("m"),
            (StageSpec("a", "", 0, 2, True, False), StageSpec("b", "", 3, 6, False, True)),
        )
    with pytest.raises(InvalidAssignment, match="more than one stage"):
        Assignment(
            "x",
            Path("m"),
            (StageSpec("a", "", 0, 2, True, False), StageSpec("a", "", 2, 6, False, True)),
        )
    with pytest.raises(InvalidAssignment, match="only the first stage embeds"):
        Assignment(
            "x",
            Path("m"),
            (StageSpec("a", "", 0, 2, True, False), StageSpec("b", "", 2, 6, True, True)),
        )


def test_stats_over_grpc(mesh: Mesh, models: dict[str, Path]) -> None:
    """The Stats RPC answers another member over mutual TLS with what the node holds."""
    from meshd.wire import dataplane_pb2, dataplane_pb2_grpc

    credentials = security.load_or_create_node_credentials(mesh.state_dir / "n1", mesh.secret, "n1")
    with installed(mesh, assignment(mesh, models["qwen3"], ("n1", "n2"))) as plan_id:

        async def ask() -> Any:
            async with peer_channel_factory(credentials)(mesh.nodes["n2"].address) as channel:
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
    channel = peer_channel_factory(credentials)(mesh.nodes[to].address)
    call = dp_grpc.DataPlaneStub(channel).Link()
    await call.write(dp.Frame(hello=dp.Hello(node_id=claims)))
    return channel, call


def test_a_node_accepts_work_only_from_the_stage_the_plan_says(
    mesh: Mesh, models: dict[str, Path]
) -> None:
    from meshd.wire import dataplane_pb2 as dp

    with installed(mesh, assignment(mesh, models["llama"], ("n1", "n2"))) as plan_id:

        async def first_reply(to: str, frame: dp.Frame) -> Any:
            channel, call = await _raw_link(mesh, "n3", "n3", to)
            async with channel:
                assert (await call.read()).hello.node_id == to
                await call.write(frame)
                async with asyncio.timeout(5):
                    return await call.read()

        start = dp.Start(origin_node_id="n3", prompt_length=1, prefill_chunk=1)
        activation = dp.Activation(start=start, dtype="float32", shape=[1, 1, 64])
        activation.data = bytes(4 * 64)
        impostor = dp.Frame(plan_id=plan_id, request_id="x", activation=activation)
        reply = mesh.loop.run(first_reply("n2", impostor))
        assert reply.failure.kind == dp.FAILURE_BAD_REQUEST
        assert "node n3 is not the previous stage of node n2" in reply.failure.message

        bad = dp.Start(origin_node_id="n3", prompt_tokens=[1], prompt_length=1, prefill_chunk=1)
        bad.sampling.top_p = 7.0  # out of range
        reply = mesh.loop.run(
            first_reply("n1", dp.Frame(plan_id=plan_id, request_id="y", start=bad))
        )
        assert reply.request_id == "y" and reply.failure.kind == dp.FAILURE_BAD_REQUEST
        assert "bad sampling parameters: top_p" in reply.failure.message

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
        plan = assignment(mesh, models["llama"], ("solo",))
        mesh.install(plan)
        started = time.monotonic()
        events, outcome = mesh.generate(
            "solo", plan.plan_id, PROMPT, SamplingParams(max_tokens=300), ignore_eos=True
        )
        assert time.monotonic() - started > 0.4, "the run must outlast the idle timeout"
        final = finished(outcome)
        assert final.finish_reason == "length" and len(events) == 300
    finally:
        mesh.close()
