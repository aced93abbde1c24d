"""mDNS discovery: announce this daemon as `_meshd._tcp.local.` and report peers as events.

mDNS is for *finding* peers only. python-zeroconf floors a received PTR TTL at 1125 s, so a
peer killed with `kill -9` stays listed for 19-75 minutes; liveness is the gRPC heartbeat's job.
What this module does promise: a peer that leaves gracefully (goodbye packet) is reported as
`PeerGone` within milliseconds, and a peer in another mesh, with another protocol version or
another mesh fingerprint is never reported at all (one log line per peer says why).

Threads: without an asyncio loop in the calling thread, `Zeroconf` runs its own loop thread and
its `ServiceBrowser` calls back on a thread of its own. Nothing here blocks the trio thread:
coroutines are submitted to zeroconf's loop and awaited with `meshd.runtime.bridge.wait_future`,
browser callbacks reach trio through `TrioToken.run_sync_soon` (non-blocking, so closing the
browser, which joins its thread, cannot deadlock), and the few blocking calls run in
`trio.to_thread`.

What is announced, and how a peer's announcement is checked: `meshd.mesh.announcement`. Which
interfaces: `meshd.mesh.interfaces`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

import trio
from zeroconf import (
    DNSAddress,
    DNSOutgoing,
    DNSText,
    IPVersion,
    RecordUpdate,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
    current_time_millis,
)
from zeroconf.const import _CLASS_IN, _FLAGS_AA, _FLAGS_QR_RESPONSE, _TYPE_A, _TYPE_TXT

from meshd.mesh.announcement import SERVICE_TYPE, Announcement, MalformedAnnouncementError
from meshd.mesh.interfaces import check_bind_addresses
from meshd.runtime.bridge import wait_future

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class PeerAppeared:
    """A compatible peer was announced for the first time (or again after it was gone)."""

    announcement: Announcement


@dataclass(frozen=True)
class PeerUpdated:
    """A known compatible peer changed what it announces (port, addresses)."""

    announcement: Announcement


@dataclass(frozen=True)
class PeerGone:
    """A peer said goodbye or became incompatible; `reason` says which."""

    node_id: str
    reason: str


DiscoveryEvent = PeerAppeared | PeerUpdated | PeerGone

GOODBYE_REASON = "mDNS goodbye (the peer left or its record expired)"


@dataclass
class _Resolution:
    """An in-flight resolution of one peer; `again` asks for one more pass after it."""

    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    again: bool = False


class Discovery:
    """Announce `announcement` on `interfaces` and send DiscoveryEvents for compatible peers.

    `interfaces` are IPv4 addresses (e.g. from `resolve_interfaces`, or ["127.0.0.1"] for a
    loopback-only mesh); zeroconf binds to exactly these. If `announcement.addresses` is empty
    the interface addresses are announced.
    """

    def __init__(
        self,
        announcement: Announcement,
        interfaces: Sequence[str],
        events: trio.MemorySendChannel[DiscoveryEvent],
        *,
        resolve_timeout_s: float = 1.5,
        resolve_attempts: int = 3,
        shutdown_timeout_s: float = 3.0,
        first_revision: int = 0,
    ) -> None:
        self._interfaces = check_bind_addresses(interfaces)
        self._own = self._with_addresses(announcement)
        self._events = events
        self._resolve_timeout_ms = int(resolve_timeout_s * 1000)
        self._resolve_attempts = max(1, resolve_attempts)
        self._shutdown_timeout_s = shutdown_timeout_s
        self._zc: Zeroconf | None = None
        self._registered: ServiceInfo | None = None
        self._peers: dict[str, Announcement] = {}
        self._ignored: dict[str, str] = {}
        self._seen_names: set[str] = set()
        self._resolutions: dict[str, _Resolution] = {}
        self._nursery: trio.Nursery | None = None
        self._warned_duplicate = False
        self._revision = first_revision
        self._announce_lock = trio.Lock()
        # time.monotonic() when the first announcement went out (for latency measurements).
        self.announced_at: float | None = None

    @property
    def announcement(self) -> Announcement:
        """What this node currently announces."""
        return self._own

    @property
    def interfaces(self) -> tuple[str, ...]:
        """The IPv4 addresses zeroconf is bound to."""
        return tuple(self._interfaces)

    @property
    def revision(self) -> int:
        """The TXT revision announced last; a Discovery that follows starts above it."""
        return self._revision

    @property
    def peers(self) -> dict[str, Announcement]:
        """Compatible peers currently announced, by node id (a copy)."""
        return dict(self._peers)

    @property
    def ignored(self) -> dict[str, str]:
        """Peers seen but ignored, by node id (or instance name), with the reason (a copy)."""
        return dict(self._ignored)

    def _with_addresses(self, announcement: Announcement) -> Announcement:
        if announcement.addresses:
            return announcement
        return replace(announcement, addresses=tuple(self._interfaces))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Announce, browse and emit events until cancelled; then say goodbye and close.

        `task_status.started()` is called once the announcement has been sent; peers are
        reported from the moment the browser runs, which is before that. Shutdown (goodbye,
        close) is shielded but bounded by `shutdown_timeout_s`.
        """
        browser: ServiceBrowser | None = None
        raw_send, raw_receive = trio.open_memory_channel[tuple[str, ServiceStateChange]](math.inf)
        try:
            self._zc = await trio.to_thread.run_sync(
                partial(Zeroconf, interfaces=list(self._interfaces), use_asyncio=False)
            )
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                # Browse first and hand peers on at once: registering takes ~0.5 s, and peers
                # found meanwhile can already be dialled.
                browser = self._start_browser(raw_send)
                nursery.start_soon(self._dispatch, raw_receive)
                await self._register()
                task_status.started()
        finally:
            self._nursery = None
            raw_send.close()
            with trio.move_on_after(self._shutdown_timeout_s) as scope:
                scope.shield = True
                await self._shutdown(browser)

    async def update(self, announcement: Announcement) -> None:
        """Announce new facts (e.g. a mesh name and fingerprint after joining with a token).

        Peers are re-evaluated against the new facts: some may appear, others go.
        """
        if announcement.node_id != self._own.node_id:
            raise ValueError(
                f"update() cannot change the node id ({self._own.node_id!r} -> "
                f"{announcement.node_id!r}); stop this Discovery and start a new one"
            )
        self._own = self._with_addresses(announcement)
        if self._registered is not None:  # else run() registers the new facts itself
            await self._announce_update()

    async def _announce_update(self) -> None:
        """Re-announce `self._own` and re-evaluate every peer seen so far."""
        async with self._announce_lock:
            if self._zc is None or self._registered is None:
                return
            self._revision += 1
            info = self._own.to_service_info(self._revision)
            await self._on_zeroconf_loop(_update_service(self._zc, info))
            self._registered = info
        self._ignored.clear()
        for name in sorted(self._seen_names):
            self._schedule_resolution(name)

    async def withdraw_quietly(self, addresses: Sequence[str] = ()) -> None:
        """Stop without the service goodbye, before another Discovery takes over.

        Used when this node moves to other interfaces but keeps at least one it announced on,
        or when none of its old addresses exists any more (a goodbye could not leave): a
        goodbye for the whole service would make every peer drop the node and find it again
        a moment later. `addresses` (announced here, not by the next Discovery, still on this
        machine) get a goodbye of their address record alone, so peers stop dialling them.
        """
        async with self._announce_lock:
            if self._zc is None or self._registered is None:
                return
            info, self._registered = self._registered, None
            await self._on_zeroconf_loop(_withdraw_quietly(self._zc, info, tuple(addresses)))

    # -- registration and shutdown --------------------------------------------------------

    async def _register(self) -> None:
        assert self._zc is not None
        announcement = self._own
        info = announcement.to_service_info(self._revision)
        self.announced_at = time.monotonic()
        await self._on_zeroconf_loop(_register_service(self._zc, info))
        self._registered = info
        if self._own != announcement:  # update() was called while we registered
            await self._announce_update()
        log.info(
            "announcing %s (mesh %r) on %s",
            announcement.node_id,
            announcement.mesh_name,
            ", ".join(self._interfaces),
        )

    def _start_browser(
        self, raw_send: trio.MemorySendChannel[tuple[str, ServiceStateChange]]
    ) -> ServiceBrowser:
        assert self._zc is not None
        token = trio.lowlevel.current_trio_token()

        def deliver(name: str, change: ServiceStateChange) -> None:
            # Runs on the trio thread; the channel may already be closed during shutdown.
            with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                raw_send.send_nowait((name, change))

        def on_change(
            zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
        ) -> None:
            # Runs on the browser's thread: hand over without blocking it.
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(deliver, name, state_change)

        return ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[on_change])

    async def _shutdown(self, browser: ServiceBrowser | None) -> None:
        zc, self._zc = self._zc, None
        if browser is not None:
            await trio.to_thread.run_sync(browser.cancel, abandon_on_cancel=True)
        if zc is None:
            return
        if self._registered is not None:
            info, self._registered = self._registered, None
            try:
                await wait_future(asyncio.run_coroutine_threadsafe(_unregister(zc, info), zc.loop))
            except Exception as error:  # a failed goodbye must not prevent closing
                log.warning("could not send the mDNS goodbye for %s: %s", info.name, error)
        await trio.to_thread.run_sync(zc.close, abandon_on_cancel=True)

    async def _on_zeroconf_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        assert self._zc is not None and self._zc.loop is not None
        return await wait_future(asyncio.run_coroutine_threadsafe(coroutine, self._zc.loop))

    # -- browsing ---------------------------------------------------------------------------

    async def _dispatch(
        self, raw_receive: trio.MemoryReceiveChannel[tuple[str, ServiceStateChange]]
    ) -> None:
        async for name, change in raw_receive:
            if change is ServiceStateChange.Removed:
                await self._handle_removal(name)
            else:
                self._seen_names.add(name)
                self._schedule_resolution(name)

    def _schedule_resolution(self, name: str) -> None:
        if self._nursery is None:
            return
        pending = self._resolutions.get(name)
        if pending is not None:
            pending.again = True
            return
        resolution = _Resolution()
        self._resolutions[name] = resolution
        self._nursery.start_soon(self._resolve_and_apply, name, resolution)

    async def _resolve_and_apply(self, name: str, resolution: _Resolution) -> None:
        try:
            with resolution.scope:
                resolution.again = True
                while resolution.again:  # bounded: runs again only after a new browser event
                    resolution.again = False
                    result = await self._resolve(name)
                    await self._apply(name, result)
        finally:
            if self._resolutions.get(name) is resolution:
                del self._resolutions[name]

    async def _resolve(self, name: str) -> Announcement | str:
        """The peer's announcement, or why it could not be had (bounded retries)."""
        assert self._zc is not None
        for _ in range(self._resolve_attempts):
            request = _request_service_info(self._zc, name, self._resolve_timeout_ms)
            info = await self._on_zeroconf_loop(request)
            if info is not None:
                try:
                    return Announcement.from_service_info(info)
                except MalformedAnnouncementError as error:
                    return f"malformed announcement: {error}"
        seconds = self._resolve_attempts * self._resolve_timeout_ms / 1000
        return f"did not answer resolution within {seconds:g} s"

    async def _apply(self, name: str, result: Announcement | str) -> None:
        if name == self._own.instance_name:
            if isinstance(result, Announcement):
                self._check_duplicate_node_id(result)
            return
        if isinstance(result, str):
            node_id = _node_id_from_name(name)
            if node_id not in self._peers:  # a known peer stays until its goodbye
                self._note_ignored(node_id, result)
            return
        reason = self._own.incompatibility_with(result)
        if reason is not None:
            self._note_ignored(result.node_id, reason)
            if result.node_id in self._peers:
                await self._events.send(PeerGone(result.node_id, reason))
                del self._peers[result.node_id]
            return
        self._ignored.pop(result.node_id, None)
        previous = self._peers.get(result.node_id)
        if previous is None:
            log.info(
                "%s sees peer %s at %s port %d",
                self._own.node_id,
                result.node_id,
                ", ".join(result.addresses),
                result.grpc_port,
            )
            await self._events.send(PeerAppeared(result))
        elif previous != result:
            await self._events.send(PeerUpdated(result))
        # Recorded only once the event is out: a removal that cancels this send must not
        # report a PeerGone for a peer the consumer never saw appear.
        self._peers[result.node_id] = result

    async def _handle_removal(self, name: str) -> None:
        self._seen_names.discard(name)
        pending = self._resolutions.pop(name, None)
        if pending is not None:
            pending.scope.cancel()
        node_id = _node_id_from_name(name)
        self._ignored.pop(node_id, None)
        if name != self._own.instance_name and self._peers.pop(node_id, None) is not None:
            log.info("%s: peer %s left (%s)", self._own.node_id, node_id, GOODBYE_REASON)
            await self._events.send(PeerGone(node_id, GOODBYE_REASON))

    def _note_ignored(self, node_id: str, reason: str) -> None:
        if self._ignored.get(node_id) != reason:
            log.info("%s ignores peer %s: %s", self._own.node_id, node_id, reason)
        self._ignored[node_id] = reason

    def _check_duplicate_node_id(self, echo: Announcement) -> None:
        """Warn (once) when another daemon announces our node id: copied state directory."""
        ours = (self._own.grpc_port, set(self._own.addresses))
        if (echo.grpc_port, set(echo.addresses)) != ours and not self._warned_duplicate:
            self._warned_duplicate = True
            log.warning(
                "another daemon announces our node id %s at %s:%d; was the state directory "
                "copied? give one of them a new node id",
                echo.node_id,
                echo.addresses,
                echo.grpc_port,
            )


