"""Lanes: a link's frames over a mutual-TLS TCP connection beside its gRPC stream.

Real parts throughout: two data-plane transports, each behind its own grpc.aio server with
the mesh's mutual TLS, on 127.0.0.1; the lanes are real TLS connections between them. A
recording handler stands in for the data plane above the transport (what it does with
frames is tested in test_dataplane, which runs over lanes too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from meshd.inference.transport.links import DataPlaneServicer, Transport, lanes, start_server
from meshd.mesh import security
from meshd.mesh.channels import peer_channel_factory
from meshd.runtime import tls_buffers
from meshd.wire import dataplane_pb2 as dp
from tests.support.dataplane_mesh import LoopThread

pytestmark = pytest.mark.integration

WAIT_S = 10.0


@dataclass
class Recorder:
    """The handler above a transport: every frame and every lost peer, in order."""

    frames: list[tuple[str, dp.Frame]] = field(default_factory=list)
    lost: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the event log would say
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def on_frame(self, sender: str, frame: dp.Frame) -> None:
        self.frames.append((sender, frame))
        self.changed.set()

    def on_peer_lost(self, peer: str, reason: str, since: float | None = None) -> None:
        self.lost.append((peer, reason))
        self.changed.set()

    async def wait_for(self, condition: object) -> None:
        async with asyncio.timeout(WAIT_S):
            while not condition():  # type: ignore[operator]
                self.changed.clear()
                await self.changed.wait()


@dataclass
class Node:
    node_id: str
    transport: Transport
    recorder: Recorder
    server: grpc.aio.Server
    address: str
    secret: security.MeshSecret


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


async def start_node(
    state: Path, secret: security.MeshSecret, node_id: str, *, lanes_on: bool = True
) -> Node:
    credentials = security.load_or_create_node_credentials(state / node_id, secret, node_id)
    recorder = Recorder()
    transport = Transport(
        node_id, peer_channel_factory(credentials), recorder, report=recorder.notes.append
    )
    servicer = DataPlaneServicer(transport.serve_link, dp.StatsReply)
    server, port = await start_server(servicer, credentials)
    if lanes_on:
        await transport.open_lanes("127.0.0.1", credentials)
    return Node(node_id, transport, recorder, server, f"127.0.0.1:{port}", secret)


@contextlib.asynccontextmanager
async def running(
    state: Path, *node_ids: str, without_lanes: tuple[str, ...] = ()
) -> AsyncIterator[list[Node]]:
    """Nodes of one new mesh, each with its transport and server; all stopped after."""
    secret = security.create_mesh_secret("lanes")
    nodes: list[Node] = []
    try:
        for node_id in node_ids:
            lanes_on = node_id not in without_lanes
            nodes.append(await start_node(state, secret, node_id, lanes_on=lanes_on))
        yield nodes
    finally:
        for node in nodes:
            await node.transport.close()
            await node.server.stop(0)


def contexts(
    state: Path, secret: security.MeshSecret, node_id: str
) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The (server, client) TLS contexts of ``node_id`` of the mesh of ``secret``."""
    credentials = security.load_or_create_node_credentials(state / node_id, secret, node_id)
    return security.ssl_contexts(credentials)


def frame(index: int, size: int = 16) -> dp.Frame:
    activation = dp.Activation(step=index, dtype="uint8", data=bytes([index % 251]) * size)
    activation.shape.append(size)
    return dp.Frame(plan_id="p", request_id=f"r{index}", activation=activation)


def steps(recorder: Recorder) -> list[int]:
    return [received.activation.step for _, received in recorder.frames]


