"""Coarse geometric buckets for measured numbers, so that plans do not flap on noise.

Why: every node re-measures FLOP/s, memory bandwidth, link latency and link bandwidth every few
seconds, with a few percent of noise. If the raw numbers went into the planner, the plan and its
id would change with every measurement and the mesh would never agree.

The bucketing: a positive value x falls in bucket i when EDGE[i] <= x < EDGE[i+1], with
EDGE[i] = float((5/4)**i) computed from an exact fraction. Buckets are therefore 25 % wide. The
planner uses the bucket's representative (9/8)*(5/4)**i, the middle of the bucket, so a
quantized number is within about +-11 % of the measurement. Edges and representatives are
built from exact rationals and compared as floats, which is exact and identical on every
platform: two machines that see the same measurement always pick the same bucket. Latencies
below 1 microsecond are counted as 1 microsecond. Memory budgets are not bucketed: they are
exact integers that the daemon keeps stable.

A value that sits on a bucket edge can still alternate between two buckets. The daemon can
remove that last source of flapping with `sticky_bucket_index` (hysteresis) and feed the
representative back into the graph: the bucket of a representative is the bucket itself.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction
from functools import lru_cache

RATIO = Fraction(5, 4)
MIDDLE = Fraction(9, 8)
MIN_INDEX = -100
MAX_INDEX = 220
MIN_LATENCY_S = 1e-6
_EDGES = tuple(float(RATIO**i) for i in range(MIN_INDEX, MAX_INDEX + 2))


def bucket_index(value: float) -> int:
    """The bucket of a positive, finite value (clamped to the supported range ~1e-10..1e21)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"expected a number to quantize, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"cannot quantize {value!r}: expected a positive, finite number")
    position = bisect.bisect_right(_EDGES, float(value)) - 1
    return min(max(position, 0), len(_EDGES) - 2) + MIN_INDEX


@lru_cache(maxsize=1024)
def bucket_value(index: int) -> float:
    """The representative value of bucket `index` (the middle of the bucket)."""
    return float(MIDDLE * RATIO**index)


def quantize(value: float) -> float:
    """The representative of the bucket `value` falls in."""
    return bucket_value(bucket_index(value))


def latency_bucket_index(latency_s: float) -> int:
    """Bucket of a one-way latency in seconds; values under 1 microsecond count as 1."""
    if not isinstance(latency_s, int | float) or not math.isfinite(latency_s) or latency_s < 0:
        raise ValueError(f"cannot quantize latency {latency_s!r} s: expected a finite number >= 0")
    return bucket_index(max(float(latency_s), MIN_LATENCY_S))


def sticky_bucket_index(value: float, previous: int | None, margin: float = 0.05) -> int:
    """Bucket of `value`, keeping `previous` while the value stays near that bucket.

    Hysteresis for the daemon: a new measurement moves to another bucket only when it leaves the
    previous bucket by more than `margin` (relative). Use it before putting numbers into the mesh
    graph, e.g. `quantize_value = bucket_value(sticky_bucket_index(x, last_index))`.
    """
    current = bucket_index(value)
    if previous is None or current == previous:
        return current
    low = float(RATIO**previous) * (1.0 - margin)
    high = float(RATIO ** (previous + 1)) * (1.0 + margin)
    return previous if low <= value < high else current
