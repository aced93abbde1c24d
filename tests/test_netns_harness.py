"""The namespace harness itself: isolation, multicast across the bridge, link control, cleanup.

Traffic is made with small `python -c` programs run inside the node namespaces (this machine
has no ping or iperf); every wait has a timeout.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import psutil
import pytest

from tests import netns
from tests.netns import Mesh, list_namespaces, parse_rate, require_root_and_netns

pytestmark = pytest.mark.netns

netns_mesh = netns.netns_mesh  # the fixture factory, made visible to this module

MCAST_GROUP = "239.77.0.1"
MCAST_PORT = 40077

# Joins the group on its own address, says "ready", prints the first datagram or "timeout".
MCAST_RECEIVER = """
import socket, sys
ip, group, port, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((group, port))
s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
             socket.inet_aton(group) + socket.inet_aton(ip))
s.settimeout(timeout)
print("ready", flush=True)
try:
    print(s.recv(100).decode(), flush=True)
except TimeoutError:
    print("timeout", flush=True)
"""

# Sends `count` datagrams to the group from its own address, 50 ms apart.
MCAST_SENDER = """
import socket, sys, time
ip, group, port, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(ip))
for _ in range(count):
    s.sendto(("hello from " + ip).encode(), (group, port))
    time.sleep(0.05)
"""

# Accepts one TCP connection, reads to EOF, prints "bytes seconds" (first byte to EOF).
TCP_SINK = """
import socket, sys, time
s = socket.create_server((sys.argv[1], 0))
s.settimeout(10)
print(s.getsockname()[1], flush=True)
conn, _ = s.accept()
conn.settimeout(10)
total, first = 0, None
while chunk := conn.recv(65536):
    first = first or time.monotonic()
    total += len(chunk)
print(total, time.monotonic() - first, flush=True)
"""

TCP_SOURCE = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as c:
    c.sendall(b"x" * int(sys.argv[3]))
"""


