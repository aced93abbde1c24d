"""Tensor-parallel stages through the daemon's API: real runner processes, real MLX ring groups.

Each "daemon" here is a :class:`RunnerSupervisor` of its own node id (the daemon-side owner of
that node's runner); they live in the test process, except where a test needs a daemon to die
(``tests/support/tp_member_process.py``). Ranks run on loopback, and the 2x2 hybrid in network
namespaces (tests/netns.py), one rank per namespace, over a bridge the test marks trusted.

Exactness bound: that of tests/test_tensor_parallel_architectures.py (max |logit difference|
<= 1e-4 x max |logit|, greedy tokens identical), for the reason given there.

Failure bounds: the heartbeat bound of the mesh is ``peer_timeout_s`` = 1.5 s; a lost member
must end its group's steps with an error, and its survivors' runners must be gone, well within
it, here within ``TEARDOWN_BOUND_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import psutil
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from meshd.inference.stage.shard import load_stage
from meshd.inference.tensor_parallel import (
    RunnerState,
    RunnerSupervisor,
    TensorParallelError,
    TensorParallelMember,
    TensorParallelSpec,
    build_group_spec,
    describe_local_link,
    group_link_verdict,
)
from tests.support.ports import free_base_port
from tests.support.random_model import make_random_model_dir

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[1]
RELATIVE_BOUND = 1e-4
TEARDOWN_BOUND_S = 1.5
PROMPT = [(index * 37 + 11) % 300 for index in range(24)]
SECRET = b"k" * 32


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(
        tmp_path_factory.mktemp("tp-llama") / "llama",
        "llama",
        layers=4,
        hidden=128,
        heads=4,
        kv_heads=2,
        vocab=320,
        intermediate=256,
        max_shard_bytes=300_000,
    )


def loopback_spec(
    model_dir: Path,
    *,
    nodes: Sequence[str] = ("a", "b"),
    layers: tuple[int, int] = (0, 4),
    stage_index: int = 0,
    first: bool = True,
    last: bool = True,
    expert_shards: Sequence[tuple[str, int, int]] = (),
    plan_id: str | None = None,
    step_timeout_s: float = 60.0,
) -> TensorParallelSpec:
    plan_id = plan_id or os.urandom(16).hex()
    verdict = group_link_verdict([describe_local_link("127.0.0.1", "127.0.0.1")])
    assert verdict.allowed, verdict.reason
    return build_group_spec(
        plan_id=plan_id,
        stage_index=stage_index,
        stage_nodes=list(nodes),
        layer_start=layers[0],
        layer_end=layers[1],
        has_embedding=first,
        has_head=last,
        model_dir=model_dir,
        addresses=dict.fromkeys(nodes, "127.0.0.1"),
        link=verdict.reason,
        mesh_secret=SECRET,
        expert_shards=expert_shards,
        base_port=free_base_port(plan_id, [stage_index], len(nodes)),
        step_timeout_s=step_timeout_s,
    )


async def start_group(
    spec: TensorParallelSpec, supervisors: dict[str, RunnerSupervisor] | None = None
) -> dict[str, RunnerSupervisor]:
    """One supervisor (daemon) per member, every rank started; the group is ready."""
    supervisors = supervisors or {m.node_id: RunnerSupervisor(m.node_id) for m in spec.members}
    await asyncio.gather(*(supervisors[m.node_id].start(spec) for m in spec.members))
    return supervisors


async def close_all(supervisors: dict[str, RunnerSupervisor]) -> None:
    await asyncio.gather(*(s.close() for s in supervisors.values()))


def run_async(body: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(body())


class Reference:
    """One mlx-lm process: its model, its caches."""

    def __init__(self, model_dir: Path) -> None:
        self.model, _ = load_model(model_dir)
        self.cache = make_prompt_cache(self.model)

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        return np.array(self.model(mx.array([list(tokens)]), cache=self.cache))


def assert_close(got: Any, expected: np.ndarray, what: str) -> None:
    got = np.array(got)
    assert got.shape == expected.shape, what
    scale = float(np.abs(expected).max())
    worst = float(np.abs(got - expected).max())
    assert worst <= RELATIVE_BOUND * scale, f"{what}: max diff {worst:.3g}, scale {scale:.3g}"
    assert int(np.argmax(got[0, -1])) == int(np.argmax(expected[0, -1])), what


def gone(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def wait_gone(pids: Sequence[int | None], bound_s: float) -> float:
    """Seconds until every pid is gone; fails the test after ``bound_s``."""
    started = time.monotonic()
    while not all(gone(pid) for pid in pids):
        elapsed = time.monotonic() - started
        assert elapsed < bound_s, f"runners {[p for p in pids if not gone(p)]} still alive"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


# --- Exactness through the API ------------------------------------------------------------------


def test_tp2_stage_generates_what_mlx_lm_does(llama_dir: Path) -> None:
    """TP=2 over loopback: prompt and greedy steps as one mlx-lm process, two requests in
    flight at once, refusals that leave the group serving, memory split, status, stop."""
    spec = loopback_spec(llama_dir)

    async def body() -> None:
        supervisors = await start_group(spec)
        try:
            leader = supervisors["a"].member(spec.plan_id, 0)
            follower = supervisors["b"].member(spec.plan_id, 0)
            assert leader is not None and follower is not None
            first, second = Reference(llama_dir), Reference(llama_dir)
            other_prompt = PROMPT[::-1][:9]

            logits = await leader.forward("r1", PROMPT, logits="all")
            assert_close(logits, first.step(PROMPT), "prompt, every position")
            tokens = [int(mx.argmax(logits[0, -1]).item())]
            second_prefill = asyncio.ensure_future(leader.forward("r2", other_prompt))
            for step in range(16):
                logits = await leader.forward("r1", tokens[-1:])
                assert_close(logits, first.step(tokens[-1:]), f"step {step}")
                tokens.append(int(mx.argmax(logits[0, -1]).item()))
            assert_close(await second_prefill, second.step(other_prompt)[:, -1:], "request 2")
            assert len(set(tokens)) >= 1

            # Refused before any rank acts: the group keeps serving, caches stay aligned.
            for bad, reason in (
                ([10**6], "outside the vocabulary"),
                (mx.zeros((1, 1, 128)), "token ids"),
            ):
                with pytest.raises(TensorParallelError, match=reason) as refused:
                    await leader.forward("r1", bad)
                assert not refused.value.fatal
            with pytest.raises(TensorParallelError, match="only rank 0"):
                await follower.forward("r1", [1])
            logits = await leader.forward("r1", tokens[-1:])
            assert_close(logits, first.step(tokens[-1:]), "after the refusals")

            await leader.release("r1")
            stats = [await leader.stats(), await follower.stats()]
            assert [s["requests"] for s in stats] == [1, 1]  # r2 still open on both ranks
            assert stats[0]["steps"] == stats[1]["steps"] == 1 + 1 + 16 + 1

            # Each rank holds half of every layer (plus the replicated embedding; only rank 0
            # the head, which is tied here), and while loading at most one layer's whole
            # tensors more (it reads a tensor whole and keeps its slice).
            whole = load_stage(llama_dir, 0, 4, has_embedding=True, has_head=True)
            embedding = 320 * 128 * 4
            layer = (whole.nbytes - embedding) / 4
            for member in (leader, follower):
                held = member.ready_info["held_bytes"]
                assert abs(held - embedding - 2 * layer) < 0.01 * whole.nbytes
                assert member.ready_info["peak_bytes"] < held + 1.1 * layer

            # Idle runners sleep in the kernel: MLX's ring polls only inside a collective.
            processes = [psutil.Process(m.pid) for m in (leader, follower)]
            before = [sum(p.cpu_times()[:2]) for p in processes]
            await asyncio.sleep(1.0)
            used = [sum(p.cpu_times()[:2]) - b for p, b in zip(processes, before, strict=True)]
            assert max(used) < 0.1, f"idle runners used {used} s of CPU in 1 s"

            status = supervisors["a"].status()
            assert status[0]["backend"] == "ring" and status[0]["rank"] == 0
            assert status[0]["link"].startswith("loopback")
            assert status[0]["state"] == "ready" and "token" not in json.dumps(status)

            # One member's daemon uninstalls the plan: the whole group ends, at once.
            pids = [leader.pid, follower.pid]
            await supervisors["b"].stop_plan(spec.plan_id)
            await wait_gone(pids, TEARDOWN_BOUND_S)
            assert follower.state is RunnerState.STOPPED
            await asyncio.sleep(0.1)  # rank 0's daemon reads its runner's end-of-file
            assert leader.state is RunnerState.FAILED and "exit code 0" in leader.error
        finally:
            await close_all(supervisors)

    run_async(body)


def test_moe_experts_placed_unevenly_over_the_group(
    architecture_dir: Callable[[str], Path],
) -> None:
    """Expert parallelism: rank 0 holds one routed expert of each MoE layer, rank 1 three; the
    stage computes what one mlx-lm process computes, and rank 0 holds less."""
    model_dir = architecture_dir("qwen3_moe")
    spec = loopback_spec(model_dir, layers=(0, 6), expert_shards=[("a", 0, 1), ("b", 1, 4)])

    async def body() -> None:
        supervisors = await start_group(spec)
        try:
            leader = supervisors["a"].member(spec.plan_id, 0)
            follower = supervisors["b"].member(spec.plan_id, 0)
            reference = Reference(model_dir)
            logits = await leader.forward("r", PROMPT)
            assert_close(logits, reference.step(PROMPT)[:, -1:], "prompt")
            for step in range(8):
                token = [int(mx.argmax(logits[0, -1]).item())]
                logits = await leader.forward("r", token)
                assert_close(logits, reference.step(token), f"step {step}")
            assert leader.ready_info["held_bytes"] < follower.ready_info["held_bytes"]
            assert supervisors["b"].status()[0]["experts"] == [[0, 1], [1, 4]]
        finally:
            await close_all(supervisors)

    run_async(body)


def test_hybrid_2x2_in_network_namespaces(llama_dir: Path, netns_mesh) -> None:
    """Two pipeline stages, each a TP=2 group, one rank per network namespace, chained through
    the API as the data plane will: token ids -> stage 0 -> hidden states -> stage 1 -> logits.
    The bridge between the namespaces is a shared network: refused until marked trusted."""
    mesh = netns_mesh(4, subnet=random.randrange(1, 250))
    ips = [node.ip for node in mesh.nodes]
    facts = json.loads(
        mesh.nodes[0]
        .run(
            [
                sys.executable,
                "-c",
                "import json, dataclasses\n"
                "from meshd.inference.tensor_parallel import describe_local_link\n"
                f"print(json.dumps(dataclasses.asdict(describe_local_link({ips[0]!r}, "
                f"{ips[1]!r}))))",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        .stdout
    )
    from meshd.inference.tensor_parallel import LinkFacts

    link = LinkFacts(**facts)
    assert link.interface == "eth0" and not link.point_to_point and link.prefix_length == 24
    refused = group_link_verdict([link])
    assert not refused.allowed and "tensor_parallel_trusted_networks" in refused.reason
    subnet = ".".join(ips[0].split(".")[:3]) + ".0/24"
    verdict = group_link_verdict([link], [subnet])
    assert verdict.allowed and "marked trusted" in verdict.reason

    plan_id = os.urandom(16).hex()
    nodes = [f"n{i}" for i in range(4)]
    stages = [(nodes[:2], (0, 2), True, False), (nodes[2:], (2, 4), False, True)]
    specs = [
        build_group_spec(
            plan_id=plan_id,
            stage_index=index,
            stage_nodes=members,
            layer_start=start,
            layer_end=end,
            has_embedding=first,
            has_head=last,
            model_dir=llama_dir,
            addresses=dict(zip(nodes, ips, strict=True)),
            link=verdict.reason,
            mesh_secret=SECRET,
        )
        for index, (members, (start, end), first, last) in enumerate(stages)
    ]
    supervisors = {
        node.ns: RunnerSupervisor(name, command_prefix=["ip", "netns", "exec", node.ns])
        for name, node in zip(nodes, mesh.nodes, strict=True)
    }
    by_node = dict(zip(nodes, supervisors.values(), strict=True))

    async def body() -> None:
        try:
            await asyncio.gather(
                *(by_node[m.node_id].start(spec) for spec in specs for m in spec.members)
            )
            first = by_node["n0"].member(plan_id, 0)
            second = by_node["n2"].member(plan_id, 1)
            assert second.status()["members"][1] == {
                "node_id": "n3",
                "address": f"{ips[3]}:{specs[1].members[1].port}",
            }
            reference = Reference(llama_dir)

            async def step(tokens: list[int], logits: str = "last") -> mx.array:
                hidden = await first.forward("req", tokens)
                return await second.forward("req", hidden, logits=logits)

            logits = await step(PROMPT, "all")
            assert_close(logits, reference.step(PROMPT), "prompt")
            for index in range(12):
                token = [int(mx.argmax(logits[0, -1]).item())]
                logits = await step(token)
                assert_close(logits, reference.step(token), f"step {index}")
        finally:
            await close_all(by_node)

    run_async(body)


# --- Failure ------------------------------------------------------------------------------------


async def generate_until_error(leader: TensorParallelMember, prompt: list[int]) -> tuple[int, Any]:
    """Greedy steps until the group fails; (steps done, the error and when it came)."""
    logits = await leader.forward("g", prompt)
    steps = 0
    while True:
        token = [int(mx.argmax(logits[0, -1]).item())]
        try:
            logits = await leader.forward("g", token)
        except TensorParallelError as error:
            return steps, (error, time.monotonic())
        steps += 1


@pytest.mark.parametrize("victim", [0, 1])
def test_kill_9_of_a_member_runner_mid_generation(llama_dir: Path, victim: int) -> None:
    """Either rank's runner killed between or during steps: the step fails with a fatal error,
    the surviving rank's runner is gone, both daemons see their rank failed."""
    spec = loopback_spec(llama_dir)

    async def body() -> None:
        supervisors = await start_group(spec)
        try:
            members = [supervisors[n].member(spec.plan_id, 0) for n in ("a", "b")]
            leader = members[0]
            pids = [member.pid for member in members]
            generation = asyncio.ensure_future(generate_until_error(leader, PROMPT))
            while (await leader.stats())["steps"] < 4:
                await asyncio.sleep(0.01)
            killed_at = time.monotonic()
            os.kill(pids[victim], signal.SIGKILL)
            steps, (error, failed_at) = await asyncio.wait_for(generation, TEARDOWN_BOUND_S)
            assert error.fatal and steps >= 3
            assert failed_at - killed_at < TEARDOWN_BOUND_S
            await wait_gone(pids, TEARDOWN_BOUND_S)
            await asyncio.sleep(0.1)  # each daemon reads its runner's end-of-file
            assert [m.state for m in members] == [RunnerState.FAILED] * 2
            with pytest.raises(TensorParallelError, match="failed"):
                await leader.forward("g", [1])
        finally:
            await close_all(supervisors)

    run_async(body)


