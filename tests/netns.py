"""A multi-node test network made of Linux network namespaces (needs root and iproute2).

Layout: one namespace `<prefix>-br` holds a bridge `br0` (multicast snooping off, so mDNS is
flooded to every port); each node `i` gets a namespace `<prefix>-n<i>` whose `eth0` (address
10.77.<subnet>.<i+1>/24) is one end of a veth pair; the other end, `p<i>`, lives in the bridge
namespace and is a port of `br0`. Nothing is created in the root namespace, so tests can
announce and multicast freely inside without touching the real network.

Names carry the creating pid (`mdt<pid>x<counter>`), so concurrent test runs never collide and
`cleanup_stale` can tell a crashed run's leftovers (pid gone) from a live run's namespaces.

Typical use::

    with Mesh(3) as mesh:
        proc = mesh.nodes[0].popen([sys.executable, "-m", "tests.support.mdns_probe", ...])
        mesh.link_down(1)
        mesh.limit_rate(2, "100mbit")
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from meshd.runtime.scratch import pid_alive

PREFIX_ROOT = "mdt"
BRIDGE = "br0"
NODE_INTERFACE = "eth0"
COMMAND_TIMEOUT_S = 10.0
PROCESS_STOP_TIMEOUT_S = 3.0

_counter = itertools.count()
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}

Direction = Literal["both", "egress", "ingress"]


class NetnsError(RuntimeError):
    """An `ip`/`tc` command failed; the message holds the command and its stderr."""


def _run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a short iproute2 command with a timeout; raise NetnsError naming it on failure."""
    result = subprocess.run(
        list(args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
    )
    if check and result.returncode != 0:
        raise NetnsError(
            f"`{' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}"
        )
    return result


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (`ip netns list`, without the id suffix)."""
    output = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in output.splitlines() if line.strip()]


def unique_prefix(root: str = PREFIX_ROOT) -> str:
    """A prefix no other live process uses: root + pid + per-process counter."""
    return f"{root}{os.getpid()}x{next(_counter)}"


def _kill_processes_in(namespace: str) -> None:
    """Kill what a crashed run left running in one of *our* namespaces (by pid)."""
    output = _run(["ip", "netns", "pids", namespace], check=False).stdout
    for pid in (int(p) for p in output.split() if p.isdigit()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def delete_namespace(namespace: str) -> None:
    """Kill processes left inside, then delete the namespace (and its interfaces)."""
    _kill_processes_in(namespace)
    _run(["ip", "netns", "del", namespace], check=False)


def cleanup_stale(prefix_root: str = PREFIX_ROOT) -> list[str]:
    """Delete namespaces of earlier runs whose creating process is gone; return their names.

    Only names of the form `<prefix_root><pid>x<n>-...` are touched, and only when that pid is
    no longer alive, so a concurrent run's meshes survive.
    """
    pattern = re.compile(rf"^{re.escape(prefix_root)}(\d+)x\d+-")
    removed = []
    for namespace in list_namespaces():
        match = pattern.match(namespace)
        if match and not pid_alive(int(match.group(1))):
            delete_namespace(namespace)
            removed.append(namespace)
    return removed


def require_root_and_netns() -> None:
    """Fail (not skip) the calling test with a clear message when namespaces are unusable."""
    if os.geteuid() != 0:
        pytest.fail("network-namespace tests need root (they run `ip netns add`); run as root")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.fail("network-namespace tests need iproute2 (`ip` and `tc`); install iproute2")
    probe = f"{unique_prefix()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except (NetnsError, subprocess.TimeoutExpired) as error:
        pytest.fail(
            f"cannot create a network namespace ({error}); the kernel or container "
            "must allow `ip netns add` (CAP_SYS_ADMIN, /run/netns writable)"
        )
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def parse_rate(rate: str) -> int:
    """Bits per second of a tc rate such as "100mbit", "1gbit", "800kbit"."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)", rate.strip().lower())
    if match is None:
        raise ValueError(f"rate {rate!r} is not like '100mbit' (units: bit, kbit, mbit, gbit)")
    return int(float(match.group(1)) * _RATE_UNITS[match.group(2)])


