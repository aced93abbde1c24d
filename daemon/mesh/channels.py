"""gRPC options, channels and servers of the peer port: one definition for every peer service.

The peer port carries the mesh's own RPCs (Peer) and the data plane's streams (DataPlane) on
one mutual-TLS server, and a node dials a peer once for both; so the limits and keepalives
are defined once, here. Prompt chunks and model-part chunks are large messages, hence the
64 MiB limit; keepalives notice a silently dead TCP connection in ~12 s even when no call is
running (the heartbeat stream notices a lost peer much sooner).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from meshd.mesh import security

MAX_MESSAGE_BYTES = 64 << 20

PEER_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    *security.CHANNEL_OPTIONS,
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 2_000),
]

PEER_SERVER_OPTIONS: list[tuple[str, Any]] = [
    # gRPC binds with SO_REUSEPORT by default: a second daemon on the same port would start
    # and the kernel would split connections between the two. Off, the second fails to bind.
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]

ChannelFactory = Callable[[str], grpc.aio.Channel]


def peer_channel(
    address: str, credentials: grpc.ChannelCredentials, *, dedicated: bool = False
) -> grpc.aio.Channel:
    """A mutual-TLS channel to a peer; `dedicated` gives it its own TCP connection.

    Call on the asyncio thread. Bandwidth probes use a dedicated connection so that they do
    not queue behind (or delay) the heartbeat stream.
    """
    options = list(PEER_CHANNEL_OPTIONS)
    if dedicated:
        options.append(("grpc.use_local_subchannel_pool", 1))
    return grpc.aio.secure_channel(address, credentials, options=options)


def peer_channel_factory(credentials: security.NodeCredentials) -> ChannelFactory:
    """Channels to peers under the mesh CA, for components that dial by address."""
    channel_credentials = security.channel_credentials(credentials)

    def factory(address: str) -> grpc.aio.Channel:
        return peer_channel(address, channel_credentials)

    return factory


def peer_server(extra_options: list[tuple[str, Any]] | None = None) -> grpc.aio.Server:
    """A grpc.aio server with the peer port's options (add services, then a secure port);
    the daemon adds its connection gate's (see meshd.mesh.gate)."""
    return grpc.aio.server(options=[*PEER_SERVER_OPTIONS, *(extra_options or [])])
