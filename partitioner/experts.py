"""Expert placement: which member of a tensor-parallel group holds which routed experts.

A decode token uses num_experts_per_tok of a layer's num_experts experts; with the experts
spread over a group, a member reads (in expectation) its share of the active experts. So the
fastest placement gives each member experts in proportion to its memory bandwidth (decode is
bandwidth-bound), capped by what its memory can hold after its share of everything else, with
what a cap refuses redistributed in proportion (water-filling, partitioner.split). Equal members
get an even split (largest remainder: 128 experts over 3 members are 43, 43, 42). When even the
capped placement cannot hold the experts, the memory-proportional split the search used stays.

The same placement applies to every MoE layer of the stage: member i holds experts
[start_i, end_i) of each of those layers, contiguous ranges in member order.

Stable under measurement noise: the weights are not the measured bandwidths but each member's
bandwidth relative to the group's fastest, rounded to a power of two (`bandwidth_weight`), so
members within about 1.41x of each other count as equal and ±10 % noise on any member moves
no expert (a 2x faster member stays 2x while the measured ratio is within 1.41x..2.83x).
Expert counts change only when a member's speed changes by a factor, not by a few percent,
so a re-plan on noise does not reload experts.
"""

from __future__ import annotations

import math
from fractions import Fraction

from partitioner.cost import CostModel, Unit
from partitioner.split import capped_proportional


def bandwidth_weight(bandwidth: float, fastest: float) -> Fraction:
    """A member's share weight: its bandwidth relative to the fastest, rounded to a power of
    two (1, 1/2, 1/4, ...; exact, so every machine rounds alike). See the module docstring."""
    if bandwidth <= 0 or fastest <= 0:
        return Fraction(1)
    steps = round(math.log2(fastest / bandwidth))
    return Fraction(1, 2 ** max(0, steps))


def place_experts(
    cost: CostModel, unit: Unit, start: int, end: int, *, first: bool, last: bool
) -> Unit:
    """The unit with its experts placed for layers [start, end) (see module docstring)."""
    experts = cost.num_experts
    if unit.degree == 1 or not experts or not cost.expert_bytes(start, end):
        return unit
    caps = [
        _most_experts(cost, unit, member, start, end, first=first, last=last)
        for member in range(unit.degree)
    ]
    weights = [
        bandwidth_weight(value, max(unit.member_bandwidth)) for value in unit.member_bandwidth
    ]
    counts = capped_proportional(experts, weights, caps)
    if counts is None:
        return unit
    placed = unit.with_experts(counts)
    return placed if cost.fits(placed, start, end, first=first, last=last) else unit


def _most_experts(
    cost: CostModel, unit: Unit, member: int, start: int, end: int, *, first: bool, last: bool
) -> int:
    """The most experts this member can hold besides its share of the rest (binary search:
    memory grows with the count)."""
    usable = unit.member_usable[member]

    def fits(count: int) -> bool:
        counts = [0] * unit.degree
        counts[member] = count
        trial = unit.with_experts(counts)
        need = cost.memory(start, end, first=first, last=last, unit=trial, member=member)
        return need.total <= usable

    low, high = 0, cost.num_experts
    if not fits(0):
        return 0
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def expert_ranges(unit: Unit) -> list[tuple[str, int, int]]:
    """(node, first expert, end) per member: contiguous ranges in member order."""
    ranges, start = [], 0
    for node, count in zip(unit.nodes, unit.expert_counts, strict=True):
        ranges.append((node, start, start + count))
        start += count
    return ranges
