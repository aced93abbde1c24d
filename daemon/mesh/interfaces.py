"""Which addresses mDNS announces and browses on: chosen automatically or named by the user.

Automatic choice skips loopback and container/VM bridges (exo #858 announced on docker0);
named interfaces are taken as given. Discovery only ever binds to the explicit IPv4 addresses
this module returns, never to every interface.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil

# Interface names of container and VM bridges: announcing there reaches containers, not peers
# (exo #858 picked docker0). Used only when the interfaces are chosen automatically.
VIRTUAL_INTERFACE_PREFIXES = (
    "docker",
    "br-",
    "veth",
    "virbr",
    "vnet",
    "cni",
    "flannel",
    "cali",
    "podman",
    "lxcbr",
    "lxdbr",
    "vboxnet",
    "vmnet",
)


class InterfaceSelectionError(ValueError):
    """The interface list cannot be resolved; the message lists what is available."""


@dataclass(frozen=True)
class InterfaceChoice:
    """The interfaces mDNS should use at one moment, and why a named one cannot be used now.

    An interface may have no address yet (a service started before the network), lose it, or
    get another (a laptop that moves): the daemon reads this again every few seconds and
    follows it, so an unusable named entry is a reason to wait and say so, not to fail.
    """

    chosen: tuple[tuple[str, str], ...] = ()  # (interface name, IPv4 address), in order
    unavailable: tuple[str, ...] = ()  # named entries not usable now, each in words
    present: frozenset[str] = frozenset()  # every IPv4 address the machine has now

    @property
    def addresses(self) -> tuple[str, ...]:
        """The IPv4 addresses to announce and browse on."""
        return tuple(ip for _, ip in self.chosen)

    def describe(self, addresses: Sequence[str] | None = None) -> str:
        """`addresses` (default: all chosen) with their interfaces: "eth0 10.0.0.5"."""
        names = {ip: name for name, ip in self.chosen}
        wanted = self.addresses if addresses is None else addresses
        return ", ".join(f"{names[ip]} {ip}" if ip in names else ip for ip in wanted)


def resolve_interfaces(spec: Sequence[str] | None, skip: Sequence[str] = ()) -> list[str]:
    """Map interface names or IPv4 addresses to the IPv4 addresses to announce on.

    `spec=None` chooses automatically: every interface that is up and has an IPv4 address,
    except loopback and container/VM bridges (`VIRTUAL_INTERFACE_PREFIXES`). Named entries are
    taken as given, loopback and bridges included. Anything in `skip` (names or addresses) is
    never returned. Reads the current network namespace through psutil.

    An empty list means nothing is usable (no network, or everything skipped): the caller runs
    without mDNS. A named entry that does not exist raises InterfaceSelectionError.
    """
    addresses, up = _read_machine()
    return select_interface_addresses(spec, skip, addresses, up)


def read_interface_choice(spec: Sequence[str] | None, skip: Sequence[str] = ()) -> InterfaceChoice:
    """`choose_interfaces` on the current network namespace (blocking: psutil reads it)."""
    addresses, up = _read_machine()
    return choose_interfaces(spec, skip, addresses, up)


def _read_machine() -> tuple[dict[str, list[str]], dict[str, bool]]:
    addresses = {
        name: [a.address for a in entries if a.family == socket.AF_INET]
        for name, entries in psutil.net_if_addrs().items()
    }
    up = {name: stats.isup for name, stats in psutil.net_if_stats().items()}
    return addresses, up


def select_interface_addresses(
    spec: Sequence[str] | None,
    skip: Sequence[str],
    addresses: Mapping[str, Sequence[str]],
    up: Mapping[str, bool],
) -> list[str]:
    """The pure part of `resolve_interfaces`: `addresses` maps interface name -> IPv4 addresses.

    Raises InterfaceSelectionError for the first named entry that cannot be used now."""
    choice = choose_interfaces(spec, skip, addresses, up)
    if choice.unavailable:
        raise InterfaceSelectionError(choice.unavailable[0])
    return list(choice.addresses)


def choose_interfaces(
    spec: Sequence[str] | None,
    skip: Sequence[str],
    addresses: Mapping[str, Sequence[str]],
    up: Mapping[str, bool],
) -> InterfaceChoice:
    """What `select_interface_addresses` picks, with a named entry that cannot be used now
    reported in `unavailable` instead of raised (pure)."""
    unavailable: list[str] = []
    if spec is None:
        chosen = _automatic_interfaces(addresses, up)
    else:
        chosen = []
        for entry in spec:
            try:
                chosen.extend(_explicit_interface(entry, addresses))
            except InterfaceSelectionError as error:
                unavailable.append(str(error))
    skipped = set(skip)
    kept: dict[str, str] = {}  # address -> interface name; the first mention wins
    for name, ip in chosen:
        if name not in skipped and ip not in skipped:
            kept.setdefault(ip, name)
    return InterfaceChoice(
        chosen=tuple((name, ip) for ip, name in kept.items()),
        unavailable=tuple(unavailable),
        present=frozenset(ip for ips in addresses.values() for ip in ips),
    )


def _automatic_interfaces(
    addresses: Mapping[str, Sequence[str]], up: Mapping[str, bool]
) -> list[tuple[str, str]]:
    return [
        (name, ip)
        for name, ips in addresses.items()
        if up.get(name, False) and not name.startswith(VIRTUAL_INTERFACE_PREFIXES)
        for ip in ips
        if not ipaddress.ip_address(ip).is_loopback
    ]


def _explicit_interface(
    entry: str, addresses: Mapping[str, Sequence[str]]
) -> list[tuple[str, str]]:
    if entry in addresses:
        if not addresses[entry]:
            raise InterfaceSelectionError(
                f"interface {entry!r} has no IPv4 address; available: {_describe(addresses)}"
            )
        return [(entry, ip) for ip in addresses[entry]]
    owners = [name for name, ips in addresses.items() if entry in ips]
    if owners:
        return [(owners[0], entry)]
    raise InterfaceSelectionError(
        f"{entry!r} is neither an interface name nor an IPv4 address of this machine; "
        f"available: {_describe(addresses)}"
    )


def _describe(addresses: Mapping[str, Sequence[str]]) -> str:
    return ", ".join(f"{name} ({', '.join(ips) or 'no IPv4'})" for name, ips in addresses.items())


def check_bind_addresses(interfaces: Sequence[str]) -> list[str]:
    if not interfaces:
        raise InterfaceSelectionError(
            "Discovery needs an explicit list of IPv4 addresses (see resolve_interfaces); "
            "it never binds to every interface on its own"
        )
    for ip in interfaces:
        try:
            parsed = ipaddress.ip_address(ip)
        except ValueError:
            parsed = None
        if parsed is None or parsed.version != 4 or parsed.is_unspecified or parsed.is_multicast:
            raise InterfaceSelectionError(
                f"{ip!r} is not a unicast IPv4 interface address; map interface names to "
                "addresses with resolve_interfaces"
            )
    return list(interfaces)
