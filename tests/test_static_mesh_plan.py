"""A static mesh keeps its plan: link-measurement noise commits no new plan.

Three daemons in network namespaces serve the random llama with link probes every half
second while a child process keeps a core busy (a loaded host's probes vary most: veth
bandwidth measured 1.2-9.8 Gbit/s), for 15 s: 30 rounds of measurements per link, and the
test checks that some of them moved enough to be re-published. Nothing joins, leaves or
changes, so after the first plan no other may be committed (at most one, a settling
layout), and requests keep being answered all along. (Before plan ids were layouts
and probes sender-timed, such a mesh committed a new plan id with the same layout every few
seconds, each one reloading every stage; benchmarks/bench_resume.py measures 5 s
probes over minutes. Before members were exempt from the peer port's bound on connections
still in their handshake, these probes filled it within seconds and the gate shut a member's
data-plane link, whose request then waited until its client gave up.)
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from meshd.api import client
from meshd.api.launcher import DaemonProcess
from meshd.wire import pb
from tests.support.cpu_load import busy_core

pytestmark = pytest.mark.netns

OBSERVE_S = 15.0
COMMITTED = re.compile(r"committed plan ([0-9a-f]{12})")
ARGS = ["--interface", "eth0", "--link-probe-interval", "0.5", "--memory-budget", "120MB"]
ARGS += ["--context-length", "256"]


def commits(daemon: DaemonProcess) -> list[str]:
    return COMMITTED.findall(daemon.log_path.read_text(errors="replace"))


def test_a_static_loaded_mesh_commits_no_new_plan(
    daemons, netns_mesh, mesh_token, tiny_llama: Path
) -> None:
    mesh = netns_mesh(3)
    args = [*ARGS, "--join", mesh_token, "--model", str(tiny_llama)]
    nodes = [daemons(args, netns=mesh.nodes[i].ns) for i in range(3)]
    for node in nodes:
        node.wait_for(
            lambda s: bool(s.agreement.active_plan_id) and len(s.agreement.members) == 3,
            90,
            "a committed 3-node plan",
        )
    plan_id = nodes[0].status().agreement.active_plan_id
    before = [commits(node) for node in nodes]
    answered = 0
    measured: dict[tuple[str, str], set[float]] = {}  # link -> the published measurements
    with busy_core(OBSERVE_S):
        deadline = time.monotonic() + OBSERVE_S
        while time.monotonic() < deadline:
            request = pb.GenerateRequest(prompt="hello", sampling=pb.Sampling(max_tokens=2))
            events = list(client.stream_generation(nodes[answered % 3].api, request, 60))
            assert events[-1].HasField("done"), events
            answered += 1
            for link in nodes[0].status().links:
                measured.setdefault((link.src, link.dst), set()).add(link.measured_at)
            time.sleep(0.5)
    after = [commits(node) for node in nodes]
    new = [a[len(b) :] for a, b in zip(after, before, strict=True)]
    assert all(len(extra) <= 1 for extra in new), f"plans committed on a static mesh: {new}"
    if not any(new):
        assert all(node.status().agreement.active_plan_id == plan_id for node in nodes)
    assert answered >= 5
    # The noise reached the planner's inputs: links were re-published while watched (a link
    # is re-published only when its measurement moved materially).
    republished = sum(len(seen) - 1 for seen in measured.values())
    assert republished >= 3, f"links re-published while watched: {measured}"
    # The probes' connect-and-close rounds (5 a round per peer here) never make a member a
    # stranger at the peer port's gate: its connections are not refused.
    refused = [line for node in nodes for line in node.log_tail(2000).splitlines()]
    refused = [line for line in refused if "connection(s) from" in line]
    assert not refused, refused
