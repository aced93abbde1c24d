"""The Peer gRPC service: what a daemon answers to other members of its mesh.

It runs on the asyncio thread (grpc.aio) behind mutual TLS: only holders of a certificate
issued under the mesh CA get past the handshake. Handlers read the membership's published
`NodeState` (an immutable value the trio side replaces whole) directly, and call into trio,
awaiting the answer, for decisions that touch trio-owned state (Hello, Propose). A bad
message from a member is answered with a status naming the problem and one warning line;
it never reaches trio as an unhandled error.

Two services of other subsystems ride on the peer port without this package importing them
(mesh sits below agreement and models): proposals go to a `ProposalReceiver` (the
agreement) and model parts come from a `ModelPartSource` (model distribution), files of a
Hub repository from a `HubFileSource`; the node plugs them in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from meshd.mesh import links
from meshd.mesh.membership import Membership
from meshd.mesh.security import peer_node_id
from meshd.runtime.bridge import AsyncioThread
from meshd.wire import pb, rpc

log = logging.getLogger("meshd.peer")


class ProposalReceiver(Protocol):
    """Takes a member's agreement message on the trio thread.

    Raises PermissionError when the message claims another sender than the certificate
    names, and ValueError when it is malformed; both are refused, the receiver goes on.
    """

    def receive(self, message: pb.ProposalMessage, cert_node_id: str | None) -> None: ...


class ModelPartSource(Protocol):
    """Streams a part of a model this node holds (on the asyncio thread).

    Raises FileNotFoundError when this node has no copy of the model, ValueError when the
    request is malformed.
    """

    def stream_part(
        self, request: pb.ModelPartRequest, caller: str | None
    ) -> AsyncIterator[pb.FileChunk]: ...


class HubFileSource(Protocol):
    """Streams a file of a Hub repository this node downloads or has (asyncio thread).

    Raises FileNotFoundError when this node neither has nor downloads the file, ValueError
    when the request is malformed, TimeoutError when the file stopped growing.
    """

    def stream_file(
        self, request: pb.HubFileRequest, caller: str | None
    ) -> AsyncIterator[pb.FileChunk]: ...


class PeerService(rpc.PeerServicer):
    """Peer RPC handlers bound to one daemon's membership."""

    def __init__(
        self,
        membership: Membership,
        bridge: AsyncioThread,
        agreement: ProposalReceiver | None = None,
        model_parts: ModelPartSource | None = None,
        hub_files: HubFileSource | None = None,
    ) -> None:
        self._membership = membership
        self._bridge = bridge
        self._agreement = agreement
        self._model_parts = model_parts
        self._hub_files = hub_files

    async def Hello(self, request: pb.HelloRequest, context: grpc.aio.ServicerContext):
        return await self._bridge.call_in_trio(
            self._membership.hello_reply,
            request,
            peer_node_id(context),
            caller_address_host(context.peer()),
        )

    async def Heartbeat(
        self, request_iterator: AsyncIterator[pb.Beat], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Beat]:
        """Echo each beat with this node's state version; pass the caller's version on.

        The caller beats as soon as its state changes, so a new version seen here is the
        quickest news of it: membership fetches that state now, not at its own next beat.
        """
        me = self._membership.identity.node_id
        caller = peer_node_id(context)
        seen = 0
        async for beat in request_iterator:
            if caller and beat.state_version > seen:
                seen = beat.state_version
                self._bridge.call_soon_in_trio(self._membership.note_peer_version, caller, seen)
            yield pb.Beat(
                node_id=me,
                seq=beat.seq,
                state_version=self._membership.own_state.version,
                sent_at=time.time(),
            )

    async def GetState(self, request: pb.StateRequest, context: grpc.aio.ServicerContext):
        return self._membership.own_state

    async def Ping(self, request: pb.PingRequest, context: grpc.aio.ServicerContext):
        return pb.PingReply(payload=request.payload)

    async def ProbeBandwidth(self, request_iterator, context: grpc.aio.ServicerContext):
        return await links.ProbeReceiver.receive(request_iterator)

    async def FetchModelPart(
        self, request: pb.ModelPartRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FileChunk]:
        caller = peer_node_id(context)
        if self._model_parts is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node shares no models")
        chunks = self._model_parts.stream_part(request, caller)
        async for chunk in _file_chunks(chunks, context, caller, "model part"):
            yield chunk

    async def FetchHubFile(
        self, request: pb.HubFileRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FileChunk]:
        caller = peer_node_id(context)
        if self._hub_files is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node shares no Hub files")
        chunks = self._hub_files.stream_file(request, caller)
        async for chunk in _file_chunks(chunks, context, caller, "Hub file"):
            yield chunk

    async def Propose(self, request: pb.ProposalMessage, context: grpc.aio.ServicerContext):
        if self._agreement is None:
            return pb.ProposeAck()
        caller = peer_node_id(context)
        try:
            await self._bridge.call_in_trio(self._agreement.receive, request, caller)
        except PermissionError as exc:
            log.warning("refused a proposal from %s: %s", caller, exc)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except ValueError as exc:
            log.warning("refused a malformed proposal from %s: %s", caller, exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed proposal: {exc}")
        return pb.ProposeAck()


def caller_address_host(peer: str) -> str | None:
    """The IP of a gRPC peer string ("ipv4:10.0.0.2:5555", "ipv6:[fe80::1]:5555")."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return None


async def _file_chunks(
    chunks: AsyncIterator[pb.FileChunk],
    context: grpc.aio.ServicerContext,
    caller: str | None,
    what: str,
) -> AsyncIterator[pb.FileChunk]:
    """A file streamed to a peer, its failures as the statuses the fetching side acts on:
    a file this node does not have (NOT_FOUND), one that did not start arriving here in time
    (UNAVAILABLE: try elsewhere), a malformed request (INVALID_ARGUMENT, logged)."""
    try:
        async for chunk in chunks:
            yield chunk
    except FileNotFoundError as exc:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
    except TimeoutError as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    except ValueError as exc:
        log.warning("refused a malformed %s request from %s: %s", what, caller, exc)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