def test_frames_go_over_the_lane_in_order_and_intact_and_answers_come_back_on_it(
    loop: LoopThread, tmp_path: Path
) -> None:
    """Frames sent before the link opened and after, small and large (a 3 MiB prefill
    chunk), arrive in send order; a node with no address for the sender answers on the lane
    the sender opened."""

    async def run() -> None:
        async with running(tmp_path, "a", "b") as (a, b):
            sizes = [16] * 50 + [3 << 20] + [2304] * 100
            for index, size in enumerate(sizes):
                assert a.transport.send("b", b.address, frame(index, size))
            await b.recorder.wait_for(lambda: len(b.recorder.frames) == len(sizes))
            assert steps(b.recorder) == list(range(len(sizes)))
            for index, ((sender, received), size) in enumerate(
                zip(b.recorder.frames, sizes, strict=True)
            ):
                assert sender == "a"
                assert received.activation.data == bytes([index % 251]) * size
            link = a.transport._outbound["b"]
            assert link.lane is not None and not link.lane.closed
            assert b.transport._lanes is not None and set(b.transport._lanes.lanes) == {"a"}
            # ...over TLS connections that keep their record buffers (runtime/tls_buffers.py)
            for context in (a.transport._lane_context, b.transport._lanes._context):
                assert context is not None
                assert tls_buffers.releases_record_buffers(context) is False

            assert "a" in b.transport._answer_on_lane  # a's frames came on its lane
            assert b.transport.reply("a", frame(7))  # b has no address for a
            await a.recorder.wait_for(lambda: a.recorder.frames)
            assert a.recorder.frames[0][0] == "b" and steps(a.recorder) == [7]
            assert not a.recorder.lost and not b.recorder.lost

    loop.run(run(), timeout=60)


def test_frames_sent_from_another_thread_arrive_intact_in_order_beside_the_loops(
    loop: LoopThread, tmp_path: Path
) -> None:
    """The compute thread sends a finished step's frames on the lane itself
    (``Lane.send_from_thread``) while the loop sends and reads on it: a thread's frames
    arrive in its order and intact, also those that found the socket full (16 MiB sent while
    the loop, the only reader, is blocked: they wait in the backlog for the loop to write);
    once the lane is closed a thread's send says False."""

    async def run() -> None:
        async with running(tmp_path, "a", "b") as (a, b):
            assert a.transport.send("b", b.address, frame(0))
            await b.recorder.wait_for(lambda: len(b.recorder.frames) == 1)
            lane = a.transport.lane_to("b", b.address)
            assert lane is not None and a.transport.lane_to("b", "127.0.0.1:1") is None
            flush_waiting = lane._flush_waiting
            handed_to_loop: list[int] = []  # the loop wrote what a thread's send left waiting

            def counted_flush() -> None:
                handed_to_loop.append(1)
                flush_waiting()

            lane._flush_waiting = counted_flush  # type: ignore[method-assign]
            sizes = [2304] * 200 + [1 << 20] * 16 + [16] * 50
            results: list[bool] = []

            def compute_thread(first: int, last: int) -> None:
                for step in range(first, last):
                    results.append(lane.send_from_thread(frame(step, sizes[step - 1])))

            # 1. while the loop sends its own frames on the same lane
            sending = asyncio.get_running_loop().run_in_executor(None, compute_thread, 1, 201)
            for index in range(100):
                assert a.transport.send("b", b.address, frame(10_000 + index))
                await asyncio.sleep(0)
            await sending
            # 2. while the loop is blocked: nobody reads, the socket fills up
            blocked = threading.Thread(target=compute_thread, args=(201, len(sizes) + 1))
            blocked.start()
            blocked.join()
            assert all(results) and len(results) == len(sizes)
            total = 1 + len(sizes) + 100
            await b.recorder.wait_for(lambda: len(b.recorder.frames) == total)
            assert handed_to_loop
            received = steps(b.recorder)
            ours = [step for step in received if 0 < step < 10_000]
            assert ours == list(range(1, len(sizes) + 1))
            assert [step for step in received if step >= 10_000] == list(range(10_000, 10_100))
            for _, got in b.recorder.frames:
                step = got.activation.step
                if 0 < step < 10_000:
                    assert got.activation.data == bytes([step % 251]) * sizes[step - 1]
            assert not a.recorder.lost and not b.recorder.lost
            lane.close()
            closed = await asyncio.to_thread(lane.send_from_thread, frame(1))
            assert closed is False

    loop.run(run(), timeout=60)


