"""Which links may carry a tensor-parallel group's collectives: the rule, and the local facts.

Why a rule: MLX's ring backend (and the runners' control channel) is plain TCP, unauthenticated
and unencrypted: activations, and anyone able to reach the port during the group's start, could
read or join it. The mesh's own traffic is mutual TLS; the collectives are not, because a
collective is latency-bound (two per layer per token) and TLS on every one would cost more than
tensor parallelism gains on the links where it gains anything. So groups form only over links
nobody else shares:

* loopback: every member on one machine (tests, benchmarks);
* point-to-point links: a Thunderbolt bridge or a direct cable, recognised by the interface
  (``IFF_POINTOPOINT``, Linux's ``thunderbolt-net`` driver, macOS's Thunderbolt bridge) or by a
  point-to-point subnet (IPv4 /31 or /30, IPv6 /127 or /126: only two hosts fit);
* networks the user marks trusted in the config (``tensor_parallel_trusted_networks``, CIDRs):
  a switch they own, a lab VLAN.

Anything else (a shared LAN, Wi-Fi) is refused with the reason, and the plan falls back to
pipeline stages there (the planner's ``trusted`` link attribute comes from the same rule).
:func:`collective_link_verdict` is the rule, pure (facts + config in, verdict out);
:func:`describe_local_link` gathers the facts about this machine's side of a link.

The mesh's view (:func:`mesh_link_verdict`): every node judges its side of each link it
measures (its own address on that link, the peer's) and publishes the verdict with the link's
measurement (``LinkMeasurement.trusted``, ``trust_reason``); the mesh graph marks a link
trusted only when both sides allowed it, so every node plans from the same flags. One more
clause applies there: two daemons on one machine (loopback) are safe, but tensor parallelism
between them only shares the same cores while the planner counts each daemon's cores as its
own, so the mesh offers it only where the user marks loopback trusted (``127.0.0.0/8`` or
``::1/128`` in ``tensor_parallel_trusted_networks``: tests and benchmarks do).

This module lives in :mod:`meshd.mesh` (the mesh publishes the verdicts; the layering contract
keeps the mesh below inference); :mod:`meshd.inference.tensor_parallel` re-exports it.
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

THUNDERBOLT_DRIVERS = frozenset({"thunderbolt-net", "thunderbolt_net"})
IFF_POINTOPOINT = 0x10
POINT_TO_POINT_PREFIX = {4: 30, 6: 126}  # at least this long: at most two usable hosts


@dataclass(frozen=True)
class LinkFacts:
    """One node's side of the link to one peer.

    interface: the local interface the peer is reached on ("" when unknown).
    point_to_point: the interface is point-to-point (flag, Thunderbolt driver or bridge).
    prefix_length: of the local address's subnet on that interface (None when unknown).
    """

    local_address: str
    peer_address: str
    interface: str = ""
    point_to_point: bool = False
    prefix_length: int | None = None


@dataclass(frozen=True)
class LinkVerdict:
    """Whether a link may carry collectives in clear, and why (shown in plans and status)."""

    allowed: bool
    reason: str


def collective_link_verdict(link: LinkFacts, trusted_networks: Iterable[str] = ()) -> LinkVerdict:
    """The rule (module docstring) for one link. Malformed addresses or networks refuse."""
    try:
        local = ipaddress.ip_address(link.local_address)
        peer = ipaddress.ip_address(link.peer_address)
        networks = [ipaddress.ip_network(text, strict=False) for text in trusted_networks]
    except ValueError as error:
        return LinkVerdict(False, f"refused: {error}")
    where = f" on {link.interface}" if link.interface else ""
    if local.is_loopback and peer.is_loopback:
        return LinkVerdict(True, f"loopback {peer} (same machine)")
    if link.point_to_point:
        return LinkVerdict(True, f"point-to-point link{where} to {peer}")
    minimum = POINT_TO_POINT_PREFIX[local.version]
    if (
        link.prefix_length is not None
        and link.prefix_length >= minimum
        and local.version == (peer.version)
    ):
        subnet = ipaddress.ip_network(f"{local}/{link.prefix_length}", strict=False)
        if peer in subnet:
            return LinkVerdict(True, f"point-to-point subnet {subnet}{where} to {peer}")
    for network in networks:
        if local in network and peer in network:
            return LinkVerdict(True, f"network {network}{where} marked trusted in the config")
    return LinkVerdict(
        False,
        f"refused: the link{where} to {peer} is a shared network and tensor-parallel traffic "
        "travels in clear; use a Thunderbolt bridge or a direct cable, or add the network to "
        "tensor_parallel_trusted_networks if nobody else is on it",
    )


def group_link_verdict(
    links: Sequence[LinkFacts], trusted_networks: Iterable[str] = ()
) -> LinkVerdict:
    """All of a group's links (each member's side to each other member) must be allowed."""
    networks = list(trusted_networks)
    if not links:
        return LinkVerdict(False, "refused: a group needs at least one link between its members")
    verdicts = [collective_link_verdict(link, networks) for link in links]
    refused = [v.reason for v in verdicts if not v.allowed]
    if refused:
        return LinkVerdict(False, refused[0])
    reasons = sorted({v.reason for v in verdicts})
    return LinkVerdict(True, "; ".join(reasons))


def mesh_link_verdict(
    local_address: str, peer_address: str, trusted_networks: Iterable[str] = ()
) -> LinkVerdict:
    """This node's side of the link to a peer, as the mesh publishes it (module docstring):
    the rule for the local interface's facts, except that loopback needs marking too."""
    networks = list(trusted_networks)
    try:
        local = ipaddress.ip_address(local_address)
        peer = ipaddress.ip_address(peer_address)
        marked = [ipaddress.ip_network(text, strict=False) for text in networks]
    except ValueError as error:
        return LinkVerdict(False, f"refused: {error}")
    same_machine = local.is_loopback and peer.is_loopback
    if same_machine and not any(local in net and peer in net for net in marked):
        return LinkVerdict(
            False,
            f"refused: loopback {peer} is this machine; tensor-parallel members there "
            "would share its cores, which planning cannot see; add 127.0.0.0/8 to "
            "tensor_parallel_trusted_networks to allow it (tests, benchmarks)",
        )
    return collective_link_verdict(describe_local_link(local_address, peer_address), networks)


