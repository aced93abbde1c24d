"""The trio/asyncio seam of a real daemon: what crosses it is owned, also when it fails.

Regression tests for two bugs of an earlier layout:
* a malformed `Propose` from an authenticated member was scheduled onto trio as a bare
  callback; its `ValueError` became a `TrioInternalError` that killed the receiver;
* a cancelled `WatchStatus` (a client going away, or the 5 s keepalive) left a trio task
  parked until the mesh next changed, and SIGTERM then ended the daemon with exit code 1.

Both run a real `meshd run` process and talk to it over real gRPC (mutual TLS for the peer
port, the Unix socket for the local API).
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from meshd.mesh import security
from meshd.mesh.channels import PEER_CHANNEL_OPTIONS
from meshd.wire import pb, rpc

pytestmark = pytest.mark.integration

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
CANCELLED_WATCHES = 20


def member_channel(tmp_path: Path, token: str, address: str) -> grpc.Channel:
    """A mutual-TLS channel of a node that holds the mesh secret: an authenticated member."""
    secret = security.decode_join_token(token)
    credentials = security.load_or_create_node_credentials(tmp_path / "member", secret, "member")
    return grpc.secure_channel(
        address, security.channel_credentials(credentials), options=PEER_CHANNEL_OPTIONS
    )


def proposal(members: list[str], sender: str = "member") -> pb.ProposalMessage:
    return pb.ProposalMessage(
        sender=sender,
        incarnation=1,
        seq=1,
        proposal=pb.Proposal(
            inputs=pb.PlanInputs(
                members=members,
                digests=[f"digest-{m}" for m in members],
                model=pb.ModelRef(name="m", digest="d"),
            ),
            plan=pb.PlanRef(plan_id="p", stage_members=members),
        ),
    )


def test_malformed_proposal_is_refused_and_the_receiver_keeps_running(
    daemons, mesh_token, tmp_path
) -> None:
    daemon = daemons([*LOOPBACK, "--no-mdns", "--join", mesh_token])
    status = daemon.wait_ready()
    with member_channel(tmp_path, mesh_token, status.peer_address) as channel:
        stub = rpc.PeerStub(channel)
        unsorted = proposal(["zeta", "member"])  # members must be sorted and unique
        with pytest.raises(grpc.RpcError) as refused:
            stub.Propose(unsorted, timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert "sorted" in refused.value.details()
        # The receiver still runs: a well-formed proposal is accepted and the API answers.
        stub.Propose(proposal(["member", "zeta"]), timeout=5)
        impostor = proposal(["member"], sender="someone-else")
        with pytest.raises(grpc.RpcError) as denied:
            stub.Propose(impostor, timeout=5)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED, denied.value
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log_tail()
    assert daemon.status().node_id == status.node_id
    assert daemon.terminate() == 0, daemon.log_tail()
    log = daemon.log_path.read_text()
    refusals = [line for line in log.splitlines() if "malformed proposal" in line]
    assert len(refusals) == 1 and "WARNING" in refusals[0], log
    assert "Traceback" not in log and "TrioInternalError" not in log, log


def test_cancelled_watches_leave_nothing_behind_and_sigterm_exits_0(daemons, mesh_token) -> None:
    daemon = daemons([*LOOPBACK, "--no-mdns", "--join", mesh_token])
    daemon.wait_ready()
    with grpc.insecure_channel(daemon.api) as channel:
        stub = rpc.LocalStub(channel)
        watches = []
        for _ in range(CANCELLED_WATCHES):
            watch = stub.WatchStatus(pb.WatchStatusRequest(min_interval_s=0.05), timeout=30)
            assert next(watch).node_id
            watches.append(watch)
        # Each watch now waits in trio for the next mesh change; nothing changes here (one
        # node, no peers). Then the clients go away: a task left parked stays until shutdown.
        time.sleep(0.5)
        for watch in watches:
            watch.cancel()
        assert stub.Status(pb.StatusRequest(), timeout=5).node_id
    code = daemon.terminate()
    log = daemon.log_path.read_text()
    assert code == 0, log
    assert "TrioInternalError" not in log and "Traceback" not in log, log
    assert "still running at shutdown" not in log and "never retrieved" not in log, log
