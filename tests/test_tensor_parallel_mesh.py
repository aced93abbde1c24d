"""Tensor-parallel and hybrid plans, committed and served by real `meshd run` daemons.

Each daemon runs in its own network namespace (tests/netns.py: real mDNS over the test's
bridge, mutual TLS); the bridge is a shared network, so its subnet must be marked trusted
(`--tensor-parallel-trusted-network`) before the mesh offers tensor-parallel groups. The
layout is forced with `--parallelism` (on this CPU the planner rarely predicts a group to be
faster, which is right: the namespaces share two cores).

Exactness: each generated token's id, and the last stage's logits (the local API's debug
`return_logits`), against one mlx-lm process fed the same prompt and the same greedy tokens:
ids identical, logits within the bound of tests/test_tensor_parallel_runner.py (max |logit
difference| <= 1e-4 x max |logit|; tensor parallelism changes the reduction order of two
all-reduces per layer).

Failure: `kill -9` of a member's daemon mid-generation (its runner dies with it by the kernel's
parent-death signal): the request ends within the heartbeat bound with UNAVAILABLE naming the
lost member, or (the origin replaying its tokens) completes on the next plan; the
survivors' runners are gone by PID, and the mesh commits a new plan that serves again.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np
import psutil
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer

from meshd.api import client, render
from meshd.api.launcher import DaemonProcess
from meshd.models.store import ModelStore
from meshd.wire import pb

pytestmark = pytest.mark.netns

RELATIVE_BOUND = 1e-4
PROMPT = "tensor parallel stages split every layer over a group "
MAX_TOKENS = 10
PLAN_TIMEOUT_S = 60.0
TEARDOWN_BOUND_S = 1.5 + 1.0  # the heartbeat bound (peer_timeout_s), and slack for a loaded CPU


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.random_model import make_random_model_dir

    return make_random_model_dir(
        tmp_path_factory.mktemp("tp-mesh") / "llama",
        "llama",
        layers=4,
        hidden=128,
        heads=4,
        kv_heads=2,
        vocab=320,
        intermediate=256,
        max_shard_bytes=400_000,
    )


# --- helpers -------------------------------------------------------------------------------------


def start_daemons(
    daemons, mesh, token: str, model: Path, *, parallelism: str, trusted: bool, extra=()
) -> list[DaemonProcess]:
    subnet = mesh.nodes[0].ip.rsplit(".", 1)[0] + ".0/24"
    args = ["--interface", "eth0", "--join", token, "--model", str(model)]
    args += ["--parallelism", parallelism, "--context-length", "256", *extra]
    if trusted:
        args += ["--tensor-parallel-trusted-network", subnet]
    return [
        daemons([*args, "--name", f"host{i}"], netns=node.ns) for i, node in enumerate(mesh.nodes)
    ]


def plan_of(status: pb.MeshStatus) -> dict:
    return json.loads(status.agreement.plan_json) if status.agreement.plan_json else {}


def wait_serving(
    nodes: Sequence[DaemonProcess], layout: str, members: int, *, model: str = ""
) -> pb.MeshStatus:
    """Every node runs the same committed plan of `layout` over `members` nodes, and every
    runner of it is ready; returns the first node's status."""

    def ready(status: pb.MeshStatus) -> bool:
        plan = plan_of(status)
        runners = [r for r in status.tensor_parallel_runners if r.plan_id == plan.get("plan_id")]
        holds = any(status.node_id in stage["nodes"] for stage in plan.get("stages", ()))
        grouped = any(
            status.node_id in s["nodes"] and len(s["nodes"]) > 1 for s in plan.get("stages", ())
        )
        return (
            plan.get("layout") == layout
            and len(status.agreement.members) == members
            and (not model or status.agreement.model == model)
            and (not grouped or (runners and all(r.state == "ready" for r in runners)))
            and (grouped or not holds or not runners)
        )

    for node in nodes:  # each one up (a daemon that exits says why)
        node.wait_for(ready, PLAN_TIMEOUT_S, f"a {layout} plan served")
    deadline = time.monotonic() + PLAN_TIMEOUT_S
    while True:  # and all at once on the same plan (a link re-measured may move it)
        statuses = [node.status() for node in nodes]
        if all(map(ready, statuses)) and len({s.agreement.active_plan_id for s in statuses}) == 1:
            return statuses[0]
        assert time.monotonic() < deadline, [s.agreement for s in statuses]
        time.sleep(0.1)