def test_a_peer_that_offers_no_lane_gets_the_frames_over_the_grpc_stream(
    loop: LoopThread, tmp_path: Path
) -> None:
    async def run() -> None:
        async with running(tmp_path, "a", "b", without_lanes=("b",)) as (a, b):
            for index in range(20):
                assert a.transport.send("b", b.address, frame(index))
            await b.recorder.wait_for(lambda: len(b.recorder.frames) == 20)
            assert steps(b.recorder) == list(range(20))
            assert a.transport._outbound["b"].lane is None
            assert b.transport.reply("a", frame(3))  # answered on the stream
            await a.recorder.wait_for(lambda: a.recorder.frames)
            assert steps(a.recorder) == [3]

    loop.run(run(), timeout=60)


def test_a_peer_port_that_never_finishes_its_handshake_breaks_the_link_in_time(
    loop: LoopThread, tmp_path: Path
) -> None:
    """A peer port that accepts the connection and never answers the TLS handshake (as one
    whose gate shut the connection and keeps shutting the reconnects): the frames queued on
    the link must not wait there forever; the link breaks within its open deadline and the
    handler hears that the peer is lost, so the requests on it end or move."""

    async def run() -> None:
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            address = f"127.0.0.1:{silent.getsockname()[1]}"
            async with running(tmp_path, "a") as (a,):
                a.transport.link_timeout_s = 1.0
                assert a.transport.send("x", address, frame(0))
                await a.recorder.wait_for(lambda: a.recorder.lost)
                ((peer, reason),) = a.recorder.lost
                assert peer == "x" and "no answer in time" in reason, reason

    loop.run(run(), timeout=30)


