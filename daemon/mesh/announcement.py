"""What a daemon announces over mDNS, and how a peer's announcement is read and checked.

The TXT record carries only public facts: node id, mesh name, protocol version, gRPC port and
the mesh fingerprint (a public hash that lets daemons skip meshes they cannot join). A peer's
record is parsed strictly: a missing or invalid field raises `MalformedAnnouncementError`
naming it, and `incompatibility_with` says in words why a well-formed peer is not ours.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass

from zeroconf import ServiceInfo

SERVICE_TYPE = "_meshd._tcp.local."

TXT_NODE_ID = "node"
TXT_MESH_NAME = "mesh"
TXT_PROTOCOL_VERSION = "proto"
TXT_GRPC_PORT = "grpc"
TXT_FINGERPRINT = "fp"
# Bumped on every update(): a TXT record identical to one still cached (going back to an earlier
# mesh within its 1 s flush window) would otherwise raise no browser event at all.
TXT_REVISION = "rev"

# A DNS label holds at most 63 bytes, and the node id is the service's instance label.
_NODE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
_FINGERPRINT_PATTERN = re.compile(r"[0-9a-f]{0,64}")
_MAX_MESH_NAME_CHARS = 63


class MalformedAnnouncementError(ValueError):
    """A TXT record or announcement field is missing or invalid; the message names which."""


@dataclass(frozen=True)
class Announcement:
    """What a daemon announces about itself over mDNS (public facts only)."""

    node_id: str
    mesh_name: str
    protocol_version: int
    grpc_port: int
    fingerprint: str
    addresses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_announcement_fields(self)

    @property
    def instance_name(self) -> str:
        """The mDNS service instance name; derived from the node id so it is unique per node."""
        return f"{self.node_id}.{SERVICE_TYPE}"

    def to_txt(self) -> dict[str, str]:
        """The TXT properties announcing this node."""
        return {
            TXT_NODE_ID: self.node_id,
            TXT_MESH_NAME: self.mesh_name,
            TXT_PROTOCOL_VERSION: str(self.protocol_version),
            TXT_GRPC_PORT: str(self.grpc_port),
            TXT_FINGERPRINT: self.fingerprint,
        }

    def to_service_info(self, revision: int = 0) -> ServiceInfo:
        """A zeroconf ServiceInfo for registering this announcement (`revision` goes in TXT)."""
        return ServiceInfo(
            SERVICE_TYPE,
            self.instance_name,
            port=self.grpc_port,
            properties={**self.to_txt(), TXT_REVISION: str(revision)},
            server=f"{self.node_id}.local.",
            parsed_addresses=list(self.addresses),
        )

    @classmethod
    def from_service_info(cls, info: ServiceInfo) -> Announcement:
        """Parse a resolved peer; raises MalformedAnnouncementError naming the bad field."""
        txt = info.decoded_properties
        node_id = _required_txt(txt, TXT_NODE_ID)
        if info.name != f"{node_id}.{SERVICE_TYPE}":
            raise MalformedAnnouncementError(
                f"instance name {info.name!r} does not match its TXT node id {node_id!r}"
            )
        return cls(
            node_id=node_id,
            mesh_name=_required_txt(txt, TXT_MESH_NAME),
            protocol_version=_int_txt(txt, TXT_PROTOCOL_VERSION),
            grpc_port=_int_txt(txt, TXT_GRPC_PORT),
            fingerprint=_required_txt(txt, TXT_FINGERPRINT),
            addresses=tuple(sorted(info.parsed_scoped_addresses())),
        )

    def incompatibility_with(self, peer: Announcement) -> str | None:
        """Why `peer` cannot be in our mesh, or None when it can."""
        if peer.mesh_name != self.mesh_name:
            return f"mesh name {peer.mesh_name!r} differs from ours ({self.mesh_name!r})"
        if peer.protocol_version != self.protocol_version:
            return (
                f"protocol version {peer.protocol_version} differs from ours "
                f"({self.protocol_version}); run the same meshd version on every node"
            )
        if peer.fingerprint != self.fingerprint:
            return (
                f"mesh fingerprint {peer.fingerprint!r} differs from ours ({self.fingerprint!r}): "
                "same mesh name, different secret; join with a token from a member"
            )
        return None


def _check_announcement_fields(a: Announcement) -> None:
    if not _NODE_ID_PATTERN.fullmatch(a.node_id):
        raise MalformedAnnouncementError(
            f"node id {a.node_id!r} is not a DNS label (1-63 letters, digits, '-' or '_')"
        )
    if not a.mesh_name or len(a.mesh_name) > _MAX_MESH_NAME_CHARS:
        raise MalformedAnnouncementError(f"mesh name {a.mesh_name!r} must have 1-63 characters")
    if a.protocol_version < 0:
        raise MalformedAnnouncementError(f"protocol version {a.protocol_version} is negative")
    if not 1 <= a.grpc_port <= 65535:
        raise MalformedAnnouncementError(f"gRPC port {a.grpc_port} is not in 1-65535")
    if not _FINGERPRINT_PATTERN.fullmatch(a.fingerprint):
        raise MalformedAnnouncementError(
            f"fingerprint {a.fingerprint!r} is not lowercase hex of at most 64 digits"
        )
    for address in a.addresses:
        try:
            ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            raise MalformedAnnouncementError(f"address {address!r} is not an IP address") from None


def _required_txt(txt: Mapping[str, str | None], key: str) -> str:
    value = txt.get(key)
    if value is None:
        raise MalformedAnnouncementError(f"TXT record has no {key!r} entry")
    return value


def _int_txt(txt: Mapping[str, str | None], key: str) -> int:
    value = _required_txt(txt, key)
    if not value.isdigit():
        raise MalformedAnnouncementError(f"TXT entry {key}={value!r} is not a whole number")
    return int(value)
