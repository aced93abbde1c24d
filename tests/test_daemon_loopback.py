"""Real daemons on loopback: discovery, secure peering, profiles, links, a converged view.

mDNS is bound to 127.0.0.1 only (never the machine's real interfaces); the
multi-host behaviour is tested in network namespaces in test_mesh_netns.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from meshd.api.launcher import alive_ids, fully_meshed
from meshd.mesh import security
from meshd.mesh.graph import graph_digest, graph_from_status
from meshd.wire import pb, rpc

pytestmark = pytest.mark.integration

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]


def peer_port(status: pb.MeshStatus) -> int:
    return int(status.peer_address.rpartition(":")[2])


def test_three_daemons_find_each_other_and_agree_on_the_view(daemons, mesh_token) -> None:
    nodes = [daemons([*LOOPBACK, "--join", mesh_token, "--name", f"n{i}"]) for i in range(3)]
    statuses = [d.wait_for(lambda s: fully_meshed(s, 3), 30, "a full 3-node mesh") for d in nodes]
    ids = {s.node_id for s in statuses}
    assert len(ids) == 3 and all(alive_ids(s) == ids for s in statuses)
    for status in statuses:
        for node in status.nodes:
            assert node.profile.flops > 1e8 and node.profile.memory_budget > 0
        for link in status.links:
            assert link.bandwidth > 1e6, link
            assert 0 < link.tcp_rtt_s < link.grpc_rtt_s < 0.5, link

    def digests() -> set[str]:
        return {graph_digest(graph_from_status(d.status())) for d in nodes}

    deadline = time.monotonic() + 10
    while len(digests()) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(digests()) == 1, "the nodes' mesh views did not converge"
    graph = graph_from_status(nodes[0].status())
    assert graph.number_of_nodes() == 3 and graph.number_of_edges() == 6


def published_version(daemon, token: str, folder) -> int:
    """The daemon's own NodeState version, read over its peer port as a member would."""
    creds = security.load_or_create_node_credentials(
        folder, security.decode_join_token(token), "observer"
    )
    address = daemon.status().peer_address.replace("0.0.0.0", "127.0.0.1")
    credentials = security.channel_credentials(creds)
    with grpc.secure_channel(address, credentials, options=security.CHANNEL_OPTIONS) as channel:
        return rpc.PeerStub(channel).GetState(pb.StateRequest(), timeout=5).version


def test_a_change_spreads_at_once_and_an_idle_mesh_stays_quiet(
    daemons, mesh_token, tmp_path
) -> None:
    # Keep-alive beats every 30 s: a node can learn of a peer's new state within the test only
    # because a change is beaten at once, and the peer fetches it on that news.
    slow = [*LOOPBACK, "--join", mesh_token, "--heartbeat-interval", "30", "--peer-timeout", "90"]
    a, b = daemons(slow), daemons(slow)
    for node in (a, b):
        node.wait_for(lambda s: fully_meshed(s, 2), 20, "a full 2-node mesh")
    c = daemons(slow)
    # a and b see each other's links to c only by fetching each other's changed state.
    for node in (a, b, c):
        node.wait_for(lambda s: fully_meshed(s, 3), 15, "a full 3-node mesh, well before 30 s")
    # Nothing changes now, so no node's version moves (fetching a peer's state is not a change
    # of one's own: when it was, an idle mesh re-fetched states back and forth without end).
    versions = [published_version(node, mesh_token, tmp_path / "observer") for node in (a, b, c)]
    time.sleep(2)
    later = [published_version(node, mesh_token, tmp_path / "observer") for node in (a, b, c)]
    assert all(0 <= y - x <= 1 for x, y in zip(versions, later, strict=True)), (versions, later)


def test_static_peers_without_mdns(daemons, mesh_token) -> None:
    first = daemons([*LOOPBACK, "--no-mdns", "--join", mesh_token])
    port = peer_port(first.wait_ready())
    second = daemons([*LOOPBACK, "--no-mdns", "--join", mesh_token, "--peer", f"127.0.0.1:{port}"])
    status = first.wait_for(lambda s: fully_meshed(s, 2, with_links=False), 20, "the static peer")
    via = {n.profile.node_id: n.source for n in second.status().nodes}
    assert via[status.node_id] == "static"