def test_a_lane_that_cannot_open_leaves_the_frames_on_the_stream(
    loop: LoopThread, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lane port nobody listens on (as behind a firewall): the link says so once and
    carries on over its gRPC stream."""

    async def run() -> None:
        async with running(tmp_path, "a", "b") as (a, b):
            assert b.transport._lanes is not None
            await b.transport._lanes.close()  # the port is still offered, nobody accepts
            for index in range(10):
                assert a.transport.send("b", b.address, frame(index))
            await b.recorder.wait_for(lambda: len(b.recorder.frames) == 10)
            assert steps(b.recorder) == list(range(10))
            assert a.transport._outbound["b"].lane is None
            await a.transport._outbound["b"].close()  # a new link soon after: no new wait
            assert a.transport.send("b", b.address, frame(10))
            await b.recorder.wait_for(lambda: len(b.recorder.frames) == 11)
            port = b.transport._lanes.port
            assert len(a.recorder.notes) == 1, a.recorder.notes
            assert "no lane to b" in a.recorder.notes[0]
            assert f"let TCP port {port} through" in a.recorder.notes[0]

    with caplog.at_level(logging.WARNING, logger="meshd.dataplane"):
        loop.run(run(), timeout=60)
    assert caplog.text.count("no lane to b") == 1, "one wait, then the stream for a while"
    assert "go over the gRPC stream" in caplog.text


async def reset_with_frames_in_doubt(a: Node, b: Node, count: int, size: int) -> None:
    """a's lane to b carried a frame; b stops reading, a sends ``count`` frames of ``size``
    bytes more (steps 1..count: more than the kernel's buffers hold, so some still wait in
    a's lane), and a's connection is reset (``ss -K``: aborted here, a RST to b)."""
    assert a.transport.send("b", b.address, frame(0))
    await b.recorder.wait_for(lambda: b.recorder.frames)
    assert b.transport._lanes is not None
    inbound = b.transport._lanes.lanes["a"]
    asyncio.get_running_loop().remove_reader(inbound._fd)  # b reads nothing more from it
    for index in range(1, count + 1):
        assert a.transport.send("b", b.address, frame(index, size))
    outbound = a.transport._outbound["b"].lane
    assert outbound is not None and outbound._backlog, "every frame left: nothing in doubt"
    own_port = outbound._sock.getsockname()[1]
    lane_port = b.transport._lanes.port
    killer = await asyncio.create_subprocess_exec(
        *("ss", "-K", "-tn", "src", "127.0.0.1", "sport", "=", f":{own_port}"),
        *("dst", "127.0.0.1", "dport", "=", f":{lane_port}"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await killer.communicate()
    assert killer.returncode == 0 and b"ESTAB" in out, (out, err)


def test_a_reset_lane_is_resumed_and_every_frame_arrives_once_in_order(
    loop: LoopThread, tmp_path: Path
) -> None:
    """A lane's connection reset under its open link (every node still a member) costs no
    frame and no lost peer: the sender re-opens it at once, the Hellos say what each end
    acted on, and exactly the frames in doubt go again, before the ones sent meanwhile."""

    async def run() -> None:
        async with running(tmp_path, "a", "b") as (a, b):
            count, size = 120, 128 << 10  # 15 MiB: within what a lane keeps to send again
            await reset_with_frames_in_doubt(a, b, count, size)
            assert a.transport.send("b", b.address, frame(count + 1))  # while it resumes
            await b.recorder.wait_for(lambda: len(b.recorder.frames) >= count + 2)
            assert steps(b.recorder) == list(range(count + 2))  # none lost, none twice
            for _, received in b.recorder.frames[1 : count + 1]:
                assert received.activation.data == bytes([received.activation.step]) * size
            link = a.transport._outbound["b"]
            assert link.lanes_resumed == 1 and link.frames_resent > 0
            assert b.transport._lanes is not None and b.transport._lanes.resumed == 1
            assert b.transport.reply("a", frame(7))  # answers come back on the new lane
            await a.recorder.wait_for(lambda: a.recorder.frames)
            assert steps(a.recorder) == [7]
            await asyncio.sleep(lanes.RESUME_GRACE_S + 0.2)  # no loss reported late either
            assert not a.recorder.lost and not b.recorder.lost
            assert any("re-opened at once" in note for note in a.recorder.notes)

    loop.run(run(), timeout=60)


def test_a_lane_that_cannot_be_resumed_breaks_the_link_on_both_sides(
    loop: LoopThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frames in doubt that the sender no longer keeps cannot go again: the link breaks on
    both sides as a lost peer (the origins replay their requests), and the next send opens
    a new link and lane."""
    monkeypatch.setattr(lanes, "RESEND_FRAMES", 4)

    async def run() -> None:
        async with running(tmp_path, "a", "b") as (a, b):
            await reset_with_frames_in_doubt(a, b, 120, 128 << 10)
            await a.recorder.wait_for(lambda: a.recorder.lost)
            await b.recorder.wait_for(lambda: b.recorder.lost)
            assert (
                a.recorder.lost[0][0] == "b" and "could not be re-opened" in a.recorder.lost[0][1]
            )
            assert "no longer kept" in a.recorder.lost[0][1]
            assert b.recorder.lost[0][0] == "a"
            assert "b" not in a.transport._outbound

            received = len(b.recorder.frames)
            assert a.transport.send("b", b.address, frame(500))  # a new link, a new lane
            await b.recorder.wait_for(lambda: len(b.recorder.frames) == received + 1)
            assert steps(b.recorder)[-1] == 500
            assert a.transport._outbound["b"].lane is not None

    loop.run(run(), timeout=60)


def test_a_peer_the_mesh_lost_gets_a_fresh_link_when_next_needed(
    loop: LoopThread, tmp_path: Path
) -> None:
    """When membership loses a peer, its link is closed at once and quietly: a stream the
    network cut would otherwise be reused by the plan committed on the peer's return and
    break seconds later under its first request. The next frame dials a new link."""

    async def run() -> None:
        async with running(tmp_path, "a", "b") as (a, b):
            assert a.transport.send("b", b.address, frame(0))
            await b.recorder.wait_for(lambda: b.recorder.frames)
            old = a.transport._outbound["b"]
            a.transport.drop_peer("b")
            assert "b" not in a.transport._outbound and old.broken
            await b.recorder.wait_for(lambda: b.recorder.lost)  # b sees a's stream end
            assert a.transport.send("b", b.address, frame(1))
            await b.recorder.wait_for(lambda: len(b.recorder.frames) == 2)
            assert steps(b.recorder) == [0, 1]
            new = a.transport._outbound["b"]
            assert new is not old and new.lane is not None and not new.broken
            assert not a.recorder.lost  # the drop itself reports nothing: membership did

    loop.run(run(), timeout=60)


def test_a_lane_its_dialler_dropped_unused_is_not_taken_for_a_lost_peer(
    loop: LoopThread, tmp_path: Path
) -> None:
    """A dialler that gave up waiting for a lane (and kept its gRPC stream) closes it
    before any frame went over it: the listener forgets it without ending anything."""

    async def run() -> None:
        async with running(tmp_path, "b") as (b,):
            _, client = contexts(tmp_path, b.secret, "a")
            assert b.transport._lanes is not None
            lane = await lanes.dial(
                b.address, b.transport._lanes.port, client, "b", _ignore, _ignore, 5.0
            )
            async with asyncio.timeout(WAIT_S):
                while "a" not in b.transport._lanes.lanes:
                    await asyncio.sleep(0.01)
            lane.close()
            async with asyncio.timeout(WAIT_S):
                while "a" in b.transport._lanes.lanes:
                    await asyncio.sleep(0.01)
            assert not b.recorder.lost

    loop.run(run(), timeout=60)


def test_a_lane_takes_only_members_and_only_the_node_its_dialler_expects(
    loop: LoopThread, tmp_path: Path
) -> None:
    """A certificate of another mesh fails the handshake and delivers nothing; a member's
    certificate that names another node than the plan says is refused by the dialler."""

    async def run() -> None:
        async with running(tmp_path, "b") as (b,):
            assert b.transport._lanes is not None
            port = b.transport._lanes.port
            _, outsider = contexts(tmp_path / "other", security.create_mesh_secret("other"), "a")
            with pytest.raises(lanes.LaneClosed):
                await lanes.dial(b.address, port, outsider, "b", _ignore, _ignore, 5.0)
            _, client = contexts(tmp_path, b.secret, "a")
            with pytest.raises(lanes.LaneClosed, match="names node b, not c"):
                await lanes.dial(b.address, port, client, "c", _ignore, _ignore, 5.0)
            await asyncio.sleep(0.2)
            assert not b.recorder.frames

    loop.run(run(), timeout=60)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (lanes.HEADER.pack(5) + b"\xff\xff\xff\xff\xff", "unreadable frame"),
        (lanes.HEADER.pack(1 << 31), "over the"),
    ],
)
def test_a_bad_frame_closes_the_lane_with_the_reason(
    loop: LoopThread, tmp_path: Path, payload: bytes, reason: str
) -> None:
    """Bytes that are not a frame, or a length over the message limit (which must not make
    the receiver wait for, or allocate, 2 GiB): the receiver drops the lane and says why."""

    async def run() -> None:
        async with running(tmp_path, "b") as (b,):
            _, client = contexts(tmp_path, b.secret, "a")
            assert b.transport._lanes is not None
            lost: list[str] = []
            lane = await lanes.dial(
                b.address, b.transport._lanes.port, client, "b", _ignore, _record(lost), 5.0
            )
            lane._sock.send(payload)
            await b.recorder.wait_for(lambda: b.recorder.lost)
            assert b.recorder.lost[0][0] == "a" and reason in b.recorder.lost[0][1]
            assert not b.recorder.frames
            async with asyncio.timeout(WAIT_S):
                while not lost:
                    await asyncio.sleep(0.01)

    loop.run(run(), timeout=60)


