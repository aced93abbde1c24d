"""Link samples: a link's capacity over its recent probes, and when it is news."""

from __future__ import annotations

import pytest

from meshd.mesh import links
from meshd.wire import pb

pytestmark = pytest.mark.unit

MBIT = 1e6 / 8


def sample(mbit: float, rtt_ms: float = 0.05, at: float = 0.0) -> links.LinkSample:
    return links.LinkSample(rtt_ms / 1e3, 2 * rtt_ms / 1e3, mbit * MBIT, 1 << 20, at)


def bucketed(s: links.LinkSample, published: pb.LinkMeasurement | None) -> pb.LinkMeasurement:
    return links.with_planning_buckets(s.to_proto("a", "b"), published)


def test_two_probes_keep_what_the_link_showed_it_can_do() -> None:
    contended, clean = sample(80, rtt_ms=3.0, at=1.0), sample(950, rtt_ms=0.04, at=2.0)
    best = links.better_of(contended, clean)
    assert best.bandwidth == clean.bandwidth
    assert best.tcp_rtt_s == clean.tcp_rtt_s and best.grpc_rtt_s == clean.grpc_rtt_s
    assert best.measured_at == 2.0
    assert links.better_of(clean, contended) == best


def test_a_starved_probe_does_not_lower_a_link_and_a_really_slower_link_shows() -> None:
    """Samples as measured on a loaded host (Mbit/s): contention only makes a link look
    slower, so the capacity is the best of the window; a link that really became slower is
    lower in every probe of the window, and then it is lower."""
    window = links.LinkWindow(size=5)
    for mbit in (900, 1300, 2700, 3000, 5000):
        capacity = window.add(sample(mbit))
    assert capacity.bandwidth == 5000 * MBIT
    for _ in range(4):
        assert window.add(sample(95)).bandwidth == 5000 * MBIT
    assert window.add(sample(97)).bandwidth == 97 * MBIT
    with pytest.raises(ValueError, match="at least one sample"):
        links.LinkWindow(size=0)


def test_the_published_bucket_holds_through_the_noise_of_a_loaded_host() -> None:
    """The window's capacity wanders by a factor of about two on a loaded 2-core host
    (measured: 2.7-5.5 Gbit/s); the planning bucket and what peers re-fetch stay put."""
    published = bucketed(sample(4000), None)
    for mbit in (2700, 3500, 5500, 3000, 4900, 2900, 7000, 2100):
        fresh = bucketed(sample(mbit), published)
        assert fresh.bandwidth_bucket == published.bandwidth_bucket, mbit
    assert not links.worth_publishing(bucketed(sample(5500), published), published)
    assert links.worth_publishing(bucketed(sample(9000), published), published)


def test_a_really_slower_link_is_published() -> None:
    published = bucketed(sample(5000), None)
    fresh = bucketed(sample(97), published)
    assert fresh.bandwidth_bucket < published.bandwidth_bucket
    assert links.worth_publishing(fresh, published)
    assert abs(fresh.bandwidth - 97 * MBIT) < 1
