"""Heartbeats over real gRPC: a hung peer is noticed; our own stall is not blamed on it; a
state change is sent at once, not at the next keep-alive beat."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from meshd.mesh.heartbeat import beat_stream
from meshd.wire import pb, rpc

pytestmark = pytest.mark.integration

INTERVAL_S = 0.05
TIMEOUT_S = 0.4


class EchoPeer(rpc.PeerServicer):
    """Echoes beats like the daemon's peer service; `hung` stops the echo without closing."""

    def __init__(self) -> None:
        self.hung = False
        self.received: list[pb.Beat] = []

    async def Heartbeat(self, request_iterator, context):
        async for beat in request_iterator:
            self.received.append(beat)
            if not self.hung:
                yield pb.Beat(node_id="peer", seq=beat.seq, sent_at=time.time())


async def with_peer(body) -> None:
    server = grpc.aio.server()
    peer = EchoPeer()
    rpc.add_PeerServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await body(peer, rpc.PeerStub(channel))
    finally:
        await server.stop(None)


def stream(stub, deliver: Callable[[pb.Beat], None]):
    return beat_stream(stub, "me", lambda: 1, asyncio.Event(), INTERVAL_S, TIMEOUT_S, deliver)


def test_a_hung_peer_is_noticed_after_the_timeout() -> None:
    async def body(peer: EchoPeer, stub) -> None:
        loop = asyncio.get_running_loop()
        echoed_at: list[float] = []
        task = asyncio.create_task(stream(stub, lambda beat: echoed_at.append(loop.time())))
        await asyncio.sleep(0.3)
        assert echoed_at and not task.done()
        peer.hung = True
        hung_at = loop.time()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(task, 5)
        noticed_at = loop.time()
        # Silence counts from the last echo, which on a busy host may have come well before
        # the peer hung (or an echo already on its way may come just after): never sooner than
        # the timeout after it, and soon after the timeout, not at the test's 5 s.
        assert noticed_at - echoed_at[-1] >= TIMEOUT_S
        assert noticed_at - hung_at < TIMEOUT_S + 1.0

    asyncio.run(with_peer(body))


def test_this_process_stalling_longer_than_the_timeout_does_not_drop_the_peer() -> None:
    async def body(peer: EchoPeer, stub) -> None:
        beats: list[pb.Beat] = []
        task = asyncio.create_task(stream(stub, beats.append))
        await asyncio.sleep(0.3)
        time.sleep(3 * TIMEOUT_S)  # the whole loop starves, as under a long import
        await asyncio.sleep(0.3)
        assert not task.done(), task
        before = len(beats)
        await asyncio.sleep(0.3)
        assert len(beats) > before, "beats keep flowing after the stall"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(with_peer(body))


def test_a_state_change_is_beaten_at_once_and_idle_beats_keep_their_interval() -> None:
    keep_alive_s = 30.0  # far longer than the test: every beat after the first is a change

    async def body(peer: EchoPeer, stub) -> None:
        version = 1
        changed = asyncio.Event()
        beats: list[pb.Beat] = []
        task = asyncio.create_task(
            beat_stream(
                stub, "me", lambda: version, changed, keep_alive_s, 2 * keep_alive_s, beats.append
            )
        )
        try:
            await asyncio.sleep(0.5)
            assert [b.state_version for b in peer.received] == [1], "one beat, then quiet"
            for version in (2, 3):
                changed.set()  # what the version's owner does after each change
                changed_at = time.monotonic()
                while len(peer.received) < version and time.monotonic() - changed_at < 10:
                    await asyncio.sleep(0.01)
                assert peer.received[-1].state_version == version, peer.received
                assert time.monotonic() - changed_at < 2, "beaten at once, not at keep-alive"
            changed.set()  # a wake-up with no new version sends nothing
            await asyncio.sleep(0.5)
            assert [b.state_version for b in peer.received] == [1, 2, 3], "no beat without news"
            assert len(beats) == 3, "each beat was echoed"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(with_peer(body))