def test_lane_tls_insists_on_tls_1_3_and_a_certificate_both_ways(tmp_path: Path) -> None:
    for context in contexts(tmp_path, security.create_mesh_secret("lanes"), "a"):
        assert context.minimum_version is ssl.TLSVersion.TLSv1_3
        assert context.verify_mode is ssl.CERT_REQUIRED
    assert lanes.split_address("[::1]:7000") == "::1"
    assert lanes.split_address("10.0.0.2:7000") == "10.0.0.2"


def _ignore(*_: object) -> None:
    return None


def _record(into: list[str]):  # type: ignore[no-untyped-def]
    def record(_lane: object, reason: str) -> None:
        into.append(reason)

    return record


def test_the_listener_bounds_handshakes_in_time_and_per_source_address(
    loop: LoopThread, tmp_path: Path
) -> None:
    """Connections that never start TLS (a port scan, a stuck or hostile client): past
    MAX_PENDING_PER_SOURCE from one address a new one is closed at once, and each is closed
    when its handshake time is up; then a member's lane opens as usual."""
    secret = security.create_mesh_secret("lanes")

    async def run() -> None:
        server_context, _ = contexts(tmp_path, secret, "b")
        listener = lanes.LaneListener(
            server_context, _ignore, _ignore, _ignore, handshake_timeout_s=0.5
        )
        port = await listener.start("127.0.0.1")
        loop_ = asyncio.get_running_loop()
        idle: list[socket.socket] = []
        try:
            for _ in range(lanes.MAX_PENDING_PER_SOURCE + 1):
                sock = socket.socket()
                sock.setblocking(False)
                await loop_.sock_connect(sock, ("127.0.0.1", port))
                idle.append(sock)
            async with asyncio.timeout(0.4):  # the one over the bound: closed at once
                assert await loop_.sock_recv(idle[-1], 1) == b""
            async with asyncio.timeout(WAIT_S):  # the others: when their time is up
                for sock in idle[:-1]:
                    assert await loop_.sock_recv(sock, 1) == b""
            _, client = contexts(tmp_path, secret, "a")
            lane = await lanes.dial(f"127.0.0.1:{port}", port, client, "b", _ignore, _ignore, 5)
            assert not lane.closed
            lane.close()
        finally:
            for sock in idle:
                sock.close()
            await listener.close()

    loop.run(run(), timeout=60)


