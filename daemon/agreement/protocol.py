"""Leaderless agreement on one pipeline plan: the pure protocol core.

Why this exists: exo's old ring let every node compute a partition from its own view and
nothing made the views agree; exo 1.0 elects a master without a quorum and its elections wedge
or flap; MLX distributed hangs when a peer disappears. Here no node is special. Every node runs
the same state machine, `AgreementNode`, and a plan is served only once *every* member of it has
confirmed exactly that plan. This module is pure: no I/O, no trio, no gRPC, no clock. Time is
the `now` argument (monotonic seconds), the outside world is the arguments of `on_membership`,
`on_message` and `on_tick`, and what the node wants done comes back as a list of outputs
(`Broadcast`, `Send`, `Committed`, `Withdrawn`, `Refused`) that the daemon maps to gRPC and to
its data plane. Those values are defined in `meshd.agreement.messages`.

The protocol
------------
1. *Eligible members.* A node's candidate membership is itself plus every peer that its
   liveness layer reports alive continuously for at least `join_stability_s` and whose profile
   digest it holds. A starting node proposes nothing for `startup_grace_s` after
   `started_at`, so that it hears its peers (and they become stable) instead of first
   committing a one-node plan; set it above `join_stability_s` plus the discovery time.
   A peer that flaps faster than `join_stability_s` never becomes a member.
   *Settling.* The daemon may name nodes whose inputs are still being measured (a joining
   peer's links, or this node's links to it; see `on_membership`). While one of them is alive
   the node keeps its current proposal instead of making a new one, unless a member of that
   proposal was lost, so a mesh does not commit a plan and replace it a second later when the
   last link measurement arrives. The daemon bounds how long a node stays settling.
2. *Proposal.* From the sorted members, their profile digests, the model, the plan settings
   digest and the *incumbent* (`PlanInputs`) the node computes `compute_plan(inputs)`: a
   `Plan` (plan id, members that hold stages, layout) or a `Refusal` ("not enough memory in
   this mesh for X: need A, have B"). The pair is the node's `Proposal`. Because
   `compute_plan` is a pure function, two nodes with the same view make the same proposal:
   concurrent rounds resolve by construction, and any node may start one (a round is nothing
   but a changed proposal).
   *Incumbent.* Every message carries its sender's active plan. The incumbent is the active
   plan most members of the view report (this node's own included; ties go to the larger
   plan id), so every node that holds the same reports picks the same one. `compute_plan`
   keeps it unless it no longer runs on these members or a different layout is materially
   better (the daemon: more than 10 % faster predicted): noise in the measurements behind
   the digests moves proposals, not the layout. The incumbent is not compared when nodes
   compare proposals (they agree on the view and the outcome), so committing a new layout,
   which makes it the incumbent, leaves the proposal as it is: `compute_plan` keeps what it
   just chose.
3. *Confirmation.* A node confirms its proposal by sending it to every peer it sees alive
   (`ProposalMessage`, with a per-node `(incarnation, seq)` stamp: a receiver keeps only the
   newest message per sender, so reordered and duplicated messages are ignored). It re-sends
   every `retransmit_interval_s` until it has committed its proposal, then every
   `gossip_interval_s`; a committed node also answers a peer that confirms the same proposal
   but has not committed it yet, so a lost message costs one retransmission, not a gossip
   period.
4. *Commit.* A node commits proposal P when P is its own current proposal, P is a `Plan`, and
   either (a) for every member m of P, the newest message it holds from m carries P, or
   (b) a member's newest message carries P with `committed=True` (a commit certificate: that
   member applied (a) or (b) itself). A node forgets a peer's proposal when the peer is lost or
   reconnects, so evidence from a previous connection (perhaps a previous incarnation) is not
   counted again.
5. *Serving (epochs and fencing).* The plan id is the epoch every data-plane message carries,
   and it is a function of the plan's layout (which node runs which layers): proposals made
   from different inputs that give the same layout share one plan id. A node serves the plans
   it committed: the newest is *active* (new requests go there); the one it replaced is
   *draining* (requests already running may finish on it). Committing a proposal whose plan
   id is the active one's replaces the record and nothing else (`Committed.changed` is False):
   the same stages keep serving under the same fencing token. `is_serving`
   and `check_serving` answer the fencing question; `check_serving` raises
   `PlanNotCommittedError` naming the plan, this node and what it serves. A served plan is
   withdrawn as soon as one of its stage members is lost or reconnects (its `alive_since`
   differs from the one recorded at commit), so nothing waits on a dead stage; a member that
   holds no stage may come and go without disturbing it. A draining plan also
   ends when the daemon calls `release_draining` (its last request finished) or after
   `drain_timeout_s`. When a node's own proposal becomes a refusal or disappears (no model,
   own profile unknown) its active plan turns draining: it starts nothing new.
   *Leaving.* The daemon names nodes that announced they are leaving (`on_membership`'s
   `leaving`): they stay alive but are no longer eligible members, so the others commit a plan
   without them while the plan they hold stages of drains; a leaving node itself proposes
   nothing and starts nothing new. `peers_moved_on` tells a leaving node when every peer's
   active plan runs without it.
6. *Partitions.* Each side of a partition sees only its own nodes, so it proposes a plan of
   its own members (a layout of its own nodes). A side that can hold the
   model commits it; a side that cannot proposes a refusal, reports it (`Refused`, `status`)
   and serves nothing. When the network heals, every node's view grows back to the whole mesh
   after `join_stability_s` and they all commit the merged plan.

Safety (holds under any message delay, loss, duplication and reordering, crashes, restarts
and partitions, given A1-A3):
  S1 Unanimity: a node commits P only if every member of P proposed P (sent it as its own
     proposal) at some point, and P is the committing node's own current proposal.
  S2 One layout per id: all nodes that commit plan id X commit the same plan: the same
     stage members and layout (A1), whatever inputs chose it.
  S3 Fencing: `is_serving(X)` is true only for a plan this node committed and has not
     withdrawn; nothing else is ever served.
  S4 No dead stages: a node never serves a plan with a stage member its liveness layer reports
     lost or reconnected since the commit.
  S5 A node whose own view cannot hold the model (refusal) starts no new request.

Liveness (given A1-A5): if from time T on the network is stable (every node's alive set is
exactly the group of nodes it can reach, each group is fully connected, the digests and the
model every node holds agree, and links lose at most k messages in a row), then every node of
every group commits the same plan of exactly that group, or reports the same refusal, by
T + detection delay + `join_stability_s` + the daemon's settling bound + (k + 1) resend
periods (a resend period is
`retransmit_interval_s` plus the daemon's tick granularity plus a message delay). Proof
sketch: after the views settle all nodes compute the same proposal, each unsettled node
re-sends it every period, so within k + 1 periods every member holds every other member's
proposal (rule a) or a certificate (rule b); no view changes afterwards, so nothing is
withdrawn.
No plan storms: the proposal changes only when membership, a digest, the model, the
settings or the incumbent change, and a joining peer enters the membership only after
`join_stability_s` of uninterrupted liveness; the served plan id changes only when the layout
does. Nodes whose incumbents differ (one committed a new layout, the other has not heard yet)
may compute different outcomes until the reports reach them, which the resend periods above
cover: a stable network's reports stop changing once its nodes have committed.

Assumptions:
  A1 `compute_plan` is deterministic and the plan id identifies the plan's layout (it is a
     hash of it), so equal inputs give the same plan on every node and equal plan ids mean
     equal layouts.
  A2 Nodes are not Byzantine, and the transport authenticates `ProposalMessage.sender`.
  A3 A node's `incarnation` grows across restarts (e.g. `time.time_ns()` at start), so a
     restarted node's messages supersede those of its previous life.
  A4 The liveness layer is eventually accurate within each group of mutually reachable nodes,
     and reachability is eventually transitive (clean partitions). It gives a peer a new
     `alive_since` whenever the peer reconnects or restarts.
  A5 Links are fair-lossy: a message re-sent often enough gets through.
If reachability stays non-transitive (A can reach B, B can reach C, A cannot reach C), the
nodes' views keep differing and they stay uncommitted; safety still holds and `status`
names the peer whose view differs and what it sees.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Mapping

from meshd.agreement.messages import (
    AgreementConfig,
    AgreementStatus,
    Broadcast,
    Committed,
    ComputePlan,
    ModelRef,
    NodeId,
    Output,
    Plan,
    PlanInputs,
    PlanNotCommittedError,
    PlanOutcome,
    Proposal,
    ProposalMessage,
    Refusal,
    Refused,
    Send,
    ServedPlan,
    Withdrawn,
)


class AgreementNode:
    """One node's side of the protocol (see the module docstring). Not thread-safe."""

    def __init__(
        self,
        node_id: NodeId,
        incarnation: int,
        compute_plan: ComputePlan,
        started_at: float,
        config: AgreementConfig | None = None,
    ) -> None:
        self.node_id = node_id
        self.incarnation = incarnation
        self.config = config or AgreementConfig()
        self._compute_plan = compute_plan
        self._started_at = started_at
        self._alive: dict[NodeId, float] = {}
        self._digests: dict[NodeId, str] = {}
        self._settling: frozenset[NodeId] = frozenset()
        self._leaving: frozenset[NodeId] = frozenset()
        self._model: ModelRef | None = None
        self._settings = ""
        self._proposal: Proposal | None = None
        self._last_computed: tuple[PlanInputs, PlanOutcome] | None = None
        self._latest: dict[NodeId, ProposalMessage] = {}
        self._active: ServedPlan | None = None
        self._draining: dict[str, ServedPlan] = {}
        self._seq = 0
        self._next_send_at = float("-inf")

    # ----------------------------------------------------------------- queries

    @property
    def proposal(self) -> Proposal | None:
        return self._proposal

    @property
    def active(self) -> ServedPlan | None:
        """The plan new requests go to, or None."""
        return self._active

    @property
    def draining(self) -> tuple[ServedPlan, ...]:
        return tuple(self._draining.values())

    def is_serving(self, plan_id: str) -> bool:
        """Whether data-plane work tagged `plan_id` may run here (active or draining)."""
        active = self._active is not None and self._active.plan_id == plan_id
        return active or plan_id in self._draining

    def peers_moved_on(self) -> bool:
        """Whether every peer seen alive serves new requests on a plan without a stage on this
        node (or on none): what a leaving node waits for before it hands its requests over."""
        for peer in self._alive:
            message = self._latest.get(peer)
            if message is None:
                return False
            if message.active is not None and self.node_id in message.active.stage_members:
                return False
        return True

    def peers_active(self) -> dict[NodeId, Plan | None]:
        """The plan each peer seen alive serves new requests on, by its newest message (None:
        no plan, or no message yet): a leaving node hands its requests over once the stages
        of those plans are loaded."""
        out: dict[NodeId, Plan | None] = {}
        for peer in self._alive:
            message = self._latest.get(peer)
            out[peer] = message.active if message is not None else None
        return out

    def check_serving(self, plan_id: str) -> None:
        """Fencing: raise `PlanNotCommittedError` unless `plan_id` is served here."""
        if not self.is_serving(plan_id):
            raise PlanNotCommittedError.for_plan(plan_id, self.node_id, self._served_ids())

    def status(self, now: float) -> AgreementStatus:
        """The committed plan, who confirmed the proposal, and why it is not committed yet."""
        confirmed, committed = self._confirmations()
        return AgreementStatus(
            node_id=self.node_id,
            active=self._active,
            draining=self.draining,
            proposal=self._proposal,
            confirmed_by=confirmed,
            committed_by=committed,
            reasons=tuple(self._pending_reasons(now)),
        )

    # ------------------------------------------------------------------ events

    def on_membership(
        self,
        now: float,
        alive: Mapping[NodeId, float],
        digests: Mapping[NodeId, str],
        model: ModelRef | None,
        settings: str = "",
        settling: Collection[NodeId] = (),
        leaving: Collection[NodeId] = (),
    ) -> list[Output]:
        """The liveness layer's view changed: peers alive (with since when), digests, model.

        `alive` maps each peer seen alive to the time it became alive (this node's clock); it
        must change whenever the peer reconnects. `digests` holds the profile digest of this
        node and of each peer whose profile it fetched. `settings` digests the mesh-wide
        settings that change plans; all nodes must pass the same. `settling` names nodes
        (this one or peers) whose digests are about to change because their measurements are
        not complete yet; the caller must bound how long a node stays in it. `leaving` names
        nodes (this one or peers) that announced they are leaving: they are no longer eligible
        members (see "Leaving" in the module docstring).
        """
        self._forget_reconnected(alive)
        self._alive = {peer: since for peer, since in alive.items() if peer != self.node_id}
        self._digests = dict(digests)
        self._model = model
        self._settings = settings
        self._settling = frozenset(settling)
        self._leaving = frozenset(leaving)
        return self._refresh(now)

    def on_message(self, now: float, message: ProposalMessage) -> list[Output]:
        """A peer's proposal arrived (possibly late, duplicated or out of order)."""
        if message.sender == self.node_id:
            return []
        previous = self._latest.get(message.sender)
        if previous is not None and message.stamp <= previous.stamp:
            return []
        self._latest[message.sender] = self._interned(message)
        outputs = self._try_commit(now)
        if not outputs:  # its report may move the incumbent (after a commit: at the next tick)
            outputs = self._update_proposal(now)
            outputs += self._try_commit(now)
        if not outputs and self._should_answer(message):
            outputs.append(Send(message.sender, self._next_message(now)))
        return outputs

    def on_tick(self, now: float) -> list[Output]:
        """Time passed: stability delays expire, drains time out, messages are re-sent."""
        outputs = self._refresh(now)
        outputs += self._expire_draining(now)
        already_sent = any(isinstance(output, Broadcast) for output in outputs)
        if not already_sent and now >= self._next_send_at:
            outputs.append(self._broadcast(now))
        return outputs

    def release_draining(self, plan_id: str) -> list[Output]:
        """The daemon's last request on draining plan `plan_id` finished: stop serving it."""
        plan = self._draining.pop(plan_id, None)
        if plan is None:
            return []
        return [Withdrawn(plan_id, f"plan {plan_id} drained: its last request finished")]

    # --------------------------------------------------------------- internals

    def _refresh(self, now: float) -> list[Output]:
        outputs = self._withdraw_plans_with_lost_members()
        outputs += self._update_proposal(now)
        outputs += self._try_commit(now)
        return outputs

    def _forget_reconnected(self, alive: Mapping[NodeId, float]) -> None:
        """Drop proposals of peers that were lost or reconnected; keep their stamp watermark."""
        for peer, message in self._latest.items():
            was_alive_since = self._alive.get(peer)
            if message.proposal is None or was_alive_since is None:
                continue
            if alive.get(peer) != was_alive_since:
                self._latest[peer] = dataclasses.replace(
                    message, proposal=None, committed=False, active=None
                )

    def _eligible_members(self, now: float) -> tuple[NodeId, ...]:
        stable_since = now - self.config.join_stability_s
        peers = [
            peer
            for peer, since in self._alive.items()
            if since <= stable_since and peer in self._digests and peer not in self._leaving
        ]
        return tuple(sorted([self.node_id, *peers]))

    def _current_inputs(self, now: float) -> PlanInputs | None:
        starting = now - self._started_at < self.config.startup_grace_s
        if starting or self._model is None or self.node_id not in self._digests:
            return None
        if self.node_id in self._leaving:
            return None
        members = self._eligible_members(now)
        digests = tuple(self._digests[member] for member in members)
        incumbent = self._incumbent(members)
        return PlanInputs(members, digests, self._model, self._settings, incumbent)

    def _incumbent(self, members: tuple[NodeId, ...]) -> Plan | None:
        """The active plan most members report (this node's own included; ties: the larger
        plan id), the same on every node that holds the same reports."""
        reports = [self._active.plan] if self._active is not None else []
        for member in members:
            message = self._latest.get(member) if member != self.node_id else None
            if message is not None and message.active is not None:
                reports.append(message.active)
        if not reports:
            return None
        # Counted by plan id (a hash of the layout, so one id is one plan): hashing whole
        # plans would cost their member lists on every message of a large mesh.
        counts = Counter(plan.plan_id for plan in reports)
        chosen = max(counts, key=lambda plan_id: (counts[plan_id], plan_id))
        return next(plan for plan in reports if plan.plan_id == chosen)

    def _outcome_for(self, inputs: PlanInputs) -> PlanOutcome:
        """`compute_plan(inputs)`, remembered for the last inputs (it may be expensive)."""
        last = self._last_computed
        if last is None or last[0] != inputs or last[0].incumbent != inputs.incumbent:
            self._last_computed = (inputs, self._compute_plan(inputs))
        return self._last_computed[1]

    def _settling_now(self) -> list[NodeId]:
        """Settling nodes that are this node or alive peers."""
        return sorted(n for n in self._settling if n == self.node_id or n in self._alive)

    def _holding_for_settling(self) -> bool:
        """Keep the current proposal while measurements settle, unless it lost a member."""
        if not self._settling_now():
            return False
        proposal = self._proposal
        return proposal is None or all(
            member == self.node_id or member in self._alive for member in proposal.members
        )

    def _update_proposal(self, now: float) -> list[Output]:
        if self._holding_for_settling():
            return []
        inputs = self._current_inputs(now)
        proposal = None if inputs is None else Proposal(inputs, self._outcome_for(inputs))
        if proposal == self._proposal:
            return []
        self._proposal = proposal
        outputs: list[Output] = []
        if proposal is None or proposal.plan is None:
            self._start_draining_active(now)
        if proposal is not None and isinstance(proposal.outcome, Refusal):
            outputs.append(Refused(proposal.outcome.reason))
        outputs.append(self._broadcast(now))
        return outputs

    def _try_commit(self, now: float) -> list[Output]:
        proposal = self._proposal
        if proposal is None or proposal.plan is None:
            return []
        if self._active is not None and self._active.proposal == proposal:
            return []
        if not (self._all_members_confirmed(proposal) or self._certified(proposal)):
            return []
        previous = self._active.plan_id if self._active is not None else ""
        self._start_draining_active(now)
        self._draining.pop(proposal.plan.plan_id, None)
        stages = set(proposal.plan.stage_members)
        member_since = tuple(
            (m, self._alive[m]) for m in proposal.members if m != self.node_id and m in stages
        )
        self._active = ServedPlan(proposal, now, member_since)
        return [Committed(proposal, previous), self._broadcast(now)]

    def _all_members_confirmed(self, proposal: Proposal) -> bool:
        return all(
            member == self.node_id or self._holds(member, proposal) for member in proposal.members
        )

    def _certified(self, proposal: Proposal) -> bool:
        return any(
            self._holds(member, proposal) and self._latest[member].committed
            for member in proposal.members
            if member != self.node_id
        )

    def _holds(self, member: NodeId, proposal: Proposal) -> bool:
        message = self._latest.get(member)
        return message is not None and message.proposal == proposal

    def _interned(self, message: ProposalMessage) -> ProposalMessage:
        """`message`, holding this node's own proposal object where it carries an equal one.

        A proposal compares its whole member list: checking every member's confirmation on
        every message costs O(members) per member. Equal proposals shared as one object
        compare by identity (``Proposal.__eq__`` checks it first), which keeps a large mesh's
        commit checks linear.
        """
        own = self._proposal
        if own is None or message.proposal is None or message.proposal is own:
            return message
        if message.proposal != own:
            return message
        return dataclasses.replace(message, proposal=own)

    def _start_draining_active(self, now: float) -> None:
        if self._active is None:
            return
        self._draining[self._active.plan_id] = dataclasses.replace(self._active, draining_since=now)
        self._active = None

    def _withdraw_plans_with_lost_members(self) -> list[Output]:
        outputs: list[Output] = []
        if self._active is not None:
            reason = self._lost_member_reason(self._active)
            if reason:
                outputs.append(Withdrawn(self._active.plan_id, reason))
                self._active = None
        for plan_id, plan in list(self._draining.items()):
            reason = self._lost_member_reason(plan)
            if reason:
                outputs.append(Withdrawn(plan_id, reason))
                del self._draining[plan_id]
        return outputs

    def _lost_member_reason(self, plan: ServedPlan) -> str:
        for member, since in plan.member_since:
            if member not in self._alive:
                return f"member {member} of plan {plan.plan_id} was lost"
            if self._alive[member] != since:
                return f"member {member} of plan {plan.plan_id} reconnected (it may have restarted)"
        return ""

    def _expire_draining(self, now: float) -> list[Output]:
        outputs: list[Output] = []
        for plan_id, plan in list(self._draining.items()):
            assert plan.draining_since is not None
            if now - plan.draining_since >= self.config.drain_timeout_s:
                del self._draining[plan_id]
                reason = f"plan {plan_id} still draining after {self.config.drain_timeout_s} s"
                outputs.append(Withdrawn(plan_id, reason))
        return outputs

    def _settled(self) -> bool:
        """True when this node has nothing to push: its proposal is committed or not a plan."""
        if self._proposal is None or self._proposal.plan is None:
            return True
        return self._active is not None and self._active.proposal == self._proposal

    def _next_message(self, now: float) -> ProposalMessage:
        self._seq += 1
        interval = (
            self.config.gossip_interval_s if self._settled() else self.config.retransmit_interval_s
        )
        self._next_send_at = now + interval
        committed = self._active is not None and self._active.proposal == self._proposal
        active = self._active.plan if self._active is not None else None
        return ProposalMessage(
            self.node_id, self.incarnation, self._seq, self._proposal, committed, active
        )

    def _broadcast(self, now: float) -> Broadcast:
        return Broadcast(frozenset(self._alive), self._next_message(now))

    def _should_answer(self, message: ProposalMessage) -> bool:
        """A peer confirms our committed proposal but lacks a certificate: send it ours."""
        return (
            message.sender in self._alive
            and not message.committed
            and message.proposal is not None
            and message.proposal == self._proposal
            and self._active is not None
            and self._active.proposal == self._proposal
        )

    def _served_ids(self) -> set[str]:
        served = set(self._draining)
        if self._active is not None:
            served.add(self._active.plan_id)
        return served

    def _confirmations(self) -> tuple[frozenset[NodeId], frozenset[NodeId]]:
        """Members whose newest message carries our proposal, and those that committed it."""
        proposal = self._proposal
        if proposal is None:
            return frozenset(), frozenset()
        confirmed = {m for m in proposal.members if m != self.node_id and self._holds(m, proposal)}
        committed = {m for m in confirmed if self._latest[m].committed}
        confirmed.add(self.node_id)
        if self._active is not None and self._active.proposal == proposal:
            committed.add(self.node_id)
        return frozenset(confirmed), frozenset(committed)

    # ----------------------------------------------------------- status words

    def _pending_reasons(self, now: float) -> list[str]:
        reasons = self._view_reasons(now)
        proposal = self._proposal
        if proposal is None:
            return reasons
        if isinstance(proposal.outcome, Refusal):
            return [*reasons, proposal.outcome.reason]
        if self._active is None or not _same_layout(self._active.proposal, proposal):
            reasons += self._disagreement_reasons(proposal)
        return reasons

    def _view_reasons(self, now: float) -> list[str]:
        reasons = []
        stability, grace = self.config.join_stability_s, self.config.startup_grace_s
        if now - self._started_at < grace:
            age = now - self._started_at
            reasons.append(f"started {age:.1f} s ago; waiting {grace:.1f} s to hear peers")
        if self._model is None:
            reasons.append("no model selected")
        if self.node_id not in self._digests:
            reasons.append("this node's own profile is not measured yet")
        settling = self._settling_now()
        if settling:
            reasons.append(f"waiting for link measurements of {', '.join(settling)}")
        if self.node_id in self._leaving:
            reasons.append("this node is leaving the mesh")
        for peer in sorted(self._leaving & self._alive.keys()):
            reasons.append(f"peer {peer} is leaving the mesh")
        for peer, since in sorted(self._alive.items()):
            if now - since < stability:
                reasons.append(
                    f"peer {peer} joined {now - since:.1f} s ago; "
                    f"waiting {stability:.1f} s for it to be stable"
                )
            elif peer not in self._digests:
                reasons.append(f"waiting for the profile of peer {peer}")
        return reasons

    def _disagreement_reasons(self, proposal: Proposal) -> list[str]:
        waiting = []
        reasons = []
        for member in proposal.members:
            if member == self.node_id:
                continue
            message = self._latest.get(member)
            if message is None or message.proposal is None:
                waiting.append(member)
            elif message.proposal != proposal:
                reasons.append(_difference(member, message.proposal, proposal))
        if waiting:
            reasons.insert(0, f"waiting for confirmation from {', '.join(waiting)}")
        return reasons


