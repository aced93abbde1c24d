"""The Peer gRPC service: what a daemon answers to other members of its mesh.

It runs on the asyncio thread (grpc.aio) behind mutual TLS: only holders of a
certificate issued under the mesh CA get past the handshake. Handlers read the
membership's immutable `NodeState` snapshot directly and call into trio only
for decisions that touch the peer table (Hello).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol

import grpc

from meshd.mesh import links
from meshd.mesh.membership import Membership
from meshd.mesh.security import peer_node_id
from meshd.runtime.bridge import AsyncioThread
from meshd.wire import pb, rpc

log = logging.getLogger("meshd.peer")


class ProposalReceiver(Protocol):
    def receive(self, message: pb.ProposalMessage, cert_node_id: str | None) -> None: ...


class PeerService(rpc.PeerServicer):
    """Peer RPC handlers bound to one daemon's membership."""

    def __init__(self, membership: Membership, bridge: AsyncioThread) -> None:
        self._membership = membership
        self._bridge = bridge
        self.agreement: ProposalReceiver | None = None
        # (model name, digest) -> this node's local model directory, or None.
        self.model_source: Callable[[str, str], Path | None] = lambda name, digest: None

    async def Hello(self, request: pb.HelloRequest, context: grpc.aio.ServicerContext):
        cert_node_id = peer_node_id(context)
        caller_host = caller_address_host(context.peer())

        async def decide() -> pb.HelloReply:
            return self._membership.hello_reply(request, cert_node_id, caller_host)

        return await self._bridge.run_in_trio(decide)

    async def Heartbeat(
        self, request_iterator: AsyncIterator[pb.Beat], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Beat]:
        me = self._membership.identity.node_id
        async for beat in request_iterator:
            yield pb.Beat(
                node_id=me,
                seq=beat.seq,
                state_version=self._membership.snapshot.version,
                sent_at=time.time(),
            )

    async def GetState(self, request: pb.StateRequest, context: grpc.aio.ServicerContext):
        return self._membership.snapshot

    async def Ping(self, request: pb.PingRequest, context: grpc.aio.ServicerContext):
        return pb.PingReply(payload=request.payload)

    async def ProbeBandwidth(self, request_iterator, context: grpc.aio.ServicerContext):
        return await links.ProbeReceiver.receive(request_iterator)

    async def FetchModelPart(
        self, request: pb.ModelPartRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FileChunk]:
        from meshd.models.share import PartSpec, export_part, file_chunks

        source = self.model_source(request.model_name, request.model_digest)
        if source is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"node {self._membership.identity.node_id} has no copy of model "
                f"{request.model_name} ({request.model_digest})",
            )
        part = PartSpec.from_request(request)
        with tempfile.TemporaryDirectory(prefix="meshd-part-") as tmp:
            root = Path(tmp)
            paths = await asyncio.to_thread(export_part, source, part, root)
            log.info(
                "sending layers %d-%d of %s to %s",
                part.layer_start,
                part.layer_end - 1,
                part.name,
                peer_node_id(context),
            )
            for chunk in file_chunks(paths, root):
                yield chunk

    async def Propose(self, request: pb.ProposalMessage, context: grpc.aio.ServicerContext):
        receiver = self.agreement
        if receiver is not None:
            self._bridge.call_soon_in_trio(receiver.receive, request, peer_node_id(context))
        return pb.ProposeAck()


def caller_address_host(peer: str) -> str | None:
    """The IP of a gRPC peer string ("ipv4:10.0.0.2:5555", "ipv6:[fe80::1]:5555")."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return None
