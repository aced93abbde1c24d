"""What this host's network lets a mesh do, read without sending anything: interface state,
the route multicast takes, which TCP ports can be bound and who holds them, firewall rules.

`meshd doctor` reads these. Nothing here sends a packet: routes come from the kernel's own
lookup (`ip route get`, `route -n get`), ports from a bind that is closed at once, holders and
flags from psutil, firewall rules from ufw's and firewalld's own tools.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass

import psutil

MDNS_GROUP = "224.0.0.251"
MDNS_PORT = 5353
TOOL_TIMEOUT_S = 5.0  # a local tool that does not answer within this is reported, not waited for


@dataclass(frozen=True)
class InterfaceState:
    """One interface as the kernel reports it."""

    name: str
    ipv4: tuple[str, ...]
    up: bool  # administratively up and running (carrier)
    multicast: bool  # the MULTICAST flag
    loopback: bool


@dataclass(frozen=True)
class MulticastRoute:
    """Where the kernel sends `MDNS_GROUP` when a socket names no interface."""

    device: str | None  # None: no route (or the lookup failed, see `error`)
    error: str = ""


@dataclass(frozen=True)
class PortState:
    """Whether a TCP port can be bound at an address, and who listens there when not."""

    bindable: bool
    reason: str = ""  # why not, in words ("in use", "not an address of this machine", ...)
    holder: str = ""  # "pid 123 (python3 -m http.server)" when the listener is known


def interface_states() -> dict[str, InterfaceState]:
    """Every interface of this network namespace, by name."""
    addresses = psutil.net_if_addrs()
    stats = psutil.net_if_stats()
    states = {}
    for name in sorted(set(addresses) | set(stats)):
        flags = set(getattr(stats.get(name), "flags", "").split(","))
        ipv4 = tuple(a.address for a in addresses.get(name, ()) if a.family == socket.AF_INET)
        up = bool(stats.get(name) and stats[name].isup) and ("running" in flags or not flags)
        states[name] = InterfaceState(
            name=name,
            ipv4=ipv4,
            up=up,
            multicast="multicast" in flags,
            loopback="loopback" in flags or name == "lo",
        )
    return states


def interface_of(address: str, states: dict[str, InterfaceState]) -> str | None:
    """The name of the interface that holds `address`."""
    return next((s.name for s in states.values() if address in s.ipv4), None)


def multicast_route(group: str = MDNS_GROUP) -> MulticastRoute:
    """The kernel's route for `group` without a chosen interface (Linux `ip`, macOS `route`)."""
    if platform.system() == "Darwin":
        return _darwin_route(group)
    if shutil.which("ip") is None:
        return MulticastRoute(None, "`ip` (iproute2) is not installed; cannot read the routes")
    done = _run(["ip", "-j", "route", "get", group])
    if done is None:
        return MulticastRoute(None, "`ip route get` did not answer")
    if done.returncode != 0:
        return MulticastRoute(None, (done.stderr or done.stdout).strip() or "no route")
    try:
        routes = json.loads(done.stdout or "[]")
    except json.JSONDecodeError:
        return MulticastRoute(None, f"cannot read `ip -j route get` output: {done.stdout!r}")
    device = routes[0].get("dev") if routes else None
    return MulticastRoute(device, "" if device else "no route")


def _darwin_route(group: str) -> MulticastRoute:
    done = _run(["route", "-n", "get", group])
    if done is None:
        return MulticastRoute(None, "`route -n get` did not answer")
    match = re.search(r"^\s*interface:\s*(\S+)", done.stdout, re.MULTILINE)
    if done.returncode != 0 or match is None:
        return MulticastRoute(None, (done.stderr or done.stdout).strip() or "no route")
    return MulticastRoute(match.group(1))


def multicast_route_fix(device: str) -> str:
    """The command that sends multicast out of `device` by default."""
    if platform.system() == "Darwin":
        return f"sudo route -nv add -net 224.0.0.0/4 -interface {device}"
    return f"sudo ip route add 224.0.0.0/4 dev {device}"


