"""Membership: which peers are alive, what they measured, and the links to them.

Discovery (mDNS or static `--peer`) only proposes *addresses*. For each address
this component runs one session task that dials the peer over mutual TLS, says
Hello, fetches its state and keeps a heartbeat stream open. Liveness is decided
here, over gRPC, never by mDNS: python-zeroconf keeps a killed peer listed for
19+ minutes. A broken stream (`kill -9`: tens of ms) or a beat gap longer than
`peer_timeout_s` (a cut link) marks the peer lost; the session then retries
with a bounded backoff for as long as the address is wanted. A beat carries the sender's state
version, and a node beats at once when its own state changes, so peers fetch a new state
within tens of milliseconds whatever the keep-alive interval.

Every node dials every peer, so each side judges liveness from its own
outgoing stream. Each link measurement also carries this node's verdict on whether the link
may carry tensor-parallel collectives (`meshd.mesh.link_trust`, with the networks the user
marked trusted). A node's own profile and outgoing link measurements are
published as an immutable `NodeState` (`own_state`) that the peer server hands out
as-is; every node therefore builds the same view once it has fetched all states.

Duplicate node ids (a copied state directory) are refused, not merged: the
daemon that started later stops with a message saying what to delete.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import trio

from meshd.mesh import links
from meshd.mesh.heartbeat import beat_stream
from meshd.mesh.identity import Identity
from meshd.mesh.peer_links import PeerLinks
from meshd.mesh.security import describe_refusal
from meshd.runtime.bridge import AsyncioThread
from meshd.runtime.events import EventLog
from meshd.runtime.notify import Publisher
from meshd.wire import pb, rpc

log = logging.getLogger("meshd.membership")

PROTOCOL_VERSION = 1
HELLO_TIMEOUT_S = 2.0
STATE_TIMEOUT_S = 3.0
MAX_BACKOFF_S = 3.0
FORGET_LOST_AFTER_S = 120.0


class DuplicateNodeId(RuntimeError):
    """Another, earlier-started daemon uses this daemon's node id."""


class PeerRefused(RuntimeError):
    """The peer said no to our Hello (or we to its reply); retrying will not help soon."""


@dataclass
class PeerRecord:
    """What this node knows about one peer."""

    node_id: str
    address: str
    source: str
    instance_id: str
    started_at: float
    alive: bool = True
    joined_at: float = field(default_factory=time.time)
    alive_since: float = field(default_factory=time.monotonic)  # renewed on every reconnect
    last_beat: float = field(default_factory=time.monotonic)
    stub: rpc.PeerStub | None = None
    lost_at: float | None = None
    lost_reason: str = ""
    state: pb.NodeState | None = None
    remote_version: int = 0
    clock_offset_s: float = 0.0  # its wall clock minus ours, from its last beat (`meshd doctor`)
    state_wanted: trio.Event = field(default_factory=trio.Event)


