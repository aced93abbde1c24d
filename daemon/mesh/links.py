"""Link measurement: latency and bandwidth from this node to one peer.

Python gRPC adds ~0.6 ms per call on top of TCP here, which would hide a fast
link. So latency is taken from the kernel's own round trip - the time a TCP
connect to the peer's port takes (SYN, SYN-ACK), minimum of a few tries - and
the gRPC round trip is reported next to it, not instead of it.

Bandwidth is measured by streaming 256 KiB chunks to the peer for a bounded
time and byte count, timed at the *sender* from its first write to the receiver's
summary: every byte counted has crossed the link by then, so neither socket
buffers at the sender nor chunks the receiver reads late, in a burst, can make a
link look faster than it is. Each probe moves at most `MAX_PROBE_BYTES` and takes
at most `PROBE_SECONDS` of sending.

Why not the receiver's clock (as before): measured on veth pairs between network
namespaces on a loaded 2-core host, receiver-timed samples of one link spread
from 1.3 to 25 Gbit/s within a minute (15 buckets): a receiver that is scheduled
late finds megabytes waiting in its socket buffer and reads them at memory speed,
and a sender that is scheduled late makes the link look slow. The planning
buckets' hysteresis (5 % around 25 % wide buckets) assumed a few percent of
noise, so nearly every probe published a new bucket, and every node a new digest.

What remains is one-sided: contention only ever makes a link look slower (another
node probing the same peer, this node's uplink busy, a CPU-starved process). So
a link's capacity is what it showed at best over its last `WINDOW` probes
(`LinkWindow`): one starved probe does not lower it, a link that really became
slower shows it in every probe of the window. Probes disturb each other too: two
probes leaving one node share its uplink, so a node runs one bandwidth probe at a
time (`Membership`), and the first sample of a link is confirmed by a second
probe, keeping the better of the two (`better_of`).

The TCP connect also says which addresses the link uses (this node's and the peer's), and
each sample carries this node's verdict on whether the link may carry tensor-parallel
collectives (:mod:`meshd.mesh.link_trust`), published with the numbers.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
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
WINDOW = 5  # probes a link's capacity is the best of
# A published planning bucket (25 % wide) moves only when the capacity lands this many buckets
# away: measured on a loaded 2-core host, a link's windowed capacity still wanders by about a
# factor of two (2.7-5.5 Gbit/s on one veth pair), which must not be news; a link that really
# changed by more (a 10 Gbit/s link now at 1 Gbit/s) is.
BANDWIDTH_HYSTERESIS_BUCKETS = 3
LATENCY_HYSTERESIS_BUCKETS = 1


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
    """Stream chunks to the peer; return (bytes/s from the first write until the receiver's
    summary arrived, bytes sent). Every byte has crossed by then: never faster than the link."""
    chunk = pb.ProbeChunk(payload=b"\x5a" * CHUNK_BYTES)
    sent = 0
    started = 0.0

    async def chunks():
        nonlocal sent, started
        started = time.perf_counter()
        deadline = started + seconds
        while sent < max_bytes and (sent < MIN_PROBE_BYTES or time.perf_counter() < deadline):
            sent += CHUNK_BYTES
            yield chunk

    summary = await stub.ProbeBandwidth(chunks(), timeout=CALL_TIMEOUT_S + seconds)
    elapsed = time.perf_counter() - started
    received = summary.bytes + CHUNK_BYTES  # the summary leaves the first chunk out
    if summary.chunks < 2 or elapsed <= 0 or received < sent:
        raise RuntimeError(
            f"bandwidth probe incomplete: the peer received {summary.chunks} chunks of "
            f"{sent // CHUNK_BYTES} sent"
        )
    return sent / elapsed, sent


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
    same numbers and a measurement wandering with the host's load changes no digest.
    """
    from partitioner.quantize import MIN_LATENCY_S, bucket_index, latency_bucket_index

    bandwidth = bucket_index(new.bandwidth)
    latency = latency_bucket_index(max(new.latency_s, MIN_LATENCY_S))
    if published is not None:
        bandwidth = _sticky(bandwidth, published.bandwidth_bucket, BANDWIDTH_HYSTERESIS_BUCKETS)
        latency = _sticky(latency, published.latency_bucket, LATENCY_HYSTERESIS_BUCKETS)
    new.bandwidth_bucket = bandwidth
    new.latency_bucket = latency
    return new


def _sticky(current: int, previous: int, band: int) -> int:
    return previous if abs(current - previous) <= band else current


class LinkWindow:
    """The last `WINDOW` samples of one link; its capacity is the best they showed.

    Contention only makes a link look slower, so the best recent sample is the link's
    capacity, and a lower one counts only once every sample of the window is lower: then the
    link really became slower.
    """

    def __init__(self, size: int = WINDOW) -> None:
        if size < 1:
            raise ValueError(f"a link window holds at least one sample, not {size}")
        self._samples: deque[LinkSample] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, sample: LinkSample) -> LinkSample:
        """Record `sample`; return the link's capacity now (see `capacity`)."""
        self._samples.append(sample)
        return self.capacity()

    def capacity(self) -> LinkSample:
        """The best bandwidth and round trips of the window, stamped with the newest time."""
        if not self._samples:
            raise ValueError("no sample of this link yet")
        best = self._samples[0]
        for sample in list(self._samples)[1:]:
            best = better_of(best, sample)
        return best


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
    """A new capacity is published when its planning buckets moved, its numbers changed by
    more than half, or its trust verdict or addresses changed (peers re-fetch state on every
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
    return abs(new.bandwidth - published.bandwidth) > 0.5 * published.bandwidth


def is_transient(exc: BaseException) -> bool:
    """Errors that mean 'peer unreachable right now', not a bug."""
    return isinstance(
        exc, grpc.aio.AioRpcError | asyncio.TimeoutError | OSError | trio.TooSlowError
    )