def tcp_port_state(host: str, port: int) -> PortState:
    """Try to bind `host:port` as a server would (SO_REUSEADDR, so a closed connection's
    TIME_WAIT does not count), then close it at once; name the listener when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            return PortState(False, _bind_reason(error, host), listener_of(port))
    return PortState(True)


def _bind_reason(error: OSError, host: str) -> str:
    if error.errno == errno.EADDRINUSE:
        return "in use"
    if error.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine"
    if error.errno == errno.EACCES:
        return "a port below 1024 needs root (or CAP_NET_BIND_SERVICE)"
    return error.strerror or str(error)


def listener_of(port: int) -> str:
    """Who listens on TCP `port` in this namespace ("" when it cannot be seen, e.g. another
    user's process without root)."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return ""
    for connection in connections:
        if connection.status != psutil.CONN_LISTEN or connection.laddr.port != port:
            continue
        if not connection.pid:
            return "another user's process (run as root to see which)"
        try:
            process = psutil.Process(connection.pid)
            command = " ".join(process.cmdline()[:4]) or process.name()
        except psutil.Error:
            command = "?"
        return f"pid {connection.pid} ({command})"
    return ""


# ---------------------------------------------------------------- firewalls


@dataclass(frozen=True)
class Opening:
    """A port the mesh needs let through: `5353/udp`, `52300/tcp`."""

    port: int
    protocol: str  # "tcp" or "udp"
    why: str

    @property
    def spec(self) -> str:
        return f"{self.port}/{self.protocol}"


@dataclass(frozen=True)
class FirewallState:
    """The host firewall meshd knows how to read, and which openings it lacks."""

    name: str  # "ufw", "firewalld" or "" when neither is active
    missing: tuple[Opening, ...] = ()
    note: str = ""  # what could not be read, in words


def ufw_commands(openings: list[Opening]) -> list[str]:
    return [f"sudo ufw allow {o.spec}" for o in openings]


def firewalld_commands(openings: list[Opening]) -> list[str]:
    adds = " ".join(f"--add-port={o.spec}" for o in openings)
    return [f"sudo firewall-cmd --permanent {adds}", "sudo firewall-cmd --reload"]


def firewall_state(openings: list[Opening]) -> FirewallState:
    """ufw or firewalld, when one is active, and the openings its rules do not allow."""
    if shutil.which("ufw"):
        state = _ufw_state(openings)
        if state is not None:
            return state
    if shutil.which("firewall-cmd"):
        state = _firewalld_state(openings)
        if state is not None:
            return state
    return FirewallState("")


def _ufw_state(openings: list[Opening]) -> FirewallState | None:
    done = _run(["ufw", "status"])
    if done is None or done.returncode != 0:
        if _ufw_enabled_in_config():  # `ufw status` needs root; its config file does not
            return FirewallState("ufw", tuple(openings), "run as root to read ufw's rules")
        return None
    if "Status: active" not in done.stdout:
        return None
    allowed = done.stdout.splitlines()
    missing = tuple(o for o in openings if not _ufw_allows(allowed, o))
    return FirewallState("ufw", missing)


def _ufw_enabled_in_config() -> bool:
    try:
        text = open("/etc/ufw/ufw.conf", encoding="utf-8").read()  # noqa: SIM115
    except OSError:
        return False
    return re.search(r"^ENABLED=yes", text, re.MULTILINE) is not None


def _ufw_allows(lines: list[str], opening: Opening) -> bool:
    pattern = re.compile(rf"^{opening.port}(/{opening.protocol})?\s.*\bALLOW\b")
    return any(pattern.match(line.strip()) for line in lines)


def _firewalld_state(openings: list[Opening]) -> FirewallState | None:
    done = _run(["firewall-cmd", "--state"])
    if done is None or done.stdout.strip() != "running":
        return None
    missing = []
    for opening in openings:
        query = _run(["firewall-cmd", f"--query-port={opening.spec}"])
        allowed = query is not None and query.stdout.strip() == "yes"
        if not allowed and not (opening.port == MDNS_PORT and _firewalld_has_mdns_service()):
            missing.append(opening)
    return FirewallState("firewalld", tuple(missing))


def _firewalld_has_mdns_service() -> bool:
    done = _run(["firewall-cmd", "--query-service=mdns"])
    return done is not None and done.stdout.strip() == "yes"


def _run(argv: list[str]) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=TOOL_TIMEOUT_S,
            check=False,
            env={**os.environ, "LC_ALL": "C"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
