"""The first thing a user runs: `meshd demo`, and the race it once lost.

The plan commits on each member a moment apart, and a node that started a moment ago may not
yet have heard which model its peers run. A request that reached such a node failed at once
with "no model is selected" (the demo asked the last node and failed about one run in seven).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.api import client
from meshd.api.demo import QUESTION, loopback_args
from meshd.api.launcher import DaemonProcess
from meshd.mesh import security
from meshd.models.store import ModelEntry
from meshd.wire import pb

pytestmark = pytest.mark.integration


def test_a_node_asked_as_soon_as_it_answers_waits_for_the_plan(
    default_model_entry: ModelEntry, model_store: Path, tmp_path: Path
) -> None:
    """Two daemons as the demo starts them; the second is asked the moment its API answers,
    seconds before any plan can commit (the agreement's startup grace alone is 3 s)."""
    token = security.encode_join_token(security.create_mesh_secret("race"))
    env = {"MESHD_MODEL_STORE": str(model_store)}
    nodes = [
        DaemonProcess(
            tmp_path / f"node{i}",
            loopback_args(token, f"race-{i}", default_model_entry.path),
            env=env,
        )
        for i in range(2)
    ]
    try:
        for node in nodes:
            node.start()
        asker = nodes[-1]
        status = asker.wait_ready(30)
        assert not status.agreement.active_plan_id, "asked before the plan committed here"
        request = pb.ChatRequest(
            messages=[pb.ChatMessage(role="user", content=QUESTION)],
            sampling=pb.Sampling(max_tokens=12),
        )
        events = list(client.stream_generation(asker.api, request, timeout_s=120))
        text = "".join(event.text for event in events if not event.HasField("done"))
        assert "Paris" in text, text
        assert events[-1].HasField("done")
    finally:
        for node in nodes:
            node.terminate()


def test_meshd_demo_answers(default_model_entry: ModelEntry, model_store: Path) -> None:
    """The command itself, as the README's first line runs it (on 2 nodes, to be quick)."""
    env = {**os.environ, "MESHD_MODEL_STORE": str(model_store)}
    result = subprocess.run(
        [sys.executable, "-m", "meshd", "demo", "--nodes", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "A: The capital of France is Paris." in result.stdout, result.stdout