def _node_id_from_name(name: str) -> str:
    suffix = f".{SERVICE_TYPE}"
    return name[: -len(suffix)] if name.endswith(suffix) else name


async def _request_service_info(zc: Zeroconf, name: str, timeout_ms: int) -> ServiceInfo | None:
    """Runs on zeroconf's loop: resolve `name`, taking the most recently received TXT record.

    Right after a peer changes its TXT, the cache holds the old and the new record for up to a
    second (RFC 6762 10.2), and zeroconf's own cache lookup may return either.
    """
    info = ServiceInfo(SERVICE_TYPE, name)
    if not await info.async_request(zc, timeout_ms):
        return None
    now = current_time_millis()
    texts = [
        record
        for record in zc.cache.async_all_by_details(name, _TYPE_TXT, _CLASS_IN)
        if isinstance(record, DNSText) and not record.is_expired(now)
    ]
    if texts:
        newest = max(texts, key=lambda record: record.created)
        info.async_update_records(zc, now, [RecordUpdate(newest, None)])
    _drop_flushed_addresses(zc, info, now)
    return info


def _drop_flushed_addresses(zc: Zeroconf, info: ServiceInfo, now: float) -> None:
    """Leave out the IPv4 addresses a peer no longer announces (runs on zeroconf's loop).

    A peer that moved announces its new address with the cache-flush bit; zeroconf then keeps
    the old address record for one more second (RFC 6762 10.2, its TTL set to 1), and a
    resolution in that second would return both, the old one perhaps first.
    """
    if info.server_key is None:
        return
    records = [
        record
        for record in zc.cache.async_all_by_details(info.server_key, _TYPE_A, _CLASS_IN)
        if isinstance(record, DNSAddress) and not record.is_expired(now)
    ]
    current = [record.address for record in records if record.ttl > 1]
    if current and len(current) < len(records):
        info.addresses = [*current, *info.addresses_by_version(IPVersion.V6Only)]


