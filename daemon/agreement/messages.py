"""The agreement protocol's vocabulary: inputs, proposals, messages, outputs, status, timing.

Pure data (frozen dataclasses, no I/O, no meshd imports outside this core): what
`meshd.agreement.protocol.AgreementNode` reads and returns, what the daemon-side runtime
(`meshd.agreement.service`) puts on the wire, and what the simulator in the tests checks.
The protocol itself, its safety and liveness argument, is in `meshd.agreement.protocol`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

NodeId = str


@dataclass(frozen=True)
class ModelRef:
    """The selected model: a name for people, a digest so that all nodes mean the same bytes."""

    name: str
    digest: str


@dataclass(frozen=True)
class Plan:
    """A computed plan: its id (the epoch data-plane messages carry), who holds stages, and
    its layout (opaque here: what the id is a hash of, besides the model and settings)."""

    plan_id: str
    stage_members: tuple[NodeId, ...]
    layout: str = ""


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan is computed from; equal inputs must give equal plans (A1).

    `incumbent`: the plan the members run now (see the protocol's "Incumbent"), which
    `compute_plan` keeps unless it cannot run any more or another is materially better. It
    takes no part in comparing inputs (nor, so, proposals): nodes agree on the members, their
    digests, the model, the settings and the outcome; a node whose incumbent differs but that
    computes the same outcome confirms the same proposal, and a commit that makes its plan the
    incumbent leaves the proposal as it is.
    """

    members: tuple[NodeId, ...]
    digests: tuple[str, ...]
    model: ModelRef
    settings: str = ""
    incumbent: Plan | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if list(self.members) != sorted(set(self.members)):
            raise ValueError(f"plan members must be sorted and unique, got {self.members}")
        if len(self.digests) != len(self.members):
            raise ValueError(
                f"need one profile digest per member: {len(self.members)} members, "
                f"{len(self.digests)} digests"
            )

    def digest_of(self, member: NodeId) -> str:
        """The profile digest these inputs hold for `member`."""
        return self.digests[self.members.index(member)]


@dataclass(frozen=True)
class Refusal:
    """`compute_plan` found no plan, e.g. "not enough memory in this mesh for X: need A, have B"."""

    reason: str


PlanOutcome = Plan | Refusal
ComputePlan = Callable[[PlanInputs], PlanOutcome]


@dataclass(frozen=True)
class Proposal:
    """A node's current proposal: what it computed and from what. Compared as a whole.

    Every node compares its proposal with every peer's on every message, and a proposal holds
    the whole member list: its hash is computed once, so that unequal proposals differ at
    once and equal ones pay one full comparison.
    """

    inputs: PlanInputs
    outcome: PlanOutcome
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.inputs, self.outcome)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Proposal):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.inputs == other.inputs
            and self.outcome == other.outcome
        )

    @property
    def members(self) -> tuple[NodeId, ...]:
        return self.inputs.members

    @property
    def plan(self) -> Plan | None:
        """The plan, or None when the outcome is a refusal."""
        return self.outcome if isinstance(self.outcome, Plan) else None


@dataclass(frozen=True)
class ProposalMessage:
    """The one message of the protocol: the sender's current proposal (a confirmation).

    `(incarnation, seq)` orders a sender's messages; `committed` says that the sender has
    committed exactly `proposal`, which makes the message a commit certificate. `active` is
    the plan the sender serves new requests on (its report for the incumbent).
    """

    sender: NodeId
    incarnation: int
    seq: int
    proposal: Proposal | None
    committed: bool
    active: Plan | None = None

    @property
    def stamp(self) -> tuple[int, int]:
        return (self.incarnation, self.seq)


@dataclass(frozen=True)
class Broadcast:
    """Send `message` to each of `recipients` (every peer the node currently sees alive)."""

    recipients: frozenset[NodeId]
    message: ProposalMessage


@dataclass(frozen=True)
class Send:
    """Send `message` to one peer."""

    to: NodeId
    message: ProposalMessage


