"""Peers and strangers at the peer port: malformed bodies from members, refused outsiders,
idle connections. Real daemon processes on loopback (no mDNS), real mutual TLS."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest

from meshd.mesh import channels, security

pytestmark = pytest.mark.integration

LOOPBACK = ["--no-mdns", "--peer-host", "127.0.0.1", "--peer-port", "0"]


def member_channel(token: str, folder: Path, port: int, node_id: str = "tester") -> grpc.Channel:
    """A channel to 127.0.0.1:port with a certificate of the token's mesh. Synchronous gRPC:
    grpc.aio objects left to the garbage collector after their event loop closed can hang the
    test process when they are finalized (their poller thread is joined)."""
    secret = security.decode_join_token(token)
    creds = security.load_or_create_node_credentials(folder, secret, node_id)
    return grpc.secure_channel(
        f"127.0.0.1:{port}",
        security.channel_credentials(creds),
        options=channels.PEER_CHANNEL_OPTIONS,
    )


def peer_port(status) -> int:
    return int(status.peer_address.rpartition(":")[2])


def test_malformed_body_from_a_member_is_invalid_argument_and_one_warning(
    daemons, mesh_token, tmp_path
) -> None:
    daemon = daemons([*LOOPBACK, "--join", mesh_token])
    port = peer_port(daemon.wait_ready())

    answers: list[tuple[grpc.StatusCode, str]] = []
    with member_channel(mesh_token, tmp_path, port) as channel:
        for method in ("/meshd.v1.Peer/Propose", "/meshd.dataplane.v1.DataPlane/Stats"):
            try:
                channel.unary_unary(method)(b"\xff\xff\xff", timeout=5)
            except grpc.RpcError as error:
                answers.append((error.code(), error.details() or ""))
    assert [code for code, _ in answers] == [grpc.StatusCode.INVALID_ARGUMENT] * 2, answers
    assert "not a valid Propose message" in answers[0][1]
    log = daemon.log_tail(400)
    assert log.count("refused a malformed meshd.v1.Peer/Propose request") == 1, log
    assert log.count("refused a malformed meshd.dataplane.v1.DataPlane/Stats request") == 1, log
    assert "Traceback" not in log and "ERROR" not in log, log


class DyingPeer:
    """A peer that says Hello and beats, but whose state call fails as a killed peer's does."""

    def __new__(cls):
        from meshd.wire import pb, rpc

        class Servicer(rpc.PeerServicer):
            async def Hello(self, request, context):
                return pb.HelloReply(accepted=True, node_id="dying", instance_id="i1")

            async def Heartbeat(self, request_iterator, context):
                async for beat in request_iterator:
                    yield pb.Beat(node_id="dying", seq=beat.seq)

            async def Ping(self, request, context):
                return pb.PingReply(payload=request.payload)

            async def GetState(self, request, context):
                await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")

        return Servicer()


def plain_membership(bridge):
    """A node's membership speaking plain (insecure) gRPC to the fake peers of these tests."""
    from meshd.mesh.identity import Identity
    from meshd.mesh.membership import Membership
    from meshd.runtime.events import EventLog

    return Membership(
        Identity("me-00000001", "me"),
        "test",
        bridge,
        lambda address, _probe: grpc.aio.insecure_channel(address),
        EventLog(),
        heartbeat_interval_s=0.05,
        peer_timeout_s=1.0,
        link_probe_interval_s=30.0,
    )


