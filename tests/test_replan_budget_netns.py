"""A re-plan that moves layers keeps every node's MLX memory within its budget.

Three daemons in network namespaces split a random 8-layer llama (94 MB of float32 weights)
under 120 MB budgets: each node's share nearly fills what its budget leaves to MLX arrays.
A fourth node joins (every boundary moves), then leaves gracefully (SIGTERM; they move back).
A node whose range moves must free the layers it no longer runs before it reads the ones it
gains: holding the old and the new stage at once would take it past its budget. MLX's own
allocator counter (``mx.get_peak_memory()``, the daemon's ``status.memory.mlx_peak``, the most
MLX held at once since the daemon started) says whether it did. A node that keeps its range
keeps its loaded weights (no stage built, no byte read: ``status.transitions``), and one whose
range moved reads only the layers it gained.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshd.api import client
from meshd.api.launcher import READY_TIMEOUT_S, DaemonProcess
from meshd.wire import pb
from tests.support.settled_mesh import wait_settled

pytestmark = pytest.mark.netns

BUDGET = "120MB"
MIB = 1024 * 1024
STREAM_TOKENS = 120  # a request that runs through a re-plan (~10 s here)


def plan_of(status: pb.MeshStatus) -> dict[str, Any]:
    return json.loads(status.agreement.plan_json)


def stages(plan: dict[str, Any]) -> dict[str, tuple[int, int, bool, bool]]:
    """node -> (layer_start, layer_end, has_embedding, has_head) of its stage in ``plan``."""
    return {
        node: (stage["layer_start"], stage["layer_end"], stage["has_embedding"], stage["has_head"])
        for stage in plan["stages"]
        for node in stage["nodes"]
    }


def predicted_mlx_peak(plan: dict[str, Any], node: str) -> int:
    """What ``plan`` predicts MLX arrays take at most on ``node`` (its weights, KV cache and
    activations: the node's planned memory less the process overhead, which MLX's counters
    do not see)."""
    share = next(m for m in plan["memory"] if m["node"] == node)
    assert share["total_bytes"] <= share["usable_bytes"]  # the budget holds the plan
    return share["total_bytes"] - share["overhead_bytes"]


def settled_over(daemons: list[DaemonProcess], n: int) -> dict[str, Any]:
    """The plan every daemon serves once it has settled over ``n`` nodes."""
    return plan_of(wait_settled(daemons, n, ready_s=READY_TIMEOUT_S))


@pytest.fixture
def hosts(daemons, mesh_token: str, tiny_llama: Path) -> Iterator[list[DaemonProcess]]:
    """Four namespaced hosts with a daemon each (not started), 120 MB budgets."""
    from tests.netns import Mesh, cleanup_stale, require_root_and_netns

    require_root_and_netns()
    cleanup_stale()
    args = ["--interface", "eth0", "--join", mesh_token, "--model", str(tiny_llama)]
    args += ["--memory-budget", BUDGET, "--context-length", "256", "--strategy", "memory"]
    with Mesh(4) as netns_mesh:
        made = [daemons(args, netns=netns_mesh.nodes[i].ns, start=False) for i in range(4)]
        try:
            yield made
        finally:
            for daemon in made:
                daemon.kill()


def assert_within_plans(statuses: list[pb.MeshStatus], plans: list[dict[str, Any]]) -> None:
    """Each node's MLX peak since it started stays within what one of the plans it served
    predicts for it (so within its budget): never the old and the new stage at once."""
    for status in statuses:
        served = [plan for plan in plans if status.node_id in stages(plan)]
        allowed = max(predicted_mlx_peak(plan, status.node_id) for plan in served)
        memory = status.memory
        assert memory.mlx_peak <= allowed, (
            f"{status.node_id}: MLX peak {memory.mlx_peak / MIB:.1f} MiB > "
            f"{allowed / MIB:.1f} MiB, the most a plan it served predicts there "
            f"(held now {memory.mlx_active / MIB:.1f} MiB); its stages: "
            f"{[stages(plan)[status.node_id] for plan in served]}"
        )
        assert memory.mlx_active <= predicted_mlx_peak(plans[-1], status.node_id)
        assert memory.mlx_peak <= memory.budget


def assert_incremental(
    before: dict[str, pb.PlanTransitions],
    statuses: list[pb.MeshStatus],
    old: dict[str, Any],
    new: dict[str, Any],
) -> list[str]:
    """A node whose stage is the same in both plans built nothing and read nothing; a node
    whose stage changed read only the layers it did not run before. Returns the keepers."""
    kept = []
    for status in statuses:
        node, now = status.node_id, status.transitions
        if node not in before or node not in stages(new):
            continue
        was = before[node]
        old_stage, new_stage = stages(old).get(node), stages(new)[node]
        if old_stage == new_stage:
            kept.append(node)
            assert now.stage_loads == was.stage_loads, (node, was, now)
            assert now.bytes_loaded == was.bytes_loaded and now.layers_loaded == was.layers_loaded
        else:
            assert old_stage is not None
            gained = set(range(*new_stage[:2])) - set(range(*old_stage[:2]))
            assert now.stage_loads == was.stage_loads + 1, (node, was, now)
            assert now.layers_loaded - was.layers_loaded == len(gained), (
                node,
                old_stage,
                new_stage,
            )
    return kept


def ask(daemon: DaemonProcess) -> None:
    request = pb.GenerateRequest(prompt="hello mesh " * 8, sampling=pb.Sampling(max_tokens=6))
    done = [e.done for e in client.stream_generation(daemon.api, request) if e.HasField("done")]
    assert done and done[0].completion_tokens > 0


@contextlib.contextmanager
def streaming(daemon: DaemonProcess) -> Iterator[list[pb.GenerationDone]]:
    """A long greedy request streams from ``daemon`` in a thread while the body runs (so the
    old plan cannot finish draining before the new one loads); it must end without error."""
    request = pb.GenerateRequest(
        prompt="hello mesh " * 8, sampling=pb.Sampling(max_tokens=STREAM_TOKENS, temperature=0.0)
    )
    started, outcome = threading.Event(), []

    def run() -> None:
        try:
            for event in client.stream_generation(daemon.api, request, timeout_s=120):
                started.set()
                if event.HasField("done"):
                    outcome.append(event.done)
        except Exception as error:
            outcome.append(error)
        finally:
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60)
    done: list[pb.GenerationDone] = []
    yield done
    thread.join(120)
    assert not thread.is_alive(), "the request did not end"
    assert len(outcome) == 1 and isinstance(outcome[0], pb.GenerationDone), outcome
    assert outcome[0].completion_tokens == STREAM_TOKENS, outcome[0]
    done.append(outcome[0])


def transitions(daemons: list[DaemonProcess]) -> dict[str, pb.PlanTransitions]:
    return {status.node_id: status.transitions for status in (d.status() for d in daemons)}


def test_a_node_joining_then_leaving_moves_layers_within_every_budget(hosts) -> None:
    three, fourth = hosts[:3], hosts[3]
    for daemon in three:
        daemon.start()
    first = settled_over(three, 3)
    ask(three[0])
    before = transitions(three)

    with streaming(three[0]) as during_join:
        fourth.start()  # every boundary moves: 3/3/2 layers become 2/2/2/2
        joined = settled_over(hosts, 4)
    statuses = [daemon.status() for daemon in hosts]
    assert_within_plans(statuses, [first, joined])
    kept = assert_incremental(before, statuses, first, joined)
    ask(hosts[0])
    before = transitions(hosts)

    assert fourth.proc is not None
    with streaming(three[1]) as during_leave:
        fourth.proc.send_signal(signal.SIGTERM)  # it leaves: the boundaries move back
        assert fourth.proc.wait(60) == 0, fourth.log_tail()
        left = settled_over(three, 3)
    statuses = [daemon.status() for daemon in three]
    assert_within_plans(statuses, [first, joined, left])
    kept += assert_incremental(before, statuses, joined, left)
    ask(three[1])
    moved = [n for n in stages(left) if stages(left)[n] != stages(joined).get(n)]
    print(f"kept their stage: {kept}; moved: {moved}; resumes {during_join[0].resumes} (join)")
    print(f"{during_leave[0].resumes} (leave)")
    assert moved  # the test moved layers (else it tested nothing)
