"""Daemons on separate hosts: one network namespace each, real multicast mDNS over a bridge.

Each daemon runs in its own namespace, announces on that namespace's eth0 only
and dials its peers over mutual TLS. The parent talks to each daemon through
the Unix socket in its state directory (the file system is shared).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from meshd.api.launcher import alive_ids, fully_meshed
from meshd.mesh import security

pytestmark = pytest.mark.netns

NETNS_ARGS = ["--interface", "eth0", "--link-probe-interval", "2"]


def start(daemons, mesh, i: int, token: str, extra: list[str] | None = None):
    return daemons(
        [*NETNS_ARGS, "--join", token, "--name", f"host{i}", *(extra or [])],
        netns=mesh.nodes[i].ns,
    )


def test_four_hosts_discover_join_leave_and_die(daemons, netns_mesh, mesh_token) -> None:
    mesh = netns_mesh(4)
    first = [start(daemons, mesh, i, mesh_token) for i in range(3)]
    for d in first:
        d.wait_for(lambda s: fully_meshed(s, 3), 30, "all 3 hosts and links")
    # A late joiner is seen by everyone.
    late = start(daemons, mesh, 3, mesh_token)
    for d in [*first, late]:
        d.wait_for(lambda s: fully_meshed(s, 4), 30, "the late joiner")
    addresses = {n.address.split(":")[0] for n in first[0].status().nodes if n.source == "mdns"}
    assert addresses <= {node.ip for node in mesh.nodes}
    # kill -9: noticed by the survivors within 2 s (gRPC liveness, not mDNS).
    late_id = late.status().node_id
    os.killpg(late.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for d in first:
        d.wait_for(lambda s: late_id not in alive_ids(s), 5, "the killed host to be lost")
    assert time.monotonic() - killed_at < 2.0
    # A graceful leave (SIGTERM) is seen too.
    leaving_id = first[2].status().node_id
    assert first[2].terminate() == 0
    for d in first[:2]:
        d.wait_for(lambda s: leaving_id not in alive_ids(s), 5, "the leaving host to be gone")
    assert "lost" in first[0].status().events[-1] or any(
        leaving_id in line for line in first[0].status().events
    )


def test_cut_link_is_noticed_and_rate_limit_is_measured(daemons, netns_mesh, mesh_token) -> None:
    mesh = netns_mesh(3)
    nodes = [start(daemons, mesh, i, mesh_token) for i in range(3)]
    for d in nodes:
        d.wait_for(lambda s: fully_meshed(s, 3), 30, "all 3 hosts and links")
    # Shape host 2's outgoing traffic to 100 Mbit/s: its links are re-measured within seconds,
    # and a lower capacity counts once every probe of the window (links.WINDOW, 5) saw it:
    # 5 rounds of a 2 s pause and two bandwidth probes taking turns, ~12-17 s alone, more
    # when the suite keeps both cores busy (it ran out of 20 s once in a full run).
    rate_bytes = 100e6 / 8
    mesh.limit_rate(2, "100mbit", direction="egress")
    id2 = nodes[2].status().node_id

    def shaped(status) -> bool:
        out = [m for m in status.links if m.src == id2]
        return len(out) == 2 and all(abs(m.bandwidth - rate_bytes) / rate_bytes < 0.15 for m in out)

    status = nodes[0].wait_for(shaped, 45, "host 2's links measured at 100 Mbit/s (+-15%)")
    unshaped = [m for m in status.links if m.src != id2]
    assert all(m.bandwidth > 2 * rate_bytes for m in unshaped), unshaped
    # Pull host 1's cable: the others notice within 2 s by the heartbeat gap.
    id1 = nodes[1].status().node_id
    mesh.link_down(1)
    cut_at = time.monotonic()
    for d in (nodes[0], nodes[2]):
        d.wait_for(lambda s: id1 not in alive_ids(s), 5, "the cut host to be lost")
    assert time.monotonic() - cut_at < 2.5
    # Plug it back: it rejoins.
    mesh.link_up(1)
    nodes[0].wait_for(lambda s: id1 in alive_ids(s), 20, "the host to come back")


def test_other_meshes_are_ignored(daemons, netns_mesh, mesh_name, mesh_token) -> None:
    mesh = netns_mesh(4)
    member_a = start(daemons, mesh, 0, mesh_token)
    member_b = start(daemons, mesh, 1, mesh_token)
    # Same mesh name, different secret: another mesh that only looks alike.
    lookalike_token = security.encode_join_token(security.create_mesh_secret(mesh_name))
    lookalike = start(daemons, mesh, 2, lookalike_token)
    # Another mesh name altogether.
    other_token = security.encode_join_token(security.create_mesh_secret("elsewhere"))
    other = start(daemons, mesh, 3, other_token)
    member_a.wait_for(lambda s: len(alive_ids(s)) == 2, 30, "the other member")
    lookalike.wait_ready()
    other.wait_ready()
    time.sleep(2)
    assert len(alive_ids(member_a.status())) == 2
    assert len(alive_ids(member_b.status())) == 2
    assert len(alive_ids(lookalike.status())) == 1
    assert len(alive_ids(other.status())) == 1
    assert "fingerprint" in lookalike.log_tail(200)
    assert f"mesh name '{mesh_name}' differs" in other.log_tail(200)
