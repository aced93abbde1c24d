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


async def beat_stream(
    stub: rpc.PeerStub,
    node_id: str,
    version: Callable[[], int],
    interval: float,
    timeout: float,
    deliver: Callable[[pb.Beat], None],
) -> None:
    """asyncio side: write a beat every `interval`, raise TimeoutError on a silent gap.

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
        seq = 0
        while True:
            seq += 1
            await call.write(
                pb.Beat(node_id=node_id, seq=seq, state_version=version(), sent_at=time.time())
            )
            await asyncio.sleep(interval)

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