OUT_OF_DESCRIPTORS = """
import asyncio, logging, os, resource, subprocess, sys
from pathlib import Path
from meshd.inference.transport import lanes
from meshd.mesh import security

warnings = []
class Count(logging.Handler):
    def emit(self, record):
        warnings.append(record)
logging.getLogger("meshd.dataplane").addHandler(Count())
own = security.load_or_create_node_credentials(
    Path(sys.argv[1]), security.create_mesh_secret("lanes"), "b"
)

async def main():
    server_context, _ = security.ssl_contexts(own)
    listener = lanes.LaneListener(server_context, print, print, print)
    port = await listener.start("127.0.0.1")
    knocking = subprocess.Popen([sys.executable, "-c", (
        "import socket, time\\n"
        f"s = [socket.create_connection(('127.0.0.1', {port})) for _ in range(6)]\\n"
        "time.sleep(3)"
    )])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 2, hard))
    turns = 0
    async def count_turns():
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1
    counter = asyncio.create_task(count_turns())
    await asyncio.sleep(1.0)
    counter.cancel()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    knocking.kill()
    knocking.wait()
    await listener.close()
    print(len(warnings), turns)

asyncio.run(main())
"""


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="counts descriptors in /proc")
def test_a_listener_out_of_descriptors_rests_instead_of_spinning(tmp_path: Path) -> None:
    """accept() failing with EMFILE leaves the listening socket readable: the listener rests
    ACCEPT_PAUSE_S (as asyncio's own servers do) instead of failing again on every turn of
    the loop (a reviewer's run of the old code: 80,000 warnings in a second)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", OUT_OF_DESCRIPTORS, str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    warnings, turns = map(int, result.stdout.split()[-2:])
    assert 1 <= warnings <= 2, (warnings, result.stderr[-1000:])
    assert turns > 1000  # the loop went on meanwhile


def test_a_listener_takes_the_peer_hosts_forms_of_ipv6(loop: LoopThread, tmp_path: Path) -> None:
    """The peer host as gRPC writes it ("[::1]") or bare ("::1"), and a member dials it."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    secret = security.create_mesh_secret("lanes")

    async def run() -> None:
        server_context, _ = contexts(tmp_path, secret, "b")
        _, client = contexts(tmp_path, secret, "a")
        for host in ("[::1]", "::1"):
            listener = lanes.LaneListener(server_context, _ignore, _ignore, _ignore)
            try:
                port = await listener.start(host)
            except OSError as error:
                pytest.skip(f"no IPv6 loopback here: {error}")
            try:
                lane = await lanes.dial(f"[::1]:{port}", port, client, "b", _ignore, _ignore, 5)
                lane.close()
            finally:
                await listener.close()

    loop.run(run(), timeout=30)
