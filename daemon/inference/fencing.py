"""Fencing: which plans a node serves, as the data plane asks for every frame.

The data plane takes one fencing callable, ``check_serving(plan_id)``, that raises (with a
message naming the plan and the node) when the plan is not committed here. It is called on
the asyncio thread for every Start, Activation and Token, so it must be cheap and must never
look into state another thread is changing. :class:`CommittedPlans` is that callable's one
implementation: an immutable set of plan ids that its owner replaces as a whole (the daemon's
plan installer after every agreement step, a test, or the stage process of the benchmarks),
so a reader on another thread sees either the old set or the new one, never half a change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from meshd.agreement.contract import PlanNotCommittedError

FenceCheck = Callable[[str], None]


@dataclass(frozen=True)
class ServedView:
    """What the origin reads to move a request to the next plan: the plans served here, the
    active one (new requests, and moved ones, go there; "" when none) and, when there is none,
    why the mesh runs no plan."""

    plans: frozenset[str] = frozenset()
    active: str = ""
    refusal: str = ""


ServedSource = Callable[[], ServedView]


class CommittedPlans:
    """The plan ids ``node_id`` serves; :meth:`check` is the data plane's fencing callable and
    :meth:`view` what the origin follows to move requests (one immutable value, swapped whole)."""

    def __init__(self, node_id: str, plan_ids: Iterable[str] = ()) -> None:
        self.node_id = node_id
        self._view = ServedView(frozenset(plan_ids))

    @property
    def plans(self) -> frozenset[str]:
        return self._view.plans

    def view(self) -> ServedView:
        return self._view

    def replace(self, plan_ids: Iterable[str], active: str = "", refusal: str = "") -> None:
        """Serve exactly ``plan_ids`` from now on, new requests on ``active`` (one reference
        swap: safe across threads)."""
        self._view = ServedView(frozenset(plan_ids), active, refusal)

    def add(self, plan_id: str, *, active: bool = False) -> None:
        view = self._view
        self._view = ServedView(view.plans | {plan_id}, plan_id if active else view.active)

    def discard(self, plan_id: str) -> None:
        view = self._view
        active = "" if view.active == plan_id else view.active
        self._view = ServedView(view.plans - {plan_id}, active, view.refusal)

    def __contains__(self, plan_id: object) -> bool:
        return plan_id in self._view.plans

    def check(self, plan_id: str) -> None:
        """Raise the agreement's PlanNotCommittedError unless ``plan_id`` is served here."""
        plans = self._view.plans
        if plan_id not in plans:
            raise PlanNotCommittedError.for_plan(plan_id, self.node_id, plans)
