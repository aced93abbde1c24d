"""A candidate plan (ordered units + layer boundaries) and its evaluation under the cost model."""

from __future__ import annotations

import math
from dataclasses import dataclass

from partitioner.cost import TOKEN_BYTES, CostModel, Unit
from partitioner.mesh import MeshView, Route


@dataclass(frozen=True)
class Layout:
    """Ordered stages: units[i] holds layers [bounds[i], bounds[i+1])."""

    units: tuple[Unit, ...]
    bounds: tuple[int, ...]

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds[:-1], self.bounds[1:], strict=True))

    def tie_key(self) -> tuple[tuple[tuple[str, ...], ...], tuple[int, ...]]:
        """Deterministic tie-breaker between layouts of equal predicted time."""
        return tuple(unit.nodes for unit in self.units), self.bounds


@dataclass(frozen=True)
class Score:
    """Predicted decode timing of a layout (see partitioner.cost for the definitions):
    time_per_token_s under `concurrency`, and one sequence alone (decode_s, stage_s, hops_s)."""

    time_per_token_s: float
    decode_s: float
    stage_s: tuple[float, ...]
    hops_s: float


class Evaluator:
    """Scores layouts; caches routes between units."""

    def __init__(self, cost: CostModel, view: MeshView) -> None:
        self.cost = cost
        self.view = view
        self._routes: dict[tuple[str, str, float], Route | None] = {}

    def route(self, src: Unit, dst: Unit, payload_bytes: float) -> Route | None:
        key = (src.leader, dst.leader, payload_bytes)
        if key not in self._routes:
            self._routes[key] = self.view.route(src.leader, dst.leader, payload_bytes)
        return self._routes[key]

    def hop_s(self, src: Unit, dst: Unit, payload_bytes: float) -> float:
        found = self.route(src, dst, payload_bytes)
        return math.inf if found is None else found.seconds

    def activation_hop_s(self, src: Unit, dst: Unit, rows: int = 1) -> float:
        return self.hop_s(src, dst, rows * self.cost.hidden_bytes)

    def ring_hops_s(self, units: tuple[Unit, ...], rows: int | None = None) -> float:
        """Forward hops with the hidden states of one micro-batch (``rows`` sequences; by
        default the rows a decode step of `concurrency` sequences has on this many stages),
        plus their tokens back to the first stage."""
        if len(units) < 2:
            return 0.0
        if rows is None:
            rows = self.cost.step_rows(len(units))
        total = sum(
            self.activation_hop_s(units[i], units[i + 1], rows) for i in range(len(units) - 1)
        )
        return total + self.hop_s(units[-1], units[0], rows * TOKEN_BYTES)

    def stage_s(self, layout: Layout, rows: int | None = None) -> tuple[float, ...]:
        """Each stage's decode step of ``rows`` sequences (by default: of one micro-batch of
        `concurrency` sequences on this many stages)."""
        if rows is None:
            rows = self.cost.step_rows(len(layout.units))
        last = len(layout.units) - 1
        return tuple(
            self.cost.stage_step_s(unit, start, end, last=index == last, rows=rows)
            for index, (unit, (start, end)) in enumerate(
                zip(layout.units, layout.ranges(), strict=True)
            )
        )

    def time_per_token(self, stage_s: tuple[float, ...] | list[float], hops_s: float) -> float:
        """Between two tokens of one sequence, from the step times of one micro-batch and its
        hops: a micro-batch's round, or the turns all micro-batches take at the slowest stage."""
        round_s = sum(stage_s) + hops_s
        return max(round_s, self.cost.micro_batches(len(stage_s)) * max(stage_s))

    def score(self, layout: Layout) -> Score:
        step_s = self.stage_s(layout)
        step_hops_s = self.ring_hops_s(layout.units)
        if self.cost.concurrency == 1:
            alone_s, alone_hops_s = step_s, step_hops_s
        else:
            alone_s = self.stage_s(layout, rows=1)
            alone_hops_s = self.ring_hops_s(layout.units, rows=1)
        return Score(
            time_per_token_s=self.time_per_token(step_s, step_hops_s),
            decode_s=sum(alone_s) + alone_hops_s,
            stage_s=alone_s,
            hops_s=alone_hops_s,
        )

    def fits(self, layout: Layout) -> bool:
        last = len(layout.units) - 1
        return all(
            end > start and self.cost.fits(unit, start, end, first=index == 0, last=index == last)
            for index, (unit, (start, end)) in enumerate(
                zip(layout.units, layout.ranges(), strict=True)
            )
        )
