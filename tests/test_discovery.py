"""mDNS discovery: the announcement format, interface choice, and real zeroconf traffic.

Real multicast only where it is safe: in-process tests bind zeroconf to 127.0.0.1 alone, and
the multi-process tests run `python -m tests.support.mdns_probe` inside network namespaces
(tests/netns).
Other test runs may announce on loopback at the same time, so every test uses a fresh mesh name
and node ids and looks only at its own nodes.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import trio
from zeroconf import ServiceInfo, Zeroconf

from meshd.mesh.announcement import (
    SERVICE_TYPE,
    TXT_PROTOCOL_VERSION,
    Announcement,
    MalformedAnnouncementError,
)
from meshd.mesh.discovery import (
    GOODBYE_REASON,
    Discovery,
    DiscoveryEvent,
    PeerAppeared,
    PeerGone,
    PeerUpdated,
)
from meshd.mesh.discovery_follow import FollowingDiscovery
from meshd.mesh.interfaces import (
    InterfaceChoice,
    InterfaceSelectionError,
    choose_interfaces,
    select_interface_addresses,
)
from tests.netns import Mesh, require_root_and_netns

pytestmark = pytest.mark.netns

LOOPBACK = ["127.0.0.1"]


def _unique(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:8]}"


def _announcement(node_id: str, mesh: str, **overrides: Any) -> Announcement:
    fields: dict[str, Any] = {
        "protocol_version": 1,
        "grpc_port": 50051,
        "fingerprint": "0123456789abcdef",
    }
    fields.update(overrides)
    return Announcement(node_id=node_id, mesh_name=mesh, **fields)


# ---------------------------------------------------------------------------------------------
# Announcement and interface selection (no network)
# ---------------------------------------------------------------------------------------------


def test_announcement_survives_a_service_info_round_trip() -> None:
    original = _announcement("node-a1", "lab", grpc_port=6001, addresses=("10.77.0.1",))
    info = original.to_service_info()
    assert info.name == f"node-a1.{SERVICE_TYPE}"
    assert info.port == 6001
    assert Announcement.from_service_info(info) == original


def test_txt_record_carries_only_the_public_fields() -> None:
    txt = _announcement("node-a1", "lab").to_txt()
    assert txt == {
        "node": "node-a1",
        "mesh": "lab",
        "proto": "1",
        "grpc": "50051",
        "fp": "0123456789abcdef",
    }


def test_malformed_txt_names_the_bad_entry() -> None:
    good = _announcement("node-a1", "lab").to_txt()
    missing = {k: v for k, v in good.items() if k != TXT_PROTOCOL_VERSION}
    info = ServiceInfo(SERVICE_TYPE, f"node-a1.{SERVICE_TYPE}", port=1, properties=missing)
    with pytest.raises(MalformedAnnouncementError, match="'proto'"):
        Announcement.from_service_info(info)
    info = ServiceInfo(
        SERVICE_TYPE, f"node-a1.{SERVICE_TYPE}", port=1, properties=good | {"grpc": "x"}
    )
    with pytest.raises(MalformedAnnouncementError, match="grpc='x'"):
        Announcement.from_service_info(info)
    info = ServiceInfo(SERVICE_TYPE, f"impostor.{SERVICE_TYPE}", port=1, properties=good)
    with pytest.raises(MalformedAnnouncementError, match="does not match"):
        Announcement.from_service_info(info)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"node_id": "has.dot"}, "node id"),
        ({"mesh_name": ""}, "mesh name"),
        ({"grpc_port": 0}, "gRPC port"),
        ({"fingerprint": "SECRET!"}, "fingerprint"),
        ({"protocol_version": -1}, "protocol version"),
        ({"addresses": ("not-an-ip",)}, "address"),
    ],
)
def test_invalid_announcement_fields_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(MalformedAnnouncementError, match=message):
        replace(_announcement("node-a1", "lab"), **overrides)


def test_incompatibility_names_the_differing_fact() -> None:
    ours = _announcement("a", "lab")
    assert ours.incompatibility_with(_announcement("b", "lab")) is None
    assert "mesh name 'home'" in str(ours.incompatibility_with(_announcement("b", "home")))
    other_version = _announcement("b", "lab", protocol_version=2)
    assert "protocol version 2" in str(ours.incompatibility_with(other_version))
    other_secret = _announcement("b", "lab", fingerprint="ffff")
    assert "fingerprint 'ffff'" in str(ours.incompatibility_with(other_secret))


HOST_ADDRESSES = {
    "lo": ["127.0.0.1"],
    "eth0": ["192.168.1.20"],
    "wlan0": ["192.168.1.21"],
    "docker0": ["172.17.0.1"],
    "veth12ab": [],
    "eth1": ["10.0.0.5"],
}
HOST_UP = {
    "lo": True,
    "eth0": True,
    "wlan0": True,
    "docker0": True,
    "veth12ab": True,
    "eth1": False,
}


def test_automatic_interfaces_skip_loopback_bridges_and_down_links() -> None:
    chosen = select_interface_addresses(None, [], HOST_ADDRESSES, HOST_UP)
    assert chosen == ["192.168.1.20", "192.168.1.21"]
    assert select_interface_addresses(None, ["wlan0"], HOST_ADDRESSES, HOST_UP) == ["192.168.1.20"]


def test_named_interfaces_are_taken_as_given_minus_skips() -> None:
    spec = ["docker0", "127.0.0.1", "eth0"]
    assert select_interface_addresses(spec, [], HOST_ADDRESSES, HOST_UP) == [
        "172.17.0.1",
        "127.0.0.1",
        "192.168.1.20",
    ]
    assert select_interface_addresses(
        spec, ["docker0", "192.168.1.20"], HOST_ADDRESSES, HOST_UP
    ) == ["127.0.0.1"]


def test_interface_errors_list_what_is_available() -> None:
    with pytest.raises(InterfaceSelectionError, match=r"'eth9'.*available: lo \(127.0.0.1\)"):
        select_interface_addresses(["eth9"], [], HOST_ADDRESSES, HOST_UP)
    with pytest.raises(InterfaceSelectionError, match="'veth12ab' has no IPv4"):
        select_interface_addresses(["veth12ab"], [], HOST_ADDRESSES, HOST_UP)


def test_a_following_daemon_waits_for_a_named_interface_and_says_why() -> None:
    spec = ["veth12ab", "eth0", "10.0.0.4", "eth9"]
    choice = choose_interfaces(spec, [], HOST_ADDRESSES, HOST_UP)
    assert choice.chosen == (("eth0", "192.168.1.20"),)
    assert [reason.split(";")[0] for reason in choice.unavailable] == [
        "interface 'veth12ab' has no IPv4 address",
        "'10.0.0.4' is neither an interface name nor an IPv4 address of this machine",
        "'eth9' is neither an interface name nor an IPv4 address of this machine",
    ]
    assert "10.0.0.5" in choice.present and choice.describe() == "eth0 192.168.1.20"


def test_nothing_usable_is_an_empty_list_not_an_error() -> None:
    assert select_interface_addresses(None, ["eth0", "wlan0"], HOST_ADDRESSES, HOST_UP) == []
    assert select_interface_addresses(None, [], {"lo": ["127.0.0.1"]}, {"lo": True}) == []


def test_discovery_refuses_to_bind_everywhere() -> None:
    send, _ = trio.open_memory_channel[DiscoveryEvent](1)
    with pytest.raises(InterfaceSelectionError, match="explicit list"):
        Discovery(_announcement("a", "lab"), [], send)
    with pytest.raises(InterfaceSelectionError, match=r"0\.0\.0\.0"):
        Discovery(_announcement("a", "lab"), ["0.0.0.0"], send)
    with pytest.raises(InterfaceSelectionError, match=r"'eth0'.*resolve_interfaces"):
        Discovery(_announcement("a", "lab"), ["eth0"], send)


# ---------------------------------------------------------------------------------------------
# Loopback: several Discovery instances in one trio run, zeroconf bound to 127.0.0.1 only
# ---------------------------------------------------------------------------------------------


@dataclass
class LoopbackNode:
    """A Discovery under test with its event stream and a scope that stops it."""

    discovery: Discovery
    receive: trio.MemoryReceiveChannel[DiscoveryEvent]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    events: list[DiscoveryEvent] = field(default_factory=list)

    @classmethod
    def make(cls, announcement: Announcement) -> LoopbackNode:
        send, receive = trio.open_memory_channel[DiscoveryEvent](100)
        return cls(Discovery(announcement, LOOPBACK, send), receive)

    @property
    def node_id(self) -> str:
        return self.discovery.announcement.node_id

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.scope:
            await self.discovery.run(task_status=task_status)

    async def wait_for(
        self, predicate: Callable[[DiscoveryEvent], bool], timeout: float = 5.0
    ) -> DiscoveryEvent:
        """The first event (already received or new) matching `predicate`, within `timeout`."""
        for event in self.events:
            if predicate(event):
                return event
        with trio.fail_after(timeout):
            while True:
                event = await self.receive.receive()
                self.events.append(event)
                if predicate(event):
                    return event


def _appeared(node_id: str) -> Callable[[DiscoveryEvent], bool]:
    return lambda e: isinstance(e, PeerAppeared) and e.announcement.node_id == node_id


def _updated(node_id: str) -> Callable[[DiscoveryEvent], bool]:
    return lambda e: isinstance(e, PeerUpdated) and e.announcement.node_id == node_id


def _gone(node_id: str) -> Callable[[DiscoveryEvent], bool]:
    return lambda e: isinstance(e, PeerGone) and e.node_id == node_id


async def _start_all(nursery: trio.Nursery, nodes: list[LoopbackNode]) -> None:
    """Start every node concurrently (registration takes ~0.45 s each)."""
    async with trio.open_nursery() as starting:
        for node in nodes:
            starting.start_soon(nursery.start, node.run)


def _ignore_lines(caplog: pytest.LogCaptureFixture, observer: str, peer: str) -> list[str]:
    prefix = f"{observer} ignores peer {peer}:"
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


def test_loopback_peers_find_each_other_ignore_strangers_and_see_goodbyes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="meshd.mesh.discovery")
    mesh = _unique("lab")
    a = LoopbackNode.make(_announcement(_unique("a"), mesh, grpc_port=7001))
    b = LoopbackNode.make(_announcement(_unique("b"), mesh, grpc_port=7002))
    other_mesh = LoopbackNode.make(_announcement(_unique("c"), _unique("elsewhere")))
    other_secret = LoopbackNode.make(_announcement(_unique("d"), mesh, fingerprint="ffff"))
    other_version = LoopbackNode.make(_announcement(_unique("e"), mesh, protocol_version=9))
    strangers = [other_mesh, other_secret, other_version]

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            await _start_all(nursery, [a, b, *strangers])
            seen_b = await a.wait_for(_appeared(b.node_id))
            await b.wait_for(_appeared(a.node_id))
            assert isinstance(seen_b, PeerAppeared)
            assert seen_b.announcement.grpc_port == 7002
            assert seen_b.announcement.addresses == ("127.0.0.1",)

            with trio.fail_after(5):
                while len(set(a.discovery.ignored) & {s.node_id for s in strangers}) < 3:
                    await trio.sleep(0.05)
            reasons = a.discovery.ignored
            assert "mesh name" in reasons[other_mesh.node_id]
            assert "fingerprint" in reasons[other_secret.node_id]
            assert "protocol version 9" in reasons[other_version.node_id]

            # A stranger that re-announces (new port) is re-resolved but not logged again.
            moved = replace(other_mesh.discovery.announcement, grpc_port=7999)
            await other_mesh.discovery.update(moved)
            await b.discovery.update(replace(b.discovery.announcement, grpc_port=7003))
            updated = await a.wait_for(_updated(b.node_id))
            assert isinstance(updated, PeerUpdated)
            assert updated.announcement.grpc_port == 7003
            await trio.sleep(0.3)

            b.scope.cancel()
            left_at = trio.current_time()
            gone = await a.wait_for(_gone(b.node_id), timeout=2.0)
            assert trio.current_time() - left_at < 2.0
            assert gone == PeerGone(b.node_id, GOODBYE_REASON)
            assert b.node_id not in a.discovery.peers

            ours = {a.node_id, b.node_id, *(s.node_id for s in strangers)}
            mine = [e for e in a.events if not isinstance(e, PeerGone)]
            assert {e.announcement.node_id for e in mine} & ours == {b.node_id}
            assert a.node_id not in a.discovery.peers

            closing_at = trio.current_time()
            nursery.cancel_scope.cancel()
        assert trio.current_time() - closing_at < 3.0, "shutdown took too long"

    trio.run(scenario)
    assert len(_ignore_lines(caplog, a.node_id, other_mesh.node_id)) == 1
    assert len(_ignore_lines(caplog, a.node_id, other_secret.node_id)) == 1


def test_update_moves_a_node_between_meshes() -> None:
    home, work = _unique("home"), _unique("work")
    a = LoopbackNode.make(_announcement(_unique("a"), home))
    b = LoopbackNode.make(_announcement(_unique("b"), work))

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            await _start_all(nursery, [a, b])
            with trio.fail_after(5):
                while b.node_id not in a.discovery.ignored:
                    await trio.sleep(0.05)

            await b.discovery.update(replace(b.discovery.announcement, mesh_name=home))
            await a.wait_for(_appeared(b.node_id))
            await b.wait_for(_appeared(a.node_id))

            await b.discovery.update(replace(b.discovery.announcement, mesh_name=work))
            gone = await a.wait_for(_gone(b.node_id))
            assert isinstance(gone, PeerGone) and "mesh name" in gone.reason
            await b.wait_for(_gone(a.node_id))

            with pytest.raises(ValueError, match="cannot change the node id"):
                await b.discovery.update(_announcement("someone-else", work))
            nursery.cancel_scope.cancel()

    trio.run(scenario)
    assert _zeroconf_threads() == [], "threads outlived Discovery.run"


def test_following_discovery_says_goodbye_when_it_leaves_an_address_that_still_exists() -> None:
    """Loopback stands in for a network the node stops using while it is still there (its
    interface went down, say): the peers see the goodbye at once, and the node again when
    the interface is back. The interface list is scripted; the mDNS traffic is real."""
    mesh = _unique("lab")
    observer = LoopbackNode.make(_announcement(_unique("a"), mesh))
    on_loopback = InterfaceChoice((("lo", "127.0.0.1"),), present=frozenset(LOOPBACK))
    lo_down = InterfaceChoice(present=frozenset(LOOPBACK))
    script = [on_loopback]
    said: list[str] = []
    send, _ = trio.open_memory_channel[DiscoveryEvent](100)
    mover = FollowingDiscovery(
        _announcement(_unique("b"), mesh),
        ["lo"],
        [],
        send,
        lambda text, level: said.append(text),
        poll_interval_s=0.1,
        read=lambda spec, skip: script[-1],
    )
    mover_id = mover._announcement.node_id

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(observer.run)
            await nursery.start(mover.run)
            await observer.wait_for(_appeared(mover_id))
            script.append(lo_down)
            await observer.wait_for(_gone(mover_id), timeout=3)
            with trio.fail_after(3):  # the goodbye leaves before the old zeroconf has closed
                while mover.addresses:
                    await trio.sleep(0.05)
            observer.events.clear()
            script.append(on_loopback)
            await observer.wait_for(_appeared(mover_id), timeout=5)
            assert mover.addresses == ("127.0.0.1",)
            with trio.fail_after(3):  # said once its registration has gone out
                while len(said) < 3:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    trio.run(scenario)
    assert said == [
        "mDNS now on lo 127.0.0.1",
        "mDNS paused: withdrew from 127.0.0.1; no usable interface now",
        "mDNS now on lo 127.0.0.1",
    ]
    assert _zeroconf_threads() == [], "threads outlived FollowingDiscovery.run"


def _zeroconf_threads() -> list[str]:
    """Names of live zeroconf loop and browser threads (all are joined on close)."""
    names = [thread.name for thread in threading.enumerate()]
    return [name for name in names if "_run_loop" in name or name.startswith("zeroconf")]


def test_a_malformed_peer_is_ignored_with_the_reason() -> None:
    a = LoopbackNode.make(_announcement(_unique("a"), _unique("lab")))
    broken_id = _unique("broken")
    txt = {"node": broken_id, "mesh": a.discovery.announcement.mesh_name, "grpc": "7000"}
    broken = ServiceInfo(
        SERVICE_TYPE, f"{broken_id}.{SERVICE_TYPE}", port=7000, properties=txt,
        server=f"{broken_id}.local.", parsed_addresses=LOOPBACK,
    )  # fmt: skip

    def announce_broken_peer() -> Zeroconf:
        zc = Zeroconf(interfaces=LOOPBACK, use_asyncio=False)
        zc.register_service(broken, cooperating_responders=True)
        return zc

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            zc = await trio.to_thread.run_sync(announce_broken_peer)
            try:
                with trio.fail_after(5):
                    while broken_id not in a.discovery.ignored:
                        await trio.sleep(0.05)
                reason = a.discovery.ignored[broken_id]
                assert a.discovery.peers == {}
            finally:
                await trio.to_thread.run_sync(zc.close)
            assert "malformed announcement" in reason
            assert "'proto'" in reason
            nursery.cancel_scope.cancel()

    trio.run(scenario)


def test_two_daemons_with_one_node_id_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="meshd.mesh.discovery")
    mesh, twin_id = _unique("lab"), _unique("twin")
    original = LoopbackNode.make(_announcement(twin_id, mesh, grpc_port=7101))
    copy = LoopbackNode.make(_announcement(twin_id, mesh, grpc_port=7102))

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            await _start_all(nursery, [original, copy])
            with trio.fail_after(5):
                while not any("another daemon announces our node id" in r.getMessage()
                              for r in caplog.records):  # fmt: skip
                    await trio.sleep(0.05)
            assert original.discovery.peers == {} and copy.discovery.peers == {}
            nursery.cancel_scope.cancel()

    trio.run(scenario)
    warning = next(r.getMessage() for r in caplog.records if "another daemon" in r.getMessage())
    assert twin_id in warning and "copied" in warning


# ---------------------------------------------------------------------------------------------
# Network namespaces: one `python -m tests.support.mdns_probe` process per node
# ---------------------------------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parent.parent


class Runner:
    """`python -m tests.support.mdns_probe` in a node's namespace; a thread reads its JSON."""

    def __init__(self, mesh: Mesh, index: int, mesh_name: str, log_dir: Path) -> None:
        self.node_id = f"n{index}"
        self.log_path = log_dir / f"{self.node_id}.log"
        command = [
            sys.executable, "-m", "tests.support.mdns_probe", "--interface", "eth0",
            "--node-id", self.node_id, "--mesh", mesh_name, "--grpc-port", str(6000 + index),
            "--seconds", "25",
        ]  # fmt: skip
        with self.log_path.open("w") as log_file:
            self.process = mesh.nodes[index].popen(
                command, stdout=subprocess.PIPE, stderr=log_file, text=True, cwd=REPO_ROOT
            )
        self.records: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.records.append(json.loads(line))
                self._changed.notify_all()

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> dict:
        """The first record matching `predicate`; fails with the runner's log after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((r for r in self.records if predicate(r)), None)
                remaining = deadline - time.monotonic()
                if found is not None or remaining <= 0:
                    break
                self._changed.wait(remaining)
        if found is None:
            pytest.fail(
                f"{self.node_id}: nothing matched within {timeout} s; records {self.records}; "
                f"log:\n{self.log_path.read_text()}"
            )
        return found

    def seen(self, peer: Runner, timeout: float = 8.0) -> dict:
        return self.wait_for(lambda r: r["event"] == "appeared" and r["node_id"] == peer.node_id,
                             timeout)  # fmt: skip

    @property
    def announced_at(self) -> float:
        return float(self.wait_for(lambda r: r["event"] == "registered", 10.0)["announced_at"])


def _latencies(observers: list[Runner], peer: Runner) -> list[float]:
    return [observer.seen(peer)["t"] - peer.announced_at for observer in observers]


def test_namespaced_processes_find_each_other_and_see_leaves(tmp_path: Path) -> None:
    require_root_and_netns()
    mesh_name = _unique("ns")
    with Mesh(4) as mesh:
        first = [Runner(mesh, i, mesh_name, tmp_path) for i in range(3)]
        for observer in first:
            for peer in first:
                if peer is not observer:
                    record = observer.seen(peer)
                    assert record["addresses"] == [mesh.nodes[int(peer.node_id[1:])].ip]
        initial = [
            lat for peer in first for lat in _latencies([o for o in first if o is not peer], peer)
        ]

        late = Runner(mesh, 3, mesh_name, tmp_path)
        late_latencies = _latencies(first, late)
        for peer in first:
            late.seen(peer)

        leaver = first[1]
        leaver.process.send_signal(signal.SIGTERM)
        left_at = time.monotonic()
        stayers = [first[0], first[2], late]
        gone_after = [
            o.wait_for(lambda r: r["event"] == "gone" and r["node_id"] == leaver.node_id, 3.0)["t"]
            - left_at
            for o in stayers
        ]
        assert leaver.process.wait(timeout=5) == 0
        leaver.wait_for(lambda r: r["event"] == "stopped", 1.0)
        own_reports = [
            r for runner in [*first, late] for r in runner.records
            if r.get("node_id") == runner.node_id
        ]  # fmt: skip
        assert own_reports == [], "a node reported itself"

    print(
        f"\nnetns discovery: announce -> seen, first three {min(initial):.3f}-{max(initial):.3f} s;"
        f" late joiner {min(late_latencies):.3f}-{max(late_latencies):.3f} s;"
        f" SIGTERM -> gone {min(gone_after):.3f}-{max(gone_after):.3f} s"
    )
    assert max(late_latencies) < 3.0
    assert max(gone_after) < 2.0


def test_resolve_interfaces_reads_the_real_namespace() -> None:
    require_root_and_netns()
    program = (
        "import json; from meshd.mesh.interfaces import resolve_interfaces as r\n"
        "out = [r(None), r(['docker0']), r(['eth0', 'lo'], skip=['lo'])]\n"
        "try:\n    r(['eth7'])\nexcept ValueError as e:\n    out.append(str(e))\n"
        "print(json.dumps(out))"
    )
    with Mesh(1) as mesh:
        node = mesh.nodes[0]
        for args in (["link", "add", "docker0", "type", "bridge"],
                     ["addr", "add", "172.17.0.1/16", "dev", "docker0"],
                     ["link", "set", "docker0", "up"]):  # fmt: skip
            subprocess.run(["ip", "-n", node.ns, *args], check=True, timeout=10)
        result = node.run(
            [sys.executable, "-c", program], capture_output=True, text=True, cwd=REPO_ROOT
        )
    assert result.returncode == 0, result.stderr
    automatic, named, skipped, error = json.loads(result.stdout)
    assert automatic == ["10.77.0.1"]
    assert named == ["172.17.0.1"]
    assert skipped == ["10.77.0.1"]
    assert "'eth7'" in error and "docker0 (172.17.0.1)" in error