class Membership:
    """Owns one session task per candidate address and the resulting peer table."""

    def __init__(
        self,
        identity: Identity,
        mesh_name: str,
        bridge: AsyncioThread,
        channel_factory: Callable[[str, bool], grpc.aio.Channel],
        events: EventLog,
        *,
        heartbeat_interval_s: float,
        peer_timeout_s: float,
        link_probe_interval_s: float,
        trusted_networks: tuple[str, ...] = (),
        tensor_parallel_port: int = 0,
    ) -> None:
        self.identity = identity
        self.mesh_name = mesh_name
        self.grpc_port = 0
        self._bridge = bridge
        self._channel_factory = channel_factory
        self.events = events
        self._interval = heartbeat_interval_s
        self._timeout = peer_timeout_s
        self.tensor_parallel_port = tensor_parallel_port
        self.peers: dict[str, PeerRecord] = {}
        self._peer_links = PeerLinks(
            identity.node_id,
            bridge,
            self._publish,
            probe_interval_s=link_probe_interval_s,
            trusted_networks=tuple(trusted_networks),
        )
        self._wanted: dict[str, str] = {}  # address -> source
        self._nursery: trio.Nursery | None = None
        self.profile: pb.NodeProfile = pb.NodeProfile(node_id=identity.node_id)
        self.model: pb.ModelSelection | None = None
        self.leaving = False
        self.loaded_plans: tuple[str, ...] = ()  # plans whose stage is loaded here
        self.hub_access: bool | None = None  # unknown until this node asked the Hub once
        self.downloads: tuple[pb.Download, ...] = ()  # files arriving here now
        # How much slower than its profile predicts this node's stage runs (None: not known).
        self.speed_correction: pb.SpeedCorrection | None = None
        self.version = 1
        # Wakes each peer's beat sender when this node's own state changes (trio thread).
        self._version_watchers: set[Callable[[], None]] = set()
        self.own_state = self._build_state()
        # "The peer table or a published state changed": agreement, status watchers.
        self.changes = Publisher[None]("membership", coalesce=True)
        self._refusals: dict[str, str] = {}  # address -> why it refused (said once)
        self.fatal: DuplicateNodeId | None = None
        self._fatal_event = trio.Event()

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run sessions until cancelled; raises DuplicateNodeId if we must stop."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for address, source in list(self._wanted.items()):
                self._start_session(address, source)
            task_status.started()
            await self._fatal_event.wait()
            nursery.cancel_scope.cancel()
        assert self.fatal is not None
        raise self.fatal

    def want(self, address: str, source: str) -> None:
        """Keep a session to `address` (from mDNS or a static peer)."""
        if address in self._wanted:
            return
        self._wanted[address] = source
        if self._nursery is not None:
            self._start_session(address, source)

    def unwant(self, address: str, reason: str) -> None:
        """Stop retrying `address` once its session ends (a live peer stays live)."""
        if self._wanted.pop(address, None) is not None:
            log.debug("no longer dialing %s: %s", address, reason)

    def unwant_peer(self, node_id: str, reason: str) -> None:
        """Stop redialling the address peer `node_id` was reached at (it said goodbye)."""
        record = self.peers.get(node_id)
        if record is not None:
            self.unwant(record.address, reason)

    def _start_session(self, address: str, source: str) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._session_loop, address, source)

    # ------------------------------------------------------------ state

    def set_profile(self, profile: pb.NodeProfile) -> None:
        self.profile = profile
        self._publish()

    def set_model(self, selection: pb.ModelSelection | None) -> None:
        """Publish the model this node wants the mesh to run (gossiped in NodeState)."""
        self.model = selection
        self._publish()

    def set_loaded_plans(self, plan_ids: tuple[str, ...]) -> None:
        """Publish the plans this node has loaded (a leaving peer waits for them)."""
        if plan_ids != self.loaded_plans:
            self.loaded_plans = plan_ids
            self._publish()

    def set_hub_access(self, reachable: bool) -> None:
        """Publish whether this node's last Hub request succeeded (peers split a
        repository's downloads between the nodes that can reach the Hub)."""
        if reachable != self.hub_access:
            self.hub_access = reachable
            self._publish()

    def set_downloads(self, downloads: tuple[pb.Download, ...]) -> None:
        """Publish the files arriving here (the caller limits how often: each change is
        a new state version the peers fetch)."""
        if downloads != self.downloads:
            self.downloads = downloads
            self._publish()

    def set_speed_correction(self, correction: pb.SpeedCorrection) -> None:
        """Publish this node's speed correction (every node then plans with it; the caller
        changes it only past a threshold, see meshd.mesh.speed_correction)."""
        if correction != self.speed_correction:
            self.speed_correction = correction
            self._publish()

    def set_leaving(self) -> None:
        """Announce that this node is stopping: peers plan without it from now on."""
        if not self.leaving:
            self.leaving = True
            self._publish()

    @property
    def links(self) -> dict[str, pb.LinkMeasurement]:
        """The published measurements of this node's links, by peer."""
        return self._peer_links.links

    def _build_state(self) -> pb.NodeState:
        alive = sorted(p.node_id for p in self.peers.values() if p.alive)
        own_links = [m for dst, m in sorted(self.links.items()) if dst in alive]
        return pb.NodeState(
            profile=self.profile,
            links=own_links,
            version=self.version,
            instance_id=self.identity.instance_id,
            alive_peers=alive,
            model=self.model,
            leaving=self.leaving,
            tensor_parallel_port=self.tensor_parallel_port,
            loaded_plans=self.loaded_plans,
            hub_access=self.hub_access,
            downloads=self.downloads,
            speed_correction=self.speed_correction,
        )

    def _publish(self) -> None:
        """Wake watchers; when this node's own state changed, bump its version and replace it.

        Many calls change only what this node knows of others (a peer's state fetched): its
        own state stays as it was, and so does its version. Bumping it anyway made every
        fetch look like news to the peers, who fetched in turn, bumped, and so on: an idle
        mesh fetching states back and forth at its heartbeat rate.
        """
        state = self._build_state()
        if state != self.own_state:
            self.version += 1
            state.version = self.version
            self.own_state = state
            for wake_sender in list(self._version_watchers):
                wake_sender()  # each peer's beat sender: the new version goes out at once
        self.changes.publish(None)

    def alive_peers(self) -> list[PeerRecord]:
        return sorted((p for p in self.peers.values() if p.alive), key=lambda p: p.node_id)

    def forget_old(self) -> None:
        now = time.monotonic()
        for node_id, rec in list(self.peers.items()):
            if not rec.alive and rec.lost_at and now - rec.lost_at > FORGET_LOST_AFTER_S:
                del self.peers[node_id]

    # ------------------------------------------------------------ incoming Hello

    def hello_reply(
        self, request: pb.HelloRequest, cert_node_id: str | None, caller_host: str | None = None
    ) -> pb.HelloReply:
        """Decide on a peer's Hello (runs on the trio thread).

        An accepted caller is dialled back (source "inbound"), so a static peer configured
        on one side only, or a peer whose mDNS does not reach us, still becomes mutual.
        """
        me = self.identity
        reply = pb.HelloReply(
            accepted=False,
            node_id=me.node_id,
            instance_id=me.instance_id,
            mesh_name=self.mesh_name,
            protocol_version=PROTOCOL_VERSION,
            started_at=me.started_at,
        )
        if cert_node_id is not None and cert_node_id != request.node_id:
            reply.refusal = pb.REFUSAL_IDENTITY_MISMATCH
            reply.reason = (
                f"your certificate is for node {cert_node_id!r} but you said {request.node_id!r}"
            )
        elif request.protocol_version != PROTOCOL_VERSION:
            reply.refusal = pb.REFUSAL_PROTOCOL_VERSION
            reply.reason = (
                f"protocol version {request.protocol_version} is not {PROTOCOL_VERSION}; "
                "upgrade meshd on both machines to the same release"
            )
        elif request.mesh_name != self.mesh_name:
            reply.refusal = pb.REFUSAL_OTHER_MESH
            reply.reason = f"this node is in mesh {self.mesh_name!r}, not {request.mesh_name!r}"
        elif conflict := self._duplicate_of(request.node_id, request.instance_id):
            reply.refusal = pb.REFUSAL_DUPLICATE_NODE_ID
            reply.reason = conflict
            self.events.add(
                "refused a daemon claiming node id %s (instance %s): %s",
                request.node_id,
                request.instance_id,
                conflict,
                level=logging.WARNING,
            )
            if request.node_id == me.node_id and request.started_at < me.started_at:
                self._die_duplicate(f"instance {request.instance_id}")
        else:
            reply.accepted = True
            known = self.peers.get(request.node_id)
            if caller_host and request.grpc_port and not (known and known.alive):
                host = f"[{caller_host}]" if ":" in caller_host else caller_host
                self.want(f"{host}:{request.grpc_port}", "inbound")
        return reply

    def _duplicate_of(self, node_id: str, instance_id: str) -> str:
        """Non-empty text when `node_id` already belongs to another live daemon."""
        me = self.identity
        if node_id == me.node_id and instance_id != me.instance_id:
            return (
                f"node id {node_id} is this daemon's own id (instance {me.instance_id}); "
                "two daemons share a copied state directory - delete the 'node_id' file in the "
                "state directory of the newer one to give it a fresh id"
            )
        known = self.peers.get(node_id)
        if known and known.alive and known.instance_id != instance_id:
            return (
                f"node id {node_id} is already in the mesh at {known.address} (instance "
                f"{known.instance_id}); a copied state directory? delete its 'node_id' file "
                "on the newer machine"
            )
        return ""

    def _die_duplicate(self, other: str) -> None:
        if self.fatal is None:
            self.fatal = DuplicateNodeId(
                f"another daemon ({other}) already uses this node id {self.identity.node_id} and "
                "started earlier; this state directory was probably copied. Stop this daemon, "
                "delete the 'node_id' file in its state directory, and start it again."
            )
            self._fatal_event.set()

    # ------------------------------------------------------------ outgoing sessions

    async def _session_loop(self, address: str, source: str) -> None:
        backoff = 0.2
        while address in self._wanted:
            try:
                await self._session(address, source)
                backoff = 0.2
            except PeerRefused as exc:
                log.info("peer %s refused: %s", address, exc)
                backoff = MAX_BACKOFF_S * 5
            except DuplicateNodeId:
                raise
            except Exception as exc:
                self._session_failed(address, exc)
            except BaseExceptionGroup as group:
                # Cancelled (the daemon stops) just as a call to the peer failed: the failure
                # is the peer's and said like any other; only the cancellation goes on up.
                cancelled, failed = group.split(trio.Cancelled)
                if cancelled is None:
                    raise
                if failed is not None:
                    self._session_failed(address, failed)
                raise cancelled from None
            await trio.sleep(backoff * (0.8 + 0.4 * random.random()))
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _session_failed(self, address: str, error: Exception) -> None:
        """Log why a session ended: an unreachable peer in words (the peer's 'lost' line is
        in the event log already), a bug with its traceback."""
        leaves = _leaves(error)
        bugs = [leaf for leaf in leaves if not _expected(leaf)]
        if bugs:
            log.error("session to %s failed unexpectedly", address, exc_info=bugs[0])
            return
        refusal = next(filter(None, (describe_refusal(leaf) for leaf in leaves)), None)
        if refusal is not None:
            self._refused(address, refusal)
        else:
            log.debug("session to %s ended: %s", address, _words(leaves[0]))

    def _refused(self, address: str, why: str) -> None:
        """Once per address (until it answers again): who refused whom, and why."""
        if self._refusals.get(address) == why:
            return
        self._refusals[address] = why
        self.events.add(
            "%s is not a member of mesh %r: %s", address, self.mesh_name, why, level=logging.WARNING
        )

    async def _session(self, address: str, source: str) -> None:
        bridge = self._bridge
        channel = await bridge.run(self._open_channel, address, False)
        probe_channel = await bridge.run(self._open_channel, address, True)
        record: PeerRecord | None = None
        try:
            stub = rpc.PeerStub(channel)
            reply = await self._hello(stub, address)
            if reply is None:
                return
            record = self._admit(reply, address, source)
            if record is None:
                return
            record.stub = stub
            self._refusals.pop(address, None)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._fetch_states, stub, record)
                    probe = rpc.PeerStub(probe_channel)
                    nursery.start_soon(self._peer_links.run, stub, probe, record.node_id, address)
                    await self._heartbeat(stub, record)
                    # Lost now: tell everyone before the helper tasks have wound down.
                    self._mark_lost(record)
                    nursery.cancel_scope.cancel()
            except Exception as error:  # a call to the peer failed before its heartbeat did
                if record.alive and not record.lost_reason:
                    record.lost_reason = _words(_leaves(error)[0])
                raise
        finally:
            if record is not None:
                self._mark_lost(record)
            with trio.CancelScope(shield=True):
                await bridge.run(_close_channels, channel, probe_channel)

    async def _open_channel(self, address: str, for_probe: bool) -> grpc.aio.Channel:
        return self._channel_factory(address, for_probe)

    async def _hello(self, stub: rpc.PeerStub, address: str) -> pb.HelloReply | None:
        me = self.identity
        request = pb.HelloRequest(
            node_id=me.node_id,
            instance_id=me.instance_id,
            mesh_name=self.mesh_name,
            protocol_version=PROTOCOL_VERSION,
            grpc_port=self.grpc_port,
            started_at=me.started_at,
        )
        reply: pb.HelloReply = await self._bridge.run(_unary, stub.Hello, request, HELLO_TIMEOUT_S)
        if reply.node_id == me.node_id and reply.instance_id == me.instance_id:
            self.unwant(address, "that address is this daemon")
            return None
        if not reply.accepted:
            if reply.refusal == pb.REFUSAL_DUPLICATE_NODE_ID:
                # The peer already knows another live daemon with our node id: we are the copy.
                self._die_duplicate(f"reported by {reply.node_id} at {address}: {reply.reason}")
            raise PeerRefused(reply.reason or "no reason given")
        return reply

    def _admit(self, reply: pb.HelloReply, address: str, source: str) -> PeerRecord | None:
        """Register the peer as alive, unless that would merge two daemons into one id."""
        conflict = self._duplicate_of(reply.node_id, reply.instance_id)
        if conflict:
            self.events.add("ignoring %s: %s", address, conflict, level=logging.WARNING)
            if (
                reply.node_id == self.identity.node_id
                and reply.started_at < self.identity.started_at
            ):
                self._die_duplicate(f"at {address}, instance {reply.instance_id}")
            raise PeerRefused(conflict)
        known = self.peers.get(reply.node_id)
        if known and known.alive:
            log.debug("%s is already connected via %s", reply.node_id, known.address)
            self.unwant(address, f"duplicate address of {reply.node_id}")
            return None
        record = PeerRecord(
            node_id=reply.node_id,
            address=address,
            source=source,
            instance_id=reply.instance_id,
            started_at=reply.started_at,
        )
        record.state_wanted.set()
        self.peers[reply.node_id] = record
        self.events.add("peer %s joined (%s, via %s)", reply.node_id, address, source)
        self._publish()
        return record

    def note_peer_version(self, node_id: str, version: int) -> None:
        """A member's beat on its own stream to us named its state version (trio thread)."""
        record = self.peers.get(node_id)
        if record is not None and record.alive:
            _want_newer_state(record, version)

    def _mark_lost(self, record: PeerRecord, reason: str = "") -> None:
        if not record.alive:
            return
        record.alive = False
        record.lost_at = time.monotonic()
        record.lost_reason = reason or record.lost_reason or "heartbeat stream ended"
        self._peer_links.forget(record.node_id)
        self.events.add("peer %s lost: %s", record.node_id, record.lost_reason)
        self._publish()

    async def _heartbeat(self, stub: rpc.PeerStub, record: PeerRecord) -> None:
        """Run the beat stream until it breaks or goes silent; record why."""

        def on_beat(beat: pb.Beat, arrived_at: float) -> None:
            record.last_beat = time.monotonic()
            if beat.sent_at:
                record.clock_offset_s = beat.sent_at - arrived_at
            _want_newer_state(record, beat.state_version)

        def deliver(beat: pb.Beat) -> None:
            self._bridge.call_soon_in_trio(on_beat, beat, time.time())  # arrival, before the hop

        changed = asyncio.Event()  # set on the asyncio thread; bound to its loop when awaited

        def wake_sender() -> None:
            self._bridge.call_soon(changed.set)

        self._version_watchers.add(wake_sender)
        try:
            await self._bridge.run(
                beat_stream,
                stub,
                self.identity.node_id,
                lambda: self.own_state.version,
                changed,
                self._interval,
                self._timeout,
                deliver,
            )
            record.lost_reason = "peer closed the heartbeat stream (shut down)"
        except TimeoutError:
            record.lost_reason = f"no heartbeat for {self._timeout:.1f} s (link down or peer hung)"
        except grpc.aio.AioRpcError as exc:
            record.lost_reason = f"heartbeat stream broke: {exc.code().name} {exc.details()}"
        finally:
            self._version_watchers.discard(wake_sender)

    async def _fetch_states(self, stub: rpc.PeerStub, record: PeerRecord) -> None:
        while True:
            await record.state_wanted.wait()
            record.state_wanted = trio.Event()
            state: pb.NodeState = await self._bridge.run(
                _unary, stub.GetState, pb.StateRequest(), STATE_TIMEOUT_S
            )
            record.state = state
            self._publish()


def _want_newer_state(record: PeerRecord, version: int) -> None:
    """Have the peer's state fetched when it names a version newer than the one known."""
    if version > record.remote_version:
        record.remote_version = version
        record.state_wanted.set()


def _leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, or the error itself."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def _expected(error: BaseException) -> bool:
    """A failure that a lost, refusing or unreachable peer causes (not a bug here)."""
    return links.is_transient(error) or isinstance(error, ConnectionError | PeerRefused)


def _words(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"a call to it failed: {error.code().name} {error.details() or ''}".rstrip()
    if isinstance(error, TimeoutError | trio.TooSlowError):
        return "a call to it timed out"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


async def _unary(method, request, timeout: float):
    return await method(request, timeout=timeout)


async def _close_channels(*channels: grpc.aio.Channel) -> None:
    for channel in channels:
        await channel.close(grace=None)
