"""Predicted against measured on real daemons, and the speed correction that follows.

Two loopback daemons split the embedded SmolLM2-135M-Instruct; their profiles claim a machine
ten times faster than this one (FLOP/s and memory bandwidth x 10), as a profile measured in a
quiet moment of a busy machine would. After a few requests, `meshd status` shows the plan's
predictions next to what the requests measured, and each node publishes a speed correction
(its decode steps took several times what the profile predicts) that the next plan uses.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import openai
import pytest

from meshd.api import render
from meshd.api.launcher import DaemonProcess
from meshd.mesh import security
from meshd.models.store import ModelEntry
from meshd.wire import pb
from partitioner import Plan

pytestmark = pytest.mark.integration

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
# What the profiles say this machine does: ten times an idle 2-core x86 VM's measurement (175
# GFLOP/s, 9 GB/s), whatever the session's own measurement (on a loaded host it is far lower,
# and ten times that would be no overstatement at all).
OVERSTATED_FLOPS = 10 * 175e9
OVERSTATED_BANDWIDTH = 10 * 9e9


def overstated_profile(template: Path, target: Path) -> None:
    document = json.loads(template.read_text())
    profile = document["profile"]
    flops = max(OVERSTATED_FLOPS, 10 * profile["flops"]) / profile["flops"]
    bandwidth = max(OVERSTATED_BANDWIDTH, 10 * profile["mem_bandwidth"]) / profile["mem_bandwidth"]
    profile["flops"] *= flops
    profile["mem_bandwidth"] *= bandwidth
    # A model is priced at its compute dtype's rate where the profile has one (float32 here).
    for key in profile.get("dtype_flops", {}):
        profile["dtype_flops"][key] *= flops
    for key in profile.get("dtype_bandwidth", {}):
        profile["dtype_bandwidth"][key] *= bandwidth
    target.write_text(json.dumps(document))


@pytest.fixture(scope="module")
def mesh(
    default_model_entry: ModelEntry, tmp_path_factory, profile_template: Path
) -> list[DaemonProcess]:
    token = security.encode_join_token(security.create_mesh_secret("predict"))
    root = tmp_path_factory.mktemp("predict-mesh")
    daemons = []
    for i in range(2):
        state = root / f"n{i}"
        state.mkdir()
        overstated_profile(profile_template, state / "profile.json")
        args = [*LOOPBACK, "--join", token, "--name", f"p{i}", "--model",
                str(default_model_entry.path), "--strategy", "memory", "--context-length", "512",
                "--no-prefix-cache", "--speed-correction"]  # fmt: skip
        daemons.append(DaemonProcess(state, args).start())
    try:
        for daemon in daemons:
            daemon.wait_for(
                lambda s: len(s.agreement.members) == 2 and bool(s.agreement.plan_json),
                120,
                "a committed 2-node plan",
            )
        yield daemons
    finally:
        for daemon in daemons:
            daemon.kill()
        shutil.rmtree(root, ignore_errors=True)


def test_status_shows_measured_next_to_predicted_and_a_correction(mesh) -> None:
    origin = mesh[0]
    before = Plan.from_dict(json.loads(origin.status().agreement.plan_json))
    client = openai.OpenAI(base_url=origin.status().http_url + "/v1", api_key="unused")
    for topic in ("the sea", "a forest", "a city"):
        client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": f"Write a story about {topic}."}],
            temperature=0.0,
            max_tokens=16,
        )
    status = origin.status()
    check = status.prediction_check
    assert check.requests >= 1
    alone = check.decode_alone
    assert alone.requests >= 1 and alone.measured > 0 and alone.predicted > 0
    assert alone.ratio == pytest.approx(alone.measured / alone.predicted)
    assert check.ttft.measured > 0 and check.prefill.measured > 0
    # The profiles overstate this machine's speed: the requests ran slower than the first plan
    # predicted (the status compares with the newest prediction, which may be corrected).
    assert alone.measured < before.prediction.tokens_per_s / 2

    def corrected(s: pb.MeshStatus) -> bool:
        return len(s.speed_corrections) == 2 and s.agreement.converged

    status = origin.wait_for(corrected, 60, "both nodes' speed corrections")
    for correction in status.speed_corrections:
        assert correction.factor > 1.5, correction
        assert correction.samples >= 8
    text = render.status_text(status)
    assert "predicted vs measured" in text and "speed correction" in text
    assert re.search(r"first token +predicted [\d.]+ m?s, measured [\d.]+ m?s \(", text), text
    after = Plan.from_dict(json.loads(status.agreement.plan_json))
    # The mesh plans with the corrected speeds: the prediction moved towards what it measured.
    assert after.prediction.tokens_per_s < before.prediction.tokens_per_s / 1.5
    assert render.status_to_json(status)["prediction_check"]["decode_alone"]["measured"] > 0
