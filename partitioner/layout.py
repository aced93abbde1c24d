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
    """Predicted decode timing of a layout (see partitioner.cost for the definitions)."""

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

    def activation_hop_s(self, src: Unit, dst: Unit) -> float:
        return self.hop_s(src, dst, self.cost.hidden_bytes)

    def ring_hops_s(self, units: tuple[Unit, ...]) -> float:
        """Forward hops with one hidden state each, plus the token back to the first stage."""
        if len(units) < 2:
            return 0.0
        total = sum(self.activation_hop_s(units[i], units[i + 1]) for i in range(len(units) - 1))
        return total + self.hop_s(units[-1], units[0], TOKEN_BYTES)

    def stage_s(self, layout: Layout) -> tuple[float, ...]:
        last = len(layout.units) - 1
        return tuple(
            self.cost.stage_decode_s(unit, start, end, last=index == last)
            for index, (unit, (start, end)) in enumerate(
                zip(layout.units, layout.ranges(), strict=True)
            )
        )

    def time_per_token(self, stage_s: tuple[float, ...] | list[float], hops_s: float) -> float:
        decode = sum(stage_s) + hops_s
        return max(decode, self.cost.concurrency * max(stage_s))

    def score(self, layout: Layout) -> Score:
        stage_s = self.stage_s(layout)
        hops_s = self.ring_hops_s(layout.units)
        return Score(
            time_per_token_s=self.time_per_token(stage_s, hops_s),
            decode_s=sum(stage_s) + hops_s,
            stage_s=stage_s,
            hops_s=hops_s,
        )

    def fits(self, layout: Layout) -> bool:
        last = len(layout.units) - 1
        return all(
            end > start and self.cost.fits(unit, start, end, first=index == 0, last=index == last)
            for index, (unit, (start, end)) in enumerate(
                zip(layout.units, layout.ranges(), strict=True)
            )
        )