def describe_local_link(local_address: str, peer_address: str) -> LinkFacts:
    """This machine's facts about the interface that holds ``local_address`` (in the current
    network namespace), for the link to ``peer_address``."""
    import psutil

    try:
        local = ipaddress.ip_address(local_address)
    except ValueError:
        return LinkFacts(local_address, peer_address)
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            address = entry.address.split("%", 1)[0]
            try:
                if ipaddress.ip_address(address) != local:
                    continue
            except ValueError:
                continue
            return LinkFacts(
                local_address,
                peer_address,
                interface=name,
                point_to_point=interface_is_point_to_point(name),
                prefix_length=_prefix_length(entry.netmask, local.version),
            )
    return LinkFacts(local_address, peer_address)


def interface_is_point_to_point(name: str, sys_class_net: Path = Path("/sys/class/net")) -> bool:
    """Linux: the interface's ``IFF_POINTOPOINT`` flag or a Thunderbolt network driver. macOS:
    a device that ``networksetup -listallhardwareports`` calls a Thunderbolt port or bridge."""
    folder = sys_class_net / name
    if folder.is_dir():
        try:
            flags = int((folder / "flags").read_text().strip(), 16)
        except (OSError, ValueError):
            flags = 0
        driver = folder / "device" / "driver"
        driver_name = driver.resolve().name if driver.exists() else ""
        return bool(flags & IFF_POINTOPOINT) or driver_name in THUNDERBOLT_DRIVERS
    if sys.platform == "darwin":
        return name in thunderbolt_devices(_macos_hardware_ports())
    return False


def thunderbolt_devices(hardware_ports: str) -> frozenset[str]:
    """Devices of ``networksetup -listallhardwareports`` output whose port is Thunderbolt
    ("Thunderbolt Bridge" -> bridge0, "Thunderbolt 1" -> en2, ...)."""
    devices, port = set(), ""
    for line in hardware_ports.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Hardware Port":
            port = value.strip()
        elif key.strip() == "Device" and port.startswith("Thunderbolt"):
            devices.add(value.strip())
    return frozenset(devices)


def _macos_hardware_ports() -> str:
    try:
        result = subprocess.run(
            ["networksetup", "-listallhardwareports"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout


def _prefix_length(netmask: str | None, version: int) -> int | None:
    if not netmask:
        return None
    try:
        if version == 4:
            return ipaddress.ip_network(f"0.0.0.0/{netmask}").prefixlen
        return ipaddress.ip_network(f"::/{netmask}").prefixlen
    except ValueError:
        return None
