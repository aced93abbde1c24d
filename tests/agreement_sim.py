"""Deterministic simulation of the agreement protocol (`meshd.agreement.protocol`), without sockets.

Why: the protocol's promises (no two nodes serve different plans under one plan id, nothing is
served that a member never confirmed, stable networks converge in bounded time) must hold
under every interleaving, and only a seeded simulation can explore thousands of interleavings
in seconds and replay a failing one exactly.

The world: a seeded discrete-event scheduler drives `AgreementNode`s. Messages get a random
delay (so they reorder), are dropped (at most `max_consecutive_drops` in a row per directed
link, the fair-lossy assumption A5) and duplicated. Nodes crash, restart (with a new
incarnation) and join; the network splits into groups and heals; profiles and the model
change. A liveness oracle plays the daemon's gRPC heartbeats: each node notices each change
of another node's reachability after its own random detection delay (so views are asymmetric
during transitions), and fetches the peer's profile digest after another delay.

`compute_plan` is a stand-in with the real partitioner's contract: a refusal
"not enough memory in this mesh for <model>: need X GB, have Y GB" when the members' memory
is short of the model, else a plan whose id is a hash of its layout (the model and the
members holding stages), keeping the incumbent while it still holds the model unless the
fresh layout is materially better (here: needs fewer holders).

Safety is checked at every event (`SafetyViolation`); liveness with `convergence_problems`
once the world is stable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from meshd.agreement.messages import (
    AgreementConfig,
    Broadcast,
    Committed,
    ComputePlan,
    ModelRef,
    Output,
    Plan,
    PlanInputs,
    PlanOutcome,
    Proposal,
    ProposalMessage,
    Refusal,
    Refused,
    Send,
    Withdrawn,
)
from meshd.agreement.protocol import AgreementNode


class SafetyViolation(AssertionError):
    """The protocol broke one of its safety properties (S1-S4 in meshd.agreement.protocol)."""


def make_compute_plan(
    memory_by_digest: Mapping[str, float], model_sizes: Mapping[ModelRef, float]
) -> ComputePlan:
    """A deterministic stand-in for `partitioner.plan_model`: memory in, plan or refusal out.

    It reads profiles by digest from `memory_by_digest`, as the daemon reads fetched profiles.
    The plan id is a function of the layout only (the real planner's `layout_plan_id`), and an
    incumbent whose holders are members and still hold the model is kept unless the fresh
    layout needs fewer holders (the stand-in's "materially faster").
    """

    def layout_plan(model: ModelRef, holders: Iterable[str]) -> Plan:
        stages = tuple(sorted(holders))
        layout = ",".join(stages)
        plan_id = hashlib.sha256(repr((model, layout)).encode()).hexdigest()[:12]
        return Plan(plan_id, stages, layout)

    def compute_plan(inputs: PlanInputs) -> PlanOutcome:
        memory = {
            m: memory_by_digest[d] for m, d in zip(inputs.members, inputs.digests, strict=True)
        }
        need, have = model_sizes[inputs.model], sum(memory.values())
        if have < need:
            return Refusal(
                f"not enough memory in this mesh for {inputs.model.name}: "
                f"need {need:g} GB, have {have:g} GB"
            )
        holders: list[str] = []
        for member in sorted(memory, key=lambda m: (-memory[m], m)):
            if sum(memory[h] for h in holders) >= need:
                break
            holders.append(member)
        fresh = layout_plan(inputs.model, holders)
        incumbent = inputs.incumbent
        if incumbent is not None and set(incumbent.stage_members) <= set(memory):
            still_holds = sum(memory[h] for h in incumbent.stage_members) >= need
            same_model = layout_plan(inputs.model, incumbent.stage_members) == incumbent
            better = len(fresh.stage_members) < len(incumbent.stage_members)
            if still_holds and same_model and not better:
                return incumbent
        return fresh

    return compute_plan


@dataclass(frozen=True)
class NetworkFaults:
    """How hostile the simulated network and liveness layer are (seconds, probabilities)."""

    min_delay_s: float = 0.001
    max_delay_s: float = 0.05
    drop_rate: float = 0.0
    max_consecutive_drops: int = 2
    duplicate_rate: float = 0.0
    min_detect_s: float = 0.01
    max_detect_s: float = 0.3


@dataclass
class SimNode:
    """The simulator's record of one machine: ground truth plus what its daemon knows."""

    node_id: str
    memory_gb: float
    profile_version: int = 0
    up: bool = False
    incarnation: int = 0
    agent: AgreementNode | None = None
    seen: dict[str, tuple[float, int]] = field(default_factory=dict)
    known_digests: dict[str, str] = field(default_factory=dict)
    known_model: ModelRef | None = None
    known_leaving: set[str] = field(default_factory=set)
    leaving: bool = False
    committed_ids: set[str] = field(default_factory=set)

    @property
    def digest(self) -> str:
        return f"{self.node_id}/v{self.profile_version}"


@dataclass(frozen=True)
class Record:
    """One protocol output the simulator saw, for assertions (commits, withdrawals...)."""

    time: float
    node_id: str
    kind: str
    detail: str


class Simulation:
    """A seeded world of agreement nodes; every run with the same seed is identical."""

    def __init__(
        self,
        seed: int,
        config: AgreementConfig,
        faults: NetworkFaults | None = None,
        tick_s: float = 0.1,
        model_sizes: Mapping[ModelRef, float] | None = None,
        node_class: type[AgreementNode] = AgreementNode,
    ) -> None:
        self.rng = random.Random(seed)
        self.config = config
        self.faults = faults or NetworkFaults()
        self.tick_s = tick_s
        self.node_class = node_class
        self.now = 0.0
        self.nodes: dict[str, SimNode] = {}
        self.groups: dict[str, int] = {}
        self.memory_by_digest: dict[str, float] = {}
        self.model_sizes: dict[ModelRef, float] = dict(model_sizes or {})
        self.model: ModelRef | None = next(iter(self.model_sizes), None)
        self.compute_plan = make_compute_plan(self.memory_by_digest, self.model_sizes)
        self.records: list[Record] = []
        self.messages_sent = 0
        self._plans_by_id: dict[str, Plan] = {}
        self._proposed: set[tuple[str, Proposal]] = set()
        self._consecutive_drops: dict[tuple[str, str], int] = {}
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    # ------------------------------------------------------------ scheduling

    def at(self, time: float, action: Callable[[], None]) -> None:
        """Run `action` at simulated `time` (ties run in scheduling order)."""
        heapq.heappush(self._queue, (max(time, self.now), next(self._order), action))

    def run_until(self, time: float) -> None:
        while self._queue and self._queue[0][0] <= time:
            self.now, _, action = heapq.heappop(self._queue)
            action()
        self.now = time

    # ------------------------------------------------------------ world changes

    def add_node(self, node_id: str, memory_gb: float) -> None:
        """A machine that exists (not started); call `start` to boot it."""
        node = SimNode(node_id, memory_gb)
        self.nodes[node_id] = node
        self.groups[node_id] = 0
        self.memory_by_digest[node.digest] = memory_gb

    def start(self, node_id: str) -> None:
        """Boot (or reboot) a machine: a fresh daemon with a new incarnation."""
        node = self.nodes[node_id]
        if node.up:
            return
        node.up = True
        node.leaving = False
        node.incarnation += 1
        node.seen = {}
        node.known_leaving = set()
        node.known_digests = {node_id: node.digest}
        node.known_model = self.model
        node.agent = self.node_class(
            node_id, node.incarnation, self.compute_plan, self.now, self.config
        )
        self._observe_all_pairs_with(node_id)
        self._feed_view(node)
        phase = self.rng.uniform(0, self.tick_s)
        self.at(self.now + phase, lambda: self._tick(node_id, node.incarnation))

    def crash(self, node_id: str) -> None:
        """The machine dies silently; its peers notice after their detection delay."""
        node = self.nodes[node_id]
        node.up = False
        node.agent = None
        self._observe_all_pairs_with(node_id)

    def leave(self, node_id: str) -> None:
        """The daemon announces it is leaving (a graceful stop); peers hear it after a delay."""
        node = self.nodes[node_id]
        if not node.up:
            return
        node.leaving = True
        node.known_leaving.add(node_id)
        self._feed_view(node)
        for other in self.nodes:
            if other != node_id:
                self.at(self.now + self._detect_delay(), self._learn_leaving_action(other, node_id))

    def _learn_leaving_action(self, observer_id: str, target_id: str) -> Callable[[], None]:
        def learn() -> None:
            observer, target = self.nodes[observer_id], self.nodes[target_id]
            if not observer.up or not self.connected(observer_id, target_id) or not target.leaving:
                return
            if target_id not in observer.known_leaving:
                observer.known_leaving.add(target_id)
                self._feed_view(observer)

        return learn

    def partition(self, *sides: Iterable[str]) -> None:
        """Split the network: nodes reach only nodes on their own side."""
        for index, side in enumerate(sides):
            for node_id in side:
                self.groups[node_id] = index
        self._observe_all_pairs()

    def heal(self) -> None:
        """Every node reaches every other node again."""
        for node_id in self.groups:
            self.groups[node_id] = 0
        self._observe_all_pairs()

    def change_profile(self, node_id: str, memory_gb: float) -> None:
        """The machine's measured profile changes; peers fetch the new digest after a delay."""
        node = self.nodes[node_id]
        node.memory_gb = memory_gb
        node.profile_version += 1
        self.memory_by_digest[node.digest] = memory_gb
        if node.up:
            node.known_digests[node_id] = node.digest
            self._feed_view(node)
        for other in self.nodes:
            if other != node_id:
                self.at(self.now + self._detect_delay(), self._learn_digest_action(other, node_id))

    def select_model(self, model: ModelRef) -> None:
        """The user selects another model; each daemon hears of it after a delay."""
        self.model = model
        for node_id in self.nodes:
            self.at(self.now + self._detect_delay(), self._learn_model_action(node_id))

    def connected(self, a: str, b: str) -> bool:
        nodes = self.nodes
        return nodes[a].up and nodes[b].up and self.groups[a] == self.groups[b]

    # ------------------------------------------------------------ liveness oracle

    def _detect_delay(self) -> float:
        return self.rng.uniform(self.faults.min_detect_s, self.faults.max_detect_s)

    def _observe_all_pairs(self) -> None:
        for node_id in self.nodes:
            self._observe_all_pairs_with(node_id)

    def _observe_all_pairs_with(self, node_id: str) -> None:
        for other in self.nodes:
            if other != node_id:
                self.at(self.now + self._detect_delay(), self._observe_action(node_id, other))
                self.at(self.now + self._detect_delay(), self._observe_action(other, node_id))

    def _observe_action(self, observer: str, target: str) -> Callable[[], None]:
        return lambda: self._observe(observer, target)

    def _observe(self, observer_id: str, target_id: str) -> None:
        """`observer`'s heartbeats catch up with the truth about `target`."""
        observer, target = self.nodes[observer_id], self.nodes[target_id]
        if not observer.up:
            return
        seen = observer.seen.get(target_id)
        changed = False
        if self.connected(observer_id, target_id):
            if seen is None or seen[1] != target.incarnation:
                observer.seen[target_id] = (self.now, target.incarnation)
                observer.known_leaving.discard(target_id)
                changed = True
            if target.leaving and target_id not in observer.known_leaving:
                delay = self._detect_delay()
                self.at(self.now + delay, self._learn_leaving_action(observer_id, target_id))
            if observer.known_digests.get(target_id) != target.digest:
                delay = self._detect_delay()
                self.at(self.now + delay, self._learn_digest_action(observer_id, target_id))
        elif seen is not None:
            del observer.seen[target_id]
            changed = True
        if changed:
            self._feed_view(observer)

    def _learn_digest_action(self, observer_id: str, target_id: str) -> Callable[[], None]:
        def learn() -> None:
            observer, target = self.nodes[observer_id], self.nodes[target_id]
            if not self.connected(observer_id, target_id):
                return
            if observer.known_digests.get(target_id) != target.digest:
                observer.known_digests[target_id] = target.digest
                self._feed_view(observer)

        return learn

    def _learn_model_action(self, node_id: str) -> Callable[[], None]:
        def learn() -> None:
            node = self.nodes[node_id]
            if node.up and node.known_model != self.model:
                node.known_model = self.model
                self._feed_view(node)

        return learn

    def _feed_view(self, node: SimNode) -> None:
        assert node.agent is not None
        alive = {peer: since for peer, (since, _) in node.seen.items()}
        digests = {
            peer: digest
            for peer, digest in node.known_digests.items()
            if peer == node.node_id or peer in alive
        }
        leaving = {n for n in node.known_leaving if n == node.node_id or n in alive}
        outputs = node.agent.on_membership(
            self.now, alive, digests, node.known_model, leaving=leaving
        )
        self._handle(node, outputs)

    # ------------------------------------------------------------ ticks and messages

    def _tick(self, node_id: str, incarnation: int) -> None:
        node = self.nodes[node_id]
        if not node.up or node.incarnation != incarnation or node.agent is None:
            return
        self._handle(node, node.agent.on_tick(self.now))
        self.at(self.now + self.tick_s, lambda: self._tick(node_id, incarnation))

    def _transmit(self, sender: str, recipient: str, message: ProposalMessage) -> None:
        self.messages_sent += 1
        if not self.connected(sender, recipient):
            return
        link = (sender, recipient)
        drops = self._consecutive_drops.get(link, 0)
        if drops < self.faults.max_consecutive_drops and self.rng.random() < self.faults.drop_rate:
            self._consecutive_drops[link] = drops + 1
            return
        self._consecutive_drops[link] = 0
        copies = 2 if self.rng.random() < self.faults.duplicate_rate else 1
        incarnation = self.nodes[recipient].incarnation
        for _ in range(copies):
            delay = self.rng.uniform(self.faults.min_delay_s, self.faults.max_delay_s)
            self.at(self.now + delay, self._deliver_action(recipient, incarnation, message))

    def _deliver_action(
        self, recipient: str, incarnation: int, message: ProposalMessage
    ) -> Callable[[], None]:
        def deliver() -> None:
            node = self.nodes[recipient]
            if node.incarnation != incarnation or not self.connected(message.sender, recipient):
                return
            assert node.agent is not None
            self._handle(node, node.agent.on_message(self.now, message))

        return deliver

    # ------------------------------------------------------------ outputs and safety

    def _handle(self, node: SimNode, outputs: list[Output]) -> None:
        for output in outputs:
            if isinstance(output, Broadcast | Send):
                self._send(node, output)
            elif isinstance(output, Committed):
                self._check_commit(node, output)
            elif isinstance(output, Withdrawn):
                self._record(node, "withdrawn", f"{output.plan_id}: {output.reason}")
            elif isinstance(output, Refused):
                self._record(node, "refused", output.reason)
        self._check_serving(node)

    def _send(self, node: SimNode, output: Broadcast | Send) -> None:
        message = output.message
        if message.sender != node.node_id:
            raise SafetyViolation(f"{node.node_id} sent a message signed by {message.sender}")
        if message.proposal is not None:
            self._proposed.add((node.node_id, message.proposal))
        recipients = output.recipients if isinstance(output, Broadcast) else (output.to,)
        for recipient in sorted(recipients):  # sorted: a seed replays in any process
            self._transmit(node.node_id, recipient, message)

    def _record(self, node: SimNode, kind: str, detail: str) -> None:
        self.records.append(Record(self.now, node.node_id, kind, detail))

    def _check_commit(self, node: SimNode, committed: Committed) -> None:
        proposal, plan_id = committed.proposal, committed.plan_id
        plan = proposal.plan
        assert plan is not None
        known = self._plans_by_id.setdefault(plan_id, plan)
        if known != plan:  # S2: one layout per plan id, whatever inputs chose it
            raise SafetyViolation(
                f"t={self.now:.3f}: {node.node_id} committed plan id {plan_id} as {plan}, "
                f"but it was committed elsewhere as {known}"
            )
        for member in proposal.members:
            if (member, proposal) not in self._proposed:
                raise SafetyViolation(
                    f"t={self.now:.3f}: {node.node_id} committed {plan_id} "
                    f"which member {member} never proposed"
                )
        assert node.agent is not None
        if node.agent.proposal != proposal:
            raise SafetyViolation(f"{node.node_id} committed {plan_id}, not its own proposal")
        node.committed_ids.add(plan_id)
        self._record(node, "committed" if committed.changed else "recommitted", plan_id)

    def _check_serving(self, node: SimNode) -> None:
        """S3/S4: a node serves only plans it committed, whose stage members it sees alive."""
        agent = node.agent
        if agent is None:
            return
        served = [agent.active] if agent.active is not None else []
        served += agent.draining
        for plan in served:
            if plan.plan_id not in node.committed_ids:
                raise SafetyViolation(f"{node.node_id} serves {plan.plan_id} it never committed")
            for member in plan.plan.stage_members:
                if member != node.node_id and member not in node.seen:
                    raise SafetyViolation(
                        f"t={self.now:.3f}: {node.node_id} serves {plan.plan_id} "
                        f"although member {member} is lost"
                    )

    # ------------------------------------------------------------ liveness

    def reachable_groups(self) -> list[tuple[str, ...]]:
        """The sets of up nodes that reach each other (the partition's sides)."""
        sides: dict[int, list[str]] = {}
        for node_id, node in sorted(self.nodes.items()):
            if node.up:
                sides.setdefault(self.groups[node_id], []).append(node_id)
        return [tuple(side) for side in sides.values()]

    def expected_inputs(self, side: tuple[str, ...]) -> PlanInputs:
        """The inputs every node of `side` should settle on, from the ground truth (the
        incumbent is whatever the side runs: it takes no part in comparing inputs)."""
        assert self.model is not None
        members = tuple(m for m in side if not self.nodes[m].leaving)
        digests = tuple(self.nodes[m].digest for m in members)
        return PlanInputs(members, digests, self.model)

    def convergence_problems(self) -> list[str]:
        """Empty when every side serves one stable plan (or refuses), else what is off.

        Stable: all nodes of the side make the same proposal, from the true inputs, and have
        committed it; a plan is its own incumbent's outcome (nothing more would change).
        """
        problems = []
        for side in self.reachable_groups():
            truth = self.expected_inputs(side)
            refusal = self.compute_plan(truth)
            proposals = set()
            for node_id in side:
                agent = self.nodes[node_id].agent
                assert agent is not None
                if self.nodes[node_id].leaving:
                    continue
                proposals.add(agent.proposal)
                problem = _node_problem(agent, truth, refusal, self.compute_plan)
                if problem:
                    reason = agent.status(self.now).reason
                    problems.append(f"{node_id}: {problem}; status: {reason}")
            if len(proposals) > 1:
                problems.append(f"side {side} holds {len(proposals)} different proposals")
        return problems

    def liveness_bound_s(self) -> float:
        """Time after the last change within which stable sides must have converged.

        Views settle after two detection delays (notice, then fetch the digest), the join
        stability and a tick; then each of a link's k+1 consecutive messages (a retransmission
        and the certificate answering it: two per round) gets through within 2(k+1) periods.
        """
        faults, config = self.faults, self.config
        views_settle = 3 * faults.max_detect_s + config.join_stability_s + self.tick_s
        period = config.retransmit_interval_s + self.tick_s + faults.max_delay_s
        return views_settle + 2 * (faults.max_consecutive_drops + 1) * period + self.tick_s

    def commits_since(self, time: float) -> list[Record]:
        """Commits that changed a node's plan id (re-confirmations of the same layout not)."""
        return [r for r in self.records if r.kind == "committed" and r.time >= time]

    def recommits_since(self, time: float) -> list[Record]:
        """Commits of a proposal whose plan id was the node's active one already."""
        return [r for r in self.records if r.kind == "recommitted" and r.time >= time]


def _node_problem(
    agent: AgreementNode, truth: PlanInputs, fresh: PlanOutcome, compute_plan: ComputePlan
) -> str:
    """What keeps `agent` from having converged ("" when it has)."""
    proposal = agent.proposal
    if proposal is None or proposal.inputs != truth:
        return f"proposes {proposal}, expected a proposal from {truth}"
    if isinstance(fresh, Refusal):
        if proposal.outcome != fresh:
            return f"proposes {proposal.outcome}, expected the refusal {fresh}"
        return "" if agent.active is None else f"refuses but still serves {agent.active.plan_id}"
    plan = proposal.plan
    if plan is None:
        return f"refuses ({proposal.outcome}) although the side holds the model"
    settled = dataclasses.replace(proposal.inputs, incumbent=plan)
    if compute_plan(settled) != plan:
        return f"its plan {plan.plan_id} would not keep itself as the incumbent"
    if agent.active is None or agent.active.proposal != proposal:
        return "has not committed its proposal"
    return ""


@dataclass(frozen=True)
class RunResult:
    """What a random run measured: when the world became stable and when it converged."""

    seed: int
    stable_at: float
    converged_after_s: float | None
    commits_after_convergence: int
    problems: tuple[str, ...]
    bound_s: float
    counts: tuple[tuple[str, int], ...]


SMALL_MODEL = ModelRef("small-model", "sha-small")
LARGE_MODEL = ModelRef("large-model", "sha-large")
FLAP_MAX_DOWN_S = 0.5


def random_run(
    seed: int,
    config: AgreementConfig,
    faults: NetworkFaults,
    node_class: type[AgreementNode] = AgreementNode,
) -> RunResult:
    """One seeded run: chaos for a while, then a stable world; measure convergence.

    Raises `SafetyViolation` as soon as a safety property breaks.
    """
    rng = random.Random(seed)
    initial = rng.randint(2, 6)
    names = [f"n{i}" for i in range(1, initial + 3)]
    memory = {name: float(rng.choice([4, 8, 16])) for name in names}
    total = sum(memory[name] for name in names[:initial])
    sizes = {SMALL_MODEL: round(total * rng.uniform(0.2, 0.6)), LARGE_MODEL: round(total * 0.9)}
    sim = Simulation(seed, config, faults, model_sizes=sizes, node_class=node_class)
    for name in names:
        sim.add_node(name, memory[name])
    for name in names[:initial]:
        sim.at(rng.uniform(0, 0.3), _action(sim.start, name))
    chaos_s = rng.uniform(1.0, 10.0)
    for _ in range(rng.randint(0, 12)):
        sim.at(rng.uniform(0.3, chaos_s), _random_fault(sim, rng, names))
    stable_at = chaos_s + FLAP_MAX_DOWN_S
    sim.at(stable_at, _stabilize(sim, rng, names))
    sim.run_until(stable_at)
    return _measure_convergence(sim, seed, stable_at)


def _action(function: Callable[[str], None], name: str) -> Callable[[], None]:
    return lambda: function(name)


def _random_fault(sim: Simulation, rng: random.Random, names: list[str]) -> Callable[[], None]:
    kind = rng.choice(
        ["crash", "restart", "split", "heal", "profile", "noise", "model", "flap", "join", "leave"]
    )
    name = rng.choice(names)

    def fault() -> None:
        if kind == "crash":
            sim.crash(name)
        elif kind in ("restart", "join"):
            sim.start(name)
        elif kind == "split":
            shuffled = rng.sample(names, len(names))
            cut = rng.randint(1, len(names) - 1)
            sim.partition(shuffled[:cut], shuffled[cut:])
        elif kind == "heal":
            sim.heal()
        elif kind == "profile":
            sim.change_profile(name, float(rng.choice([4, 8, 16])))
        elif kind == "noise":  # a new digest for the same machine: link buckets moved
            sim.change_profile(name, sim.nodes[name].memory_gb)
        elif kind == "leave":  # a graceful stop: announce, then exit a moment later
            sim.leave(name)
            sim.at(sim.now + rng.uniform(0.1, 0.45), _action(sim.crash, name))
        elif kind == "model":
            sim.select_model(rng.choice([SMALL_MODEL, LARGE_MODEL]))
        else:
            sim.crash(name)
            sim.at(sim.now + rng.uniform(0.05, FLAP_MAX_DOWN_S), _action(sim.start, name))

    return fault


def _stabilize(sim: Simulation, rng: random.Random, names: list[str]) -> Callable[[], None]:
    """The last change: maybe heal, maybe bring crashed machines back; then nothing moves."""

    def stabilize() -> None:
        if rng.random() < 0.6:
            sim.heal()
        for name in names:
            if sim.nodes[name].incarnation > 0 and not sim.nodes[name].up and rng.random() < 0.5:
                sim.start(name)

    return stabilize


def _measure_convergence(sim: Simulation, seed: int, stable_at: float) -> RunResult:
    """Poll every tick until the bound; converged means all sides settled and stayed so."""
    deadline = stable_at + sim.liveness_bound_s()
    converged_at = None
    time = stable_at
    while time < deadline:
        time = min(time + sim.tick_s, deadline)
        sim.run_until(time)
        if converged_at is None and not sim.convergence_problems():
            converged_at = time
    sim.run_until(deadline + sim.config.retransmit_interval_s * 4)
    problems = tuple(sim.convergence_problems())
    after = 0
    if converged_at is not None:
        since = converged_at + 1e-9
        after = len(sim.commits_since(since)) + len(sim.recommits_since(since))
    kinds = Counter(record.kind for record in sim.records)
    kinds["messages"] = sim.messages_sent
    return RunResult(
        seed=seed,
        stable_at=stable_at,
        converged_after_s=None if converged_at is None else converged_at - stable_at,
        commits_after_convergence=after,
        problems=problems,
        bound_s=sim.liveness_bound_s(),
        counts=tuple(sorted(kinds.items())),
    )


def scaled_run(
    seed: int,
    nodes: int,
    config: AgreementConfig,
    faults: NetworkFaults,
    *,
    churn_events: int = 8,
    chaos_s: float = 4.0,
) -> RunResult:
    """A mesh of `nodes` machines starting together, then churn, then a stable world.

    The churn is what a large mesh sees: crashes, restarts, flapping links, graceful leaves,
    re-measured profiles and late joiners (a tenth more machines than start), spread over
    `chaos_s`. The model needs about a third of the starting machines' memory, so plans span
    many nodes and every churn event touches a holder with some probability.
    """
    rng = random.Random(seed)
    spare = max(1, nodes // 10)
    names = [f"n{i}" for i in range(1, nodes + spare + 1)]
    memory = {name: float(rng.choice([4, 8, 16])) for name in names}
    total = sum(memory[name] for name in names[:nodes])
    sizes = {SMALL_MODEL: round(total * 0.33), LARGE_MODEL: round(total * 0.9)}
    sim = Simulation(seed, config, faults, model_sizes=sizes)
    for name in names:
        sim.add_node(name, memory[name])
    for name in names[:nodes]:
        sim.at(rng.uniform(0, 0.3), _action(sim.start, name))
    kinds = ("crash", "restart", "flap", "leave", "noise", "profile", "join")
    for _ in range(churn_events):
        sim.at(rng.uniform(0.5, chaos_s), _churn(sim, rng, names, nodes, rng.choice(kinds)))
    stable_at = chaos_s + FLAP_MAX_DOWN_S
    sim.at(stable_at, _stabilize(sim, rng, names))
    sim.run_until(stable_at)
    return _measure_convergence(sim, seed, stable_at)


def _churn(
    sim: Simulation, rng: random.Random, names: list[str], starting: int, kind: str
) -> Callable[[], None]:
    """One churn event of `kind` on a machine picked when it fires."""

    def event() -> None:
        if kind == "join":
            sim.start(rng.choice(names[starting:]))
            return
        name = rng.choice(names[:starting])
        if kind == "crash":
            sim.crash(name)
        elif kind == "restart":
            sim.start(name)
        elif kind == "flap":
            sim.crash(name)
            sim.at(sim.now + rng.uniform(0.05, FLAP_MAX_DOWN_S), _action(sim.start, name))
        elif kind == "leave":
            sim.leave(name)
            sim.at(sim.now + rng.uniform(0.1, 0.45), _action(sim.crash, name))
        elif kind == "noise":
            sim.change_profile(name, sim.nodes[name].memory_gb)
        else:
            sim.change_profile(name, float(rng.choice([4, 8, 16])))

    return event