def test_a_peer_lost_in_the_middle_of_a_call_is_one_line_not_a_traceback(caplog) -> None:
    """An expected failure (the peer died while this node fetched its state) ends the session
    with the 'lost' line in words; no ERROR, no traceback (those are for bugs)."""
    import logging

    import trio

    from meshd.runtime.bridge import AsyncioThread
    from meshd.wire import rpc

    async def start_peer() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        rpc.add_PeerServicer_to_server(DyingPeer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    async def main() -> None:
        async with AsyncioThread() as bridge:
            server, port = await bridge.run(start_peer)
            membership = plain_membership(bridge)
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(membership.run)
                    membership.want(f"127.0.0.1:{port}", "static")
                    with trio.fail_after(10):
                        while "dying" not in membership.peers or membership.peers["dying"].alive:
                            await trio.sleep(0.02)
                    await trio.sleep(0.3)  # the session's retry is under way too
                    nursery.cancel_scope.cancel()
            finally:
                # Stopped on its own loop also when the test fails: a grpc.aio server left to
                # the collector after its loop closed hangs the process (its poller joins).
                await bridge.run(server.stop, None)

    with caplog.at_level(logging.DEBUG):
        trio.run(main)
    ours = [r for r in caplog.records if r.name.startswith("meshd")]  # not the fake peer's
    errors = [r for r in ours if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]
    lost = [r.getMessage() for r in caplog.records if "peer dying lost" in r.getMessage()]
    assert lost and "UNAVAILABLE" in lost[0], lost


def test_a_session_cancelled_as_its_call_fails_stops_quietly(caplog) -> None:
    """The daemon stops (its sessions are cancelled) just as a call to a peer fails: the
    session's nursery ends with both the cancellation and the call's error in one group. The
    session loop says the failure like any other (one line, no traceback) and lets only the
    cancellation go on, so the stop is clean (before: the group escaped Membership.run)."""
    import logging

    import trio

    from meshd.runtime.bridge import AsyncioThread

    address = "127.0.0.1:9"  # never dialled: the session below is the race itself

    async def main() -> bool:
        async with AsyncioThread() as bridge:
            membership = plain_membership(bridge)
            in_call = trio.Event()

            async def failing_call() -> None:
                try:
                    await trio.sleep_forever()
                except trio.Cancelled:
                    raise ConnectionError("the peer's call failed as the session stopped") from None

            async def racing_session(address: str, source: str) -> None:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(failing_call)
                    in_call.set()
                    await trio.sleep_forever()

            membership._session = racing_session  # type: ignore[method-assign]
            membership._wanted[address] = "static"
            with trio.CancelScope() as stopping:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(membership._session_loop, address, "static")
                    await in_call.wait()
                    stopping.cancel()
            return stopping.cancelled_caught

    with caplog.at_level(logging.DEBUG, logger="meshd"):
        assert trio.run(main)
    ours = [r for r in caplog.records if r.name.startswith("meshd")]
    assert not [r for r in ours if r.levelno >= logging.ERROR or r.exc_info]
    said = [r.getMessage() for r in ours if address in r.getMessage()]
    assert any("ConnectionError: the peer's call failed" in line for line in said), said


def test_a_daemon_of_another_mesh_is_named_once_on_both_sides(
    daemons, mesh_name, mesh_token
) -> None:
    import time

    from meshd.api.launcher import alive_ids

    member = daemons([*LOOPBACK, "--join", mesh_token, "--peer-handshake-timeout", "1"])
    member_status = member.wait_ready()
    port = peer_port(member_status)
    outsider_token = security.encode_join_token(security.create_mesh_secret("other"))
    outsider = daemons([*LOOPBACK, "--join", outsider_token, "--peer", f"127.0.0.1:{port}"])
    outsider.wait_ready()
    time.sleep(8)  # several redials and handshake timeouts
    assert alive_ids(member.status()) == {member_status.node_id}
    dialler = outsider.log_tail(400)
    said = [line for line in dialler.splitlines() if "is not a member of mesh 'other'" in line]
    assert len(said) == 1, dialler
    assert f"127.0.0.1:{port} is not a member" in said[0]
    assert "not signed by this mesh's key" in said[0]
    assert "Handshake failed" not in dialler and "Traceback" not in dialler, dialler
    refusing = member.log_tail(400)
    heard = [line for line in refusing.splitlines() if "did not complete the TLS handshake" in line]
    assert len(heard) == 1, refusing
    assert "127.0.0.1 opened" in heard[0] and f"mesh '{mesh_name}'" in heard[0]


def test_idle_connections_are_bounded_per_address_and_in_time(daemons, mesh_token) -> None:
    import socket
    import time

    member = daemons([*LOOPBACK, "--join", mesh_token, "--peer-handshake-timeout", "2"])
    port = peer_port(member.wait_ready())
    idle = []
    try:
        for _ in range(40):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)

        def closed(sock: socket.socket) -> bool:
            sock.setblocking(False)
            try:
                return sock.recv(1) == b""
            except BlockingIOError:
                return False  # open, nothing to read
            except OSError:
                return True

        shut_at_once = sum(closed(sock) for sock in idle)
        assert shut_at_once == 40 - 32, shut_at_once  # the bound per address
        time.sleep(2.5)
        assert all(closed(sock) for sock in idle), "the handshake timeout closes the rest"
    finally:
        for sock in idle:
            sock.close()
    time.sleep(2)
    log = member.log_tail(200)
    assert "refused 8 connection(s) from 127.0.0.1" in log, log
    # The member still serves: a member's call goes through.
    assert member.status().node_id


