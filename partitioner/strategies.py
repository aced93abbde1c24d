"""The two strategies: `memory` (the baseline) and `speed` (minimise predicted time per token).

memory: nodes in order of memory budget (largest first, then id), layers in proportion to
    usable memory by largest remainder (no layer lost, nodes with a zero share are left out,
    never an empty stage). If a stage then does not fit (KV cache, embeddings or head, uneven
    layers), shares are capped at what each node holds and the rest is redistributed in
    proportion (water-filling by memory), and boundaries are repaired. The order ignores links:
    that is what a baseline does.

speed: minimises the predicted time per token (partitioner.cost) subject to memory. With one
    sequence a pipeline runs its stages one after another, so the time is the sum of the stage
    times plus the hops: the fastest nodes should hold as many layers as fit, and a node whose
    extra hop costs more than its layers save is left out (prima.cpp's finding). Under
    concurrency the slowest stage matters too, and balanced stages (water-filling by speed
    within memory caps) win.
    1. Units (nodes, tensor-parallel groups) are ranked by seconds per layer.
    2. Candidate sets of units. Up to EXHAUSTIVE_UNITS units: every set. Beyond: the fastest
       unit that holds the whole model alone; the fastest units until their capacity covers
       the model (plus one or two more); the largest units until they cover it (fewest hops);
       sets grown from each of the fastest nodes over their cheapest direct links; small
       baseline sets. Sets that cannot beat the best so far (lower_bound) are skipped.
    3. Orders: every order up to PERMUTE_LIMIT units; else every rotation of the cheapest ring
       over the measured links and of its reverse (partitioner.order: exact up to 8 units,
       heuristic beyond); if none fits, the order the feasibility search packs them in.
    4. Splits (partitioner.split): exact minimum of summed stage times by dynamic programming
       when small enough, fastest-first filling, balanced filling; then local search on the
       boundaries.
    5. Local search over sets: drop a unit, swap one for one of the next-fastest unused units,
       add one; repeated while the time improves (bounded rounds).
    6. The memory baseline and the fitting layout are candidates too, so `speed` is never
       predicted slower than `memory`.
    7. Nodes earn their place (PlanOptions.min_gain, g): every layout evaluated is kept as the
       fastest of its node count, and the result is the layout with the fewest nodes whose time
       is within (1 + g) of the fastest found (then the fastest of those, then node ids). Sets
       are pruned against (1 + g) x the best time instead of the best time, so a smaller set
       that could be chosen is still evaluated; the work grows by the sets within the margin,
       never exponentially. A node needed to hold the model is always used: no layout without
       it fits.
    A split of stages that include a tensor-parallel group (hybrid) balances the stages'
    predicted times (water-filling by speed within memory): the summed-time optimum would give
    a group that is slower per layer than a node a single layer, and one faster per layer every
    layer but one, neither a layout worth its nodes.
    Checked against brute force (tests): the optimum on meshes of up to four nodes.
All choices break ties on node ids, so every machine picks the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import combinations, islice, permutations

from partitioner.cost import CostModel, Unit
from partitioner.fit import find_fitting_layout
from partitioner.layout import Evaluator, Layout
from partitioner.order import EXACT_LIMIT, best_cycle
from partitioner.split import (
    bounds_from_counts,
    capped_proportional,
    improve_bounds,
    largest_remainder,
    repair_bounds,
    split_for_order,
)

LOCAL_SEARCH_ROUNDS = 4
SWAP_CANDIDATES = 4
EXTRA_UNITS = 2
EXHAUSTIVE_UNITS = 6
PERMUTE_LIMIT = 4
NEIGHBOURHOOD_STARTS = 3

Ranked = tuple[float, Layout]
Accept = Callable[[frozenset[Unit]], bool]


def memory_layout(cost: CostModel, units: Sequence[Unit]) -> Layout | None:
    """The baseline split (see module docstring), or None when it cannot be made to fit."""
    order = sorted(units, key=lambda u: (-u.usable_bytes, u.nodes))
    total = cost.num_layers
    shares = largest_remainder(total, [u.usable_bytes for u in order])
    layout = _layout_from_shares(order, shares)
    if layout is not None and _fits(cost, layout):
        return layout
    caps = [
        cost.max_end(unit, 0, first=i == 0, last=False, limit=total) for i, unit in enumerate(order)
    ]
    capped = capped_proportional(total, [u.usable_bytes for u in order], caps)
    if capped is None:
        return None
    layout = _layout_from_shares(order, capped)
    if layout is None:
        return None
    bounds = repair_bounds(cost, layout.units, layout.bounds)
    return None if bounds is None else Layout(layout.units, bounds)


def _layout_from_shares(order: Sequence[Unit], shares: Sequence[int]) -> Layout | None:
    kept = [(unit, share) for unit, share in zip(order, shares, strict=True) if share > 0]
    if not kept:
        return None
    return Layout(tuple(u for u, _ in kept), bounds_from_counts([s for _, s in kept]))


def _fits(cost: CostModel, layout: Layout) -> bool:
    last = len(layout.units) - 1
    return all(
        cost.fits(unit, start, end, first=i == 0, last=i == last)
        for i, (unit, (start, end)) in enumerate(zip(layout.units, layout.ranges(), strict=True))
    )


class SpeedSearch:
    """The speed strategy's search (see module docstring); one instance per planning call."""

    def __init__(
        self,
        evaluator: Evaluator,
        units: Sequence[Unit],
        accept: Accept | None = None,
        min_gain: float = 0.0,
    ) -> None:
        """`accept` restricts the layouts to sets of units it accepts (a forced kind of
        layout: partitioner.planner); None accepts every set. `min_gain`: what a node must add
        to join (step 7 of the module docstring)."""
        self.evaluator = evaluator
        self.min_gain = min_gain
        # The fastest layout found for each node count (step 7).
        self.by_size: dict[int, Ranked] = {}
        self.accept = accept or (lambda unit_set: True)
        self.cost = evaluator.cost
        self.rate = {unit: self.cost.per_layer_decode_s(unit) for unit in units}
        self.cap = {
            unit: self.cost.max_end(unit, 0, first=False, last=False, limit=self.cost.num_layers)
            for unit in units
        }
        self.ranked = sorted(units, key=lambda u: (self.rate[u], -self.cap[u], u.nodes))
        self._cache: dict[frozenset[Unit], Ranked | None] = {}
        links = evaluator.view.links.values()
        self._min_latency = min((link.latency_s for link in links), default=0.0)

    def run(self, extra_layouts: Sequence[Layout]) -> Layout | None:
        """The layout with the fewest nodes within `min_gain` of the fastest (module
        docstring), or None when no accepted set fits."""
        extra_layouts = [x for x in extra_layouts if self.accept(frozenset(x.units))]
        best: Ranked | None = None
        for unit_set in filter(self.accept, self._seed_sets(extra_layouts)):
            if best is None or self.lower_bound(unit_set) < self._cutoff(best, unit_set):
                best = _better(best, self.evaluate(unit_set))
        for layout in extra_layouts:
            best = _better(best, self._record(self._as_is(layout)))
        if best is None:
            return None
        self._local_search(best)
        return self.chosen()[1]

    def chosen(self) -> Ranked:
        """Of the layouts found: the fewest nodes within `min_gain` of the fastest."""
        return choose_within_margin(list(self.by_size.values()), self.min_gain)

    def _cutoff(self, best: Ranked, unit_set: frozenset[Unit]) -> float:
        """Sets whose lower bound reaches this cannot be chosen (step 7): a set with fewer
        nodes than the choice so far may win within the margin, any other only by being the
        fastest."""
        nodes = sum(unit.degree for unit in unit_set)
        if self.by_size and nodes < node_count(self.chosen()[1]):
            return best[0] * (1.0 + self.min_gain)
        return best[0]

    def _record(self, ranked: Ranked | None) -> Ranked | None:
        if ranked is not None:
            size = node_count(ranked[1])
            self.by_size[size] = _better(self.by_size.get(size), ranked) or ranked
        return ranked

    # ---- candidate sets -----------------------------------------------------------------

    def _seed_sets(self, extra_layouts: Sequence[Layout]) -> list[frozenset[Unit]]:
        if len(self.ranked) <= EXHAUSTIVE_UNITS:
            return self._all_sets()
        total = self.cost.num_layers
        seeds: list[frozenset[Unit]] = []
        for kind in (1, 2):  # the fastest single node and the fastest group that hold it all
            alone = next(
                (
                    u
                    for u in self.ranked
                    if min(u.degree, 2) == kind
                    and self.cost.fits(u, 0, total, first=True, last=True)
                ),
                None,
            )
            if alone is not None:
                seeds.append(frozenset([alone]))
        by_size = sorted(self.ranked, key=lambda u: (-self.cap[u], self.rate[u], u.nodes))
        seeds.extend(self._covering_prefixes(self.ranked, EXTRA_UNITS))
        seeds.extend(self._covering_prefixes(by_size, 0))
        seeds.extend(self._neighbourhoods())
        seeds.extend(self._group_seeds())
        seeds.extend(
            frozenset(layout.units) for layout in extra_layouts if len(layout.units) <= EXACT_LIMIT
        )
        return list(dict.fromkeys(seeds))

    def _all_sets(self) -> list[frozenset[Unit]]:
        """Every set of units with disjoint nodes (small meshes: the search is exhaustive)."""
        found: list[frozenset[Unit]] = []
        for size in range(1, min(len(self.ranked), self.cost.num_layers) + 1):
            for combo in combinations(self.ranked, size):
                nodes = [node for unit in combo for node in unit.nodes]
                if len(nodes) == len(set(nodes)):
                    found.append(frozenset(combo))
        return found

    def _neighbourhoods(self) -> list[frozenset[Unit]]:
        """From each of the fastest units, grow a set over the cheapest direct links until it
        can hold the model: pipelines whose hops are short even if their nodes are not the
        fastest."""
        view = self.evaluator.view
        hidden = self.cost.hidden_bytes
        singles = {unit.leader: unit for unit in self.ranked if unit.degree == 1}
        seeds = []
        for start in [u for u in self.ranked if u.degree == 1][:NEIGHBOURHOOD_STARTS]:
            chosen, covered = [start], self.cap[start]
            while covered < self.cost.num_layers and len(chosen) < self.cost.num_layers:
                options = []
                for member in chosen:
                    for dst in view.neighbours(member.leader):
                        unit = singles.get(dst)
                        back = view.links.get((dst, member.leader))
                        if unit is None or unit in chosen or back is None or not self.cap[unit]:
                            continue
                        forward = view.links[(member.leader, dst)]
                        hop = forward.transfer_s(hidden) + back.transfer_s(hidden)
                        options.append((hop, self.rate[unit], unit.nodes, unit))
                if not options:
                    break
                best = min(options)[3]
                chosen.append(best)
                covered += self.cap[best]
            if covered >= self.cost.num_layers:
                seeds.append(frozenset(chosen))
        return seeds

    def _group_seeds(self) -> list[frozenset[Unit]]:
        """Hybrids: each of the fastest groups, completed by the fastest units whose nodes are
        free until they can hold the model together."""
        seeds = []
        groups = [unit for unit in self.ranked if unit.degree > 1][:NEIGHBOURHOOD_STARTS]
        for group in groups:
            rest = [
                u for u in self.ranked if u is not group and set(group.nodes).isdisjoint(u.nodes)
            ]
            seeds.extend(
                frozenset({group} | prefix)
                for prefix in self._covering_prefixes(rest, 0, covered=self.cap[group])
            )
        return seeds

    def _covering_prefixes(
        self, ordered: list[Unit], extra: int, covered: int = 0
    ) -> list[frozenset[Unit]]:
        """Take disjoint units in order until their capacity covers the model, then `extra`."""
        chosen: list[Unit] = []
        used: set[str] = set()
        found: list[frozenset[Unit]] = []
        for unit in ordered:
            if not used.isdisjoint(unit.nodes) or self.cap[unit] == 0:
                continue
            chosen.append(unit)
            used.update(unit.nodes)
            covered += self.cap[unit]
            if covered >= self.cost.num_layers:
                found.append(frozenset(chosen))
                if len(found) > extra or len(chosen) >= self.cost.num_layers:
                    break
        return found

    # ---- evaluation ---------------------------------------------------------------------

    def lower_bound(self, unit_set: frozenset[Unit]) -> float:
        """No layout of these units is faster than this (sets that cannot win are skipped).

        Every layer's active weights are read and computed by some unit, at best the fastest of
        the set (a tensor-parallel group counts as its members together), the head by one
        member; a ring of S > 1 stages has S hops of at least the smallest latency in the mesh;
        and where `concurrency` sequences decode in m micro-batches, the slowest stage's step
        (at least as long as all units sharing the work in proportion to their speed) comes
        round m times per token. Reads count one token's active weights (what any step reads
        at least), FLOPs a step's rows.
        """
        cost = self.cost
        read = cost.active_bytes(0, cost.num_layers)
        flops = cost.stage_flops(0, cost.num_layers)
        bandwidth = max(unit.total_bandwidth for unit in unit_set)
        compute = max(unit.total_flops for unit in unit_set)
        head_bandwidth = max(max(unit.member_bandwidth) for unit in unit_set)
        head_compute = max(max(unit.member_flops) for unit in unit_set)
        count = len(unit_set)
        rows = cost.step_rows(count)
        stages = max(
            read / bandwidth + cost.model.head_matrix_bytes / head_bandwidth,
            rows * (flops / compute + cost.head_flops / head_compute),
        )
        hops = count * self._min_latency if count > 1 else 0.0
        slowest_stage = max(  # stages in parallel, perfectly balanced
            read / sum(unit.total_bandwidth for unit in unit_set),
            rows * flops / sum(unit.total_flops for unit in unit_set),
        )
        return max(stages + hops, cost.micro_batches(count) * slowest_stage)

    def evaluate(self, unit_set: frozenset[Unit]) -> Ranked | None:
        """Best layout for this set of units (order, rotation and split), cached."""
        if unit_set not in self._cache:
            self._cache[unit_set] = self._record(self._evaluate(unit_set))
        return self._cache[unit_set]

    def _evaluate(self, unit_set: frozenset[Unit]) -> Ranked | None:
        units = sorted(unit_set, key=lambda u: u.nodes)
        if len(units) > self.cost.num_layers or not self.accept(unit_set):
            return None
        cycle = best_cycle(
            len(units),
            lambda i, j: self.evaluator.activation_hop_s(units[i], units[j]),
        )
        if cycle is None:
            return None
        ring = [units[i] for i in cycle]
        best: Ranked | None = None
        for rotation in self._rotations(ring):
            hops_s = self.evaluator.ring_hops_s(rotation)
            found = split_for_order(self.evaluator, rotation, hops_s)
            if found is not None:
                best = _better(best, (found[1], found[0]))
        if best is None:
            best = self._memory_first_order(units)
        return best

    def _memory_first_order(self, units: list[Unit]) -> Ranked | None:
        """When no hop-cheap order fits (tight memory, uneven layers), the order in which the
        feasibility search packs these units, if any fits, split and refined."""
        fitting = find_fitting_layout(self.cost, units, use_all=True)
        if fitting is None or self.evaluator.ring_hops_s(fitting.units) == math.inf:
            return None
        hops_s = self.evaluator.ring_hops_s(fitting.units)
        found = split_for_order(self.evaluator, fitting.units, hops_s)
        return (found[1], found[0]) if found is not None else self._as_is(fitting)

    def _rotations(self, ring: list[Unit]) -> list[tuple[Unit, ...]]:
        """Up to PERMUTE_LIMIT units: every order. Up to EXACT_LIMIT: every rotation of the
        cheapest cycle and of its reverse (which node is first and last, and which gets which
        layers, can matter as much as the hops). Beyond: the rotation whose token hop back
        replaces the most expensive forward hop."""
        count = len(ring)
        if count <= PERMUTE_LIMIT:
            return [tuple(order) for order in permutations(ring)]
        if count <= EXACT_LIMIT:
            orders = [tuple(ring[i:] + ring[:i]) for i in range(count)]
            reverse = ring[::-1]
            orders += [tuple(reverse[i:] + reverse[:i]) for i in range(count)]
            return list(dict.fromkeys(orders))
        hop = [
            self.evaluator.activation_hop_s(ring[i], ring[(i + 1) % count]) for i in range(count)
        ]
        worst = max(range(count), key=lambda i: (hop[i], -i))
        start = (worst + 1) % count
        return [tuple(ring[start:] + ring[:start])]

    def _as_is(self, layout: Layout) -> Ranked | None:
        """A given layout in its own order, with its boundaries improved by local search."""
        if not self.evaluator.fits(layout):
            return None
        hops_s = self.evaluator.ring_hops_s(layout.units)
        bounds, seconds = improve_bounds(self.evaluator, layout.units, layout.bounds, hops_s)
        return seconds, Layout(layout.units, bounds)

    # ---- local search over sets ---------------------------------------------------------

    def _local_search(self, best: Ranked) -> None:
        """Neighbours of the fastest layout and of the one chosen within the margin, while
        either changes (bounded rounds); every layout evaluated is recorded by node count."""
        for _ in range(LOCAL_SEARCH_ROUNDS):
            before = (best, self.chosen())
            for current in dict.fromkeys(frozenset(r[1].units) for r in before):
                for neighbour in filter(self.accept, self._neighbours(current)):
                    if self.lower_bound(neighbour) < self._cutoff(best, neighbour):
                        best = _better(best, self.evaluate(neighbour)) or best
            if (best, self.chosen()) == before:
                break

    def _neighbours(self, current: frozenset[Unit]) -> list[frozenset[Unit]]:
        used = {node for unit in current for node in unit.nodes}
        spare = [u for u in self.ranked if used.isdisjoint(u.nodes)][:SWAP_CANDIDATES]
        members = sorted(current, key=lambda u: u.nodes)
        found: list[frozenset[Unit]] = []
        if len(members) > 1:
            found.extend(current - {unit} for unit in members)
        for unit in members:
            others = used - set(unit.nodes)
            options = (
                other
                for other in self.ranked
                if other not in current and others.isdisjoint(other.nodes)
            )
            found.extend((current - {unit}) | {other} for other in islice(options, SWAP_CANDIDATES))
        found.extend(current | {unit} for unit in spare)
        return found


def _better(best: Ranked | None, candidate: Ranked | None) -> Ranked | None:
    if candidate is None:
        return best
    if best is None:
        return candidate
    if (candidate[0], candidate[1].tie_key()) < (best[0], best[1].tie_key()):
        return candidate
    return best


def node_count(layout: Layout) -> int:
    """Machines a layout uses (a tensor-parallel group counts each member)."""
    return sum(unit.degree for unit in layout.units)


def choose_within_margin(found: Sequence[Ranked], min_gain: float) -> Ranked:
    """The fewest nodes whose time is within (1 + min_gain) of the fastest, then the fastest
    of those, then node ids: a node joins only where it adds at least `min_gain` speed."""
    fastest = min(ranked[0] for ranked in found)
    limit = fastest * (1.0 + min_gain) * (1.0 + 1e-12)
    within = [ranked for ranked in found if ranked[0] <= limit]
    return min(within, key=lambda r: (node_count(r[1]), r[0], r[1].tie_key()))
