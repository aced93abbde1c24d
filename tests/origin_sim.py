"""Deterministic simulation of the origin core (`meshd.inference.origin.core`), without sockets.

Why: the origin's promise (a request completes with exactly the tokens an undisturbed run gives,
or fails in bounded time with a reason; it never waits out a timeout for an event that cannot
come) must hold under every interleaving of faults, and only a seeded simulation explores
thousands of them in seconds and replays a failing one exactly.

The world: one origin node ``o`` (no stage) and stage nodes; plans are ordered tuples of nodes.
A seeded discrete-event scheduler drives one request's :class:`OriginCore` and carries its
decisions out: a Connect opens (or is refused: a dead node answers at once, a cut one after
the link timeout), a Start runs the attempt on its plan's simulated stages, which give one
token per step (``token_of``: a deterministic function of the position, as a greedy or seeded
model is of its prefix, so a replay gives the same continuation), an End stops them (a late
token may still come). Faults, each at a random time:

* ``kill``: a stage node dies; links to it break at once; the liveness layer withdraws its
  plans after a delay and, maybe, commits a plan without it (it loads, then is ready).
* ``cut``: a stage node's link goes silent: frames are lost, connects time out; the liveness
  layer notices after a delay, as for a kill.
* ``lane_reset``: one connection of the attempt's path breaks; every node stays a member and
  the plan stays (the transport reconnects at the next send). The stages drop the request:
  the origin hears it as a lost link (its own) or an UNREACHABLE failure (between stages).
* ``leave``: a node leaves gracefully: a plan without it commits; the old plan serves on until
  it is handed over (its stages answer FENCED, then it is withdrawn).
* ``replan``: another plan commits mid-request; the old one drains, then is withdrawn.
* ``slow``: a stage computes slowly for a while.
* ``dup``: token frames are duplicated, and ended attempts send late ones.

The oracle (:func:`check`): when the world keeps or regains a served plan, the request must
complete with the reference tokens within ``SETTLE_BOUND_S`` of the world's last change; when
the world ends without a plan, it must fail with a reason within the resume timeout (and a
little) of losing it.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from meshd.inference.errors import ErrorKind
from meshd.inference.origin.core import (
    Connect,
    Deliver,
    DroppedCandidate,
    Failed,
    FeedToken,
    Finished,
    Moving,
    OriginCore,
    PlanRef,
    PlanState,
    PlanView,
    Report,
    Resumed,
    SendEnd,
    SendStart,
    Timeouts,
)
from meshd.inference.stage_events import FailureKind, Finish

ORIGIN = "o"
STAGE_NODES = ("a", "b", "c", "d")
LINK_TIMEOUT_S = 5.0
SETTLE_BOUND_S = 20.0  # a healed world: the request ends within this of its last change
FAULTS = ("kill", "cut", "lane_reset", "leave", "replan", "slow", "dup")


class OriginViolation(AssertionError):
    """The origin broke its promise; the message says how, with the seed to replay it."""


def token_of(index: int) -> int:
    """The model: the token at a position is fixed by the prefix (here: by the position)."""
    return (index * 7919 + 13) % 50_000


@dataclass(eq=False)
class Run:
    """An attempt running on the simulated stages."""

    number: int
    plan: PlanRef
    next_index: int
    alive: bool = True


@dataclass
class World:
    """What the liveness layer and the agreement decided, as the origin sees it."""

    active: PlanRef | None
    state: PlanState = PlanState.READY
    installed: set[str] = field(default_factory=set)  # plans the stages still serve
    dead: set[str] = field(default_factory=set)
    cut: set[str] = field(default_factory=set)
    slow: dict[str, float] = field(default_factory=dict)  # node -> factor
    no_plan_since: float | None = None  # the world ends without a plan from then on
    last_change: float = 0.0
    plan_ids: Callable[[], int] = field(default_factory=lambda: itertools.count(2).__next__)

    def view(self) -> PlanView:
        return PlanView(active=self.active, state=self.state)


class OriginSim:
    """One request under one seeded fault schedule."""

    def __init__(self, seed: int, *, faults: tuple[str, ...] = FAULTS, n_faults: int = 0) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        rng = self.rng
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.max_tokens = rng.randint(6, 40)
        self.hop_s = rng.uniform(0.0005, 0.005)
        self.timeouts = Timeouts(first_token_s=300.0, token_s=60.0, resume_s=60.0)
        plan = PlanRef("p1", ("a", "b", "c"))
        self.world = World(active=plan, installed={"p1"})
        self.plans: dict[str, PlanRef] = {"p1": plan}  # every plan committed, by id
        self.core = OriginCore("r", plan, 0.0, timeouts=self.timeouts, resume=True)
        self.runs: dict[int, Run] = {}
        self.delivered: list[int] = []
        self.outcome: Finished | Failed | None = None
        self.ended_at: float | None = None
        self.log: list[str] = []
        self.dup_p = 0.0
        self._tick_at = float("inf")
        count = n_faults or rng.randint(1, 3)
        for _ in range(count):
            kind = rng.choice(faults)
            self.at(rng.uniform(0.0, self.max_tokens * self.hop_s * 6), self._fault(kind))

    # ------------------------------------------------------------ scheduler

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (max(when, self.now), next(self._seq), action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.now + delay, action)

    def run(self, limit_s: float = 2_000.0) -> None:
        self.apply(self.core.begin())
        steps = 0
        while self._queue and self.outcome is None:
            when, _, action = heapq.heappop(self._queue)
            if when > limit_s:
                break
            self.now = when
            action()
            steps += 1
            if steps > 200_000:
                raise OriginViolation(f"seed {self.seed}: the simulation does not end")
            self._schedule_tick()

    def _schedule_tick(self) -> None:
        if self.outcome is not None:
            return
        wake = self.core.wake_at(self.now)
        if wake < self._tick_at or self._tick_at <= self.now:
            self._tick_at = wake
            self.at(wake, self._tick)

    def _tick(self) -> None:
        if self.now < self._tick_at:
            return  # a tick that a nearer one replaced
        self._tick_at = float("inf")
        self.apply(self.core.on_tick(self.now, self.world.view()))

    def _view_changed(self) -> None:
        """The origin polls the plans; a change is seen within a poll."""
        self.world.last_change = self.now
        self.after(self.core.poll_s if self.core.poll_s < 1 else 0.1, self._tick_now)

    def _tick_now(self) -> None:
        self.apply(self.core.on_tick(self.now, self.world.view()))

    # ------------------------------------------------------------ decisions

    def apply(self, decisions: tuple[object, ...]) -> None:
        for decision in decisions:
            if isinstance(decision, Deliver):
                continue  # taken in _token, where the index is known
            if isinstance(decision, Connect):
                self._connect(decision.attempt.number, decision.attempt.plan)
            elif isinstance(decision, SendStart):
                attempt = decision.attempt
                start = attempt.from_tokens
                run = Run(attempt.number, attempt.plan, start)
                self.runs[attempt.number] = run
                self._start(run)
            elif isinstance(decision, SendEnd):
                run = self.runs.pop(decision.attempt.number, None)
                if run is not None and run.alive and self.rng.random() < self.dup_p:
                    index = run.next_index
                    self.after(self.hop_s, lambda n=run.number, i=index: self._token(n, i))
                if run is not None:
                    run.alive = False
            elif isinstance(decision, Finished | Failed):
                self.outcome = decision
                self.ended_at = self.now
            elif isinstance(decision, Moving | Resumed | Report | DroppedCandidate):
                self.log.append(f"{self.now:.3f} {decision}")
            elif isinstance(decision, FeedToken):
                pass  # the values are the model's anyway; only the pace would change

    def _connect(self, number: int, plan: PlanRef) -> None:
        world = self.world
        if any(node in world.cut for node in plan.nodes):
            error = f"stage unreachable: no answer within {LINK_TIMEOUT_S:g} s"
            self.after(LINK_TIMEOUT_S, lambda: self._connected(number, error))
        elif any(node in world.dead for node in plan.nodes):
            error = "stage unreachable: connection refused"
            self.after(0.002, lambda: self._connected(number, error))
        else:
            self.after(self.rng.uniform(0.0005, 0.01), lambda: self._connected(number, None))

    def _connected(self, number: int, error: str | None) -> None:
        self.apply(self.core.on_connected(number, error, self.now))

    def _start(self, run: Run) -> None:
        if run.plan.plan_id not in self.world.installed:
            self.after(self.hop_s, lambda: self._failure(run, FailureKind.FENCED, "not here"))
            return
        prefill = self.hop_s * len(run.plan.nodes) * (1 + run.next_index / 8)
        self.after(prefill, lambda: self._step(run))

    def _pace(self, plan: PlanRef) -> float:
        slow = max((self.world.slow.get(node, 1.0) for node in plan.nodes), default=1.0)
        return self.hop_s * len(plan.nodes) * slow

    def _step(self, run: Run) -> None:
        if not run.alive or run.next_index >= self.max_tokens:
            return
        world = self.world
        if any(node in world.dead or node in world.cut for node in run.plan.nodes):
            run.alive = False  # frames lost; the liveness layer will tell
            return
        index = run.next_index
        run.next_index += 1
        self._token(run.number, index)
        if self.rng.random() < self.dup_p:
            self.after(self.hop_s * 3, lambda: self._token(run.number, index))
        self.after(self._pace(run.plan), lambda: self._step(run))

    def _token(self, number: int, index: int) -> None:
        finish = Finish.LENGTH if index == self.max_tokens - 1 else Finish.NONE
        decisions = self.core.on_token(number, index, token_of(index), finish, self.now)
        for decision in decisions:
            if isinstance(decision, Deliver):
                self.delivered.append(token_of(index))
        self.apply(decisions)

    def _failure(self, run: Run, kind: FailureKind, message: str) -> None:
        run.alive = False
        self.apply(self.core.on_failure(run.number, kind, message, self.now))

    # ------------------------------------------------------------ faults

    def _fault(self, kind: str) -> Callable[[], None]:
        return getattr(self, f"_{kind}")

    def _victim(self) -> str | None:
        active = self.world.active
        alive = [n for n in (active.nodes if active else ()) if n not in self.world.dead]
        return self.rng.choice(alive) if alive else None

    def _survivors_plan(self, without: str) -> PlanRef | None:
        world = self.world
        nodes = [
            n for n in STAGE_NODES if n != without and n not in world.dead and n not in world.cut
        ]
        if not nodes:
            return None
        self.rng.shuffle(nodes)
        return PlanRef(f"p{world.plan_ids()}", tuple(nodes[: self.rng.randint(1, 3)]))

    def _commit(self, plan: PlanRef) -> None:
        world = self.world
        if any(node in world.dead or node in world.cut for node in plan.nodes):
            # The agreement plans over live members only: one lost meanwhile is left out.
            lost = next(n for n in plan.nodes if n in world.dead or n in world.cut)
            survivors = self._survivors_plan(lost)
            if survivors is None:
                return
            plan = survivors
        world.active = plan
        self.plans[plan.plan_id] = plan
        world.installed.add(plan.plan_id)
        world.no_plan_since = None
        world.state = PlanState.LOADING
        self._view_changed()

        def ready() -> None:
            if world.active is plan:
                world.state = PlanState.READY
                self._view_changed()

        self.after(self.rng.uniform(0.0, 3.0), ready)

    def _withdraw(self, plan_id: str, reason: str) -> None:
        world = self.world
        world.installed.discard(plan_id)
        for run in list(self.runs.values()):
            if run.plan.plan_id == plan_id:
                run.alive = False
        if world.active is not None and world.active.plan_id == plan_id:
            world.active = None
            world.no_plan_since = self.now
        self._view_changed()
        self.apply(self.core.on_plan_removed(plan_id, reason, self.now))

    def _lost(self, node: str, *, cut: bool) -> None:
        """A kill or a cut: runs through it stop; the liveness layer reacts."""
        world = self.world
        (world.cut if cut else world.dead).add(node)
        world.last_change = self.now
        for run in self.runs.values():
            if node in run.plan.nodes:
                run.alive = False
        if not cut:  # a dead process's connections reset at once
            self.after(self.rng.uniform(0.001, 0.05), lambda: self._link_lost(node, "reset"))
        replace = self.rng.random() < 0.8
        detect = self.rng.uniform(0.5, 5.0)

        def notice() -> None:
            self._link_lost(node, "no heartbeat")
            for plan_id in sorted(world.installed):
                if node in self.plans[plan_id].nodes:
                    self._withdraw(plan_id, f"node {node} lost")
            if replace:
                survivors = self._survivors_plan(node)
                if survivors is not None:
                    self.after(self.rng.uniform(0.1, 5.0), lambda: self._commit(survivors))

        self.after(detect, notice)

    def _link_lost(self, node: str, reason: str) -> None:
        self.apply(self.core.on_link_lost(node, f"link to {node} broke: {reason}", self.now))

    def _kill(self) -> None:
        victim = self._victim()
        if victim is not None:
            self._lost(victim, cut=False)

    def _cut(self) -> None:
        victim = self._victim()
        if victim is not None:
            self._lost(victim, cut=True)

    def _lane_reset(self) -> None:
        """One connection of a running attempt's path breaks; nothing else changes."""
        if not self.runs:
            return
        run = self.rng.choice(list(self.runs.values()))
        path = (ORIGIN, *run.plan.nodes, ORIGIN)
        hop = self.rng.randrange(len(path) - 1)
        pair = (path[hop], path[hop + 1])
        self.world.last_change = self.now
        for other in self.runs.values():
            other_path = (ORIGIN, *other.plan.nodes, ORIGIN)
            hops = set(itertools.pairwise(other_path))
            if pair in hops or pair[::-1] in hops:
                other.alive = False
        if ORIGIN in pair:
            node = pair[1] if pair[0] == ORIGIN else pair[0]
            if node != ORIGIN:
                self.after(self.rng.uniform(0.0, 0.01), lambda: self._link_lost(node, "reset"))
            return
        for other in list(self.runs.values()):
            if pair[0] in other.plan.nodes and pair[1] in other.plan.nodes:
                message = f"stage {pair[1]} unreachable: the lane was reset"
                self.after(
                    self.rng.uniform(0.0, 0.01),
                    lambda o=other, m=message: self._failure(o, FailureKind.UNREACHABLE, m),
                )

    def _leave(self) -> None:
        victim = self._victim()
        if victim is None:
            return
        old = self.world.active
        assert old is not None
        survivors = self._survivors_plan(victim)
        if survivors is None:
            return
        self.after(self.rng.uniform(0.1, 2.0), lambda: self._commit(survivors))
        self._hand_over(old, self.rng.uniform(2.0, 30.0), FailureKind.FENCED)

    def _replan(self) -> None:
        old = self.world.active
        if old is None:
            return
        nodes = [n for n in STAGE_NODES if n not in self.world.dead and n not in self.world.cut]
        self.rng.shuffle(nodes)
        plan = PlanRef(f"p{self.world.plan_ids()}", tuple(nodes[: self.rng.randint(1, 4)]))
        self.after(self.rng.uniform(0.0, 1.0), lambda: self._commit(plan))
        self._hand_over(old, self.rng.uniform(1.0, 40.0), FailureKind.FENCED)

    def _hand_over(self, old: PlanRef, after_s: float, kind: FailureKind) -> None:
        """The old plan serves on, then its stages refuse and it is withdrawn."""

        def hand_over() -> None:
            for run in list(self.runs.values()):
                if run.plan.plan_id == old.plan_id and run.alive:
                    self.after(self.hop_s, lambda r=run: self._failure(r, kind, "handed over"))
            self._withdraw(old.plan_id, f"plan {old.plan_id} handed over")

        self.after(after_s, hand_over)

    def _slow(self) -> None:
        node = self.rng.choice(STAGE_NODES)
        self.world.slow[node] = self.rng.uniform(5.0, 200.0)
        self.world.last_change = self.now

        def heal() -> None:
            self.world.slow.pop(node, None)
            self.world.last_change = self.now

        self.after(self.rng.uniform(0.1, 10.0), heal)

    def _dup(self) -> None:
        self.dup_p = self.rng.uniform(0.05, 0.5)