def test_a_start_with_token_ids_outside_the_vocabulary_is_refused_by_the_stage(
    daemons, mesh_token, architecture_dir, tmp_path
) -> None:
    """A member's Start whose prompt holds an id past the model's vocabulary (320 here) is
    refused in words; it never reaches MLX's unchecked embedding lookup (which corrupted the
    daemon's heap when the fuzzer found it)."""
    from meshd.wire import dataplane_pb2 as dp

    model = architecture_dir("mistral")
    daemon = daemons([*LOOPBACK, "--join", mesh_token, "--model", str(model)])
    # Frames go straight to the stage, with no origin to wait for the load: wait until the
    # committed plan is installed here, or the stage rightly answers "not installed yet".
    status = daemon.wait_for(
        lambda s: (
            bool(s.agreement.active_plan_id)
            and s.agreement.active_plan_id[:12] in s.transitions.last_install
        ),
        60,
        "a plan installed",
    )
    sampling = dp.Sampling(top_p=1.0, repetition_penalty=1.0, seed=1, max_tokens=4)

    def start(request_id: str, prompt: list[int]) -> dp.Frame:
        body = dp.Start(
            origin_node_id="tester",
            prompt_tokens=prompt,
            prompt_length=len(prompt),
            sampling=sampling,
            prefill_chunk=8,
        )
        return dp.Frame(plan_id=status.agreement.active_plan_id, request_id=request_id, start=body)

    done = threading.Event()

    def frames():
        yield dp.Frame(hello=dp.Hello(node_id="tester")).SerializeToString()
        yield start("bad", [1, 2, 5000]).SerializeToString()
        yield start("good", [1, 2, 3]).SerializeToString()
        done.wait(30)  # keep the link open while the stage answers

    replies: list[dp.Frame] = []
    with member_channel(mesh_token, tmp_path, peer_port(status)) as channel:
        call = channel.stream_stream("/meshd.dataplane.v1.DataPlane/Link")(frames(), timeout=60)
        try:
            for raw in call:
                frame = dp.Frame.FromString(raw)
                # Frames a stage sends together arrive as one Bundle (continuous batching).
                replies += frame.bundle.frames if frame.HasField("bundle") else [frame]
                if any(r.token.finish for r in replies if r.request_id == "good"):
                    break
        finally:
            done.set()
            call.cancel()
    (failure,) = [r.failure for r in replies if r.request_id == "bad"]
    assert "token id 5000" in failure.message and "0 <= id < 320" in failure.message
    assert len([r for r in replies if r.request_id == "good" and r.HasField("token")]) == 4
    assert daemon.proc.poll() is None
    assert "Traceback" not in daemon.log_tail(400)
