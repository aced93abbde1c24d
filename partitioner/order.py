"""Stage order: the ring through the chosen units with the least hop cost.

A pipeline is a ring: hidden states go forward stage by stage and the sampled token goes from
the last stage back to the first. With measured, asymmetric links the order matters ("more
nodes made it slower" is often a slow link in the middle of the ring). This is an asymmetric
travelling-salesman cycle:
- up to EXACT_LIMIT units: exact, Held-Karp dynamic programming (2^n * n^2 steps);
- beyond: nearest neighbour from the first unit, then bounded or-opt passes (move one unit to
  a better place while the cycle gets cheaper). A good heuristic, not an optimum.
Which edge of the cycle becomes the token's way back (the rotation) is chosen by the caller,
because it also decides which unit holds the embeddings and which the head.
"""

from __future__ import annotations

import math
from collections.abc import Callable

EXACT_LIMIT = 8
MAX_OR_OPT_PASSES = 3
UNREACHABLE = 1e30

CostFn = Callable[[int, int], float]


def best_cycle(count: int, cost: CostFn) -> list[int] | None:
    """Indices 0..count-1 in the cheapest cycle order, starting at 0; None if no finite cycle."""
    if count <= 2:
        order = list(range(count))
        return order if _cycle_cost(order, cost) < math.inf else None
    weights = [[cost(i, j) if i != j else math.inf for j in range(count)] for i in range(count)]
    order = _held_karp(weights) if count <= EXACT_LIMIT else _heuristic(weights)
    if order is None or _cycle_cost(order, cost) == math.inf:
        return None
    return order


def _cycle_cost(order: list[int], cost: CostFn) -> float:
    if len(order) < 2:
        return 0.0
    return sum(cost(order[i], order[(i + 1) % len(order)]) for i in range(len(order)))


def _held_karp(weights: list[list[float]]) -> list[int] | None:
    count = len(weights)
    size = 1 << count
    best = [[math.inf] * count for _ in range(size)]
    parent = [[-1] * count for _ in range(size)]
    best[1][0] = 0.0
    for mask in range(1, size, 2):
        row = best[mask]
        for last in range(count):
            so_far = row[last]
            if so_far == math.inf:
                continue
            out = weights[last]
            for nxt in range(1, count):
                bit = 1 << nxt
                if mask & bit:
                    continue
                value = so_far + out[nxt]
                if value < best[mask | bit][nxt]:
                    best[mask | bit][nxt] = value
                    parent[mask | bit][nxt] = last
    full = size - 1
    closing = [best[full][last] + weights[last][0] for last in range(count)]
    end = min(range(1, count), key=lambda last: (closing[last], last))
    if closing[end] == math.inf:
        return None
    order, mask, node = [], full, end
    while node != -1:
        order.append(node)
        mask, node = mask ^ (1 << node), parent[mask][node]
    return order[::-1]


def _heuristic(weights: list[list[float]]) -> list[int]:
    count = len(weights)
    order, left = [0], set(range(1, count))
    while left:
        here = order[-1]
        nxt = min(left, key=lambda j: (weights[here][j], j))
        order.append(nxt)
        left.remove(nxt)
    finite = [[min(w, UNREACHABLE) for w in row] for row in weights]
    for _ in range(MAX_OR_OPT_PASSES):
        if not _or_opt_pass(order, finite):
            break
    return order


def _or_opt_pass(order: list[int], weights: list[list[float]]) -> bool:
    """Move single units (never the first) to the position that shortens the cycle most."""
    improved = False
    count = len(order)
    for position in range(1, count):
        node = order[position]
        prev, nxt = order[position - 1], order[(position + 1) % count]
        removal_gain = weights[prev][node] + weights[node][nxt] - weights[prev][nxt]
        rest = order[:position] + order[position + 1 :]
        best_delta, best_slot = 0.0, -1
        for slot in range(len(rest)):
            a, b = rest[slot], rest[(slot + 1) % len(rest)]
            delta = weights[a][node] + weights[node][b] - weights[a][b] - removal_gain
            if delta < best_delta - 1e-15:
                best_delta, best_slot = delta, slot
        if best_slot >= 0:
            rest.insert(best_slot + 1, node)
            order[:] = rest
            improved = True
    return improved
