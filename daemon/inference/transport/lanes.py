"""Lanes: a link's frames over a plain mutual-TLS TCP connection, read and written in place.

Why: a frame that crosses a grpc.aio stream inside a daemon takes ~1.1 ms from one node's
compute thread to the next one's on this project's 2-core machines (``perf sched``: 0.6 ms
of the sender's loop thread busy through the writer task and ``call.write``, ~0.2 ms of gRPC
core's event-engine threads and poller handing the message on, 0.3 ms of the receiver's
loop). A lane is a non-blocking TLS socket that the same loop watches: :meth:`Lane.send`
encrypts the frame and hands it to the socket at once, and the receiving side decrypts what
arrived and hands every whole frame straight to the stage runtime in the loop's readiness
callback, with no task, queue or extra thread between. Not asyncio's own TLS transport: its
record layer is Python, and on a core whose caches the stage's matrix work has just
evicted, it cost ~0.14 ms of the receiver's loop per frame; ``ssl.SSLSocket`` does the same
in C.

What stays the same: every frame is the same ``dataplane.Frame`` (``proto/dataplane.proto``),
each preceded by its length (4 bytes, big-endian) on the wire. Both ends present a
certificate of the mesh CA (TLS 1.3, the same node credentials as the peer port:
:func:`meshd.mesh.security.ssl_contexts`) and each takes the other's node id from its
certificate, so a lane carries frames only between members, and only from the node it
names. The link's gRPC stream still opens first (Hello
both ways, and the listener's port in the answer, ``Hello.lane_port``) and stays open: the
link breaks when either breaks, and where no lane opens (a peer that offers none, a port a
firewall blocks) the frames go over the stream as before.

The listener is a second open port: handshakes are bounded in time
(``HANDSHAKE_TIMEOUT_S``) and per source address (``MAX_PENDING_PER_SOURCE`` connections
still in their handshake), as the peer port's are (:mod:`meshd.mesh.gate`).

**A reset connection is re-opened, not reported.** A lane's TCP connection can break while
both nodes stay members and the link's gRPC stream stays up (``ss -K``, a NAT or firewall
that resets it, a NIC blip). Reporting that as a lost peer ends every request through it and
the origin replays them (the whole prefix recomputed on every stage, ~2 s). Instead the
dialler re-opens the lane at once (:func:`reopen`, at most ``RECOVER_ATTEMPTS`` dials within
``RECOVER_WITHIN_S``) and both ends send again what the other did not act on:

* Which frames are in doubt is not guessed. Each end counts the frames it handed to the data
  plane from a connection (``frames_received``: handled in the readiness callback, so a frame
  counted is a frame acted on; a frame whose bytes arrived only in part is not), and the new
  connection starts with a Hello both ways carrying that count (``Hello.resume``). Each end
  then sends again exactly the frames the other's count leaves out, in order, before any new
  frame: no frame is lost, none arrives twice, and the receiver's order is the sender's.
* What a sender keeps to do that: a reference to the serialized bytes of each frame it took
  (the bytes it wrote anyway, no copy), the newest ``RESEND_FRAMES`` frames and at most
  ``RESEND_BYTES`` (more than the kernel's send and receive buffers can hold between the
  two data planes; a decode step in flight is one frame per request). Per frame that is one
  append and one count under the lock the send takes anyway: no allocation of its own, no
  system call. A count that reaches back past what is kept cannot be resumed.
* The listener keeps a broken lane's count for ``RESUME_GRACE_S`` (a little more than the
  dialler's bound) and reports the loss only if no resume came by then; a connection the
  listener replaces is read to its end before its count is given. A lane that ended for a
  reason a new connection would not cure (a frame that cannot be read, one over the size
  limit) is reported at once, as is one that cannot be resumed: then the origins replay as
  before (:mod:`meshd.inference.origin.core`), which stays the fallback.

A TCP reset is seen at once by both ends: the end that aborts gets ``ECONNABORTED`` and the
one that receives the RST ``ECONNRESET``, both wake the loop's reader callback (epoll reports
the socket's error as readable), so the lane fails in the same loop turn, not at its next
write. The stage core drops a copy of a frame it already acted on as well (a step, a token
index or a Start it has: :mod:`meshd.inference.stage.core`), so a re-sent frame is harmless
even where the counts could not be exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

from google.protobuf.message import DecodeError

from meshd.mesh import security
from meshd.mesh.channels import MAX_MESSAGE_BYTES
from meshd.runtime import hoptrace
from meshd.wire import dataplane_pb2 as dp

log = logging.getLogger("meshd.dataplane")

HEADER = struct.Struct(">I")
_NOT_NOW = (BlockingIOError, InterruptedError)  # a non-blocking socket's "try again"
HANDSHAKE_TIMEOUT_S = 5.0
# A dialler waits this long for a lane (a LAN's connect and handshake take milliseconds),
# then uses the link's gRPC stream, and tries that peer's lane again after RETRY_AFTER_S.
OPEN_TIMEOUT_S = 2.0
RETRY_AFTER_S = 60.0
READ_CHUNK_BYTES = 256 << 10
MAX_PENDING_PER_SOURCE = 8
MAX_PENDING = 64  # handshakes under way from all sources together
ACCEPT_PAUSE_S = 1.0  # out of descriptors: the listener rests this long, as asyncio's does
# A silently dead peer (a cable pulled) is noticed like the peer port's keepalives do.
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_PROBES = 2
# A connection that broke under a link that did not: re-opened and resumed within this bound,
# by at most this many dials (the second after a short pause), else reported as a loss.
RECOVER_WITHIN_S = 1.0
RECOVER_ATTEMPTS = 2
RECOVER_PAUSE_S = 0.05
RESUME_GRACE_S = RECOVER_WITHIN_S + 0.5  # the listener's wait for the dialler's resume
# The frames a lane keeps to send again after a reset: the newest RESEND_FRAMES, at most
# RESEND_BYTES of them (Linux's default TCP buffers: 4 MiB to send, 6 MiB to receive).
RESEND_FRAMES = 256
RESEND_BYTES = 16 << 20


class LaneClosed(ConnectionError):
    """A lane could not open or broke; the message names the peer and why."""


def _keep_alive(sock: socket.socket) -> None:
    """TCP keepalives and no Nagle delay on the lane's socket (where the system has them)."""
    options = [
        (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    ]
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, value)


