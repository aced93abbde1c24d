"""The heartbeat stream to one peer, asyncio side: beats out, beats in, a watchdog.

Membership (:mod:`meshd.mesh.membership`) runs it on the asyncio thread for each session and
decides on the trio side what its end means (the peer lost, and why).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from meshd.wire import pb, rpc

STALL_SLACK_S = 0.02  # a heartbeat watchdog waking later than this was starved, not the peer
# How often the sender looks at this node's state version between beats: a change goes out
# within this delay, not a whole interval later. A timer wake-up costs ~1% of what a beat
# does (a gRPC message each way, through the C core's poller), so polling is cheap.
VERSION_POLL_S = 0.05


async def beat_stream(
    stub: rpc.PeerStub,
    node_id: str,
    version: Callable[[], int],
    interval: float,
    timeout: float,
    deliver: Callable[[pb.Beat], None],
) -> None:
    """asyncio side: beat every `interval` and on a state change, raise TimeoutError on silence.

    A beat goes out `interval` after the last one, or as soon as `version()` changes (within
    VERSION_POLL_S): the peer learns of a new state at once, so the keep-alive rate, the
    daemon's main idle cost, need not be high for changes to spread fast. The peer echoes
    each beat with its own version; an echo is what proves the peer alive.

    The gap counts only time this process was running: a process starved of CPU (or of the
    GIL, e.g. while importing mlx-lm or loading weights) reads its peers' beats late, and
    blaming the peer for that would drop a healthy member and re-plan the mesh. The watchdog
    wakes every `interval / 2`; any lateness of its own wake-up is a stall of this process and
    extends the peer's allowance until the next beat arrives.
    """
    import asyncio

    loop = asyncio.get_running_loop()
    call = stub.Heartbeat()
    received = 0
    last_beat_at = loop.time()

    async def send() -> None:
        seq, sent_version, due = 0, None, loop.time()
        while True:
            current = version()
            if current != sent_version or loop.time() >= due:
                seq += 1
                beat = pb.Beat(node_id=node_id, seq=seq, state_version=current, sent_at=time.time())
                await call.write(beat)
                sent_version, due = current, loop.time() + interval
            await asyncio.sleep(max(0.0, min(VERSION_POLL_S, due - loop.time())))

    async def receive() -> None:
        nonlocal received, last_beat_at
        while True:
            beat = await call.read()
            if beat is grpc.aio.EOF:
                return
            received += 1
            last_beat_at = loop.time()
            deliver(beat)

    sender = asyncio.create_task(send())
    receiver = asyncio.create_task(receive())
    check_s = interval / 2
    try:
        seen, stalled = received, 0.0
        while not receiver.done():
            woke_for = loop.time() + check_s
            await asyncio.wait({receiver}, timeout=check_s)  # a broken stream ends `receiver`
            if received != seen:
                seen, stalled = received, 0.0
            stalled += max(0.0, loop.time() - woke_for - STALL_SLACK_S)
            if loop.time() - last_beat_at - stalled > timeout:
                raise TimeoutError(f"no heartbeat for {timeout:.1f} s")
        receiver.result()
    finally:
        for task in (sender, receiver):
            task.cancel()
        call.cancel()
        await asyncio.gather(sender, receiver, return_exceptions=True)