async def _register_service(zc: Zeroconf, info: ServiceInfo) -> None:
    """Runs on zeroconf's loop. No probing (cooperating responders): ~0.45 s instead of 1.6 s;
    the instance name is the node id, which is unique by construction."""
    broadcast = await zc.async_register_service(
        info, allow_name_change=False, cooperating_responders=True
    )
    await broadcast


async def _update_service(zc: Zeroconf, info: ServiceInfo) -> None:
    """Runs on zeroconf's loop."""
    await (await zc.async_update_service(info))


async def _withdraw_quietly(zc: Zeroconf, info: ServiceInfo, addresses: tuple[str, ...]) -> None:
    """Runs on zeroconf's loop: goodbyes for `addresses`' records, then forget the service
    without the goodbye `Zeroconf.close` would send for it.

    The goodbyes go without the cache-flush bit: with it, a peer would flush this node's
    other address records too (RFC 6762 10.2).
    """
    if addresses and info.server is not None:
        out = DNSOutgoing(_FLAGS_QR_RESPONSE | _FLAGS_AA)
        for ip in addresses:
            record = DNSAddress(info.server, _TYPE_A, _CLASS_IN, 0, socket.inet_aton(ip))
            out.add_answer_at_time(record, 0)
        zc.async_send(out)
    zc.registry.async_remove(info)


async def _unregister(zc: Zeroconf, info: ServiceInfo) -> None:
    """Runs on zeroconf's loop: broadcasts the goodbye."""
    await (await zc.async_unregister_service(info))
