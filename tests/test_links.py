"""Link samples: which ones need a second probe, and what two probes say together."""

from __future__ import annotations

from meshd.mesh import links
from meshd.wire import pb

MBIT = 1e6 / 8


def sample(mbit: float, rtt_ms: float = 0.05, at: float = 0.0) -> links.LinkSample:
    return links.LinkSample(rtt_ms / 1e3, 2 * rtt_ms / 1e3, mbit * MBIT, 1 << 20, at)


def bucketed(s: links.LinkSample, published: pb.LinkMeasurement | None) -> pb.LinkMeasurement:
    return links.with_planning_buckets(s.to_proto("a", "b"), published)


def test_the_first_sample_of_a_link_is_confirmed() -> None:
    assert links.needs_confirmation(bucketed(sample(1000), None), None)


def test_a_worse_sample_is_confirmed_and_a_better_or_equal_one_is_not() -> None:
    published = bucketed(sample(1000), None)
    assert links.needs_confirmation(bucketed(sample(100), published), published)
    assert links.needs_confirmation(bucketed(sample(1000, rtt_ms=5), published), published)
    assert not links.needs_confirmation(bucketed(sample(1010), published), published)
    assert not links.needs_confirmation(bucketed(sample(5000), published), published)


def test_two_probes_keep_what_the_link_showed_it_can_do() -> None:
    contended, clean = sample(80, rtt_ms=3.0, at=1.0), sample(950, rtt_ms=0.04, at=2.0)
    best = links.better_of(contended, clean)
    assert best.bandwidth == clean.bandwidth
    assert best.tcp_rtt_s == clean.tcp_rtt_s and best.grpc_rtt_s == clean.grpc_rtt_s
    assert best.measured_at == 2.0
    assert links.better_of(clean, contended) == best


def test_a_really_slower_link_stays_slow_after_confirmation() -> None:
    published = bucketed(sample(5000), None)
    confirmed = links.better_of(sample(95), sample(97))
    fresh = bucketed(confirmed, published)
    assert links.worth_publishing(fresh, published)
    assert abs(fresh.bandwidth - 97 * MBIT) < 1
