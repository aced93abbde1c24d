"""A model larger than any one node's memory budget runs across the mesh within budgets.

Each daemon may use 120 MB; the random-weight llama's 94 MB of weights plus its KV cache,
activations and the stated overhead need three of them. Each node must load only its
share (MLX's allocator counters, not guesses) and stay within its budget while generating.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshd.api import client
from meshd.wire import pb
from tests.support.memory_checks import assert_nodes_hold_only_their_share

pytestmark = pytest.mark.integration

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
BUDGET = 120_000_000


@pytest.fixture
def big_model(tiny_llama: Path) -> Path:
    return tiny_llama


def test_model_bigger_than_any_node_runs_within_every_budget(daemons, mesh_token, big_model):
    from meshd.models.info import read_model_spec

    weights = read_model_spec(big_model).total_weight_bytes
    assert weights > 0.75 * BUDGET  # no node could also hold KV cache, activations, overhead
    args = [*LOOPBACK, "--join", mesh_token, "--model", str(big_model)]
    args += ["--memory-budget", "120MB", "--context-length", "256"]
    nodes = [daemons(args) for _ in range(3)]
    for d in nodes:
        d.wait_for(
            lambda s: bool(s.agreement.active_plan_id) and len(s.agreement.members) == 3,
            60,
            "a committed plan over 3 nodes",
        )
    plan = json.loads(nodes[0].status().agreement.plan_json)
    assert len(plan["stages"]) == 3

    request = pb.GenerateRequest(prompt="hello mesh " * 20, sampling=pb.Sampling(max_tokens=24))
    done = [e.done for e in client.stream_generation(nodes[1].api, request) if e.HasField("done")]
    assert done and done[0].completion_tokens > 0

    assert_nodes_hold_only_their_share(nodes, plan, BUDGET, weights)
