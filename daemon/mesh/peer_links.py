"""The links from this node to its peers: probed while a session to the peer lasts, and
published (with planning buckets) only when they changed materially.

Membership (:mod:`meshd.mesh.membership`) starts a probe loop per session, forgets a lost
peer's link and publishes the measurements in this node's state; the measuring itself (round
trips, bandwidth, the confirmation rules) is :mod:`meshd.mesh.links`.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import trio

from meshd.mesh import links
from meshd.mesh.link_trust import mesh_link_verdict
from meshd.runtime.bridge import AsyncioThread
from meshd.wire import pb, rpc

log = logging.getLogger("meshd.membership")

CONFIRM_PAUSE_S = (0.02, 0.1)  # random, so two nodes probing one peer drift apart


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"peer address {address!r} is not host:port")
    return host.strip("[]"), int(port)


class PeerLinks:
    """The measured links from node ``node_id`` to its peers (trio thread)."""

    def __init__(
        self,
        node_id: str,
        bridge: AsyncioThread,
        publish: Callable[[], None],
        *,
        probe_interval_s: float,
        trusted_networks: tuple[str, ...],
    ) -> None:
        """``publish``: this node's state changed (a link's published measurement did)."""
        self._node_id = node_id
        self._bridge = bridge
        self._publish = publish
        self._probe_interval = probe_interval_s
        self._trusted_networks = trusted_networks
        self._bandwidth_turn = trio.Lock()  # one bandwidth probe at a time leaves this node
        self.links: dict[str, pb.LinkMeasurement] = {}  # published, by peer
        self._windows: dict[str, links.LinkWindow] = {}

    def forget(self, peer: str) -> None:
        """The peer is lost: its link is not this node's any more."""
        self.links.pop(peer, None)
        self._windows.pop(peer, None)

    async def run(
        self, stub: rpc.PeerStub, probe_stub: rpc.PeerStub, peer: str, address: str
    ) -> None:
        """Probe the link to ``peer`` at ``address`` for as long as its session lasts."""
        while True:  # no stagger needed: bandwidth probes take turns (`_bandwidth_turn`)
            sample = await self._measure_link(stub, probe_stub, peer, address)
            window = self._windows.setdefault(peer, links.LinkWindow())
            if sample is not None and not window:
                # The first plan is made from the first sample: a second probe, a moment
                # later, keeps one starved probe from deciding it.
                await trio.sleep(random.uniform(*CONFIRM_PAUSE_S))
                again = await self._measure_link(stub, probe_stub, peer, address, sample.grpc_rtt_s)
                if again is not None:
                    window.add(again)
            if sample is not None:
                self._record_link(peer, sample, window.add(sample))
            await trio.sleep(self._probe_interval * random.uniform(0.9, 1.1))

    async def _measure_link(
        self,
        stub: rpc.PeerStub,
        probe_stub: rpc.PeerStub,
        peer: str,
        address: str,
        grpc_rtt_s: float | None = None,
    ) -> links.LinkSample | None:
        """One probe of the link to `peer` at `address`; None (logged) when the peer is unreachable.

        Round trips are measured concurrently with other peers' probes; bandwidth probes take
        turns (`_bandwidth_turn`), because probes leaving this node share its uplink. A known
        `grpc_rtt_s` (shown, never planned with) is reused instead of measured again. The
        sample carries this node's verdict on the link for tensor-parallel traffic.
        """
        host, port = split_address(address)
        try:
            tcp = await links.tcp_rtt(host, port)
            rtt = (
                grpc_rtt_s
                if grpc_rtt_s is not None
                else await self._bridge.run(links.grpc_rtt, stub)
            )
            async with self._bandwidth_turn:
                bandwidth, sent = await self._bridge.run(links.probe_bandwidth, probe_stub)
        except Exception as exc:
            if not links.is_transient(exc):
                raise
            log.info("measuring the link to %s failed: %s", peer, exc)
            return None
        # Reads the interface's facts (and on macOS asks networksetup): not on the trio thread.
        verdict = await trio.to_thread.run_sync(
            mesh_link_verdict, tcp.local_address, tcp.peer_address, self._trusted_networks
        )
        return links.LinkSample(
            tcp.rtt_s,
            rtt,
            bandwidth,
            sent,
            time.time(),
            src_address=tcp.local_address,
            dst_address=tcp.peer_address,
            trusted=verdict.allowed,
            trust_reason=verdict.reason,
        )

    def _bucketed(self, peer: str, sample: links.LinkSample) -> pb.LinkMeasurement:
        """`sample` as a measurement with planning buckets relative to the published one."""
        proto = sample.to_proto(self._node_id, peer)
        return links.with_planning_buckets(proto, self.links.get(peer))

    def _record_link(self, peer: str, sample: links.LinkSample, capacity: links.LinkSample) -> None:
        """Publish the link's capacity (the best of its recent samples, `links.LinkWindow`)
        only when it changed materially.

        Digests hash bucketed link numbers; re-publishing every noisy sample would make
        peers re-fetch state and re-propose for nothing. A capacity inside the hysteresis
        band of the published one's buckets keeps the published one.
        """
        published = self.links.get(peer)
        fresh = self._bucketed(peer, capacity)
        log.debug(
            "link sample to %s: rtt %.3f ms, %.1f Mbit/s; capacity %.1f Mbit/s (bucket %d)",
            peer,
            sample.tcp_rtt_s * 1e3,
            sample.bandwidth * 8 / 1e6,
            capacity.bandwidth * 8 / 1e6,
            fresh.bandwidth_bucket,
        )
        if not links.worth_publishing(fresh, published):
            return
        self.links[peer] = fresh
        log.info(
            "link to %s: rtt %.3f ms (grpc %.3f ms), %.1f Mbit/s",
            peer,
            capacity.tcp_rtt_s * 1e3,
            capacity.grpc_rtt_s * 1e3,
            capacity.bandwidth * 8 / 1e6,
        )
        if published is None or published.trust_reason != fresh.trust_reason:
            log.info("link to %s for tensor-parallel traffic: %s", peer, fresh.trust_reason)
        self._publish()
