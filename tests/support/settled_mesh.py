"""Namespaced `meshd run` daemons for tests and benchmarks, and the wait for a settled plan.

A re-plan is over when every daemon serves the same plan, has loaded it, and nothing moves
or drains any more: the state tests and benchmarks of re-plans measure from.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from meshd.api.launcher import DaemonProcess
from meshd.wire import pb
from tests.netns import Mesh


def namespaced_daemons(
    mesh: Mesh, root: Path, profile: Path, args: list[str]
) -> list[DaemonProcess]:
    """One daemon (not started) per namespace of ``mesh``, state in ``root/host<i>`` with a
    copy of the measured ``profile``."""
    daemons = []
    for i, node in enumerate(mesh.nodes):
        state = root / f"host{i}"
        state.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(profile, state / "profile.json")
        daemons.append(DaemonProcess(state, args, netns=node.ns))
    return daemons


def wait_settled(
    daemons: list[DaemonProcess], n: int, timeout_s: float = 120, ready_s: float = 120
) -> pb.MeshStatus:
    """Wait until every daemon serves one plan over ``n`` nodes and has loaded it (nothing is
    moving, no older plan drains); returns the first daemon's status then."""
    for daemon in daemons:
        daemon.wait_ready(ready_s)
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    while time.monotonic() < deadline:
        statuses = [daemon.status() for daemon in daemons]
        seen = {status.agreement.active_plan_id for status in statuses}
        if (
            len(seen) == 1
            and all(len(s.agreement.members) == n and s.agreement.plan_json for s in statuses)
            and all(not s.transitions.moving and not s.agreement.draining for s in statuses)
            and all(next(iter(seen))[:12] in s.transitions.last_install for s in statuses)
        ):
            return statuses[0]
        time.sleep(0.2)
    tails = "\n".join(daemon.log_tail(15) for daemon in daemons)
    raise TimeoutError(f"no settled {n}-node plan (plans {seen}):\n{tails}")