@dataclass(frozen=True)
class Committed:
    """The node now serves `proposal`'s plan as its active plan; new requests go there.

    The previously active plan, if any, now drains (see `AgreementNode.draining`), unless it
    has the same plan id: then the same layout goes on serving (`changed` is False) and
    nothing on the data plane changes.
    """

    proposal: Proposal
    previous_plan_id: str = ""

    @property
    def plan_id(self) -> str:
        plan = self.proposal.plan
        assert plan is not None, "only plans are committed"
        return plan.plan_id

    @property
    def members(self) -> tuple[NodeId, ...]:
        return self.proposal.members

    @property
    def changed(self) -> bool:
        """Whether the active plan id changed (False: the same layout, re-confirmed)."""
        return self.plan_id != self.previous_plan_id


@dataclass(frozen=True)
class Withdrawn:
    """The node stopped serving plan `plan_id`; requests still running on it must fail."""

    plan_id: str
    reason: str


@dataclass(frozen=True)
class Refused:
    """This node's view cannot hold the model; it starts no new request (its plan drains)."""

    reason: str


Output = Broadcast | Send | Committed | Withdrawn | Refused


@dataclass(frozen=True)
class ServedPlan:
    """A committed plan this node serves, with what it needs to decide when to stop.

    `member_since`: when each stage member (other than this node) became alive, as seen at
    commit; a different time later means it reconnected.
    """

    proposal: Proposal
    committed_at: float
    member_since: tuple[tuple[NodeId, float], ...]
    draining_since: float | None = None

    @property
    def plan(self) -> Plan:
        plan = self.proposal.plan
        assert plan is not None, "only plans are served"
        return plan

    @property
    def plan_id(self) -> str:
        return self.plan.plan_id

    @property
    def members(self) -> tuple[NodeId, ...]:
        return self.proposal.members


@dataclass(frozen=True)
class AgreementStatus:
    """What `meshd status` shows about agreement on this node.

    `confirmed_by` and `committed_by` refer to the current `proposal` (they equal its members
    once converged): the members whose newest message carries it, and those known to have
    committed it. `reasons` says, in words, why the proposal is not committed yet or what is
    about to change it (a peer still stabilizing); empty when converged.
    """

    node_id: NodeId
    active: ServedPlan | None
    draining: tuple[ServedPlan, ...]
    proposal: Proposal | None
    confirmed_by: frozenset[NodeId]
    committed_by: frozenset[NodeId]
    reasons: tuple[str, ...]

    @property
    def converged(self) -> bool:
        """True when the proposal is committed and nothing is pending."""
        return not self.reasons

    @property
    def reason(self) -> str:
        """Why the node is not (or not yet) serving its current view, in one line."""
        return "; ".join(self.reasons)


class PlanNotCommittedError(RuntimeError):
    """Data-plane work arrived for a plan this node does not serve (fencing)."""

    @classmethod
    def for_plan(
        cls, plan_id: str, node_id: NodeId, serving: Collection[str]
    ) -> PlanNotCommittedError:
        """The refusal naming the plan, this node and what it serves instead."""
        served = ", ".join(sorted(serving)) or "no plan"
        return cls(
            f"plan {plan_id} is not committed on node {node_id} (it serves {served}); "
            "the mesh is changing plans: retry once the sender and this node agree"
        )


@dataclass(frozen=True)
class AgreementConfig:
    """Timing of the protocol, in seconds.

    join_stability_s: how long a peer must stay alive before it joins the membership.
    startup_grace_s: how long a starting node listens before proposing anything.
    retransmit_interval_s: re-send period while the node's proposal is not committed.
    gossip_interval_s: re-send period once it is (anti-entropy only).
    drain_timeout_s: the longest a replaced plan keeps serving requests already running.
    """

    join_stability_s: float = 2.0
    startup_grace_s: float = 3.0
    retransmit_interval_s: float = 0.5
    gossip_interval_s: float = 5.0
    drain_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for setting in dataclasses.fields(self):
            value = getattr(self, setting.name)
            if not value >= 0:
                raise ValueError(f"{setting.name} must be >= 0 seconds, got {value}")
        if self.retransmit_interval_s <= 0 or self.gossip_interval_s <= 0:
            raise ValueError(
                "retransmit_interval_s and gossip_interval_s must be > 0 "
                f"(got {self.retransmit_interval_s} and {self.gossip_interval_s})"
            )
