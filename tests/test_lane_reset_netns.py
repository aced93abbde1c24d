"""A reset lane costs the client a moment, not the request: the text is the undisturbed run's.

Three daemons in network namespaces split the real default model (the mesh of
``tests/test_resume_netns.py``). While a greedy answer streams from the first stage's node,
the lane (the direct TLS connection that carries the data plane's frames) from the first stage
to the second is killed with ``ss -K``: the kernel aborts the socket and resets its peer.
Every node stays a member and the plan stays: nothing will re-plan. The first stage re-opens
the lane at once and both ends send again the frames the other did not act on
(:mod:`meshd.inference.transport.lanes`), so the request goes on where it was: the text is exactly
the undisturbed run's, the stream's longest pause is a token interval or two (well under the
bound asserted here; measured ones are printed), and the origin did not replay the request
(its final event counts no resume; the event log says the lane was re-opened).
"""

from __future__ import annotations

import itertools
import subprocess
import time

import pytest

from meshd.config import DEFAULT_PEER_PORT
from meshd.wire import pb
from tests.test_resume_netns import (  # the module's three-node mesh and its story
    DISTURB_AFTER,
    MAX_TOKENS,
    ThreeHosts,
    hosts,  # noqa: F401 (a fixture)
    story,
)

pytestmark = pytest.mark.netns

LANE_PORT = DEFAULT_PEER_PORT + 1  # the daemons' lanes listen next to the peer port
LONGEST_PAUSE_S = 2.0  # a replay took 1.8-2.3 s; a resumed lane takes a token interval


def loaded(status: pb.MeshStatus) -> bool:
    transitions = status.transitions
    return transitions.HasField("active_plan_loaded") and transitions.active_plan_loaded


@pytest.fixture(scope="module")
def undisturbed(hosts: ThreeHosts) -> str:  # noqa: F811 (the fixture)
    """The story as the mesh tells it undisturbed, once every node has loaded the plan (a
    stage still loading would make the first request fail before it starts)."""
    order = hosts.wait_for_three()
    for daemon in order:
        daemon.wait_for(loaded, 120, "the active plan loaded")
    text, done, _ = story(order[0])
    assert done.resumes == 0 and done.completion_tokens > 2 * DISTURB_AFTER, done
    return text


def reset_lane(mesh: ThreeHosts, sender_index: int, receiver_index: int) -> str:
    """Abort the sender's lane connection(s) to the receiver (``ss -K``); what ss killed."""
    sender = mesh.netns_mesh.nodes[sender_index]
    receiver = mesh.netns_mesh.nodes[receiver_index]
    result = sender.run(
        ["ss", "-K", "-tn", "dst", receiver.ip, "dport", "=", str(LANE_PORT)],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_reset_lane_between_two_stages_does_not_change_the_text(
    hosts: ThreeHosts,  # noqa: F811 (the fixture)
    undisturbed: str,
) -> None:
    order = hosts.wait_for_three()
    origin = order[0]  # the origin is the first stage: its lane to the second is reset
    before = origin.status().agreement.active_plan_id
    first = hosts.daemons.index(order[0])
    second = hosts.daemons.index(order[1])
    reset_at: list[float] = []
    killed: list[str] = []

    def disturb(pieces: int) -> None:
        if pieces == DISTURB_AFTER:
            killed.append(reset_lane(hosts, first, second))
            reset_at.append(time.monotonic())

    started = time.monotonic()
    try:
        text, done, arrivals = story(origin, disturb, MAX_TOKENS)
    except Exception as error:  # the old behaviour: UNAVAILABLE after the resume timeout
        waited = time.monotonic() - started
        raise AssertionError(f"the request failed after {waited:.1f} s: {error}") from error
    assert killed and "ESTAB" in killed[0], f"no lane connection was reset: {killed}"
    after = [t for t in arrivals if t > reset_at[0]]
    gaps = [b - a for a, b in zip([reset_at[0], *after], after, strict=False)]
    status = origin.status()
    resumed = [line for line in status.events if "re-opened at once" in line]
    before_reset = [t for t in arrivals if t <= reset_at[0]]
    usual = sorted(b - a for a, b in itertools.pairwise(before_reset))
    print(
        f"longest pause after the reset {max(gaps) * 1e3:.0f} ms (the median interval before "
        f"it {usual[len(usual) // 2] * 1e3:.0f} ms, the longest {usual[-1] * 1e3:.0f} ms); "
        f"{done.paused_s=:.2f}"
    )
    print(*resumed, sep="\n")
    assert text == undisturbed
    assert max(gaps) < LONGEST_PAUSE_S, gaps
    assert done.resumes == 0 and done.plan_id == before, done  # no replay: the lane resumed
    assert resumed, f"the event log does not say the lane was re-opened: {status.events}"
    assert len(status.agreement.members) == 3 and status.agreement.active_plan_id == before


def test_ss_can_reset_a_socket_here() -> None:
    """The reset this module relies on works on this kernel (CONFIG_INET_DIAG_DESTROY)."""
    result = subprocess.run(["ss", "-K", "-tn", "dst", "127.0.0.2"], capture_output=True)
    assert result.returncode == 0, result.stderr
