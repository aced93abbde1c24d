"""Turning an ordered list of units into contiguous layer ranges.

- `largest_remainder`: integer shares of a total in proportion to weights, exact (fractions),
  so no layer is lost to rounding (mlx-lm's equal split drops the remainder; exo's float
  boundaries produced empty stages).
- `capped_proportional`: the same, but no share above its cap (water-filling within caps).
- `repair_bounds`: moves boundaries until every stage fits its memory, keeping the order.
- `improve_bounds`: local search on boundaries under the exact cost model.
- `split_for_order`: the best split the speed strategy finds for one stage order (stages
  with a tensor-parallel group: balanced by predicted time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from partitioner.cost import CostModel, Unit
from partitioner.layout import Evaluator, Layout

MAX_IMPROVE_PASSES = 12
TIME_TOLERANCE = 1e-9
DP_BUDGET = 20_000


def largest_remainder(total: int, weights: Sequence[int | float]) -> list[int]:
    """Shares of `total` proportional to `weights`, summing exactly to `total`.

    Each share is floor(total * w / sum); the leftover units go to the largest remainders,
    ties to the earlier position. All-zero weights give all-zero shares.
    """
    exact = [Fraction(w) for w in weights]
    weight_sum = sum(exact, Fraction(0))
    if total <= 0 or weight_sum <= 0:
        return [0] * len(exact)
    quotas = [total * w / weight_sum for w in exact]
    shares = [int(q) for q in quotas]
    leftover = total - sum(shares)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - shares[i]), i))
    for index in by_remainder[:leftover]:
        shares[index] += 1
    return shares


def capped_proportional(
    total: int, weights: Sequence[int | float], caps: Sequence[int]
) -> list[int] | None:
    """Proportional shares with share[i] <= caps[i]; None when the caps cannot hold `total`."""
    shares = [0] * len(weights)
    active = [i for i in range(len(weights)) if caps[i] > 0 and weights[i] > 0]
    remaining = total
    while remaining > 0 and active:
        proposal = largest_remainder(remaining, [weights[i] for i in active])
        over = [i for i, share in zip(active, proposal, strict=True) if share > caps[i]]
        if not over:
            for i, share in zip(active, proposal, strict=True):
                shares[i] = share
            return shares
        for i in over:
            shares[i] = caps[i]
            remaining -= caps[i]
        active = [i for i in active if i not in over]
    return shares if remaining == 0 else None


def bounds_from_counts(counts: Sequence[int]) -> tuple[int, ...]:
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    return tuple(bounds)


def repair_bounds(
    cost: CostModel, units: Sequence[Unit], bounds: Sequence[int]
) -> tuple[int, ...] | None:
    """Boundaries as close to `bounds` as the memory allows, or None when this order cannot fit.

    Quick passes first. Forward: a stage over budget gives its last layers to the next stage.
    Backward: if the last stage is then over budget, it gives its first layers back, and so on
    towards the front. When that fails, an exact search over boundary positions decides.
    """
    count = len(units)
    if count == 0 or count > cost.num_layers:
        return None
    quick = _quick_repair(cost, units, bounds)
    if quick is not None and _all_fit(cost, units, quick):
        return quick
    return _exact_bounds(cost, units, bounds)


def _quick_repair(
    cost: CostModel, units: Sequence[Unit], bounds: Sequence[int]
) -> tuple[int, ...] | None:
    count, total = len(units), cost.num_layers
    fixed = list(bounds)
    for i in range(count - 1):
        limit = min(fixed[i + 1], total - (count - 1 - i))
        end = cost.max_end(units[i], fixed[i], first=i == 0, last=False, limit=limit)
        if end <= fixed[i]:
            return None
        fixed[i + 1] = end
    for i in range(count - 1, 0, -1):
        start, end = fixed[i], fixed[i + 1]
        last = i == count - 1
        if cost.fits(units[i], start, end, first=False, last=last):
            break
        new_start = cost.min_start(units[i], end, first=False, last=last, floor=start)
        if new_start >= end:
            return None
        fixed[i] = new_start
    return tuple(fixed)


def _exact_bounds(
    cost: CostModel, units: Sequence[Unit], target: Sequence[int]
) -> tuple[int, ...] | None:
    """Fitting boundaries for this order if any exist, each as close to `target` as possible.

    reachable[i] holds every position where stage i can start after stages 0..i-1 fit (a
    stage's possible ends from one start form a range, because memory grows with the range);
    then boundaries are picked from the back, each the reachable one nearest its target.
    """
    count, total = len(units), cost.num_layers
    reachable: list[list[int]] = [[0]]
    for i in range(count - 1):
        limit = total - (count - 1 - i)
        covered = [False] * (total + 1)
        for start in reachable[-1]:
            end = cost.max_end(units[i], start, first=i == 0, last=False, limit=limit)
            for position in range(start + 1, end + 1):
                covered[position] = True
        positions = [p for p in range(total + 1) if covered[p]]
        if not positions:
            return None
        reachable.append(positions)
    bounds = [0] * count + [total]
    for i in range(count - 1, -1, -1):
        options = [
            start
            for start in reachable[i]
            if start < bounds[i + 1]
            and cost.fits(units[i], start, bounds[i + 1], first=i == 0, last=i == count - 1)
        ]
        if not options:
            return None
        bounds[i] = min(options, key=lambda start: (abs(start - target[i]), start))
    return tuple(bounds)


def _all_fit(cost: CostModel, units: Sequence[Unit], bounds: Sequence[int]) -> bool:
    last = len(units) - 1
    return all(
        bounds[i + 1] > bounds[i]
        and cost.fits(unit, bounds[i], bounds[i + 1], first=i == 0, last=i == last)
        for i, unit in enumerate(units)
    )


def improve_bounds(
    evaluator: Evaluator, units: tuple[Unit, ...], bounds: tuple[int, ...], hops_s: float
) -> tuple[tuple[int, ...], float]:
    """Local search: move single boundaries while the predicted time per token drops.

    Steps shrink from about a quarter of a stage to one layer; only moves that keep both
    affected stages within memory are taken. A move that leaves the time unchanged (within
    TIME_TOLERANCE, i.e. float noise) is taken when it evens out the memory use of the two
    stages, so equally fast nodes share the layers instead of one filling up to its budget.
    Deterministic: boundaries are tried in order. Returns the bounds and their time per token.
    """
    cost = evaluator.cost
    count = len(units)
    state = _SearchState(evaluator, units, list(bounds), hops_s)
    step = max(1, cost.num_layers // (4 * count))
    while step >= 1:
        for _ in range(MAX_IMPROVE_PASSES):
            moved = False
            for k in range(1, count):
                for delta in (step, -step):
                    moved |= state.try_move(k, delta)
            if not moved:
                break
        step //= 2
    return tuple(state.bounds), state.best


class _SearchState:
    """Boundaries with their stage times and memory fills, updated move by move."""

    def __init__(
        self, evaluator: Evaluator, units: tuple[Unit, ...], bounds: list[int], hops_s: float
    ) -> None:
        self.evaluator = evaluator
        self.cost = evaluator.cost
        self.units = units
        self.bounds = bounds
        self.hops_s = hops_s
        self.last = len(units) - 1
        self.rows = self.cost.step_rows(len(units))
        self.stage_s = [self._time(i, bounds[i], bounds[i + 1]) for i in range(len(units))]
        self.fill = [self._fill(i, bounds[i], bounds[i + 1]) for i in range(len(units))]
        self.best = evaluator.time_per_token(self.stage_s, hops_s)

    def _time(self, index: int, start: int, end: int) -> float:
        unit, last = self.units[index], index == self.last
        return self.cost.stage_step_s(unit, start, end, last=last, rows=self.rows)

    def _fill(self, index: int, start: int, end: int) -> float:
        """Share of the unit's usable memory the stage uses; inf when it does not fit."""
        unit = self.units[index]
        if unit.degree > 1:
            return self.cost.fill(unit, start, end, first=index == 0, last=index == self.last)
        need = self.cost.need(unit, start, end, first=index == 0, last=index == self.last)
        return need / unit.usable_bytes if need <= unit.usable_bytes else math.inf

    def try_move(self, k: int, delta: int) -> bool:
        """Move boundary k by delta if that fits and is faster (or as fast and more even)."""
        bounds = self.bounds
        moved = bounds[k] + delta
        if not bounds[k - 1] < moved < bounds[k + 1]:
            return False
        left_fill = self._fill(k - 1, bounds[k - 1], moved)
        right_fill = self._fill(k, moved, bounds[k + 1])
        if math.inf in (left_fill, right_fill):
            return False
        trial = list(self.stage_s)
        trial[k - 1] = self._time(k - 1, bounds[k - 1], moved)
        trial[k] = self._time(k, moved, bounds[k + 1])
        seconds = self.evaluator.time_per_token(trial, self.hops_s)
        tolerance = self.best * TIME_TOLERANCE
        faster = seconds < self.best - tolerance
        evener = (
            seconds <= self.best + tolerance
            and max(left_fill, right_fill) < max(self.fill[k - 1], self.fill[k]) - 1e-12
        )
        if not (faster or evener):
            return False
        bounds[k] = moved
        self.stage_s = trial
        self.fill[k - 1], self.fill[k] = left_fill, right_fill
        self.best = seconds
        return True


def role_caps(cost: CostModel, units: Sequence[Unit]) -> list[int]:
    """Layers each unit could hold in its position (first / middle / last), estimated from the
    front of the model for first and middle and from the back for the last stage."""
    total = cost.num_layers
    count = len(units)
    caps = []
    for i, unit in enumerate(units):
        first, last = i == 0, i == count - 1
        if last:
            start = cost.min_start(unit, total, first=first, last=True, floor=0)
            caps.append(total - start)
        else:
            caps.append(cost.max_end(unit, 0, first=first, last=False, limit=total))
    return caps


def fill_fastest_counts(rates: Sequence[float], caps: Sequence[int], total: int) -> list[int]:
    """One layer each, then the fastest units (lowest seconds per layer) filled to their caps."""
    counts = [1] * len(rates)
    remaining = total - len(rates)
    for i in sorted(range(len(rates)), key=lambda i: (rates[i], i)):
        extra = max(0, min(caps[i] - 1, remaining))
        counts[i] += extra
        remaining -= extra
    if remaining > 0:
        counts[-1] += remaining
    return counts


def balanced_counts(rates: Sequence[float], caps: Sequence[int], total: int) -> list[int] | None:
    """One layer each, the rest in proportion to speed within caps (equal stage times)."""
    speeds = [1.0 / rate if rate > 0 else 1.0 for rate in rates]
    extra = capped_proportional(total - len(rates), speeds, [max(0, cap - 1) for cap in caps])
    return None if extra is None else [1 + e for e in extra]


def split_for_order(
    evaluator: Evaluator, units: tuple[Unit, ...], hops_s: float
) -> tuple[Layout, float] | None:
    """The fastest fitting split the search finds for units in this order, with its time.

    Starting points: the exact minimum of the summed stage times (dynamic programming, when
    stages x layers^2 is at most DP_BUDGET: this is the optimum when one batch goes round the
    ring at a time), and the fastest units filled first, or, where the sequences decode in
    several micro-batches that keep every stage busy, stage times balanced by speed
    (water-filling within memory caps). Each is refined by local search and the fastest
    result kept."""
    cost = evaluator.cost
    total = cost.num_layers
    if not units or len(units) > total:
        return None
    if len(units) == 1:
        layout = Layout(units, (0, total))
        if not evaluator.fits(layout):
            return None
        return layout, evaluator.time_per_token(evaluator.stage_s(layout), hops_s)
    rates = [cost.per_layer_decode_s(unit) for unit in units]
    caps = role_caps(cost, units)
    if any(unit.degree > 1 for unit in units):
        return _balanced_split(evaluator, units, rates, caps, hops_s)
    starts: list[tuple[int, ...]] = []
    if len(units) * total * total <= DP_BUDGET:
        exact = min_sum_bounds(cost, units)
        if exact is None:
            return None
        starts.append(exact)
    # One batch at a time: start from the fastest units filled first. Micro-batches: from
    # stage times balanced by speed only; also refining the fastest-first start made planning
    # 4.5x slower at 64 nodes for plans that were as often worse as better (see the commit
    # that added this).
    pipelined = cost.micro_batches(len(units)) > 1
    balanced = balanced_counts(rates, caps, total) if pipelined else None
    proposals = [balanced if balanced is not None else fill_fastest_counts(rates, caps, total)]
    for counts in proposals:
        repaired = repair_bounds(cost, units, bounds_from_counts(counts))
        if repaired is not None:
            starts.append(repaired)
    best: tuple[Layout, float] | None = None
    for start in dict.fromkeys(starts):
        bounds, seconds = improve_bounds(evaluator, units, start, hops_s)
        candidate = Layout(units, bounds)
        if best is None or (seconds, candidate.tie_key()) < (best[1], best[0].tie_key()):
            best = (candidate, seconds)
    return best


def _balanced_split(
    evaluator: Evaluator,
    units: tuple[Unit, ...],
    rates: Sequence[float],
    caps: Sequence[int],
    hops_s: float,
) -> tuple[Layout, float] | None:
    """Stages with a tensor-parallel group (hybrid): layers in proportion to each unit's
    speed within memory, so the stages' predicted times are balanced and every unit holds a
    share that matches it (partitioner.strategies explains why not the summed-time optimum)."""
    cost = evaluator.cost
    counts = balanced_counts(rates, caps, cost.num_layers)
    if counts is None:
        counts = fill_fastest_counts(rates, caps, cost.num_layers)
    bounds = repair_bounds(cost, units, bounds_from_counts(counts))
    if bounds is None:
        return None
    layout = Layout(units, bounds)
    return layout, evaluator.time_per_token(evaluator.stage_s(layout), hops_s)


def min_sum_bounds(cost: CostModel, units: Sequence[Unit]) -> tuple[int, ...] | None:
    """Boundaries minimising the sum of stage decode step times (of the rows a micro-batch
    has on this many stages) with every stage fitting (exact).

    best[i][k]: least time for stages 0..i-1 holding layers [0, k). A stage's start is tried
    from its end backwards and stops at the first range that does not fit (ranges only grow).
    """
    count, total = len(units), cost.num_layers
    rows = cost.step_rows(count)
    best = [[math.inf] * (total + 1) for _ in range(count + 1)]
    came_from = [[-1] * (total + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for i, unit in enumerate(units):
        first, last = i == 0, i == count - 1
        ends = [total] if last else range(i + 1, total - (count - 1 - i) + 1)
        for end in ends:
            for start in range(end - 1, i - 1, -1):
                if not cost.fits(unit, start, end, first=first, last=last):
                    break
                if best[i][start] == math.inf:
                    continue
                value = best[i][start] + cost.stage_step_s(unit, start, end, last=last, rows=rows)
                if value < best[i + 1][end]:
                    best[i + 1][end] = value
                    came_from[i + 1][end] = start
    if best[count][total] == math.inf:
        return None
    bounds = [total]
    for i in range(count, 0, -1):
        bounds.append(came_from[i][bounds[-1]])
    return tuple(reversed(bounds))
