"""Agreement in the daemon: feed the pure protocol core, carry its messages, plan the mesh.

`meshd.agreement.protocol.AgreementNode` is the protocol (pure, simulated in the tests). This
component is its runtime, and what the data plane sees of it is `meshd.agreement.contract`:

* **Inputs.** The live peers from `Membership` (with the monotonic time each became alive,
  renewed on every reconnect), one *profile digest* per node, and the selected model.
  A digest hashes exactly what the partitioner reads of a node — memory budget (less the
  process overhead the node measured, `mesh.graph.plannable_budget`), the buckets
  of its FLOP/s and memory bandwidth, and the buckets of its outgoing links — so every node
  computes the same digest from the same served `NodeState`, and measurement noise inside a
  bucket changes nothing (the publisher also applies hysteresis: `Membership` for links,
  `profiling.settle_profile` for FLOP/s and memory bandwidth, whose re-measure within the
  previous spread publishes the previous number).
* **Settling.** A node whose published links still miss a node that joined moments ago is
  *settling* (`settling_nodes`); the core keeps its current proposal meanwhile, for at most
  `settle_bound_s`, so a starting mesh commits one plan made from measured links instead of
  committing one and replacing it when the last measurement lands.
* **Model selection** is a last-writer-wins register gossiped in every `NodeState`
  (`winning_selection`): any node may change the model with `meshd load` and every node
  converges on the same one without a master. Every node re-publishes the winning selection
  as its own, so the model outlives the node that loaded it (a laptop that loaded a model
  and went to sleep does not switch the mesh back). A node's configured model is only a
  startup default: any loaded model beats it, and among defaults the oldest wins, so a node
  that joins or restarts never switches the model of a running mesh.
* **compute_plan** restricts the mesh graph to the members, runs `partitioner.plan_model`
  with the incumbent's stages (the running layout is kept unless another is predicted more
  than `partitioner.SWITCH_GAIN` faster, and a layout with more nodes only while they earn
  `min_gain`; a forced kind that cannot run falls back to the best plan, whose note says
  why) and caches the full plan by plan id, which is a hash of the layout; a plan that
  cannot fit becomes a `Refusal` whose reason says how much memory is missing ("not enough
  memory in this mesh for ..."). A commit of the plan id already active is a
  re-confirmation from newer inputs: logged at debug level, nothing else happens.
* **Leaving.** A peer whose `NodeState` says `leaving` is no longer planned with; this node
  leaves by publishing the flag (`Membership.set_leaving`) and waiting for
  `peers_moved_on`.
* **Messages** go out over the peer channels as `Propose` calls with a deadline; one outbox
  slot per peer keeps only the newest message (receivers keep only the newest anyway), so a
  slow peer never builds a queue. Incoming messages are accepted only when the TLS
  certificate names the sender.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import trio

import partitioner
from meshd.agreement import messages as ag
from meshd.agreement.contract import PlanChange, ServedPlans
from meshd.agreement.protocol import AgreementNode
from meshd.agreement.remembered import RememberedSelection, write_remembered
from meshd.mesh.graph import (
    dtype_rates,
    effective_bandwidth,
    effective_flops,
    mesh_graph,
    plannable_budget,
    planning_bandwidth,
    planning_latency,
)
from meshd.mesh.membership import Membership
from meshd.runtime.bridge import AsyncioThread
from meshd.runtime.events import EventLog
from meshd.runtime.notify import Publisher
from meshd.wire import pb, rpc
from partitioner.quantize import bucket_index, latency_bucket_index

log = logging.getLogger("meshd.planning")

KEEP_RETRY_S = 30.0  # after a failed write of the kept selection (a full or read-only disk)

TICK_S = 0.1
PROPOSE_TIMEOUT_S = 1.0
SETTLE_BASE_S = 2.0
SETTLE_PER_PEER_S = 0.5


# ---------------------------------------------------------------- digests and selections


def state_digest(state: pb.NodeState) -> str:
    """What the partitioner reads of one node, bucketed, hashed (same on every node).

    Also what tensor-parallel groups are built from: each link's trust verdict and, for a
    trusted link, the addresses its runners would use, and the node's runner port. So a change
    of any of them is a new digest (and a new plan), and every member of a group derives the
    group's configuration from the same state.
    """
    profile = state.profile
    if profile.flops <= 0 or profile.mem_bandwidth <= 0 or plannable_budget(profile) <= 0:
        return ""
    links = sorted(
        [
            m.dst,
            latency_bucket_index(planning_latency(m)),
            bucket_index(planning_bandwidth(m)),
            [m.src_address, m.dst_address] if m.trusted else False,
        ]
        for m in state.links
        if m.bandwidth > 0
    )
    payload = [
        profile.node_id,
        plannable_budget(profile),
        bucket_index(effective_flops(state)),
        bucket_index(effective_bandwidth(state)),
        links,
        int(state.tensor_parallel_port),
    ]
    rates = dtype_rates(state)  # per-dtype rates, bucketed; absent from older profiles
    if rates:
        payload.append(rates)
    if state.speed_correction.row_flops > 0:  # measured by the node: meshd.mesh.graph
        payload.append(bucket_index(state.speed_correction.row_flops))
    if state.speed_correction.collective_overhead_s > 0:
        payload.append(
            ["collectives", latency_bucket_index(state.speed_correction.collective_overhead_s)]
        )
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


def settle_bound_s(peers: int) -> float:
    """How long to wait for the link measurements of a node that just joined.

    A node measures its links one bandwidth probe at a time, each confirmed once, so the
    time to measure all of them grows with the number of peers.
    """
    return SETTLE_BASE_S + SETTLE_PER_PEER_S * peers


def settling_nodes(
    states: dict[str, pb.NodeState], alive_since: dict[str, float], now: float
) -> set[str]:
    """Nodes whose published links still miss a node that joined less than a bound ago.

    `alive_since` holds every node of the view (this one with its start time). A node with no
    state yet counts as missing all its links. Planning before the last link of a joining node
    is measured would commit a plan and replace it as soon as the measurement arrives; a link
    that cannot be measured within `settle_bound_s` is planned without.
    """
    bound = settle_bound_s(len(alive_since) - 1)
    settling = set()
    for node, since in alive_since.items():
        state = states.get(node)
        measured = {m.dst for m in state.links if m.bandwidth > 0} if state is not None else set()
        for other, other_since in alive_since.items():
            if other != node and other not in measured and now - max(since, other_since) < bound:
                settling.add(node)
                break
    return settling


def model_selection(
    spec: partitioner.ModelSpec,
    options: partitioner.PlanOptions,
    node_id: str,
    path: str = "",
    *,
    startup_default: bool = False,
    after: pb.ModelSelection | None = None,
) -> pb.ModelSelection:
    """A selection record for `spec`; the digest names the model description exactly.

    `startup_default`: the node's configured model, offered when it starts; it loses to any
    model loaded on purpose (see `winning_selection`). `after`: the selection the mesh runs
    now; the new one is stamped later than it even where this node's clock is behind the
    clock that stamped it, so a `meshd load` always takes effect."""
    return pb.ModelSelection(
        name=spec.name,
        digest=spec.digest(),
        spec_json=json.dumps(spec.to_dict(), sort_keys=True),
        options_json=json.dumps(options.to_dict(), sort_keys=True),
        set_at=max(time.time(), after.set_at + 0.001 if after is not None else 0.0),
        set_by=node_id,
        path=path,
        startup_default=startup_default,
    )


def winning_selection(selections: list[pb.ModelSelection]) -> pb.ModelSelection | None:
    """The model the mesh runs, from the selections its live nodes publish.

    The newest selection made on purpose wins (largest `(set_at, set_by)`); without one, the
    oldest startup default does, so starting a node never changes what a running mesh serves.
    Every node computes this from the same gossiped states, so all agree without a master.
    """
    chosen = [s for s in selections if s.name and not s.startup_default]
    if chosen:
        return max(chosen, key=lambda s: (s.set_at, s.set_by))
    defaults = [s for s in selections if s.name]
    return min(defaults, key=lambda s: (s.set_at, s.set_by)) if defaults else None


def _model_key(selection: pb.ModelSelection | None) -> tuple[str, str]:
    """What a selection names: the model, by name and digest ("" for none)."""
    return (selection.name, selection.digest) if selection is not None else ("", "")


# ---------------------------------------------------------------- wire conversion


def plan_to_proto(plan: ag.Plan) -> pb.PlanRef:
    return pb.PlanRef(
        plan_id=plan.plan_id, stage_members=list(plan.stage_members), layout=plan.layout
    )


def plan_from_proto(message: pb.PlanRef) -> ag.Plan:
    return ag.Plan(message.plan_id, tuple(message.stage_members), message.layout)


def proposal_to_proto(proposal: ag.Proposal) -> pb.Proposal:
    inputs = proposal.inputs
    message = pb.Proposal(
        inputs=pb.PlanInputs(
            members=list(inputs.members),
            digests=list(inputs.digests),
            model=pb.ModelRef(name=inputs.model.name, digest=inputs.model.digest),
            settings=inputs.settings,
        )
    )
    if inputs.incumbent is not None:
        message.inputs.incumbent.CopyFrom(plan_to_proto(inputs.incumbent))
    if isinstance(proposal.outcome, ag.Plan):
        message.plan.CopyFrom(plan_to_proto(proposal.outcome))
    else:
        message.refusal = proposal.outcome.reason
    return message


def proposal_from_proto(message: pb.Proposal) -> ag.Proposal:
    wire = message.inputs
    inputs = ag.PlanInputs(
        members=tuple(wire.members),
        digests=tuple(wire.digests),
        model=ag.ModelRef(wire.model.name, wire.model.digest),
        settings=wire.settings,
        incumbent=plan_from_proto(wire.incumbent) if wire.HasField("incumbent") else None,
    )
    outcome: ag.PlanOutcome
    if message.WhichOneof("outcome") == "plan":
        outcome = plan_from_proto(message.plan)
    else:
        outcome = ag.Refusal(message.refusal)
    return ag.Proposal(inputs, outcome)


def message_to_proto(message: ag.ProposalMessage) -> pb.ProposalMessage:
    out = pb.ProposalMessage(
        sender=message.sender,
        incarnation=message.incarnation,
        seq=message.seq,
        committed=message.committed,
    )
    if message.proposal is not None:
        out.proposal.CopyFrom(proposal_to_proto(message.proposal))
    if message.active is not None:
        out.active.CopyFrom(plan_to_proto(message.active))
    return out


def message_from_proto(message: pb.ProposalMessage) -> ag.ProposalMessage:
    return ag.ProposalMessage(
        sender=message.sender,
        incarnation=message.incarnation,
        seq=message.seq,
        proposal=proposal_from_proto(message.proposal) if message.HasField("proposal") else None,
        committed=message.committed,
        active=plan_from_proto(message.active) if message.HasField("active") else None,
    )


# ---------------------------------------------------------------- the component


class PlanAgreement:
    """Runs the agreement protocol for one daemon."""

    def __init__(
        self,
        membership: Membership,
        bridge: AsyncioThread,
        events: EventLog,
        config: ag.AgreementConfig,
        *,
        state_dir: Path | None = None,
        mesh: str = "",
    ) -> None:
        """`state_dir`: where the winning loaded selection is kept across restarts
        (:mod:`meshd.agreement.remembered`), for the mesh whose fingerprint is `mesh`; None
        keeps nothing."""
        self._membership = membership
        self._bridge = bridge
        self._events = events
        self._node_id = membership.identity.node_id
        self._started_at = time.monotonic()
        self.core = AgreementNode(
            self._node_id,
            time.time_ns(),
            self._compute_plan,
            started_at=self._started_at,
            config=config,
        )
        self._settling: set[str] = set()
        self.plans: dict[str, partitioner.Plan] = {}
        self._states: dict[tuple[str, str], pb.NodeState] = {}
        self._selection: pb.ModelSelection | None = None
        self._state_dir = state_dir
        self._mesh = mesh
        self._kept: pb.ModelSelection | None = None  # what the state directory holds
        self._keep_wanted = trio.Event()
        self._outbox: dict[str, ag.ProposalMessage] = {}
        self._outbox_ready: dict[str, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self.changes = Publisher[PlanChange]("agreement")
        self.last_refusal = ""
        self.commits = 0  # commits that changed the active plan id (a new layout)
        self.recommits = 0  # commits of the plan id already active (newer inputs, same layout)

    # ------------------------------------------------------------ run

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self._membership.changes.subscribe() as membership_changes:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._feed_membership()
                nursery.start_soon(self._follow_membership, membership_changes)
                nursery.start_soon(self._tick)
                if self._state_dir is not None:
                    nursery.start_soon(self._keep_selections, self._state_dir)
                task_status.started()

    async def _follow_membership(self, changes: trio.MemoryReceiveChannel[None]) -> None:
        async for _ in changes:
            self._feed_membership()

    def remember(self, remembered: RememberedSelection) -> None:
        """Offer the selection this node kept before it stopped. Not when it was kept in
        another mesh (this state directory joined a new one), nor over a model loaded since
        this node started."""
        selection = remembered.selection
        if remembered.mesh != self._mesh:
            self._events.add(
                "not offering %s, kept from another mesh (this node joined a new one)",
                selection.name,
            )
            return
        current = self._membership.model
        if current is not None and not current.startup_default:
            return  # a `meshd load` that came in while this node started is newer
        self._kept = selection
        self._membership.set_model(selection)
        self._events.add(
            "the mesh ran %s (loaded on %s) when this node stopped: offering it again",
            selection.name,
            selection.set_by,
        )

    async def _keep_selections(self, state_dir: Path) -> None:
        """Write the winning loaded selection to the state directory whenever it changes, off
        the trio thread (a slow disk must not hold heartbeats up). A failed write is said
        once per selection and tried again after KEEP_RETRY_S."""
        warned: pb.ModelSelection | None = None
        while True:
            await self._keep_wanted.wait()
            self._keep_wanted = trio.Event()
            selection = self._selection
            if selection is None or selection.startup_default:
                continue
            if selection == self._kept:
                continue
            remembered = RememberedSelection(selection, self._mesh)
            try:
                await trio.to_thread.run_sync(write_remembered, state_dir, remembered)
            except OSError as error:
                if selection != warned:
                    warned = selection
                    self._events.add(
                        "cannot keep the loaded model %s for the next start in %s: %s",
                        selection.name,
                        state_dir,
                        error,
                        level=logging.WARNING,
                    )
                await trio.sleep(KEEP_RETRY_S)
                self._keep_wanted.set()
                continue
            self._kept = selection

    async def _tick(self) -> None:
        while True:
            await trio.sleep(TICK_S)
            if self._settling:
                self._feed_membership()  # a settling bound may have passed
            self._apply(self.core.on_tick(time.monotonic()))

    # ------------------------------------------------------------ inputs

    @property
    def selection(self) -> pb.ModelSelection | None:
        return self._selection

    def _feed_membership(self) -> None:
        membership = self._membership
        own = membership.own_state
        states = {self._node_id: own}
        alive: dict[str, float] = {}
        for record in membership.alive_peers():
            alive[record.node_id] = record.alive_since
            if record.state is not None:
                states[record.node_id] = record.state
        now = time.monotonic()
        self._settling = settling_nodes(states, {**alive, self._node_id: self._started_at}, now)
        leaving = {node_id for node_id, state in states.items() if state.leaving}
        digests: dict[str, str] = {}
        for node_id, state in states.items():
            digest = state_digest(state)
            if digest:
                digests[node_id] = digest
                self._states[(node_id, digest)] = state
        previous = self._selection
        self._selection = winning_selection([s.model for s in states.values()])
        if _model_key(previous) != _model_key(self._selection):
            # Before any plan follows: a request that reaches this node meanwhile is told that
            # a plan is on its way, not that no model is selected.
            self._notify(PlanChange("selected", "", None))
        self._adopt(own, self._selection)
        if self._selection != self._kept:  # compared as `_adopt` does: the whole record
            self._keep_wanted.set()
        model = settings = None
        if self._selection is not None:
            model = ag.ModelRef(self._selection.name, self._selection.digest)
            settings = self._selection.options_json
        outputs = self.core.on_membership(
            now, alive, digests, model, settings or "", settling=self._settling, leaving=leaving
        )
        self._apply(outputs)
        self._forget_unreferenced(digests)

    def _adopt(self, own: pb.NodeState, winner: pb.ModelSelection | None) -> None:
        """Publish a loaded model another node selected as this node's own selection too.

        The register then lives in every node's state, not only in the state of the node
        that ran `meshd load`: when that node leaves, the mesh keeps the model. Startup
        defaults are not adopted (each node offers its own until a model is loaded); the
        record is copied as it is, so every node still names the same `(set_at, set_by)`.
        """
        if winner is None or winner.startup_default or own.model == winner:
            return
        self._events.add("model %s was loaded on %s: the mesh runs it", winner.name, winner.set_by)
        self._membership.set_model(winner)

    def _forget_unreferenced(self, digests: dict[str, str]) -> None:
        """Drop cached states and plans nothing refers to any more.

        A daemon runs for months: every re-measured link bucket makes a new digest and every
        membership change a new plan. Kept: the states of the current digests and of the
        proposals still in play (own, active, draining), and those proposals' plans.
        """
        core = self.core
        proposals = [core.proposal] + [s.proposal for s in (core.active, *core.draining) if s]
        live = [p for p in proposals if p is not None]
        keep_states = set(digests.items())
        for proposal in live:
            keep_states.update(zip(proposal.inputs.members, proposal.inputs.digests, strict=True))
        for key in set(self._states) - keep_states:
            del self._states[key]
        keep_plans = {p.outcome.plan_id for p in live if isinstance(p.outcome, ag.Plan)}
        for plan_id in set(self.plans) - keep_plans:
            del self.plans[plan_id]

    def _compute_plan(self, inputs: ag.PlanInputs) -> ag.PlanOutcome:
        selection = self._selection
        if selection is None or selection.digest != inputs.model.digest:
            return ag.Refusal(
                f"the description of model {inputs.model.name} has not reached this node yet: "
                "the mesh plans once every member has it (seconds); if this stays, check that "
                "every node runs the same meshd version"
            )
        try:
            states = [
                self._states[(m, d)] for m, d in zip(inputs.members, inputs.digests, strict=True)
            ]
        except KeyError as exc:
            return ag.Refusal(
                f"the measured profile of node {exc} has not reached this node yet: the mesh "
                "plans once it has (seconds after the node joins)"
            )
        spec = partitioner.ModelSpec.from_dict(json.loads(selection.spec_json))
        options = partitioner.PlanOptions.from_dict(json.loads(inputs.settings or "{}"))
        incumbent = None
        if inputs.incumbent is not None and inputs.incumbent.layout:
            try:
                incumbent = partitioner.stages_from_layout_key(inputs.incumbent.layout)
            except ValueError as exc:  # a peer's report we cannot read: plan without it
                log.warning("ignoring incumbent %s: %s", inputs.incumbent.plan_id[:12], exc)
        try:
            plan = partitioner.plan_model(mesh_graph(states), spec, options, incumbent)
        except partitioner.InsufficientMemory as exc:
            return ag.Refusal(partitioner.describe_refusal(exc))
        except (partitioner.MeshError, partitioner.PlanOptionsError, ValueError) as exc:
            return ag.Refusal(f"cannot plan {spec.name} over this mesh: {exc}")
        self.plans[plan.plan_id] = plan
        return ag.Plan(plan.plan_id, plan.nodes, plan.layout_key)

    # ------------------------------------------------------------ messages

    def receive(self, message: pb.ProposalMessage, cert_node_id: str | None) -> None:
        """A member's Propose call (on the trio thread).

        Raises PermissionError when the certificate names another sender, ValueError when the
        message is malformed; the peer service answers the caller with that refusal.
        """
        if cert_node_id is not None and cert_node_id != message.sender:
            raise PermissionError(
                f"the proposal claims to be from {message.sender!r} but arrived over a channel "
                f"of {cert_node_id!r}"
            )
        self._apply(self.core.on_message(time.monotonic(), message_from_proto(message)))

    def _apply(self, outputs: list[ag.Output]) -> None:
        for output in outputs:
            if isinstance(output, ag.Broadcast):
                for peer in output.recipients:
                    self._post(peer, output.message)
            elif isinstance(output, ag.Send):
                self._post(output.to, output.message)
            elif isinstance(output, ag.Committed):
                self._on_committed(output)
            elif isinstance(output, ag.Withdrawn):
                self._events.add("plan %s withdrawn: %s", output.plan_id[:12], output.reason)
                self._notify(PlanChange("withdrawn", output.plan_id, None, output.reason))
            elif isinstance(output, ag.Refused):
                if output.reason != self.last_refusal:
                    self._events.add("no plan: %s", output.reason, level=logging.WARNING)
                self.last_refusal = output.reason
                self._notify(PlanChange("refused", "", None, output.reason))

    def _on_committed(self, output: ag.Committed) -> None:
        plan = self.plan_for(output.proposal)
        self.last_refusal = ""
        self.recommits += not output.changed
        self.commits += output.changed
        if not output.changed:  # the same layout from newer inputs: nothing moves
            log.debug("plan %s re-confirmed from newer inputs", output.plan_id[:12])
            return
        layout = ", ".join(
            f"{'+'.join(stage.nodes)} {stage.layer_start}-{stage.layer_end - 1}"
            for stage in (plan.stages if plan else ())
        )
        self._events.add(
            "committed plan %s over %d node(s): %s",
            output.plan_id[:12],
            len(output.members),
            layout or "?",
        )
        self._notify(
            PlanChange("committed", output.plan_id, plan, states=self.states_of(output.proposal))
        )

    def _notify(self, change: PlanChange) -> None:
        self.changes.publish(change)

    def _post(self, peer: str, message: ag.ProposalMessage) -> None:
        self._outbox[peer] = message
        ready = self._outbox_ready.get(peer)
        if ready is None:
            ready = self._outbox_ready[peer] = trio.Event()
            assert self._nursery is not None
            self._nursery.start_soon(self._sender, peer)
        ready.set()

    async def _sender(self, peer: str) -> None:
        """Deliver the newest message for `peer`; the protocol re-sends what gets lost."""
        while True:
            await self._outbox_ready[peer].wait()
            self._outbox_ready[peer] = trio.Event()
            message = self._outbox.pop(peer, None)
            record = self._membership.peers.get(peer)
            if message is None or record is None or not record.alive or record.stub is None:
                continue
            try:
                await self._bridge.run(_propose, record.stub, message_to_proto(message))
            except Exception as exc:  # the protocol retransmits; liveness handles dead peers
                log.debug("proposal to %s not delivered: %s", peer, exc)

    # ------------------------------------------------------------ status

    def plan_for(self, proposal: ag.Proposal) -> partitioner.Plan | None:
        """The full partitioner plan behind a proposal (recomputed if not cached here)."""
        outcome = proposal.outcome
        if not isinstance(outcome, ag.Plan):
            return None
        plan = self.plans.get(outcome.plan_id)
        if plan is None:
            log.warning("plan %s was not cached; recomputing it", outcome.plan_id[:12])
            self._compute_plan(proposal.inputs)
            plan = self.plans.get(outcome.plan_id)
        return plan

    def peers_moved_on(self) -> bool:
        """Every live peer serves new requests on a plan without a stage here (leaving)."""
        return self.core.peers_moved_on()

    def states_of(self, proposal: ag.Proposal) -> dict[str, pb.NodeState]:
        """The node states a proposal's plan was computed from (those still cached here)."""
        inputs = proposal.inputs
        pairs = zip(inputs.members, inputs.digests, strict=True)
        return {node: self._states[(node, d)] for node, d in pairs if (node, d) in self._states}

    def peers_ready_without(self, loaded: Callable[[str], tuple[str, ...]]) -> bool:
        """Every live peer serves new requests on a plan without a stage here, and every stage
        member of that plan has loaded it (``loaded(node)``: the plans a node says it has
        loaded): a leaving node's requests then move with no wait for a load."""
        if not self.core.peers_moved_on():
            return False
        for plan in self.core.peers_active().values():
            if plan is None:
                continue
            for member in plan.stage_members:
                if plan.plan_id not in loaded(member):
                    return False
        return True

    def release(self, plan_id: str) -> None:
        """A draining plan has no request left here: stop serving it."""
        self._apply(self.core.release_draining(plan_id))

    def served(self) -> ServedPlans:
        """The plans this node serves now (`meshd.agreement.contract.PlanSource`)."""
        core = self.core
        active = core.active.plan_id if core.active is not None else ""
        return ServedPlans(active, tuple(served.plan_id for served in core.draining))

    def status_message(self) -> pb.AgreementStatus:
        """The agreement's status as `meshd status` and the status app show it."""
        status = self.core.status(time.monotonic())
        out = pb.AgreementStatus(
            model=self._selection.name if self._selection else "",
            confirmed_by=sorted(status.confirmed_by),
            committed_by=sorted(status.committed_by),
            draining=[served.plan_id for served in status.draining],
            reason=status.reason,
            converged=status.converged,
        )
        if status.active is not None:
            out.active_plan_id = status.active.plan_id
            out.members.extend(status.active.members)
            plan = self.plan_for(status.active.proposal)
            if plan is not None:
                out.plan_json = json.dumps(plan.to_dict())
        if status.proposal is not None:
            if isinstance(status.proposal.outcome, ag.Plan):
                out.proposal_plan_id = status.proposal.outcome.plan_id
            else:
                out.refusal = status.proposal.outcome.reason
        return out


async def _propose(stub: rpc.PeerStub, message: pb.ProposalMessage) -> None:
    await stub.Propose(message, timeout=PROPOSE_TIMEOUT_S)