class Lane:
    """One end of an open lane: a non-blocking TLS socket that the loop watches.

    Reading happens in the loop's readiness callback: as many bytes as the socket holds are
    decrypted (in C) and every whole frame in them goes to ``on_frame(peer, frame)`` at
    once. :meth:`send` hands a frame to the socket in place; what it cannot take yet waits,
    in order, until the socket is writable. ``on_lost(lane, reason)`` runs once when the
    lane ends for any reason but :meth:`close` (``recoverable`` says whether a new
    connection would cure it). With ``on_hello``, the first frame is shown to it first:
    ``on_hello(lane, hello)`` when it is a Hello (a resume's, see the module docstring; it is
    not delivered), ``on_hello(lane, None)`` when it is a data-plane frame.
    """

    def __init__(
        self,
        sock: ssl.SSLSocket,
        peer: str,
        on_frame: Callable[[str, dp.Frame], None],
        on_lost: Callable[[Lane, str], None],
        on_first_data: Callable[[Lane], None] | None = None,
        on_hello: Callable[[Lane, dp.Hello | None], None] | None = None,
    ) -> None:
        self.peer = peer
        self._on_hello = on_hello
        self._sock = sock
        self._on_first_data = on_first_data
        self._fd = sock.fileno()
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._loop = asyncio.get_running_loop()
        self._chunk = bytearray(READ_CHUNK_BYTES)
        self._chunk_view = memoryview(self._chunk)
        self._pending = bytearray()  # the start of a frame whose rest has not arrived
        self._backlog = bytearray()  # bytes the socket did not take yet, in order
        # The TLS socket, the backlog and ``closed`` are shared with the compute thread's
        # sends (send_from_thread): each use of them holds this lock, and none holds it
        # while frames are delivered (a delivery may send on this lane).
        self._io = threading.Lock()
        self._writing = False  # a writer callback is registered
        self.used = False  # bytes went either way (a lane never used is not missed)
        # Positions in the link's stream of frames, counted on from the lane a resumed one
        # replaces: the frames handed to on_frame (a read stops after one), and the frames
        # taken to send, of which _kept holds the newest (frames_sent - len(_kept) is the
        # position of the oldest), within RESEND_*, for a resume to send again.
        self.frames_received = 0
        self._kept: deque[bytes] = deque()
        self._kept_bytes = 0
        self.frames_sent = 0
        self.recoverable = True  # a loss a new connection would cure (not a bad frame)
        self.closed = False
        _keep_alive(sock)
        self._loop.add_reader(self._fd, self._readable)

    def send(self, frame: dp.Frame) -> bool:
        """Write ``frame`` now (or after what the socket has not taken yet); False when the
        lane was closed already (the frame was not taken). The loop's own sends. A frame
        taken by a lane that then breaks is sent again when the lane is resumed, or its loss
        is reported (``on_lost``)."""
        if self.closed:
            return False
        if hoptrace.enabled:
            hoptrace.mark("frame_send")
        self.used = True
        payload = frame.SerializeToString()
        with self._io:
            self._keep(payload)
            self._backlog += HEADER.pack(len(payload))
            self._backlog += payload
        if not self._writing:
            self._flush()
        if hoptrace.enabled:
            hoptrace.mark("frame_sent")
        return True  # taken: sent, or sent again by a resume, or its loss is reported

    def send_from_thread(self, frame: dp.Frame) -> bool:
        """Write ``frame`` from another thread than the loop's (the compute thread sends a
        step's result the moment it is done, :mod:`meshd.inference.stage.runtime`); False when the
        lane was closed already (the frame was not taken). A write that fails takes the
        frame all the same: a resume sends it again, or the loss is reported on the loop.

        The socket takes the frame at once unless frames wait already: then it goes behind
        them, and the loop writes it (woken with ``call_soon_threadsafe``)."""
        if hoptrace.enabled:
            hoptrace.mark("frame_send")
        payload = frame.SerializeToString()  # small: a decode step's frames
        data = HEADER.pack(len(payload)) + payload
        with self._io:
            if self.closed:
                return False
            self.used = True
            self._keep(payload)
            if not self._backlog:
                try:
                    sent = self._sock.send(data)
                except (ssl.SSLWantWriteError, ssl.SSLWantReadError, *_NOT_NOW):
                    sent = 0  # the loop writes it: when writable, or after TLS read
                except OSError as error:
                    self._from_thread(self._fail, f"the lane broke: {error}")
                    return True  # kept: a resume sends it again
                data = data[sent:]
            if data:
                self._backlog += data
        if data:
            self._from_thread(self._flush_waiting)
        if hoptrace.enabled:
            hoptrace.mark("frame_sent")
        return True

    def close(self) -> None:
        """Close without reporting a loss (the owner is done with the lane)."""
        if self.closed:
            return
        with self._io:
            self.closed = True  # another thread's send sees it from now on
        self._loop.remove_reader(self._fd)
        if self._writing:
            self._loop.remove_writer(self._fd)
        with self._io, contextlib.suppress(OSError):
            self._sock.close()

    def _keep(self, payload: bytes) -> None:
        """Keep a taken frame's bytes for a resume (holding ``_io``): the newest
        RESEND_FRAMES, at most RESEND_BYTES."""
        kept = self._kept
        kept.append(payload)
        self.frames_sent += 1
        self._kept_bytes += len(payload)
        while len(kept) > RESEND_FRAMES or (self._kept_bytes > RESEND_BYTES and len(kept) > 1):
            self._kept_bytes -= len(kept.popleft())

    def send_hello(self, hello: dp.Hello) -> None:
        """Write a lane's own Hello (a resume's): not a data-plane frame, neither counted nor
        kept."""
        payload = dp.Frame(hello=hello).SerializeToString()
        with self._io:
            if self.closed:
                return
            self._backlog += HEADER.pack(len(payload))
            self._backlog += payload
        if not self._writing:
            self._flush()

    @property
    def greeted(self) -> bool:
        """Its first frame came (a lane dialled without ``on_hello``: always)."""
        return self._on_hello is None

    def resend(self, broken: Lane, received: int) -> int | None:
        """Continue ``broken`` (the lane this one replaces, closed): send again, before
        anything else, the frames it took from stream position ``received`` on (its peer
        acted on those before); how many, or None when some of them are no longer kept
        (they cannot be sent again). Nothing may have been sent on this lane before."""
        with broken._io:
            kept = list(broken._kept)
            taken = broken.frames_sent
        first_kept = taken - len(kept)
        if not first_kept <= received <= taken:
            return None
        again = kept[received - first_kept :]
        with self._io:
            if self.closed:
                return None
            self.frames_sent = received  # this lane's positions go on from there
            for payload in again:
                self._keep(payload)
                self._backlog += HEADER.pack(len(payload))
                self._backlog += payload
        if again:
            self.used = True
            if not self._writing:
                self._flush()
        return len(again)

    def drain(self) -> None:
        """Read what the socket still holds (frames that arrived before its replacement was
        opened are acted on, and counted, first); then :meth:`close` it."""
        while not self.closed:
            acted_on = self.frames_received
            self._readable()
            if self.frames_received == acted_on:
                break
        self.close()

    def _from_thread(self, callback: Callable[..., object], *args: object) -> None:
        """Run ``callback`` on the lane's loop (a closed loop: the node is going away)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(callback, *args)

    # ------------------------------------------------------------ the loop's callbacks

    def _readable(self) -> None:
        if hoptrace.enabled:
            hoptrace.mark("lane_readable")
        while not self.closed:
            try:
                with self._io:
                    count = self._sock.recv_into(self._chunk)
            except (ssl.SSLWantReadError, *_NOT_NOW):
                break
            except ssl.SSLWantWriteError:
                break  # TLS wants to write first: the writer callback flushes, then we read
            except OSError as error:
                self._fail(f"the lane broke: {error}")
                return
            if count == 0:
                self._fail("the peer closed the lane")
                return
            delivered = self.frames_received
            self._received(self._chunk_view[:count])
            if self.frames_received != delivered and not self.closed and not self._pending_bytes():
                break  # the loop calls again while the socket holds more (level-triggered)
        if self._backlog and not self._writing and not self.closed:
            self._flush()  # a write that waited for TLS to read

    def _received(self, data: memoryview) -> None:
        """Hand every whole frame in what was pending and ``data`` to ``on_frame``; keep the
        start of an incomplete one."""
        self.used = True
        if self._on_first_data is not None:  # once
            first_data, self._on_first_data = self._on_first_data, None
            first_data(self)
        if self._pending:
            self._pending += data
            consumed = self._frames_in(self._pending)
            del self._pending[:consumed]
        else:
            consumed = self._frames_in(data)
            self._pending = bytearray(data[consumed:])

    def _frames_in(self, buffer: bytearray | memoryview) -> int:
        """Parse and deliver the whole frames at the start of ``buffer``; bytes consumed."""
        start = 0
        with memoryview(buffer) as view:
            end = len(view)
            while not self.closed and end - start >= HEADER.size:
                (length,) = HEADER.unpack_from(view, start)
                if length > MAX_MESSAGE_BYTES:
                    self.recoverable = False
                    self._fail(f"a frame of {length} bytes is over the {MAX_MESSAGE_BYTES} limit")
                    break
                stop = start + HEADER.size + length
                if stop > end:
                    break
                try:
                    frame = dp.Frame.FromString(view[start + HEADER.size : stop])
                except DecodeError as error:
                    self.recoverable = False
                    self._fail(f"an unreadable frame: {error}")
                    break
                start = stop
                if self._on_hello is not None:  # only the first frame may be a lane's Hello
                    on_hello, self._on_hello = self._on_hello, None
                    if frame.HasField("hello"):
                        on_hello(self, frame.hello)
                        continue
                    on_hello(self, None)
                    if self.closed:
                        break
                self.frames_received += 1
                if hoptrace.enabled:
                    hoptrace.mark("frame_parsed")
                self._on_frame(self.peer, frame)
        return start

    def _pending_bytes(self) -> int:
        with self._io:
            return 0 if self.closed else self._sock.pending()

    def _flush_waiting(self) -> None:
        """Loop: write what another thread's send left waiting."""
        if not self._writing and not self.closed:
            self._flush()

    def _flush(self) -> None:
        """Give the socket what it takes of the backlog; watch for writability if any is
        left (one callback, until the backlog is empty)."""
        with self._io:
            if self.closed:
                return
            failure = ""
            try:
                sent = self._sock.send(self._backlog)
            except (ssl.SSLWantWriteError, *_NOT_NOW):
                sent = 0
            except ssl.SSLWantReadError:
                return  # TLS must read first: _readable flushes after it read
            except OSError as error:
                sent, failure = 0, f"the lane broke: {error}"
            del self._backlog[:sent]
        if failure:
            self._fail(failure)
            return
        if self._backlog and not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._writable)
        elif not self._backlog and self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)

    def _writable(self) -> None:
        if not self.closed:
            self._flush()

    def _fail(self, reason: str) -> None:
        """Close and report the loss on the loop's next turn: never from inside a send, so
        whoever sent sees False and no other side effect."""
        if self.closed:
            return
        self.close()
        self._loop.call_soon(self._on_lost, self, reason)