def test_wrong_secret_is_refused_and_never_seen(daemons, mesh_name, mesh_token) -> None:
    member = daemons([*LOOPBACK, "--join", mesh_token])
    member_status = member.wait_ready()
    outsider_token = security.encode_join_token(security.create_mesh_secret(mesh_name))
    outsider = daemons(
        [*LOOPBACK, "--join", outsider_token, "--peer", f"127.0.0.1:{peer_port(member_status)}"]
    )
    outsider.wait_ready()
    time.sleep(3)
    assert alive_ids(member.status()) == {member_status.node_id}
    assert len(alive_ids(outsider.status())) == 1
    log = outsider.log_tail(200)
    assert "fingerprint" in log or "CERTIFICATE_VERIFY_FAILED" in log or "refused" in log, log


def test_plain_grpc_client_gets_no_answer(daemons, mesh_token) -> None:
    member = daemons([*LOOPBACK, "--join", mesh_token])
    port = peer_port(member.wait_ready())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as err:
        rpc.PeerStub(channel).GetState(pb.StateRequest(), timeout=2)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_copied_state_directory_is_refused(daemons, mesh_token, tmp_path) -> None:
    original = daemons([*LOOPBACK, "--join", mesh_token])
    other = daemons([*LOOPBACK, "--join", mesh_token])
    original.wait_for(lambda s: len(alive_ids(s)) == 2, 20, "two nodes")
    copy_dir = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(original.state_dir), str(copy_dir)], check=True)
    (copy_dir / "api.sock").unlink(missing_ok=True)
    copy = daemons([*LOOPBACK, "--join", mesh_token], state_dir=copy_dir)
    assert copy.proc is not None
    code = copy.proc.wait(30)
    assert code == 3
    assert "delete the 'node_id' file" in copy.log_tail()
    time.sleep(1)
    for d in (original, other):
        status = d.status()
        assert len(alive_ids(status)) == 2
        instances = {n.instance_id for n in status.nodes if n.alive}
        assert len(instances) == 2  # the copy was never merged in


def test_killed_peer_leaves_the_view_fast(daemons, mesh_token) -> None:
    a = daemons([*LOOPBACK, "--join", mesh_token])
    b = daemons([*LOOPBACK, "--join", mesh_token])
    a.wait_for(lambda s: len(alive_ids(s)) == 2, 20, "two nodes")
    os.killpg(b.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    a.wait_for(lambda s: len(alive_ids(s)) == 1, 5, "the killed peer to be lost")
    assert time.monotonic() - killed_at < 2.0


def test_cli_status_json_and_token(daemons, mesh_name, mesh_token) -> None:
    a = daemons([*LOOPBACK, "--join", mesh_token])
    a.wait_ready()
    cli = [sys.executable, "-m", "meshd.api.cli"]
    out = subprocess.run(
        [*cli, "status", "--json", "--state-dir", str(a.state_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    data = json.loads(out)
    assert data["mesh_name"] == mesh_name and data["nodes"][0]["source"] == "self"
    text = subprocess.run(
        [*cli, "peers", "--state-dir", str(a.state_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert "NODE" in text and "BUDGET" in text
    token = subprocess.run(
        [*cli, "token", "--state-dir", str(a.state_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    assert security.decode_join_token(token) == security.decode_join_token(mesh_token)


def test_cli_without_daemon_says_so(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "meshd.api.cli", "status", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "no meshd daemon answers" in result.stderr


def test_cli_plan_from_the_live_view(daemons, mesh_token, tmp_path) -> None:
    from tests.support.random_model import make_random_model_dir

    model = make_random_model_dir(
        tmp_path / "m", "llama", layers=6, hidden=256, heads=4, kv_heads=2, intermediate=688
    )
    a = daemons([*LOOPBACK, "--join", mesh_token, "--memory-budget", "90MB"])
    daemons([*LOOPBACK, "--join", mesh_token, "--memory-budget", "90MB"])
    a.wait_for(lambda s: fully_meshed(s, 2), 30, "two nodes and their links")
    cli = [sys.executable, "-m", "meshd.api.cli", "plan", "--state-dir", str(a.state_dir)]
    result = subprocess.run(
        [*cli, "--model", str(model), "--context", "128", "--strategy", "memory", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)  # one strategy: the plan itself
    layers = [range(s["layer_start"], s["layer_end"]) for s in plan["stages"]]
    assert [i for r in layers for i in r] == list(range(6))
    assert {n for s in plan["stages"] for n in s["nodes"]} <= alive_ids(a.status())
    table = subprocess.run(
        [*cli, "--model", str(model), "--context", "128"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert table.returncode == 0 and "ms/token" in table.stdout, table.stderr