class Reference:
    """One mlx-lm process: the model, its caches, greedy steps as the mesh takes them."""

    def __init__(self, model_dir: Path) -> None:
        self.model, _ = load_model(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.cache = make_prompt_cache(self.model)

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        logits = self.model(mx.array([list(tokens)]), cache=self.cache)
        return np.array(logits[0, -1].astype(mx.float32))


def generate_with_logits(node: DaemonProcess, max_tokens: int = MAX_TOKENS):
    """(token ids, logits rows, done) of a greedy request through `node`'s local API."""
    request = pb.GenerateRequest(
        prompt=PROMPT, sampling=pb.Sampling(max_tokens=max_tokens), return_logits=True
    )
    ids, rows, done = [], [], None
    for event in client.stream_generation(node.api, request, timeout_s=120):
        if event.HasField("token"):
            assert event.token.index == len(ids)
            ids.append(event.token.token_id)
            rows.append(np.frombuffer(event.token.logits, dtype="<f4"))
        elif event.HasField("done"):
            done = event.done
    return ids, rows, done


def assert_matches_mlx_lm(model_dir: Path, ids: list[int], rows: list[np.ndarray]) -> None:
    """The mesh's greedy tokens and logits are one mlx-lm process's, within the bound."""
    reference = Reference(model_dir)
    prompt = list(reference.tokenizer.encode(PROMPT))
    reference.step(prompt[:-1])  # the data plane prefills all but the last token, then it
    expected = reference.step(prompt[-1:])
    assert ids, "no tokens generated"
    for index, (token, row) in enumerate(zip(ids, rows, strict=True)):
        assert row.shape == expected.shape, index
        scale = float(np.abs(expected).max())
        worst = float(np.abs(row - expected).max())
        assert worst <= RELATIVE_BOUND * scale, f"token {index}: |diff| {worst:.3g}, scale {scale}"
        assert token == int(np.argmax(expected)), f"token {index}: {token} vs mlx-lm"
        expected = reference.step([token])


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class ExitWatch:
    """When a process ended (or became a zombie), polled from a thread once started, so a
    request streaming meanwhile does not delay the measurement."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._ended = threading.Event()
        self._at = 0.0
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _poll(self) -> None:
        deadline = time.monotonic() + 60.0
        while not gone(self._pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        self._at = time.monotonic()
        self._ended.set()

    def result(self, timeout_s: float) -> float:
        """The moment the process was seen gone (monotonic)."""
        assert self._ended.wait(timeout_s), f"process {self._pid} still runs"
        assert gone(self._pid), f"process {self._pid} still runs"
        return self._at


def node_index(nodes: Sequence[DaemonProcess], node_id: str) -> int:
    return next(i for i, node in enumerate(nodes) if node.status().node_id == node_id)


# --- exactness -----------------------------------------------------------------------------------


def test_tp2_dense_then_moe_then_kill_9_of_a_member(
    daemons, netns_mesh, mesh_token, dense_model, architecture_dir, model_store
) -> None:
    """Three daemons, TP=2 forced over a trusted subnet: a group of two and an origin.

    1. A dense model: the plan, its status, and generation as mlx-lm from the origin.
    2. `meshd load` of a random MoE: the group re-forms with the routed experts split between
       the members as the plan places them, and generates as mlx-lm too.
    3. `kill -9` of the group's rank 1 daemon while a long request streams from the origin:
       the request ends at once as UNAVAILABLE naming it (or, as requests resume on the next
       plan, completes), rank 0's runner is gone by PID, and the mesh commits a new plan over
       the survivors that serves.
    """
    mesh = netns_mesh(3, subnet=random.randrange(1, 250))
    nodes = start_daemons(
        daemons, mesh, mesh_token, dense_model, parallelism="tensor", trusted=True
    )
    status = wait_serving(nodes, "tensor", 3)
    plan = plan_of(status)
    assert [len(stage["nodes"]) for stage in plan["stages"]] == [2]
    (group,) = status.tensor_parallel_groups
    assert list(group.members) == plan["stages"][0]["nodes"] and group.backend == "ring"
    assert "marked trusted in the config" in group.link
    assert all(address.startswith("10.77.") for address in group.addresses)
    assert all(m.trusted and "marked trusted" in m.trust_reason for m in status.links)
    leader, member = (node_index(nodes, node) for node in group.members)
    (origin,) = set(range(3)) - {leader, member}
    ranks = {i: [r.rank for r in nodes[i].status().tensor_parallel_runners] for i in range(3)}
    assert ranks == {leader: [0], member: [1], origin: []}
    text = render.status_text(nodes[origin].status())
    assert "tensor-parallel stage 0" in text and "backend ring" in text, text

    ids, rows, done = generate_with_logits(nodes[origin])
    assert done is not None and done.completion_tokens == len(ids) == MAX_TOKENS
    assert_matches_mlx_lm(dense_model, ids, rows)

    moe = architecture_dir("qwen3_moe")
    # In the store the daemons share, as a user's models are: whichever member dies (the node
    # that ran the load included), the survivors hold the model to plan it again.
    ModelStore(model_store).import_mlx_dir(moe)
    client.load_model(nodes[origin].api, pb.LoadModelRequest(model=moe.name))
    status = wait_serving(nodes, "tensor", 3, model=moe.name)
    (stage,) = plan_of(status)["stages"]
    (group,) = status.tensor_parallel_groups  # three alike nodes: any two may form it now
    assert list(group.members) == stage["nodes"] and len(stage["nodes"]) == 2
    leader, member = (node_index(nodes, node) for node in group.members)
    (origin,) = set(range(3)) - {leader, member}
    experts = [(s["node"], s["expert_start"], s["expert_end"]) for s in stage["experts"]]
    assert [node for node, _, _ in experts] == stage["nodes"] and experts[0][1] == 0
    assert all(start < end for _, start, end in experts), experts  # each member holds some
    runners = nodes[leader].status().tensor_parallel_runners
    (runner,) = [r for r in runners if r.plan_id == status.agreement.active_plan_id]
    assert runner.state == "ready" and runner.pid > 0
    ids, rows, done = generate_with_logits(nodes[origin])
    assert done is not None and done.completion_tokens == MAX_TOKENS
    assert_matches_mlx_lm(moe, ids, rows)

    old_plan = status.agreement.active_plan_id
    # max_tokens unset: as many as the plan's context holds (a long request to kill into)
    request = pb.GenerateRequest(prompt=PROMPT, sampling=pb.Sampling())
    received, failure, done, killed_at, runner_gone = 0, None, None, None, ExitWatch(runner.pid)
    try:
        for event in client.stream_generation(nodes[origin].api, request, timeout_s=60):
            received += event.HasField("text")
            done = event.done if event.HasField("done") else done
            if received == 3 and killed_at is None:
                nodes[member].kill()
                killed_at = time.monotonic()
                runner_gone.start()
    except client.GenerationFailed as error:
        failure = error
    assert killed_at is not None, "the request ended before the kill"
    if failure is None:  # resumed on the survivors' plan (the origin replays its tokens)
        assert done is not None and done.completion_tokens > 3, done
    else:  # or ended at once, as the kind the origin may retry, naming the lost member
        assert failure.code.name == "UNAVAILABLE", failure
        assert group.members[1] in str(failure), failure
        assert time.monotonic() - killed_at < TEARDOWN_BOUND_S, failure
    gone_after = runner_gone.result(TEARDOWN_BOUND_S) - killed_at
    assert gone_after < TEARDOWN_BOUND_S, f"rank 0's runner {runner.pid} outlived its group"

    survivors = [nodes[leader], nodes[origin]]
    status = wait_serving(survivors, "tensor", 2, model=moe.name)
    assert status.agreement.active_plan_id != old_plan
    assert group.members[1] not in plan_of(status)["stages"][0]["nodes"]
    ids, _, done = generate_with_logits(nodes[origin], max_tokens=4)
    assert done is not None and len(ids) == 4
    events = "\n".join(nodes[leader].status().events)
    assert re.search(rf"tensor-parallel stage \S+ stopped: node {group.members[1]} lost", events)


def test_hybrid_2x2_over_trusted_namespaces(daemons, netns_mesh, mesh_token, tiny_llama) -> None:
    """Pipeline stages with tensor-parallel groups over four namespaced daemons, forced by
    `hybrid` (the 110 MB budgets keep any node from holding the whole model): every node
    serves in exactly one stage, the plan is a pipeline (more than one stage) with at least
    one group, each group runs as its plan stage, and the text is one mlx-lm process's.

    Which layout wins ([2, 2], [1, 2, 1], [1, 1, 2], ...) is the planner's price of links
    measured on whatever load the host has, so the test asserts what makes a plan hybrid
    rather than one list of widths."""
    mesh = netns_mesh(4, subnet=random.randrange(1, 250))
    nodes = start_daemons(
        daemons,
        mesh,
        mesh_token,
        tiny_llama,
        parallelism="hybrid",
        trusted=True,
        extra=["--memory-budget", "110MB"],
    )
    status = wait_serving(nodes, "hybrid", 4)
    stages = plan_of(status)["stages"]
    serving = [node for stage in stages for node in stage["nodes"]]
    assert sorted(serving) == sorted(set(serving)) and len(serving) == 4, stages
    assert set(serving) == set(status.agreement.members), (stages, status.agreement.members)
    widths = [len(stage["nodes"]) for stage in stages]
    grouped = [index for index, width in enumerate(widths) if width > 1]
    assert len(stages) > 1 and grouped, f"not a hybrid plan: widths {widths}"
    groups = status.tensor_parallel_groups
    assert [g.stage for g in groups] == grouped
    assert [set(g.members) for g in groups] == [set(stages[i]["nodes"]) for i in grouped]
    ids, rows, done = generate_with_logits(nodes[0])
    assert done is not None and done.completion_tokens == MAX_TOKENS
    assert_matches_mlx_lm(tiny_llama, ids, rows)


# --- trust ---------------------------------------------------------------------------------


def test_without_trust_the_plan_is_a_pipeline_and_says_why(
    daemons, netns_mesh, mesh_token, tiny_llama
) -> None:
    """The same bridge, not marked trusted: `auto` splits the model into a pipeline (no node
    holds it alone), every link says why it may not carry tensor-parallel traffic, and a
    forced `tensor` layout serves as a pipeline whose note says why."""
    mesh = netns_mesh(2, subnet=random.randrange(1, 250))
    nodes = start_daemons(
        daemons,
        mesh,
        mesh_token,
        tiny_llama,
        parallelism="auto",
        trusted=False,
        extra=["--memory-budget", "150MB"],
    )
    status = wait_serving(nodes, "pipeline", 2)
    assert not status.tensor_parallel_groups and not status.tensor_parallel_runners
    assert len(status.links) == 2
    for link in status.links:
        assert not link.trusted and "shared network" in link.trust_reason, link
        assert "tensor_parallel_trusted_networks" in link.trust_reason
    text = render.status_text(status)
    assert "tensor-parallel refused on" in text and "shared network" in text, text

    client.load_model(
        nodes[0].api, pb.LoadModelRequest(model=str(tiny_llama), parallelism="tensor")
    )
    noted = nodes[1].wait_for(
        lambda s: "trusted" in _plan_note(s), PLAN_TIMEOUT_S, "a pipeline that says why"
    )
    assert not noted.agreement.refusal
    assert _plan_note(noted).startswith(
        "tensor parallelism needs a group of 2 or 4 nodes joined by links marked trusted in both "
        "directions (tensor-parallel traffic is unencrypted); none of the 2 nodes with usable "
        "memory are: serving a pipeline instead; "
    )
    assert f"note: {_plan_note(noted)}" in render.status_text(noted)


def _plan_note(status: pb.MeshStatus) -> str:
    """The committed plan's note: why it is not the kind of layout asked for."""
    plan_json = status.agreement.plan_json
    return json.loads(plan_json).get("note", "") if plan_json else ""