async def _until_ready(sock: socket.socket, *, write: bool) -> None:
    """Wait until ``sock`` is readable (or writable)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = sock.fileno()
    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def _handshake(sock: ssl.SSLSocket) -> str:
    """Run the TLS handshake of a non-blocking socket on the loop; the peer's node id."""
    while True:
        try:
            sock.do_handshake()
            break
        except ssl.SSLWantReadError:
            await _until_ready(sock, write=False)
        except ssl.SSLWantWriteError:
            await _until_ready(sock, write=True)
    certified = security.ssl_peer_node_id(sock)
    if certified is None:
        raise LaneClosed("the peer presented no node certificate")
    return certified


class LaneListener:
    """The accepting side: one TLS listener per node, its lanes by peer node id;
    ``on_open(peer)`` once the first bytes arrived on a peer's lane (from then on the peer
    sends its frames there), ``on_lost(peer, reason, broke_at)`` when a lane that carried any
    ends and its dialler did not resume it within ``RESUME_GRACE_S`` (see the module
    docstring); ``broke_at`` (time.monotonic()) is when it broke: said up to the grace later,
    the loss is no news to a request begun meanwhile, over another link.

    A connection becomes a lane once its handshake passed (within the handshake timeout); at
    most MAX_PENDING_PER_SOURCE connections from one address, and MAX_PENDING from all, may
    be in their handshake at once: a further one is closed at once.
    """

    def __init__(
        self,
        context: ssl.SSLContext,
        on_frame: Callable[[str, dp.Frame], None],
        on_open: Callable[[str], None],
        on_lost: Callable[[str, str, float], None],
        *,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self._context = context
        self._handshake_timeout_s = handshake_timeout_s
        self._on_frame = on_frame
        self._on_open = on_open
        self._on_lost = on_lost
        self._socket: socket.socket | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self._pending: Counter[str] = Counter()  # source address -> handshakes under way
        self.lanes: dict[str, Lane] = {}
        # Lanes that broke or were replaced, by peer, until their dialler resumes them (or
        # the grace ends); and the answers to that peer meanwhile, sent after the resume.
        self._broken: dict[str, _Broken] = {}
        self.resumed = 0  # lanes resumed (their frames in doubt sent again both ways)
        self.port = 0

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host`` (the peer port's host) at ``port`` (0: a free one); returns the
        port. OSError when it cannot (the port is taken)."""
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if ":" in host:  # "::" listens on IPv4 too where the system can, as gRPC's [::] does
            dual = host == "::" and socket.has_dualstack_ipv6()
            listening = socket.create_server(
                (host, port), family=socket.AF_INET6, dualstack_ipv6=dual
            )
        else:
            listening = socket.create_server((host, port))
        listening.setblocking(False)
        self._socket = listening
        self.port = listening.getsockname()[1]
        asyncio.get_running_loop().add_reader(listening.fileno(), self._accept)
        return self.port

    def _accept(self) -> None:
        assert self._socket is not None
        while True:
            try:
                sock, address = self._socket.accept()
            except _NOT_NOW:
                return
            except OSError as error:  # out of descriptors: rest, or this runs every turn
                log.warning(
                    "the lane listener could not accept a connection (%s): it rests %g s",
                    error,
                    ACCEPT_PAUSE_S,
                )
                self._rest()
                return
            source = str(address[0])
            pending = self._pending
            if pending[source] >= MAX_PENDING_PER_SOURCE or pending.total() >= MAX_PENDING:
                sock.close()
                continue
            self._pending[source] += 1
            task = asyncio.create_task(self._admit(sock, source), name=f"lane-from-{source}")
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    def _rest(self) -> None:
        """Stop accepting for ACCEPT_PAUSE_S (the socket stays readable meanwhile)."""
        assert self._socket is not None
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._socket.fileno())
        loop.call_later(ACCEPT_PAUSE_S, self._resume, self._socket)

    def _resume(self, listening: socket.socket) -> None:
        if self._socket is listening:  # not closed meanwhile
            asyncio.get_running_loop().add_reader(listening.fileno(), self._accept)

    async def _admit(self, sock: socket.socket, source: str) -> None:
        """One accepted connection: handshake in time, then a lane; else closed quietly
        (a stranger's failed handshake is not this node's error)."""
        wrapped: ssl.SSLSocket | None = None
        try:
            sock.setblocking(False)
            wrapped = self._context.wrap_socket(
                sock, server_side=True, do_handshake_on_connect=False
            )
            async with asyncio.timeout(self._handshake_timeout_s):
                peer = await _handshake(wrapped)
        except BaseException as error:
            (wrapped or sock).close()
            if not isinstance(error, OSError | TimeoutError | LaneClosed):
                raise  # cancelled: the listener is closing
            log.debug("a lane from %s was refused: %s", source, error)
            return
        finally:
            self._pending[source] -= 1
            if self._pending[source] <= 0:
                del self._pending[source]
        lane = Lane(wrapped, peer, self._on_frame, self._lost, self._first_data, self._hello)
        previous = self.lanes.get(peer)
        self.lanes[peer] = lane
        if previous is not None:
            # The peer reopened its link or this lane: the old one is done. What it still
            # holds is acted on first, so its count is final if the new lane resumes it.
            previous.drain()
            if previous.used and (previous.greeted or peer not in self._broken):
                self._keep_broken(previous, "", report=False)

    def _first_data(self, lane: Lane) -> None:
        if self.lanes.get(lane.peer) is lane:
            self._on_open(lane.peer)

    def _lost(self, lane: Lane, reason: str) -> None:
        if self.lanes.get(lane.peer) is not lane:
            return
        del self.lanes[lane.peer]
        if not lane.used:  # the dialler gave up on it and kept its gRPC stream
            return
        if not lane.greeted and lane.peer in self._broken:
            return  # a resume that broke before its Hello: the lane it resumes still waits
        if lane.recoverable:
            self._keep_broken(lane, reason, report=True)  # its dialler may resume it
        else:
            self._on_lost(lane.peer, f"its lane to us broke: {reason}", time.monotonic())

    def _keep_broken(self, lane: Lane, reason: str, *, report: bool) -> None:
        """Keep ``lane`` for a resume for RESUME_GRACE_S; then, if ``report``, say it is
        lost."""
        earlier = self._broken.pop(lane.peer, None)
        if earlier is not None:
            earlier.expiry.cancel()
            if earlier.report:  # a lane broken before this one, never resumed
                self._on_lost(
                    lane.peer, f"its lane to us broke: {earlier.reason}", earlier.broke_at
                )
        expiry = asyncio.get_running_loop().call_later(RESUME_GRACE_S, self._expire, lane)
        self._broken[lane.peer] = _Broken(lane, reason, report, expiry)

    def _expire(self, lane: Lane) -> None:
        broken = self._broken.get(lane.peer)
        if broken is None or broken.lane is not lane:
            return
        del self._broken[lane.peer]
        if broken.report:
            self._on_lost(
                lane.peer,
                f"its lane to us broke ({broken.reason}) and was not resumed within "
                f"{RESUME_GRACE_S:g} s",
                broken.broke_at,
            )

    def _hello(self, lane: Lane, hello: dp.Hello | None) -> None:
        """A new lane's first frame. A resume: answer with what this node acted on of the
        broken lane, send again what the peer did not, then the answers that waited. A
        data-plane frame: the peer opened a new link, the broken lane will not be resumed."""
        if self.lanes.get(lane.peer) is not lane:
            return
        broken = self._broken.pop(lane.peer, None)
        if broken is not None:
            broken.expiry.cancel()
        if hello is None or not hello.resume:
            if broken is not None and broken.report:
                self._on_lost(lane.peer, f"its lane to us broke: {broken.reason}", broken.broke_at)
            elif broken is not None:
                for frame in broken.waiting:
                    lane.send(frame)
            if hello is not None:
                lane.send_hello(dp.Hello(resume=False))
            return
        if broken is None:
            lane.send_hello(dp.Hello(resume=False))  # the dialler reports the loss
            return
        lane.frames_received = broken.lane.frames_received  # positions go on from there
        lane.send_hello(dp.Hello(resume=True, frames_received=broken.lane.frames_received))
        again = lane.resend(broken.lane, hello.frames_received)
        if again is None:
            self._on_lost(
                lane.peer,
                f"its lane to us broke ({broken.reason or 'replaced'}) and this node's frames "
                "in doubt are no longer kept",
                broken.broke_at,
            )
            return
        for frame in broken.waiting:
            lane.send(frame)
        self.resumed += 1
        log.info(
            "the lane from %s was resumed: %d frame(s) sent again, %d waited",
            lane.peer,
            again,
            len(broken.waiting),
        )

    def send(self, peer: str, frame: dp.Frame) -> bool:
        """An answer to ``peer`` on its lane; while its broken lane waits for a resume the
        answer waits with it (sent after the frames in doubt). False: no lane takes it."""
        broken = self._broken.get(peer)
        if broken is not None:
            if len(broken.waiting) >= RESEND_FRAMES:
                return False
            broken.waiting.append(frame)
            return True
        lane = self.lanes.get(peer)
        return lane is not None and lane.send(frame)

    async def close(self) -> None:
        if self._socket is not None:
            asyncio.get_running_loop().remove_reader(self._socket.fileno())
            self._socket.close()
            self._socket = None
        for task in list(self._handshakes):
            task.cancel()
        for lane in list(self.lanes.values()):
            lane.close()
        self.lanes.clear()
        for broken in self._broken.values():
            broken.expiry.cancel()
        self._broken.clear()


class _Broken:
    """A listener's lane that broke (or was replaced), kept for its dialler's resume."""

    __slots__ = ("broke_at", "expiry", "lane", "reason", "report", "waiting")

    def __init__(self, lane: Lane, reason: str, report: bool, expiry: asyncio.TimerHandle) -> None:
        self.lane = lane
        self.reason = reason
        self.report = report  # said lost when the grace ends (a replaced lane is not)
        self.expiry = expiry
        self.broke_at = time.monotonic()  # requests begun later never used it
        self.waiting: list[dp.Frame] = []


def split_address(address: str) -> str:
    """The host of a ``host:port`` address (``[v6]:port`` too)."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


async def dial(
    address: str,
    port: int,
    context: ssl.SSLContext,
    peer: str,
    on_frame: Callable[[str, dp.Frame], None],
    on_lost: Callable[[Lane, str], None],
    timeout_s: float,
    on_hello: Callable[[Lane, dp.Hello | None], None] | None = None,
) -> Lane:
    """Open a lane to ``peer`` at the host of its link ``address`` and ``port``; LaneClosed
    when it cannot open in ``timeout_s`` or the certificate names another node."""
    loop = asyncio.get_running_loop()
    host = split_address(address)
    sock: socket.socket | None = None
    try:
        async with asyncio.timeout(timeout_s):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, kind, proto, _, target = infos[0]
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            await loop.sock_connect(sock, target)
            sock = context.wrap_socket(
                sock, server_hostname=security.TLS_SERVER_NAME, do_handshake_on_connect=False
            )
            certified = await _handshake(sock)
    except BaseException as error:
        if sock is not None:
            sock.close()
        if isinstance(error, TimeoutError):
            raise LaneClosed(f"no lane to {host}:{port} within {timeout_s:g} s") from None
        if isinstance(error, OSError | LaneClosed):
            raise LaneClosed(f"no lane to {host}:{port}: {error}") from None
        raise  # cancelled: the link is closing
    if certified != peer:
        sock.close()
        raise LaneClosed(
            f"the certificate at {host}:{port} names node {certified}, not {peer}: the plan's "
            "address book is stale"
        )
    assert isinstance(sock, ssl.SSLSocket)
    return Lane(sock, peer, on_frame, on_lost, on_hello=on_hello)


async def reopen(
    address: str,
    port: int,
    context: ssl.SSLContext,
    broken: Lane,
    on_frame: Callable[[str, dp.Frame], None],
    on_lost: Callable[[Lane, str], None],
    timeout_s: float,
) -> tuple[Lane, int]:
    """A new lane in place of ``broken`` (closed; its link's stream still open), resumed:
    the Hellos say what each end acted on, and each sends again what the other did not
    (see the module docstring). The lane, and how many of this node's frames went again;
    LaneClosed when it cannot open, the peer does not answer the resume in ``timeout_s``,
    does not know the broken lane, or this node no longer keeps a frame in doubt."""
    deadline = time.monotonic() + timeout_s
    answer: asyncio.Future[dp.Hello] = asyncio.get_running_loop().create_future()

    def answered(_: Lane, hello: dp.Hello | None) -> None:
        if not answer.done():
            answer.set_result(hello or dp.Hello(resume=False))  # a frame: not a resume

    def lost(lane: Lane, reason: str) -> None:
        if answer.done():
            on_lost(lane, reason)
        else:  # broke before the resume: this call says so
            answer.set_exception(LaneClosed(f"the new lane broke: {reason}"))

    lane = await dial(address, port, context, broken.peer, on_frame, lost, timeout_s, answered)
    lane.frames_received = broken.frames_received  # positions go on from there
    try:
        lane.send_hello(dp.Hello(resume=True, frames_received=broken.frames_received))
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            hello = await answer
        if not hello.resume:
            raise LaneClosed(f"node {broken.peer} no longer knows the broken lane")
        again = lane.resend(broken, hello.frames_received)
        if again is None:
            raise LaneClosed(
                f"node {broken.peer} acted on {hello.frames_received} of the "
                f"{broken.frames_sent} frames the broken lane took; the ones in doubt are no "
                "longer kept"
            )
    except BaseException as error:
        lane.close()
        if isinstance(error, TimeoutError):
            raise LaneClosed(f"node {broken.peer} did not answer the resume in time") from None
        raise
    return lane, again
