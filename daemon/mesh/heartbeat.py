"""The heartbeat stream to one peer, asyncio side: beats out, beats in, a watchdog.

Membership (:mod:`meshd.mesh.membership`) runs it on the asyncio thread for each session and
decides on the trio side what its end means (the peer lost, and why).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import grpc

from meshd.wire import pb, rpc

STALL_SLACK_S = 0.02  # a heartbeat watchdog waking later than this was starved, not the peer


async def beat_stream(
    stub: rpc.PeerStub,
    node_id: str,
    version: Callable[[], int],
    changed: asyncio.Event,
    interval: float,
    timeout: float,
    deliver: Callable[[pb.Beat], None],
) -> None:
    """asyncio side: beat every `interval` and on a state change, raise TimeoutError on silence.

    A beat goes out `interval` after the last one, or as soon as `version()` changes: the
    owner of the version sets `changed` after each change, and the sender, waiting on it,
    beats at once. So the peer learns of a new state at once, and the keep-alive rate, the
    daemon's main idle cost, need not be high for changes to spread fast. (The sender used
    to poll the version every 50 ms instead: 20 wake-ups a second per peer, ~0.5% of a
    core of an idle daemon on a 2-core x86 machine.) The peer echoes each beat with its own
    version; an echo is what proves the peer alive.

    The gap counts only time this process was running: a process starved of CPU (or of the
    GIL, e.g. while importing mlx-lm or loading weights) reads its peers' beats late, and
    blaming the peer for that would drop a healthy member and re-plan the mesh. The watchdog
    wakes every `interval / 2`; any lateness of its own wake-up is a stall of this process and
    extends the peer's allowance until the next beat arrives.
    """
    loop = asyncio.get_running_loop()
    call = stub.Heartbeat()
    received = 0
    last_beat_at = loop.time()

    async def send() -> None:
        seq, sent_version, due = 0, None, loop.time()
        while True:
            changed.clear()  # before the read: a change after it sets the event again
            current = version()
            if current != sent_version or loop.time() >= due:
                seq += 1
                beat = pb.Beat(node_id=node_id, seq=seq, state_version=current, sent_at=time.time())
                await call.write(beat)
                sent_version, due = current, loop.time() + interval
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, due - loop.time())):
                    await changed.wait()

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
