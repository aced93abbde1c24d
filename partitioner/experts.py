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
"""

from __future__ import annotations

from partitioner.cost import CostModel, Unit
from partitioner.split import capped_proportional


def place_experts(
    cost: CostModel, unit: Unit, start: int, end: int, *, first: bool, last: bool
) -> Unit:
    """The unit with its experts placed for layers [start, end) (see module docstring)."""
    experts = cost.num_experts
    expert_bytes = cost.expert_bytes(start, end)
    if unit.degree == 1 or not experts or not expert_bytes:
        return unit
    caps = []
    empty = unit.with_experts((0,) * unit.degree)
    for member, usable in enumerate(unit.member_usable):
        need = cost.memory(start, end, first=first, last=last, unit=empty, member=member).total
        free = usable - need
        caps.append(max(0, min(experts, free * experts // expert_bytes)))
    counts = capped_proportional(experts, list(unit.member_bandwidth), caps)
    if counts is None:
        return unit
    placed = unit.with_experts(counts)
    return placed if cost.fits(placed, start, end, first=first, last=last) else unit


def expert_ranges(unit: Unit) -> list[tuple[str, int, int]]:
    """(node, first expert, end) per member: contiguous ranges in member order."""
    ranges, start = [], 0
    for node, count in zip(unit.nodes, unit.expert_counts, strict=True):
        ranges.append((node, start, start + count))
        start += count
    return ranges