def check(sim: OriginSim) -> None:
    """The origin's promise, for one finished simulation (OriginViolation when broken)."""
    seed, world = sim.seed, sim.world
    where = f"seed {sim.seed}: " + "; ".join(sim.log[-8:])
    reference = [token_of(i) for i in range(sim.max_tokens)]
    if sim.delivered != reference[: len(sim.delivered)]:
        raise OriginViolation(
            f"{where}: delivered {sim.delivered}, expected a prefix of {reference}"
        )
    outcome = sim.outcome
    if outcome is None:
        raise OriginViolation(f"{where}: the request never ended (t={sim.now:.1f})")
    assert sim.ended_at is not None
    if isinstance(outcome, Finished):
        if sim.delivered != reference:
            raise OriginViolation(f"{where}: finished with {sim.delivered}, expected {reference}")
        return
    if not outcome.message or outcome.kind is not ErrorKind.UNAVAILABLE:
        raise OriginViolation(f"seed {seed}: failed without a fitting reason: {outcome}")
    if world.no_plan_since is None:
        raise OriginViolation(
            f"{where}: failed at {sim.ended_at:.2f} s ({outcome.message}) although the mesh "
            f"serves plan {world.active.plan_id if world.active else None} (its last change at "
            f"{world.last_change:.2f} s)"
        )
    bound = world.no_plan_since + sim.timeouts.resume_s + SETTLE_BOUND_S
    if sim.ended_at > bound:
        raise OriginViolation(f"{where}: failed only at {sim.ended_at:.2f} s, bound {bound:.2f}")


def check_settled_in_time(sim: OriginSim) -> None:
    """A request on a healed world ends within ``SETTLE_BOUND_S`` of the last change."""
    if isinstance(sim.outcome, Finished) and sim.ended_at is not None:
        bound = max(sim.world.last_change, 0.0) + SETTLE_BOUND_S
        undisturbed = sim.max_tokens * sim.hop_s * 3 * 200  # the slowest stage, fully
        if sim.ended_at > bound + undisturbed:
            raise OriginViolation(
                f"seed {sim.seed}: ended only at {sim.ended_at:.2f} s; the world settled at "
                f"{sim.world.last_change:.2f} s: it waited for something that could not come "
                f"({'; '.join(sim.log[-6:])})"
            )


def simulate(seed: int, **kwargs: object) -> OriginSim:
    sim = OriginSim(seed, **kwargs)  # type: ignore[arg-type]
    sim.run()
    check(sim)
    check_settled_in_time(sim)
    return sim
