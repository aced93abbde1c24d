"""Data-plane transport: a link per ordered node pair, and where a frame goes.

A link is a persistent bidirectional stream (``DataPlane/Link``), opened lazily by the
sender, reused by every request, reopened on the next send after a failure. Frames are
written in order, so a request's steps reach each stage in order. Both sides start with a
Hello; the receiving side checks it against the TLS certificate's node id, the sending side
checks that the address answered as the node the plan names. A stream's return direction
carries frames only to a node that has no address in the plan (an origin that holds no
stage): such an origin opens streams to every stage before it starts a request.

Where the receiving side offers a lane (its Hello's ``lane_port``, :mod:`meshd.inference.
lanes`), the sender opens it before the link counts as open, and from then on every frame of
the link, both ways, goes over the lane; the stream stays open beside it, and the link breaks
when either breaks. A lane that cannot open leaves the frames on the stream (it is tried
again after ``lanes.RETRY_AFTER_S``). Answers to a node with no address go on the connection
it opened last (its lane, once it has one), so they follow its frames' path.

A lane whose connection breaks while the link's stream stays open (a reset: every node is
still a member) does not break the link: the sender re-opens it at once and both ends send
again the frames the other did not act on (:func:`meshd.inference.transport.lanes.reopen`, exact
counts, no frame twice); frames sent meanwhile wait, in order, behind those. Only when that
fails within ``lanes.RECOVER_WITHIN_S`` is the link broken and the peer reported lost, so
the origins replay their requests as before. A reset lane costs milliseconds, not a replay.

This module knows frames only as protobuf messages to move: what they mean is the business
of the :class:`LinkHandler` it delivers them to (the data plane's facade), through a narrow
interface: ``on_frame(sender, frame)`` and ``on_peer_lost(peer, reason)``. A frame a node
sends to itself is delivered on the loop's next turn, never re-entrantly.

Everything runs on the daemon's asyncio thread (the one that owns every grpc.aio server and
channel, see :mod:`meshd.runtime.bridge`), with one exception: the compute thread writes a
decode step's hidden states, or a last stage's token, on the open lane
:meth:`Transport.lane_to` gave the stage runtime (:meth:`Lane.send_from_thread`, under the
lane's own lock). Measured with
``bench_batching.py --scaling --no-lanes-too`` (daemons in network namespaces, one core each,
SmolLM2 float32): 0.86 ms per hop over lanes, 1.12 ms over the gRPC streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc

from meshd.inference.transport import lanes
from meshd.inference.transport.lanes import Lane, LaneClosed, LaneListener
from meshd.mesh import channels, security
from meshd.mesh.channels import ChannelFactory
from meshd.runtime import tls_buffers
from meshd.runtime.rpc_guard import add_guarded_servicer
from meshd.wire import dataplane_pb2 as dp
from meshd.wire import dataplane_pb2_grpc as dp_grpc

log = logging.getLogger("meshd.dataplane")


class LinkError(RuntimeError):
    """A stream to a peer could not be opened or broke; the message names the peer."""


class LinkHandler(Protocol):
    """What the transport delivers to (the data plane)."""

    def on_frame(self, sender: str, frame: dp.Frame) -> None: ...

    def on_peer_lost(self, peer: str, reason: str, since: float | None = None) -> None:
        """Frames to or from ``peer`` may be lost; ``since`` (time.monotonic()), when known,
        is when the link broke: requests begun after it did not use it."""


def describe_error(error: BaseException) -> str:
    """A one-line reason for a failed stream."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    if isinstance(error, TimeoutError):
        return "no answer in time"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _retrieve_exception(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen (it is reported elsewhere)."""
    if not future.cancelled():
        future.exception()


class _OutboundLink:
    """A persistent stream this node opened to ``peer``; frames are written in send order."""

    def __init__(
        self,
        peer: str,
        address: str,
        *,
        own_id: str,
        channel_factory: ChannelFactory,
        hello_timeout_s: float,
        on_frame: Callable[[str, dp.Frame], None],
        on_broken: Callable[[_OutboundLink, str], None],
        lane_context: ssl.SSLContext | None = None,
        lanes_refused: dict[tuple[str, int], float] | None = None,
        report: Callable[[str], None] | None = None,
    ) -> None:
        self.peer = peer
        self.address = address
        self._own_id = own_id
        self._channel_factory = channel_factory
        self._hello_timeout_s = hello_timeout_s
        self._on_frame = on_frame
        self._on_broken = on_broken
        self._outbox: asyncio.Queue[dp.Frame] = asyncio.Queue()
        self._lane_context = lane_context
        self._lanes_refused = lanes_refused if lanes_refused is not None else {}
        self._report = report
        self.lane: Lane | None = None  # where frames go once open; else the gRPC stream
        self._lane_port = 0  # the peer's lane port, once a lane opened there
        self.lanes_resumed = 0  # lanes re-opened after their connection broke
        self.frames_resent = 0  # frames in doubt those resumes sent again
        self._lane_lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._opened.add_done_callback(_retrieve_exception)
        self.broken = False
        self._closing = False
        self._task = asyncio.create_task(self._run(), name=f"dataplane-link-{peer}")

    def send(self, frame: dp.Frame) -> bool:
        if self.broken:
            return False
        lane = self.lane
        if lane is not None:
            if lane.send(frame):
                return True
            if not lane.recoverable:
                return False  # a lane closed for a bad frame: the link breaks
        # No lane, or one that just broke: the stream writes it, or it waits for the lane's
        # resume (behind the frames in doubt); if neither comes, the link breaks.
        self._outbox.put_nowait(frame)
        return True

    async def wait_open(self, timeout_s: float) -> None:
        """Wait until the peer answered our Hello; LinkError when it did not."""
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(self._opened)
        except TimeoutError:
            reason = f"no answer within {timeout_s:g} s"
            self._fail(reason)
            self._task.cancel()
            raise LinkError(self.unreachable(reason)) from None

    def unreachable(self, reason: str) -> str:
        return f"stage {self.peer} at {self.address} unreachable: {reason}"

    async def close(self) -> None:
        self.stop()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task

    def stop(self) -> None:
        """Take no frame from now on, and end the stream and lane (without reporting the
        peer lost); :meth:`close` also waits for that end."""
        self._closing = True
        self.broken = True
        if self.lane is not None:
            self.lane.close()
        self._task.cancel()

    async def _run(self) -> None:
        channel = None
        try:
            deadline = time.monotonic() + self._hello_timeout_s
            channel = self._channel_factory(self.address)
            call = dp_grpc.DataPlaneStub(channel).Link()
            # One deadline for the whole Hello: the write waits while the channel connects,
            # and a peer port that keeps refusing the connection must end the link, not
            # leave the frames queued on it waiting forever.
            async with asyncio.timeout(self._hello_timeout_s):
                await call.write(dp.Frame(hello=dp.Hello(node_id=self._own_id)))
                reply = await call.read()
            self._check_hello(reply)
            if reply.hello.lane_port and self._lane_context is not None:
                await self._open_lane(reply.hello.lane_port, deadline)
            self._opened.set_result(None)
            await self._pump(call)
        except asyncio.CancelledError:
            if not self._closing:
                self._fail("the link was cancelled")
            raise
        except Exception as error:
            self._fail(describe_error(error))
        finally:
            if channel is not None:
                with contextlib.suppress(Exception):
                    await channel.close()

    def _check_hello(self, reply: Any) -> None:
        if reply is grpc.aio.EOF or not reply.HasField("hello"):
            raise LinkError("the peer closed the stream without a Hello")
        if reply.hello.node_id != self.peer:
            raise LinkError(
                f"{self.address} answered as node {reply.hello.node_id}, not {self.peer}: the "
                "plan's address book is stale"
            )

    async def _open_lane(self, port: int, deadline: float) -> None:
        """Move the link's frames to a lane at ``port``; where none opens (by ``deadline``,
        when the link must be open, and within lanes.OPEN_TIMEOUT_S), they stay on the gRPC
        stream (the link works either way, the lane only makes each frame cheaper)."""
        assert self._lane_context is not None
        now = time.monotonic()
        if self._lanes_refused.get((self.address, port), 0.0) > now:
            return  # it failed a moment ago: no new wait on every link opened
        timeout_s = min(deadline - now, lanes.OPEN_TIMEOUT_S)
        try:
            if timeout_s <= 0:
                raise LaneClosed("no time was left after the link's Hello")
            lane = await lanes.dial(
                self.address,
                port,
                self._lane_context,
                self.peer,
                self._on_frame,
                self._on_lane_lost,
                timeout_s,
            )
        except (LaneClosed, asyncio.CancelledError) as error:
            # Failed, or the link's opening was given up: not tried again at once.
            self._lanes_refused[(self.address, port)] = time.monotonic() + lanes.RETRY_AFTER_S
            if isinstance(error, asyncio.CancelledError):
                raise
            log.warning(
                "no lane to %s (%s), its frames go over the gRPC stream (slower) for %g s: %s",
                self.peer,
                self.address,
                lanes.RETRY_AFTER_S,
                error,
            )
            if self._report is not None:
                self._report(
                    f"no lane to {self.peer} ({error}): its frames go over the peer port, "
                    f"slower; let TCP port {port} through to it (a fixed --lane-port there "
                    "makes that one rule)"
                )
            return
        self._lane_port = port
        self._use_lane(lane)

    def _use_lane(self, lane: Lane) -> None:
        """From now on the link's frames go on ``lane``: first those queued while it opened
        (or while a broken one was re-opened), in order."""
        while not self._outbox.empty():
            lane.send(self._outbox.get_nowait())
        self.lane = lane

    def _on_lane_lost(self, lane: Lane, reason: str) -> None:
        if lane is self.lane and not self._lane_lost.done():
            self._lane_lost.set_result(reason)

    async def _pump(self, call: Any) -> None:
        """Write queued frames and read returned ones until either direction ends, or the
        lane ends and cannot be resumed."""
        reader = asyncio.create_task(self._read(call))
        other = self._lane_lost if self.lane is not None else asyncio.create_task(self._write(call))
        resuming: asyncio.Task[None] | None = None
        try:
            while True:
                done, _ = await asyncio.wait({other, reader}, return_when=asyncio.FIRST_COMPLETED)
                if reader in done or other is not self._lane_lost:
                    for task in done:
                        task.result()  # raises the direction's error
                    raise LinkError("the peer closed the stream")
                reason = self._lane_lost.result()
                resuming = asyncio.create_task(self._resume_lane(reason))
                done, _ = await asyncio.wait(
                    {resuming, reader}, return_when=asyncio.FIRST_COMPLETED
                )
                if resuming not in done:
                    resuming.cancel()
                    raise LinkError(f"{reason}, and the peer closed the stream")
                resuming.result()  # LinkError when the lane could not be resumed
                other = self._lane_lost
        finally:
            if resuming is not None:  # the link may have closed while it ran
                resuming.cancel()
                resuming.add_done_callback(_retrieve_exception)
            other.cancel()
            reader.cancel()
            call.cancel()
            if self.lane is not None:
                self.lane.close()

    async def _resume_lane(self, reason: str) -> None:
        """The lane broke under an open stream: re-open it at once and resume it (the frames
        in doubt go again both ways, exactly once); frames sent meanwhile wait in the outbox.
        LinkError when that fails within lanes.RECOVER_WITHIN_S."""
        broken = self.lane
        assert broken is not None and self._lane_context is not None
        if not broken.recoverable:
            raise LinkError(reason)
        self.lane = None
        self._lane_lost = asyncio.get_running_loop().create_future()
        began = time.monotonic()
        deadline = began + lanes.RECOVER_WITHIN_S
        failures: list[str] = []
        for attempt in range(lanes.RECOVER_ATTEMPTS):
            if attempt:
                pause = min(lanes.RECOVER_PAUSE_S, deadline - time.monotonic())
                await asyncio.sleep(max(0.0, pause))
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                lane, again = await lanes.reopen(
                    self.address,
                    self._lane_port,
                    self._lane_context,
                    broken,
                    self._on_frame,
                    self._on_lane_lost,
                    left,
                )
            except LaneClosed as error:
                failures.append(str(error))
                continue
            waited = self._outbox.qsize()
            self._use_lane(lane)
            self.lanes_resumed += 1
            self.frames_resent += again
            log.warning(
                "the lane to %s (%s) broke (%s) and was resumed in %.1f ms: %d frame(s) in "
                "doubt sent again, %d waited",
                self.peer,
                self.address,
                reason,
                (time.monotonic() - began) * 1e3,
                again,
                waited,
            )
            if self._report is not None:
                self._report(
                    f"the lane to {self.peer} broke ({reason}) and was re-opened at once "
                    f"({(time.monotonic() - began) * 1e3:.0f} ms): {again} frame(s) in doubt "
                    "were sent again, no request was replayed"
                )
            return
        raise LinkError(
            f"{reason}; it could not be re-opened within {lanes.RECOVER_WITHIN_S:g} s: "
            + ("; ".join(failures) or "no time was left")
        )

    async def _write(self, call: Any) -> None:
        while True:
            frame = await self._outbox.get()
            await call.write(frame)

    async def _read(self, call: Any) -> None:
        while True:
            frame = await call.read()
            if frame is grpc.aio.EOF:
                return
            self._on_frame(self.peer, frame)

    def _fail(self, reason: str) -> None:
        if self.broken and self._opened.done():
            return
        self.broken = True
        if not self._opened.done():
            self._opened.set_exception(LinkError(self.unreachable(reason)))
        if not self._closing:
            self._on_broken(self, reason)


class _InboundLink:
    """A stream a peer opened to us: we read its frames and may answer on it."""

    def __init__(self, peer: str, context: grpc.aio.ServicerContext) -> None:
        self.peer = peer
        self._context = context
        self._outbox: asyncio.Queue[dp.Frame] = asyncio.Queue()
        self.closed = False

    def send(self, frame: dp.Frame) -> bool:
        if self.closed:
            return False
        self._outbox.put_nowait(frame)
        return True

    async def write_forever(self) -> None:
        while True:
            frame = await self._outbox.get()
            await self._context.write(frame)


class Transport:
    """This node's streams to and from its peers, and the routing of frames over them."""

    def __init__(
        self,
        node_id: str,
        channel_factory: ChannelFactory,
        handler: LinkHandler,
        *,
        link_timeout_s: float = 5.0,
        report: Callable[[str], None] | None = None,
    ) -> None:
        """``report``: where what a user should know about the links is told, in words (the
        event log): a lane that could not open."""
        self.node_id = node_id
        self._channel_factory = channel_factory
        self._handler = handler
        self.link_timeout_s = link_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbound: dict[str, _OutboundLink] = {}
        self._inbound: dict[str, _InboundLink] = {}
        self._retired: set[asyncio.Future[None]] = set()  # links being closed (address moved)
        self._closed = False
        self._lanes: LaneListener | None = None  # accepts peers' lanes, once opened
        self._answer_on_lane: set[str] = set()  # peers whose newest link to us is a lane
        self._lanes_refused: dict[tuple[str, int], float] = {}  # (address, port) -> retry at
        self._lane_context: ssl.SSLContext | None = None  # dials peers' lanes
        self._report = report
        self.frames_received = 0
        self.frames_sent = 0

    async def open_lanes(
        self,
        host: str,
        credentials: security.NodeCredentials,
        *,
        port: int = 0,
        handshake_timeout_s: float = lanes.HANDSHAKE_TIMEOUT_S,
    ) -> int:
        """Offer peers a lane (:mod:`meshd.inference.transport.lanes`) on ``host``:``port`` and dial
        theirs; returns the listener's port. OSError when it cannot listen there."""
        self.bind_loop()
        server_context, self._lane_context = security.ssl_contexts(credentials)
        for context in (server_context, self._lane_context):
            tls_buffers.keep_record_buffers(context)  # no allocation per frame (lanes.py)
        self._lanes = LaneListener(
            server_context,
            self.dispatch,
            self._answer_on_lane.add,
            self._on_lane_lost,
            handshake_timeout_s=handshake_timeout_s,
        )
        return await self._lanes.start(host, port)

    def _on_lane_lost(self, peer: str, reason: str, since: float) -> None:
        if not self._closed:
            self._handler.on_peer_lost(peer, reason, since)

    def bind_loop(self) -> asyncio.AbstractEventLoop:
        """The one asyncio loop this transport runs on (bound on first use)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("a data plane must be used from one asyncio loop only")
        return loop

    # ------------------------------------------------------------ sending

    def send(self, node_id: str, address: str, frame: dp.Frame, *, open_new: bool = True) -> bool:
        """Send ``frame`` to ``node_id`` at ``address`` (locally when it is this node); False
        when it cannot go (the link broke, or none is open and ``open_new`` is False)."""
        if node_id == self.node_id:
            self.bind_loop().call_soon(self.dispatch, self.node_id, frame)
            return True
        link = self._outbound.get(node_id)
        if link is None or link.broken or link.address != address:
            if not open_new or self._closed:
                return False
            link = self._link_to(node_id, address)
        self.frames_sent += 1
        return link.send(frame)

    def lane_to(self, node_id: str, address: str | None) -> Lane | None:
        """The open lane of this node's link to ``node_id`` at ``address``, if it has one:
        where the compute thread may send that node a finished step's frames itself
        (:meth:`Lane.send_from_thread`); None sends them through this loop."""
        link = self._outbound.get(node_id)
        if address is None or link is None or link.broken or link.address != address:
            return None
        lane = link.lane
        return lane if lane is not None and not lane.closed else None

    def count_sent(self, frames: int) -> None:
        """Count frames another thread sent on this node's lanes (``frames_sent``)."""
        self.frames_sent += frames

    def reply(self, node_id: str, frame: dp.Frame) -> bool:
        """Best effort to a node we may have no address for: local, its stream, or ours."""
        if node_id == self.node_id:
            return self.send(node_id, "", frame)
        if node_id in self._answer_on_lane:
            # The peer's frames come on its lane: answers go there, and only there (frames
            # the lane took before it broke are lost, so a later one must not overtake them
            # on another path; the lane's loss ends the requests it carried).
            if self._lanes is not None and self._lanes.send(node_id, frame):
                self.frames_sent += 1
                return True
            log.warning(
                "the lane of node %s broke: a frame of request %s is dropped",
                node_id,
                frame.request_id,
            )
            return False
        inbound = self._inbound.get(node_id)
        if inbound is not None and inbound.send(frame):
            self.frames_sent += 1
            return True
        outbound = self._outbound.get(node_id)
        if outbound is not None and outbound.send(frame):
            self.frames_sent += 1
            return True
        log.warning("no route to node %s for request %s: dropped", node_id, frame.request_id)
        return False

    def route(self, node_id: str, address: str | None, frame: dp.Frame) -> bool:
        """To a stage at its plan address, or back to a node the plan has no address for.
        For one request the choice never changes, so its frames stay ordered."""
        if address is not None:
            return self.send(node_id, address, frame)
        return self.reply(node_id, frame)

    async def connect(self, peers: Sequence[tuple[str, str]]) -> str | None:
        """Open (or reuse) a stream to every ``(node_id, address)`` but this node; the first
        failure's message, or None when all answered."""
        links = [self._link_to(node, address) for node, address in peers if node != self.node_id]
        results = await asyncio.gather(
            *(link.wait_open(self.link_timeout_s) for link in links), return_exceptions=True
        )
        errors = [str(result) for result in results if isinstance(result, BaseException)]
        return errors[0] if errors else None

    def _link_to(self, node_id: str, address: str) -> _OutboundLink:
        link = self._outbound.get(node_id)
        if link is None or link.broken or link.address != address:
            if link is not None:
                self.drop_peer(node_id)
            link = _OutboundLink(
                node_id,
                address,
                own_id=self.node_id,
                channel_factory=self._channel_factory,
                hello_timeout_s=self.link_timeout_s,
                on_frame=self.dispatch,
                on_broken=self._on_outbound_broken,
                lane_context=self._lane_context,
                lanes_refused=self._lanes_refused,
                report=self._report,
            )
            self._outbound[node_id] = link
        return link

    def drop_peer(self, node_id: str) -> None:
        """The mesh lost ``node_id``: close this node's link to it now, quietly (the plans
        it served are withdrawn by the agreement, not by the link). A stream cut with the
        network stays open on a dead connection until TCP gives up, seconds later; were it
        kept, the plan committed when the peer comes back would send over it and lose its
        first request to that late timeout. A fresh link is dialled when next needed."""
        link = self._outbound.pop(node_id, None)
        if link is None or link.broken:
            return
        link.stop()
        closing = asyncio.ensure_future(link.close())
        self._retired.add(closing)
        closing.add_done_callback(self._retired.discard)

    # ------------------------------------------------------------ receiving

    def dispatch(self, sender: str, frame: dp.Frame) -> None:
        """Hand one received frame to the handler; a bug in handling it is logged, and the
        stream it came on keeps going."""
        self.frames_received += 1
        try:
            self._handler.on_frame(sender, frame)
        except Exception:
            log.exception(
                "data-plane frame from %s for request %s failed", sender, frame.request_id
            )

    async def serve_link(self, context: grpc.aio.ServicerContext) -> None:
        """One inbound stream: Hello both ways, then dispatch frames until it ends."""
        self.bind_loop()
        peer = await self._accept_hello(context)
        link = _InboundLink(peer, context)
        self._inbound[peer] = link  # answers to the peer go here, until its lane carries data
        self._answer_on_lane.discard(peer)
        lane_port = self._lanes.port if self._lanes is not None else 0
        await context.write(dp.Frame(hello=dp.Hello(node_id=self.node_id, lane_port=lane_port)))
        writer = asyncio.create_task(link.write_forever())
        reason = "the peer closed the stream"
        try:
            while True:
                frame = await context.read()
                if frame is grpc.aio.EOF:
                    break
                self.dispatch(peer, frame)
        except asyncio.CancelledError:
            reason = "the stream was cancelled"
            raise
        except Exception as error:
            reason = describe_error(error)
        finally:
            link.closed = True
            writer.cancel()
            if self._inbound.get(peer) is link:
                del self._inbound[peer]
                if not self._closed:
                    self._handler.on_peer_lost(peer, f"its stream to us broke: {reason}")

    async def _accept_hello(self, context: grpc.aio.ServicerContext) -> str:
        try:
            async with asyncio.timeout(self.link_timeout_s):
                hello = await context.read()
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no Hello on a new link")
        if hello is grpc.aio.EOF or not hello.HasField("hello") or not hello.hello.node_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a link starts with a Hello")
        claimed = hello.hello.node_id
        certified = security.peer_node_id(context)
        if certified is not None and certified != claimed:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the TLS certificate names node {certified} but its Hello claims {claimed}",
            )
        return claimed

    def _on_outbound_broken(self, link: _OutboundLink, reason: str) -> None:
        if self._outbound.get(link.peer) is link:
            del self._outbound[link.peer]
        log.warning("data-plane link to %s (%s) broke: %s", link.peer, link.address, reason)
        if not self._closed:
            self._handler.on_peer_lost(link.peer, reason)

    async def close(self) -> None:
        """Close every stream; nothing is sent or reported after this."""
        self._closed = True
        for link in list(self._outbound.values()):
            await link.close()
        self._outbound.clear()
        for inbound in self._inbound.values():
            inbound.closed = True
        if self._lanes is not None:
            await self._lanes.close()


class DataPlaneServicer(dp_grpc.DataPlaneServicer):
    """The gRPC face of a data plane; add it to the daemon's peer server with
    ``dataplane_pb2_grpc.add_DataPlaneServicer_to_server(plane.servicer(), server)``."""

    def __init__(
        self,
        serve_link: Callable[[grpc.aio.ServicerContext], Awaitable[None]],
        stats: Callable[[], dp.StatsReply],
    ) -> None:
        self._serve_link = serve_link
        self._stats = stats

    async def Link(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await self._serve_link(context)

    async def Stats(self, request: dp.StatsRequest, context: grpc.aio.ServicerContext) -> Any:
        return self._stats()


async def start_server(
    servicer: DataPlaneServicer, credentials: security.NodeCredentials, address: str = "127.0.0.1:0"
) -> tuple[grpc.aio.Server, int]:
    """A mutual-TLS grpc.aio server with only the data plane on it; returns it and its port."""
    server = channels.peer_server()
    add_guarded_servicer(dp_grpc.add_DataPlaneServicer_to_server, servicer, server)
    port = server.add_secure_port(address, security.server_credentials(credentials))
    if port == 0:
        raise OSError(f"cannot listen on {address}: is the port taken?")
    await server.start()
    return server, port