def test_kill_9_of_a_member_daemon_takes_its_runner_and_the_group(
    llama_dir: Path, tmp_path: Path
) -> None:
    """The member daemon of rank 1 dies: its runner dies with it (the kernel's parent-death
    signal), rank 0's runner sees the group broken and exits, the step fails."""
    spec = loopback_spec(llama_dir)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(spec.to_json())
    owner = subprocess.Popen(
        [sys.executable, "-m", "tests.support.tp_member_process", "b", str(spec_path)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    async def body() -> None:
        supervisor = RunnerSupervisor("a")
        try:
            leader = await supervisor.start(spec)
            line = await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 60)
            remote_runner = json.loads(line)["runner_pid"]
            generation = asyncio.ensure_future(generate_until_error(leader, PROMPT))
            while (await leader.stats())["steps"] < 3:
                await asyncio.sleep(0.01)
            killed_at = time.monotonic()
            owner.kill()
            _, (error, failed_at) = await asyncio.wait_for(generation, TEARDOWN_BOUND_S)
            assert error.fatal and failed_at - killed_at < TEARDOWN_BOUND_S
            await wait_gone([remote_runner, leader.pid], TEARDOWN_BOUND_S)
        finally:
            await supervisor.close()

    try:
        run_async(body)
    finally:
        owner.kill()
        owner.wait(timeout=10)


def test_a_hung_member_is_torn_down_by_the_step_deadline_and_by_liveness(
    llama_dir: Path,
) -> None:
    """A member that stops answering without closing its sockets (a cut cable; here SIGSTOP)
    hangs MLX's collectives: rank 0's step deadline tears its side down, and the member's own
    daemon, told by the mesh's liveness that rank 0's node is lost, kills its runner by PID."""
    spec = loopback_spec(llama_dir)

    async def body() -> None:
        supervisors = await start_group(spec)
        follower = supervisors["b"].member(spec.plan_id, 0)
        try:
            leader = supervisors["a"].member(spec.plan_id, 0)
            await leader.forward("h", PROMPT)
            os.kill(follower.pid, signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(TensorParallelError, match="longer than 1") as error:
                await leader.forward("h", [3], timeout_s=1.0)
            assert error.value.fatal and time.monotonic() - started < 1.0 + TEARDOWN_BOUND_S
            await wait_gone([leader.pid], TEARDOWN_BOUND_S)

            assert gone(follower.pid) is False  # stopped, not dead: nothing closed its sockets
            assert supervisors["b"].member_lost("a", "heartbeat lost") == [spec.name]
            await wait_gone([follower.pid], TEARDOWN_BOUND_S)
            assert "heartbeat lost: a" in follower.status()["error"]
        finally:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(follower.pid, signal.SIGKILL)
            await close_all(supervisors)

    run_async(body)


def test_start_up_failures_name_their_cause(
    llama_dir: Path, architecture_dir: Callable[[str], Path]
) -> None:
    async def body() -> None:
        # An architecture without shard(group) is refused before any process starts.
        mixtral = loopback_spec(architecture_dir("mixtral"), layers=(0, 6))
        member = TensorParallelMember(mixtral, 0)
        with pytest.raises(TensorParallelError, match="mixtral model has no shard"):
            await member.start()
        assert member.pid is None and member.state is RunnerState.FAILED

        # Rank 1 never comes: rank 0's runner gives up at its start-up deadline and says why.
        spec = loopback_spec(llama_dir)
        member = TensorParallelMember(spec, 0, startup_timeout_s=2.0)
        with pytest.raises(TensorParallelError, match=r"ranks \[1\] did not join"):
            await member.start()
        await wait_gone([member.pid], TEARDOWN_BOUND_S)

    run_async(body)