def _multicast_reaches(mesh: Mesh, sender: int, receiver: int, wait_s: float = 1.5) -> bool:
    """True when a datagram sent to MCAST_GROUP by node `sender` arrives at node `receiver`."""
    rx_node, tx_node = mesh.nodes[receiver], mesh.nodes[sender]
    rx = rx_node.popen(
        [sys.executable, "-c", MCAST_RECEIVER, rx_node.ip, MCAST_GROUP, str(MCAST_PORT),
         str(wait_s)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert rx.stdout is not None
    assert rx.stdout.readline().strip() == "ready"
    sends = 8  # 0.4 s of datagrams: the receiver needs one, a cut link gets none
    tx_node.run(
        [sys.executable, "-c", MCAST_SENDER, tx_node.ip, MCAST_GROUP, str(MCAST_PORT), str(sends)],
        timeout=wait_s + 5,
    )
    line = rx.stdout.readline().strip()
    rx.wait(timeout=wait_s + 5)
    return line == f"hello from {tx_node.ip}"


def _throughput_mbit(mesh: Mesh, sender: int, receiver: int, n_bytes: int) -> float:
    """Mbit/s of one TCP transfer from node `sender` to node `receiver`, as the sink saw it."""
    rx_node = mesh.nodes[receiver]
    sink = rx_node.popen(
        [sys.executable, "-c", TCP_SINK, rx_node.ip], stdout=subprocess.PIPE, text=True
    )
    assert sink.stdout is not None
    port = sink.stdout.readline().strip()
    source = mesh.nodes[sender].run(
        [sys.executable, "-c", TCP_SOURCE, rx_node.ip, port, str(n_bytes)], timeout=20
    )
    assert source.returncode == 0
    received, seconds = sink.stdout.readline().split()
    sink.wait(timeout=5)
    assert int(received) == n_bytes
    return n_bytes * 8 / float(seconds) / 1e6


def _ours(prefix: str) -> list[str]:
    return [ns for ns in list_namespaces() if ns.startswith(f"{prefix}-")]


def test_mesh_lives_in_its_own_namespaces_and_removes_them() -> None:
    require_root_and_netns()
    root_interfaces = set(psutil.net_if_addrs())
    with Mesh(3) as mesh:
        assert sorted(_ours(mesh.prefix)) == sorted(mesh.namespaces)
        assert [node.ip for node in mesh.nodes] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
        shown = mesh.nodes[2].run(["ip", "-br", "addr"], capture_output=True, text=True)
        assert "10.77.0.3/24" in shown.stdout
        assert set(psutil.net_if_addrs()) == root_interfaces, "the root namespace was touched"
    assert _ours(mesh.prefix) == []


def test_mesh_is_removed_when_the_body_raises() -> None:
    require_root_and_netns()
    with pytest.raises(RuntimeError, match="boom"), Mesh(2) as mesh:
        sleeper = mesh.nodes[0].popen(["sleep", "30"])
        raise RuntimeError("boom")
    assert _ours(mesh.prefix) == []
    assert sleeper.poll() is not None, "a process started in the mesh outlived it"


def test_multicast_crosses_the_bridge_and_link_down_cuts_it() -> None:
    require_root_and_netns()
    with Mesh(2) as mesh:
        assert _multicast_reaches(mesh, sender=0, receiver=1)
        mesh.link_down(1)
        assert not _multicast_reaches(mesh, sender=0, receiver=1, wait_s=0.6)
        mesh.link_up(1)
        assert _multicast_reaches(mesh, sender=0, receiver=1)
        mesh.link_down(0, end="node")
        assert not _multicast_reaches(mesh, sender=1, receiver=0, wait_s=0.6)


def test_limit_rate_caps_throughput_and_clear_rate_lifts_it() -> None:
    require_root_and_netns()
    limit_mbit = 16
    with Mesh(2) as mesh:
        mesh.limit_rate(1, f"{limit_mbit}mbit")
        capped = _throughput_mbit(mesh, sender=0, receiver=1, n_bytes=1_500_000)
        mesh.clear_rate(1)
        free = _throughput_mbit(mesh, sender=0, receiver=1, n_bytes=1_500_000)
    assert 0.6 * limit_mbit < capped < 1.15 * limit_mbit, f"capped at {capped:.1f} Mbit/s"
    assert free > 3 * limit_mbit, f"still slow after clear_rate: {free:.1f} Mbit/s"


def test_cleanup_stale_removes_dead_runs_and_keeps_live_ones() -> None:
    require_root_and_netns()
    dead_pid = _a_dead_pid()
    dead = f"{netns.PREFIX_ROOT}{dead_pid}x0-n0"
    live = f"{netns.unique_prefix()}-n0"
    for name in (dead, live):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        removed = netns.cleanup_stale()
        remaining = list_namespaces()
        assert dead in removed and dead not in remaining
        assert live not in removed and live in remaining
    finally:
        for name in (dead, live):
            netns.delete_namespace(name)


def _a_dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen(["true"])
    process.wait(timeout=5)
    assert not psutil.pid_exists(process.pid)
    return process.pid


def test_fixture_factory_creates_meshes_and_closes_them(netns_mesh: Callable[..., Mesh]) -> None:
    first = netns_mesh(1)
    second = netns_mesh(2, subnet=9)
    assert second.nodes[1].ip == "10.77.9.2"
    assert set(_ours(first.prefix)) == set(first.namespaces)
    assert set(_ours(second.prefix)) == set(second.namespaces)


def test_parse_rate_reads_tc_units() -> None:
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1gbit") == 1_000_000_000
    assert parse_rate("2.5kbit") == 2500
    with pytest.raises(ValueError, match="100mbit"):
        parse_rate("100 MB/s")


def test_namespaces_come_up_fast() -> None:
    require_root_and_netns()
    started = time.monotonic()
    with Mesh(4):
        up_s = time.monotonic() - started
    assert up_s < 2.0, f"4 namespaces took {up_s:.2f} s"
