"""Link measurement: latency and bandwidth from this node to one peer.

Python gRPC adds ~0.6 ms per call on top of TCP here, which would hide a fast
link. So latency is taken from the kernel's own round trip - the time a TCP
connect to the peer's port takes (SYN, SYN-ACK), minimum of a few tries - and
the gRPC round trip is reported next to it, not instead of it.

Bandwidth is measured by streaming 256 KiB chunks to the peer for a bounded
time and byte count; the *receiver* times the chunks (first chunk excluded), so
what fills socket buffers at the sender does not inflate the rate. Each probe
moves at most `MAX_PROBE_BYTES` and takes at most `PROBE_SECONDS` of sending.

The TCP connect also says which addresses the link uses (this node's and the peer's), and
each sample carries this node's verdict on whether the link may carry tensor-parallel
collectives (:mod:`meshd.mesh.link_trust`), published with the numbers.

Probes disturb each other: two probes leaving one node share its uplink (each
would report half), and a node whose uplink is full acknowledges incoming
probes late. So a node runs one bandwidth probe at a time (`Membership`), and
the first sample of a link, or one that makes it look worse, is confirmed by a
second probe, keeping the better of the two (`needs_confirmation`, `better_of`).
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import trio

from meshd.wire import pb, rpc

CHUNK_BYTES = 256 * 1024
PROBE_SECONDS = 0.15
MIN_PROBE_BYTES = 512 * 1024
MAX_PROBE_BYTES = 16 * 1024 * 1024
PING_PAYLOAD = b"\0" * 64
RTT_SAMPLES = 5
CALL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class LinkSample:
    """One measurement of the directed link this node -> peer.

    src_address / dst_address: the IPs the probe's TCP connection used at each end; trusted /
    trust_reason: this node's verdict on the link for tensor-parallel traffic.
    """

    tcp_rtt_s: float
    grpc_rtt_s: float
    bandwidth: float
    probe_bytes: int
    measured_at: float
    src_address: str = ""
    dst_address: str = ""
    trusted: bool = False
    trust_reason: str = ""

    def to_proto(self, src: str, dst: str) -> pb.LinkMeasurement:
        return pb.LinkMeasurement(
            src=src,
            dst=dst,
            tcp_rtt_s=self.tcp_rtt_s,
            grpc_rtt_s=self.grpc_rtt_s,
            latency_s=self.tcp_rtt_s / 2,
            bandwidth=self.bandwidth,
            probe_bytes=self.probe_bytes,
            measured_at=self.measured_at,
            trusted=self.trusted,
            trust_reason=self.trust_reason,
            src_address=self.src_address,
            dst_address=self.dst_address,
        )


class TcpProbe(NamedTuple):
    """The kernel-level round trip to a peer, and the IPs the connection used."""

    rtt_s: float
    local_address: str
    peer_address: str


async def tcp_rtt(host: str, port: int, samples: int = 5, timeout_s: float = 2.0) -> TcpProbe:
    """Minimum TCP connect time to host:port, a kernel-level RTT (SYN -> SYN-ACK), and the
    local and remote IPs of the connection (the addresses this link really uses).

    Timed inside a worker thread with a plain socket, so neither trio's scheduling nor
    name resolution is counted; the trio thread is never blocked.
    """

    def measure() -> TcpProbe:
        best, local, peer = float("inf"), "", ""
        for _ in range(samples):
            start = time.perf_counter()
            with socket.create_connection((host, port), timeout=timeout_s) as connection:
                best = min(best, time.perf_counter() - start)
                local = _bare_ip(connection.getsockname()[0])
                peer = _bare_ip(connection.getpeername()[0])
        return TcpProbe(best, local, peer)

    # A probe of a dead link must not hold up its session's shutdown: abandon the thread.
    return await trio.to_thread.run_sync(measure, abandon_on_cancel=True)


def _bare_ip(address: str) -> str:
    """An IP as the socket reports it, without an IPv6 zone or the IPv4-mapped prefix."""
    address = address.split("%", 1)[0]
    return address.removeprefix("::ffff:") if "." in address else address


async def grpc_rtt(stub: rpc.PeerStub, samples: int = RTT_SAMPLES) -> float:
    """Minimum round trip of a small unary Ping (asyncio side)."""
    best = float("inf")
    for _ in range(samples):
        start = time.perf_counter()
        await stub.Ping(pb.PingRequest(payload=PING_PAYLOAD), timeout=CALL_TIMEOUT_S)
        best = min(best, time.perf_counter() - start)
    return best


async def probe_bandwidth(
    stub: rpc.PeerStub,
    seconds: float = PROBE_SECONDS,
    max_bytes: int = MAX_PROBE_BYTES,
) -> tuple[float, int]:
    """Stream chunks to the peer; return (bytes/s as timed by the receiver, bytes sent)."""
    chunk = pb.ProbeChunk(payload=b"\x5a" * CHUNK_BYTES)
    sent = 0

    async def chunks():
        nonlocal sent
        deadline = time.perf_counter() + seconds
        while sent < max_bytes and (sent < MIN_PROBE_BYTES or time.perf_counter() < deadline):
            sent += CHUNK_BYTES
            yield chunk

    summary = await stub.ProbeBandwidth(chunks(), timeout=CALL_TIMEOUT_S + seconds)
    if summary.receive_seconds <= 0 or summary.bytes == 0:
        raise RuntimeError("bandwidth probe too short to time; the peer received one chunk")
    return summary.bytes / summary.receive_seconds, sent


class ProbeReceiver:
    """Server side of ProbeBandwidth: time chunk arrivals, excluding the first."""

    @staticmethod
    async def receive(request_iterator) -> pb.ProbeSummary:
        first_at: float | None = None
        last_at = 0.0
        counted = 0
        chunks = 0
        async for chunk in request_iterator:
            now = time.perf_counter()
            chunks += 1
            if first_at is None:
                first_at = now
                continue
            counted += len(chunk.payload)
            last_at = now
        seconds = (last_at - first_at) if first_at is not None and chunks > 1 else 0.0
        return pb.ProbeSummary(bytes=counted, receive_seconds=seconds, chunks=chunks)


def with_planning_buckets(
    new: pb.LinkMeasurement, published: pb.LinkMeasurement | None
) -> pb.LinkMeasurement:
    """Set `new`'s planning buckets, keeping the published ones unless the link really moved.

    Hysteresis (sticky buckets) happens here, at the measurer, so all nodes plan with the
    same numbers and a measurement wobbling around a bucket edge changes no plan.
    """
    from partitioner.quantize import (
        MIN_LATENCY_S,
        bucket_index,
        latency_bucket_index,
        sticky_bucket_index,
    )

    old_bw = published.bandwidth_bucket if published is not None else None
    old_lat = published.latency_bucket if published is not None else None
    new.bandwidth_bucket = (
        sticky_bucket_index(new.bandwidth, old_bw)
        if old_bw is not None
        else bucket_index(new.bandwidth)
    )
    latency = max(new.latency_s, MIN_LATENCY_S)
    new.latency_bucket = (
        sticky_bucket_index(latency, old_lat)
        if old_lat is not None
        else latency_bucket_index(latency)
    )
    return new


def needs_confirmation(new: pb.LinkMeasurement, published: pb.LinkMeasurement | None) -> bool:
    """Whether a sample (with planning buckets set) must be confirmed by a second probe.

    The first sample of a link and a sample that moves the link to a worse bucket are: the
    first plan is made from the first sample, and contention only ever makes a link look
    worse (another node probing the same peer, this node's own uplink busy, a CPU-starved
    receiver), while a really slower link shows in both probes.
    """
    if published is None:
        return True
    return (
        new.bandwidth_bucket < published.bandwidth_bucket
        or new.latency_bucket > published.latency_bucket
    )


def better_of(a: LinkSample, b: LinkSample) -> LinkSample:
    """What two probes of one link show it can do: the higher bandwidth, the lower RTTs."""
    best = a if a.bandwidth >= b.bandwidth else b
    newest = a if a.measured_at >= b.measured_at else b
    return LinkSample(
        tcp_rtt_s=min(a.tcp_rtt_s, b.tcp_rtt_s),
        grpc_rtt_s=min(a.grpc_rtt_s, b.grpc_rtt_s),
        bandwidth=best.bandwidth,
        probe_bytes=best.probe_bytes,
        measured_at=newest.measured_at,
        src_address=newest.src_address,
        dst_address=newest.dst_address,
        trusted=newest.trusted,
        trust_reason=newest.trust_reason,
    )


def worth_publishing(new: pb.LinkMeasurement, published: pb.LinkMeasurement | None) -> bool:
    """A new sample is published when its planning buckets moved, its numbers changed by
    more than 10 %, or its trust verdict or addresses changed (peers re-fetch state on every
    publication; noise is not news)."""
    if published is None:
        return True
    if (new.trusted, new.trust_reason, new.src_address, new.dst_address) != (
        published.trusted,
        published.trust_reason,
        published.src_address,
        published.dst_address,
    ):
        return True
    if (new.bandwidth_bucket, new.latency_bucket) != (
        published.bandwidth_bucket,
        published.latency_bucket,
    ):
        return True
    return abs(new.bandwidth - published.bandwidth) > 0.1 * published.bandwidth


def is_transient(exc: BaseException) -> bool:
    """Errors that mean 'peer unreachable right now', not a bug."""
    return isinstance(
        exc, grpc.aio.AioRpcError | asyncio.TimeoutError | OSError | trio.TooSlowError
    )
