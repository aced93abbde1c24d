"""Does any plan fit? The authority behind every refusal.

The strategies try layouts they like; when none of those fits, this search decides between a
plan and a refusal, so that a refusal means "no plan can fit", not "my favourite plan did not".

Exact search (at most EXACT_NODE_LIMIT nodes that can hold anything): dynamic programming over
the set of units used so far. For each set it keeps the furthest layer boundary reachable
using exactly those units, in some order, as consecutive stages from layer 0. Reaching further
is never worse, because memory only grows with a stage's range, so keeping the maximum is
exact. A plan exists when some unit outside a set can hold the remaining layers plus the head
(and the embeddings, if the set is empty). Cost: 2^n x units steps, each a binary search.

Beyond the limit a greedy heuristic: finish with any unit that can hold the rest plus the head,
otherwise add the unit that reaches furthest. It can, rarely, refuse a packing that exists.
"""

from __future__ import annotations

from collections.abc import Sequence

from partitioner.cost import CostModel, Unit
from partitioner.layout import Layout

EXACT_NODE_LIMIT = 10


def find_fitting_layout(
    cost: CostModel, units: Sequence[Unit], *, use_all: bool = False
) -> Layout | None:
    """Any layout in which every stage fits, or None when (the search finds that) none does.

    use_all: only layouts with every unit as a stage (the units must not share nodes). Then
    each unit keeps at least one layer for every unit still to come; this variant is a
    heuristic that the speed strategy uses to order a given set of units.
    """
    useful = [unit for unit in units if _can_hold_a_layer(cost, unit)]
    nodes = sorted({node for unit in useful for node in unit.nodes})
    if not useful or (use_all and len(useful) < len(units)):
        return None
    if len(nodes) <= EXACT_NODE_LIMIT:
        return _exact(cost, useful, nodes, use_all=use_all)
    return None if use_all else _greedy(cost, useful)


def _can_hold_a_layer(cost: CostModel, unit: Unit) -> bool:
    """Whether the unit can hold anything at all: its smallest layer, or a first/last stage."""
    total = cost.num_layers
    sizes = cost.model.layer_bytes
    smallest = min(range(total), key=lambda i: (sizes[i], i))
    return (
        cost.fits(unit, smallest, smallest + 1, first=False, last=False)
        or cost.fits(unit, 0, 1, first=True, last=total == 1)
        or cost.fits(unit, total - 1, total, first=total == 1, last=True)
    )


def _exact(
    cost: CostModel, units: list[Unit], nodes: list[str], *, use_all: bool = False
) -> Layout | None:
    total = cost.num_layers
    bit_of = {node: 1 << i for i, node in enumerate(nodes)}
    masks = [sum(bit_of[node] for node in unit.nodes) for unit in units]
    full = sum(set(masks)) if use_all else -1
    reach: dict[int, int] = {0: 0}
    came_from: dict[int, tuple[int, int]] = {}
    for mask in range(1 << len(nodes)):
        if mask not in reach:
            continue
        start = reach[mask]
        for index, unit in enumerate(units):
            if masks[index] & mask:
                continue
            grown = mask | masks[index]
            if (not use_all or grown == full) and cost.fits(
                unit, start, total, first=mask == 0, last=True
            ):
                return _rebuild(units, came_from, reach, mask, (index, start, total))
            still_to_come = sum(1 for m in masks if not m & grown) if use_all else 1
            limit = total - max(still_to_come, 1)
            end = cost.max_end(unit, start, first=mask == 0, last=False, limit=limit)
            if end > start and end > reach.get(grown, -1):
                reach[grown] = end
                came_from[grown] = (mask, index)
    return None


def _rebuild(
    units: list[Unit],
    came_from: dict[int, tuple[int, int]],
    reach: dict[int, int],
    mask: int,
    final: tuple[int, int, int],
) -> Layout:
    chain: list[int] = [final[0]]
    bounds = [final[2], final[1]]
    while mask:
        previous, index = came_from[mask]
        chain.append(index)
        bounds.append(reach[previous])
        mask = previous
    return Layout(tuple(units[i] for i in reversed(chain)), tuple(reversed(bounds)))


def _greedy(cost: CostModel, units: list[Unit]) -> Layout | None:
    total = cost.num_layers
    ranked = sorted(units, key=lambda u: (-u.usable_bytes, u.nodes))
    chosen: list[Unit] = []
    bounds = [0]
    used: set[str] = set()
    while True:
        start, first = bounds[-1], not chosen
        free = [u for u in ranked if used.isdisjoint(u.nodes)]
        finisher = next(
            (u for u in free if cost.fits(u, start, total, first=first, last=True)), None
        )
        if finisher is not None:
            return Layout((*chosen, finisher), (*bounds, total))
        ends = [(cost.max_end(u, start, first=first, last=False, limit=total - 1), u) for u in free]
        ends = [(end, u) for end, u in ends if end > start]
        if not ends:
            return None
        end, unit = max(ends, key=lambda item: (item[0], item[1].usable_bytes))
        chosen.append(unit)
        bounds.append(end)
        used.update(unit.nodes)
