"""A real daemon's profile and memory: a re-measure within the spread keeps the plan, and a
budget that cannot hold the daemon's own process is refused at start."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshd.agreement.service import state_digest
from meshd.api import client
from meshd.api.launcher import DaemonProcess
from meshd.wire import pb
from tests.conftest import PROFILE_FILE

pytestmark = pytest.mark.integration

MEASURED_OVERHEAD = {"MESHD_PROCESS_OVERHEAD": ""}  # the suite plans 0 unless told so


@pytest.fixture
def started() -> Iterator[list[DaemonProcess]]:
    made: list[DaemonProcess] = []
    yield made
    for daemon in made:
        daemon.kill()


def _daemon(state: Path, args: list[str], model_store: Path) -> DaemonProcess:
    env = {**MEASURED_OVERHEAD, "MESHD_MODEL_STORE": str(model_store)}
    return DaemonProcess(state, ["--no-mdns", "--http", "off", "--peer-port", "0", *args], env=env)


def test_a_budget_below_the_process_overhead_is_refused_at_start(
    tmp_path: Path, model_store: Path, profile_template: Path, started: list[DaemonProcess]
) -> None:
    state = tmp_path / "small"
    state.mkdir()
    shutil.copyfile(profile_template, state / PROFILE_FILE)
    daemon = _daemon(state, ["--memory-budget", "100MiB"], model_store).start()
    started.append(daemon)
    assert daemon.proc is not None
    code = daemon.proc.wait(60)
    log = daemon.log_tail(10)
    assert code == 2, log
    assert "--memory-budget 100 MiB is below this daemon's own overhead of" in log
    assert "give at least" in log


def _own(status: pb.MeshStatus) -> pb.PeerStatus:
    return next(n for n in status.nodes if n.source == "self")


def test_a_remeasure_within_the_spread_keeps_the_profile_digest_and_plan(
    tmp_path: Path,
    model_store: Path,
    profile_template: Path,
    architecture_dir: Callable[[str], Path],
    started: list[DaemonProcess],
) -> None:
    state = tmp_path / "node"
    state.mkdir()
    document = json.loads(profile_template.read_text())
    # A quiet measurement whose samples spread 4x: any re-measure on this machine, quiet or
    # loaded, falls within it, so the plan must not move.
    document["profile"].update(flops_spread=4.0, mem_bandwidth_spread=4.0, loaded=False)
    (state / PROFILE_FILE).write_text(json.dumps(document))
    args = ["--model", str(architecture_dir("mistral")), "--memory-budget", "1GiB"]
    daemon = _daemon(state, args, model_store).start()
    started.append(daemon)
    before = daemon.wait_for(lambda s: bool(s.agreement.active_plan_id), 60, "a plan")
    own = _own(before)
    assert own.profile.process_overhead > 0  # measured, and planned out of the budget
    assert before.memory.overhead == own.profile.process_overhead
    digest = state_digest(pb.NodeState(profile=own.profile))
    measured_at = own.profile.measured_at

    after = client.remeasure(daemon.api, timeout_s=60)
    assert _own(after).profile.measured_at >= measured_at
    assert any("profile measured again" in line for line in after.events), after.events[-4:]
    profile = _own(after).profile
    assert (profile.flops, profile.mem_bandwidth) == (own.profile.flops, own.profile.mem_bandwidth)
    assert state_digest(pb.NodeState(profile=profile)) == digest
    time.sleep(1.0)  # an agreement round, were the digest to have changed
    assert daemon.status().agreement.active_plan_id == before.agreement.active_plan_id