def _difference(peer: NodeId, theirs: Proposal, ours: Proposal) -> str:
    """Why `peer`'s proposal differs from ours, in words for `meshd status`."""
    a, b = theirs.inputs, ours.inputs
    if a.members != b.members:
        return f"{peer}'s view differs: it sees {{{', '.join(a.members)}}}"
    if a.model != b.model:
        return f"{peer} selects model {a.model.name} ({a.model.digest})"
    if a.settings != b.settings:
        return f"{peer} uses different plan settings ({a.settings!r} vs ours {b.settings!r})"
    if a.incumbent != b.incumbent:
        theirs_id = a.incumbent.plan_id[:12] if a.incumbent else "none"
        ours_id = b.incumbent.plan_id[:12] if b.incumbent else "none"
        return f"{peer} counts plan {theirs_id} as the running one (we count {ours_id})"
    differing = [m for m in a.members if a.digest_of(m) != b.digest_of(m)]
    if differing:
        return f"{peer} holds a different profile digest for {', '.join(differing)}"
    return (
        f"{peer} computed a different plan from the same inputs "
        "(compute_plan must be deterministic)"
    )


def _same_layout(active: Proposal, pending: Proposal) -> bool:
    """A pending proposal that only re-confirms the active plan (same plan id, newer inputs
    such as a re-measured link) changes nothing a client or operator can see: the status
    stays converged while it commits, instead of flipping to "updating" at every periodic
    measurement."""
    if active == pending:
        return True
    return (
        active.plan is not None
        and pending.plan is not None
        and pending.plan.plan_id == active.plan.plan_id
    )
