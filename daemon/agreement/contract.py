"""What the data plane may know of the agreement: the narrow interface meshd.inference uses.

The agreement decides which plan the mesh serves; the data plane installs plans and fences
its work with their ids. Everything the data plane needs crosses here and nothing else: it
never reaches into the protocol core or the runtime (`meshd.agreement.protocol`,
`meshd.agreement.service`), so either can change without touching inference (the layering
test enforces it, see docs/architecture.md).

* `PlanChange`: a plan became active, was withdrawn, or the mesh refused to plan; delivered
  in order to subscribers of `PlanSource.changes` on the trio thread.
* `PlanSource`: the agreement as the data plane uses it (implemented by
  `meshd.agreement.service.PlanAgreement`).
* `PlanNotCommittedError`: what a fencing check raises for a plan this node does not serve.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import partitioner
from meshd.agreement.messages import PlanNotCommittedError
from meshd.runtime.notify import Publisher
from meshd.wire import pb

__all__ = ["PlanChange", "PlanNotCommittedError", "PlanSource", "ServedPlans"]


@dataclass
class PlanChange:
    """What the data plane is told: a plan became active, or one must stop ("selected": the
    mesh's model changed, and a plan for it is on its way).

    states: for a committed plan, the node states it was computed from, by node id (what the
    members of a tensor-parallel group derive the group's addresses and ports from: each
    member reads the same states, since the plan's inputs name them by digest).
    """

    kind: Literal["committed", "withdrawn", "refused", "selected"]
    plan_id: str
    plan: partitioner.Plan | None
    reason: str = ""
    states: Mapping[str, pb.NodeState] = field(default_factory=dict)


@dataclass(frozen=True)
class ServedPlans:
    """The plans this node serves now: the active one and those still draining."""

    active: str = ""  # "" when no plan is active
    draining: tuple[str, ...] = ()

    @property
    def ids(self) -> frozenset[str]:
        return frozenset([self.active] if self.active else []) | frozenset(self.draining)

    def check(self, plan_id: str, node_id: str) -> None:
        """Fencing for the data plane: raise `PlanNotCommittedError` unless `plan_id` is served.

        The one fencing check (the protocol core raises the same error with the same words);
        cheap and safe on any thread, since a `ServedPlans` is immutable.
        """
        if plan_id not in self.ids:
            raise PlanNotCommittedError.for_plan(plan_id, node_id, self.ids)


class PlanSource(Protocol):
    """The agreement as the data plane sees it (trio thread)."""

    @property
    def changes(self) -> Publisher[PlanChange]:
        """Subscribe for every committed, withdrawn or refused plan, in order."""
        ...

    @property
    def selection(self) -> pb.ModelSelection | None:
        """The model the mesh runs (last writer wins), or None."""
        ...

    @property
    def last_refusal(self) -> str:
        """Why the mesh runs no plan, in words ("" when a plan is committed)."""
        ...

    def served(self) -> ServedPlans:
        """The plans this node serves now."""
        ...

    def release(self, plan_id: str) -> None:
        """A draining plan has no request left on this node: stop serving it."""
        ...
