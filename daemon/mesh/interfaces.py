"""Which addresses mDNS announces and browses on: chosen automatically or named by the user.

Automatic choice skips loopback and container/VM bridges (exo #858 announced on docker0);
named interfaces are taken as given. Discovery only ever binds to the explicit IPv4 addresses
this module returns, never to every interface.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence

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


def resolve_interfaces(spec: Sequence[str] | None, skip: Sequence[str] = ()) -> list[str]:
    """Map interface names or IPv4 addresses to the IPv4 addresses to announce on.

    `spec=None` chooses automatically: every interface that is up and has an IPv4 address,
    except loopback and container/VM bridges (`VIRTUAL_INTERFACE_PREFIXES`). Named entries are
    taken as given, loopback and bridges included. Anything in `skip` (names or addresses) is
    never returned. Reads the current network namespace through psutil.

    An empty list means nothing is usable (no network, or everything skipped): the caller runs
    without mDNS. A named entry that does not exist raises InterfaceSelectionError.
    """
    addresses = {
        name: [a.address for a in entries if a.family == socket.AF_INET]
        for name, entries in psutil.net_if_addrs().items()
    }
    up = {name: stats.isup for name, stats in psutil.net_if_stats().items()}
    return select_interface_addresses(spec, skip, addresses, up)


def select_interface_addresses(
    spec: Sequence[str] | None,
    skip: Sequence[str],
    addresses: Mapping[str, Sequence[str]],
    up: Mapping[str, bool],
) -> list[str]:
    """The pure part of `resolve_interfaces`: `addresses` maps interface name -> IPv4 addresses."""
    if spec is None:
        chosen = _automatic_interfaces(addresses, up)
    else:
        chosen = [pair for entry in spec for pair in _explicit_interface(entry, addresses)]
    skipped = set(skip)
    result = [ip for name, ip in chosen if name not in skipped and ip not in skipped]
    return list(dict.fromkeys(result))


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
