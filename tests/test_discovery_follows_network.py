"""mDNS follows the network while the daemon runs: an address that comes, goes or changes.

A daemon started before its network is up, or a laptop that moves between networks, must be
found by its peers on its new address without a restart. Real daemons, each in its own network
namespace (tests/netns.py); the peer's view is read through its local API.
"""

from __future__ import annotations

import time

import pytest

from meshd.api.launcher import alive_ids
from meshd.wire import pb

pytestmark = pytest.mark.netns

# A short poll of the interfaces is what lets these tests stay in seconds.
FOLLOW_ARGS = ["--link-probe-interval", "30"]
SEEN_WITHIN_S = 15.0


def start(daemons, mesh, i: int, token: str, extra: list[str] | None = None):
    return daemons(
        [*FOLLOW_ARGS, "--join", token, "--name", f"host{i}", *(extra or [])],
        netns=mesh.nodes[i].ns,
    )


def peer_address(status: pb.MeshStatus, node_id: str) -> str:
    """The address the observer's live session to `node_id` uses ("" when none is live)."""
    return next((n.address for n in status.nodes if n.profile.node_id == node_id and n.alive), "")


def test_a_daemon_started_without_an_address_is_found_once_it_gets_one(
    daemons, netns_mesh, mesh_token
) -> None:
    mesh = netns_mesh(2)
    mesh.remove_address(1)  # host1's network is not up yet when its daemon starts
    observer = start(daemons, mesh, 0, mesh_token, ["--interface", "eth0"])
    late = start(daemons, mesh, 1, mesh_token)  # interfaces chosen automatically
    late_id = late.wait_ready().node_id
    observer.wait_ready()
    late.wait_for(lambda s: any("mDNS" in e for e in s.events), 10, "a word on mDNS")
    assert late_id not in alive_ids(observer.status())

    address = mesh.add_address(1, 2)
    added_at = time.monotonic()
    status = observer.wait_for(
        lambda s: peer_address(s, late_id).startswith(f"{address}:"),
        SEEN_WITHIN_S,
        f"host1 to be found at {address} after its address came up",
    )
    found_after = time.monotonic() - added_at
    assert [n.source for n in status.nodes if n.profile.node_id == late_id] == ["mdns"]
    late.wait_for(lambda s: any(f"mDNS now on eth0 {address}" in e for e in s.events), 5, "words")
    print(f"\nfound {found_after:.2f} s after its address came up")


def test_a_daemon_that_moves_is_lost_then_found_on_its_new_address(
    daemons, netns_mesh, mesh_token
) -> None:
    mesh = netns_mesh(2)
    observer = start(daemons, mesh, 0, mesh_token, ["--interface", "eth0"])
    mover = start(daemons, mesh, 1, mesh_token, ["--interface", "eth0"])
    mover_id = mover.wait_ready().node_id
    old = mesh.nodes[1].ip
    observer.wait_for(lambda s: peer_address(s, mover_id).startswith(f"{old}:"), 20, "the mover")

    mesh.remove_address(1)
    removed_at = time.monotonic()
    observer.wait_for(lambda s: mover_id not in alive_ids(s), 5, "the mover to be lost")
    lost_after = time.monotonic() - removed_at
    mover.wait_for(
        lambda s: any(f"withdrew from {old}" in e for e in s.events), 5, "mDNS to withdraw"
    )

    new = mesh.add_address(1, 12)
    added_at = time.monotonic()
    observer.wait_for(
        lambda s: peer_address(s, mover_id).startswith(f"{new}:"),
        SEEN_WITHIN_S,
        f"the mover to be found again at {new}",
    )
    found_after = time.monotonic() - added_at
    # Found by mDNS, not only by the mover dialling back: the observer saw the new announcement.
    # Whether the mover's goodbye from the old address got out decides which words say so: a
    # peer that said goodbye is seen anew, one that did not is seen to have moved.
    observer.wait_for(
        lambda s: (
            any(f"peer {mover_id} moved: mDNS announces it at {new}:" in e for e in s.events)
            or f"sees peer {mover_id} at {new} port"
            in observer.log_path.read_text(errors="replace")
        ),
        SEEN_WITHIN_S,
        "the mover's new announcement",
    )
    announced_after = time.monotonic() - added_at
    mover.wait_for(lambda s: any(f"mDNS now on eth0 {new}" in e for e in s.events), 5, "words")
    print(
        f"\nlost {lost_after:.2f} s after its address went; with the new one, alive again after "
        f"{found_after:.2f} s, its announcement seen after {announced_after:.2f} s"
    )


def test_a_daemon_readdressed_in_place_is_followed_to_its_new_address(
    daemons, netns_mesh, mesh_token
) -> None:
    """A new lease replaces the old address at once: the observer may hear the new
    announcement before its session at the old address has timed out, and must still end up
    dialling the new one."""
    mesh = netns_mesh(2)
    observer = start(daemons, mesh, 0, mesh_token, ["--interface", "eth0"])
    mover = start(daemons, mesh, 1, mesh_token)
    mover_id = mover.wait_ready().node_id
    old = mesh.nodes[1].ip
    observer.wait_for(lambda s: peer_address(s, mover_id).startswith(f"{old}:"), 20, "the mover")

    new = mesh.add_address(1, 22)
    mesh.remove_address(1, old)
    readdressed_at = time.monotonic()
    observer.wait_for(
        lambda s: peer_address(s, mover_id).startswith(f"{new}:"),
        SEEN_WITHIN_S,
        f"the mover to be dialled at {new}",
    )
    print(
        f"\nreaddressed: alive at the new address after {time.monotonic() - readdressed_at:.2f} s"
    )
    mover.wait_for(lambda s: any(f"withdrew from {old}" in e for e in s.events), 5, "words")
