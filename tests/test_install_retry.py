"""A committed plan that could not load here is tried again until it loads.

Two loopback daemons form a tensor-parallel group. Before they start, this test binds
rank 0's collective port of every slot of their runners' port range, as an outgoing
connection or another program may hold a port when a runner starts (a suite run once failed
so: "[ring] Couldn't bind socket (error: 98)"). The group cannot form; the test then frees
the ports, and without any re-plan the daemons try the same plan again and serve it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import time
from pathlib import Path

import pytest

from meshd.api import client
from meshd.inference.tensor_parallel.spec import PORT_SLOTS, PORT_STRIDE
from meshd.wire import pb

pytestmark = pytest.mark.integration

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.random_model import make_random_model_dir

    folder = tmp_path_factory.mktemp("retry") / "llama"
    return make_random_model_dir(folder, "llama", layers=4, hidden=64, heads=4, kv_heads=2)


def hold_rank0_ports(base: int) -> list[socket.socket]:
    """Hold rank 0's collective port of every slot, bound but not listening, as an outgoing
    connection holds its local port (without SO_REUSEADDR, so MLX's ring cannot bind it)."""
    held = []
    try:
        for slot in range(PORT_SLOTS):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", base + PORT_STRIDE * slot))
    except OSError:
        release(held)
        raise
    return held


def release(held: list[socket.socket]) -> None:
    for sock in held:
        with contextlib.suppress(OSError):
            sock.close()


def wait_until_any(nodes, predicate, timeout_s: float) -> pb.MeshStatus:
    """The first status of any of `nodes` that satisfies `predicate`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for node in nodes:
            status = node.status()
            if predicate(status):
                return status
        time.sleep(0.1)
    raise TimeoutError(f"no node reached it within {timeout_s} s: {nodes[0].log_tail()}")


def events_say(text: str):
    return lambda status: any(text in line for line in status.events)


def serving_group(status: pb.MeshStatus) -> bool:
    runners = status.tensor_parallel_runners
    active = status.agreement.active_plan_id
    return bool(active and runners) and all(
        r.state == "ready" for r in runners if r.plan_id == active
    )


def test_a_group_that_could_not_bind_its_port_forms_once_the_port_is_free(
    daemons, small_llama, mesh_token: str
) -> None:
    base = 20000 + PORT_STRIDE * PORT_SLOTS * random.randrange(8)  # below the ephemeral ports
    held = hold_rank0_ports(base)
    try:
        args = [*LOOPBACK, "--join", mesh_token, "--model", str(small_llama)]
        args += ["--parallelism", "tensor", "--tensor-parallel-port", str(base)]
        args += ["--tensor-parallel-trusted-network", "127.0.0.0/8", "--context-length", "256"]
        nodes = [daemons([*args, "--name", f"retry-{i}"]) for i in range(2)]
        for node in nodes:
            node.wait_ready()
        failed = wait_until_any(nodes, events_say("is in use"), 90)
        plan_id = failed.agreement.active_plan_id
        assert plan_id and not serving_group(failed), failed
    finally:
        release(held)
    for node in nodes:
        status = node.wait_for(serving_group, 90, "the same plan served once the port is free")
        assert status.agreement.active_plan_id == plan_id  # no re-plan: the same plan loaded
    statuses = [node.status() for node in nodes]
    (retried,) = [status for status in statuses if status.node_id == failed.node_id]
    assert any(f"trying plan {plan_id[:12]} here again" in line for line in retried.events)

    request = pb.GenerateRequest(prompt="hello", sampling=pb.Sampling(max_tokens=MAX_TOKENS))
    events = list(client.stream_generation(nodes[0].api, request, timeout_s=60))
    assert events[-1].done.completion_tokens == MAX_TOKENS, events[-1]


def test_a_runner_killed_once_ready_is_replaced_and_the_plan_serves_again(
    daemons, small_llama, mesh_token: str
) -> None:
    """`kill -9` of rank 1's runner (as the kernel's OOM killer would): both nodes stay in
    the mesh, so nothing re-plans; each loads the plan again, the group forms anew with new
    runners, and requests are served again on the same plan."""
    args = [*LOOPBACK, "--join", mesh_token, "--model", str(small_llama)]
    args += ["--parallelism", "tensor", "--tensor-parallel-trusted-network", "127.0.0.0/8"]
    args += ["--context-length", "256"]
    nodes = [daemons([*args, "--name", f"reform-{i}"]) for i in range(2)]
    before = [node.wait_for(serving_group, 90, "a served tensor-parallel plan") for node in nodes]
    plan_id = before[0].agreement.active_plan_id
    old_pids = {r.pid for s in before for r in s.tensor_parallel_runners}
    (victim,) = [r.pid for s in before for r in s.tensor_parallel_runners if r.rank == 1]
    os.kill(victim, signal.SIGKILL)

    def reformed(status: pb.MeshStatus) -> bool:
        pids = {r.pid for r in status.tensor_parallel_runners}
        return serving_group(status) and not pids & old_pids

    for node in nodes:
        status = node.wait_for(reformed, 60, "new runners serving the same plan")
        assert status.agreement.active_plan_id == plan_id  # no re-plan: the group re-formed
        assert any("loading the plan here again" in line for line in status.events)
    request = pb.GenerateRequest(prompt="hello", sampling=pb.Sampling(max_tokens=MAX_TOKENS))
    events = list(client.stream_generation(nodes[0].api, request, timeout_s=60))
    assert events[-1].done.completion_tokens == MAX_TOKENS, events[-1]