@dataclass
class Node:
    """One node of a Mesh: its namespace, address and the processes started in it."""

    index: int
    ns: str
    ip: str
    bridge_port: str
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def command(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` prefixed to run inside this node's namespace."""
        return ["ip", "netns", "exec", self.ns, *cmd]

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `cmd` in this node's namespace; the Mesh stops it on close."""
        process = subprocess.Popen(self.command(cmd), **kwargs)
        self.processes.append(process)
        return process

    def run(
        self, cmd: Sequence[str], *, timeout: float = 30.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run `cmd` to completion in this node's namespace (bounded by `timeout`)."""
        return subprocess.run(self.command(cmd), timeout=timeout, check=False, **kwargs)

    def stop_processes(self) -> None:
        """SIGTERM every process still running, then SIGKILL what ignores it."""
        running = [p for p in self.processes if p.poll() is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        for process in running:
            try:
                process.wait(timeout=PROCESS_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=PROCESS_STOP_TIMEOUT_S)
        self.processes.clear()


class Mesh:
    """`n_nodes` namespaces joined by a bridge; a context manager that removes all it made."""

    def __init__(self, n_nodes: int, *, prefix: str | None = None, subnet: int = 0) -> None:
        if not 1 <= n_nodes <= 250:
            raise ValueError(f"n_nodes must be 1-250, not {n_nodes}")
        if not 0 <= subnet <= 255:
            raise ValueError(f"subnet must be 0-255, not {subnet}")
        self.prefix = prefix or unique_prefix()
        self.subnet = subnet
        self.bridge_ns = f"{self.prefix}-br"
        self.nodes = [
            Node(
                index=i, ns=f"{self.prefix}-n{i}", ip=f"10.77.{subnet}.{i + 1}", bridge_port=f"p{i}"
            )
            for i in range(n_nodes)
        ]

    def __enter__(self) -> Mesh:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this mesh owns."""
        return [self.bridge_ns, *(node.ns for node in self.nodes)]

    def create(self) -> None:
        """Create the bridge namespace, then each node (use the context manager instead)."""
        _run(["ip", "netns", "add", self.bridge_ns])
        br = ["ip", "-n", self.bridge_ns]
        _run([*br, "link", "add", BRIDGE, "type", "bridge", "mcast_snooping", "0"])
        _run([*br, "link", "set", BRIDGE, "up"])
        for node in self.nodes:
            self._create_node(node)

    def _create_node(self, node: Node) -> None:
        _run(["ip", "netns", "add", node.ns])
        br = ["ip", "-n", self.bridge_ns]
        inside = ["ip", "-n", node.ns]
        _run([*br, "link", "add", node.bridge_port, "type", "veth",
              "peer", "name", NODE_INTERFACE, "netns", node.ns])  # fmt: skip
        _run([*br, "link", "set", node.bridge_port, "master", BRIDGE, "up"])
        _run([*inside, "addr", "add", f"{node.ip}/24", "dev", NODE_INTERFACE])
        _run([*inside, "link", "set", NODE_INTERFACE, "up"])
        _run([*inside, "link", "set", "lo", "up"])

    def close(self) -> None:
        """Stop started processes and delete every namespace with this mesh's prefix."""
        for node in self.nodes:
            node.stop_processes()
        ours = f"{self.prefix}-"
        for namespace in list_namespaces():
            if namespace.startswith(ours):
                delete_namespace(namespace)

    # -- link control ----------------------------------------------------------------------

    def _ends(self, i: int, direction: Direction) -> list[tuple[str, str]]:
        """(namespace, device) pairs whose egress shapes traffic of node i in `direction`."""
        node = self.nodes[i]
        node_end = (node.ns, NODE_INTERFACE)
        bridge_end = (self.bridge_ns, node.bridge_port)
        return {"egress": [node_end], "ingress": [bridge_end], "both": [node_end, bridge_end]}[
            direction
        ]

    def link_down(self, i: int, *, end: Literal["bridge", "node"] = "bridge") -> None:
        """Cut node i off: by default its bridge port goes down (a pulled cable: the node keeps
        its address and sees no carrier); `end="node"` downs the node's own eth0 instead."""
        self._set_link(i, end, "down")

    def link_up(self, i: int, *, end: Literal["bridge", "node"] = "bridge") -> None:
        """Undo `link_down` (the same `end`)."""
        self._set_link(i, end, "up")

    def _set_link(self, i: int, end: str, state: str) -> None:
        node = self.nodes[i]
        ns, device = (
            (self.bridge_ns, node.bridge_port) if end == "bridge" else (node.ns, NODE_INTERFACE)
        )
        _run(["ip", "-n", ns, "link", "set", device, state])

    def remove_address(self, i: int, ip: str | None = None) -> None:
        """Take an address (default: `nodes[i].ip`) off node i's eth0, the link staying up: a
        network that went away, or an old lease."""
        node = self.nodes[i]
        _run(["ip", "-n", node.ns, "addr", "del", f"{ip or node.ip}/24", "dev", NODE_INTERFACE])

    def add_address(self, i: int, host: int) -> str:
        """Give node i's eth0 the address 10.77.<subnet>.<host> (a network that came up, or a
        new lease); it becomes `nodes[i].ip`, which is returned."""
        node = self.nodes[i]
        # As systemd sets it: removing the first address then keeps this one (the kernel's
        # default removes every other address of the subnet with it).
        sysctl = f"net.ipv4.conf.{NODE_INTERFACE}.promote_secondaries=1"
        _run(["ip", "netns", "exec", node.ns, "sysctl", "-q", "-w", sysctl])
        node.ip = f"10.77.{self.subnet}.{host}"
        _run(["ip", "-n", node.ns, "addr", "add", f"{node.ip}/24", "dev", NODE_INTERFACE])
        return node.ip

    def limit_rate(self, i: int, rate: str = "100mbit", *, direction: Direction = "both") -> None:
        """Cap node i's link with a token bucket (`tbf`; this kernel has no netem)."""
        bits_per_s = parse_rate(rate)
        # tbf needs a bucket of at least rate/HZ; 10 ms of traffic is plenty and keeps it smooth.
        burst_bytes = max(bits_per_s // 8 // 100, 4 * 1514)
        for ns, device in self._ends(i, direction):
            tbf = ["tbf", "rate", rate, "burst", str(burst_bytes), "latency", "100ms"]
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", device, "root", *tbf])

    def clear_rate(self, i: int, *, direction: Direction = "both") -> None:
        """Remove a `limit_rate` cap (no error when none is set)."""
        for ns, device in self._ends(i, direction):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", device, "root"], check=False)


@pytest.fixture
def netns_mesh() -> Iterator[Callable[..., Mesh]]:
    """Fixture factory: `make(n_nodes, **kwargs)` returns an entered Mesh closed at teardown."""
    require_root_and_netns()
    cleanup_stale()
    meshes: list[Mesh] = []

    def make(n_nodes: int, **kwargs: Any) -> Mesh:
        mesh = Mesh(n_nodes, **kwargs)
        meshes.append(mesh)
        return mesh.__enter__()

    try:
        yield make
    finally:
        for mesh in reversed(meshes):
            mesh.close()
