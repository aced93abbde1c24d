"""A request running while the mesh re-plans moves to the new plan in the background.

Two loopback daemons serve the 94 MB random llama split in two; while a long generation
streams, a third daemon joins. The mesh commits a new plan over three nodes; the old one
drains. The running request goes on without an error: its origin starts it on the new plan
while the old one still streams, the new attempt catches up and the stream switches over
(a background move, counted in status), so it finishes on the new plan; a request started
afterwards runs on the new plan too.
"""

from __future__ import annotations

import threading
import time

import pytest

from meshd.api import client
from meshd.wire import pb

pytestmark = pytest.mark.integration

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0"]
MAX_TOKENS = 600


def committed(n: int):
    def check(status: pb.MeshStatus) -> bool:
        return bool(status.agreement.active_plan_id) and len(status.agreement.members) == n

    return check


def test_running_request_drains_on_its_plan_while_the_mesh_replans(
    daemons, mesh_token, tiny_llama
) -> None:
    args = [*LOOPBACK, "--join", mesh_token, "--model", str(tiny_llama)]
    args += ["--strategy", "memory", "--context-length", "1024"]
    first = [daemons(args) for _ in range(2)]
    for d in first:
        d.wait_for(committed(2), 60, "a committed 2-node plan")
    old_plan = first[0].status().agreement.active_plan_id

    events: list[pb.GenerateEvent] = []
    errors: list[BaseException] = []
    tokens_seen = threading.Event()

    def consume() -> None:
        request = pb.GenerateRequest(
            prompt="once upon a time " * 8,
            sampling=pb.Sampling(max_tokens=MAX_TOKENS, temperature=0.8, seed=3),
        )
        try:
            for event in client.stream_generation(first[0].api, request, timeout_s=300):
                events.append(event)
                tokens_seen.set()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)
            tokens_seen.set()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    assert tokens_seen.wait(60), "the long request produced no token"

    third = daemons(args)
    started = time.monotonic()
    for d in [*first, third]:
        d.wait_for(committed(3), 60, "a committed 3-node plan")
    new_plan = first[0].status().agreement.active_plan_id
    assert new_plan != old_plan
    replanned_after = time.monotonic() - started

    quick = pb.GenerateRequest(prompt="hello", sampling=pb.Sampling(max_tokens=4))
    done_new = [e.done for e in client.stream_generation(third.api, quick) if e.HasField("done")]
    # On the 3-node plan, not the draining one. A plan's id is its layout: link-measurement
    # noise cannot commit the same layout again under another id meanwhile.
    assert done_new and done_new[0].plan_id == new_plan

    reader.join(300)
    assert not errors, errors
    done = [e.done for e in events if e.HasField("done")]
    assert done, "the long request never finished"
    assert still_streaming_at_replan(done[0], replanned_after)
    assert done[0].finish_reason in ("length", "eos")
    # It moved while the old plan still served it: the stream switched over to a plan over
    # the three nodes (the one committed at the join, or one that replaced it meanwhile).
    status = first[0].status()
    assert done[0].plan_id != old_plan and done[0].resumes >= 1, done[0]
    assert status.transitions.requests_moved_in_background >= 1, status.transitions


def still_streaming_at_replan(done: pb.GenerationDone, replanned_after_s: float) -> bool:
    """The long request was still running when the new plan committed (it drained)."""
    return done.total_s > replanned_after_s
