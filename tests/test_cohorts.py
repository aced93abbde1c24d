"""Micro-batch cohorts, simulated: two stage cores serving many requests on a virtual clock.

The first and last :class:`StageCore` of a two-stage pipeline are driven the way
:mod:`meshd.inference.stage.runtime` drives them on real nodes: each stage's compute thread
takes the core's ready steps when idle and runs the decode steps of one cohort in one pass
(the runtime's grouping), hidden states and tokens cross a 1 ms hop, and a finished request's
origin ends it on both stages. A pass costs what a memory-bound decode step costs: nearly
the same whatever its rows. Nothing here runs MLX, a thread or a socket.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from meshd.inference.sampling import SamplingParams
from meshd.inference.stage import cohorts
from meshd.inference.stage.core import StageCore
from meshd.inference.stage_events import (
    ActivationFrame,
    Advanced,
    EndFrame,
    Finish,
    Hidden,
    Sampled,
    SendActivation,
    SendToken,
    StartFrame,
    TokenFrame,
    Work,
)
from partitioner.cost import MIN_MICRO_BATCH_ROWS, micro_batches
from tests.test_stage_core import plan_of, start_of

pytestmark = pytest.mark.unit

HOP_S = 0.001
PROMPT_STEP_S = 0.030


def pass_s(rows: int) -> float:
    """A decode pass: reading the stage's weights (50 ms) plus 2 ms a row."""
    return 0.050 + 0.002 * rows


@dataclass
class Stage:
    node: str
    core: StageCore
    busy_until: float = 0.0
    passes: list[tuple[float, tuple[str, ...], int | None]] = field(default_factory=list)


@dataclass
class Pipeline:
    """Two stages, a virtual clock, and what each stage computed."""

    max_tokens: int
    cohorts: bool = True  # False: the first stage cuts whoever is back, as it did before
    late: dict[str, float] = field(default_factory=dict)  # request: its next token's delay
    now: float = 0.0
    events: list = field(default_factory=list)
    counter: itertools.count = field(default_factory=itertools.count)
    tokens: Counter[str] = field(default_factory=Counter)
    finished: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        plan = plan_of("p", "a", "b")
        self.stages = {node: Stage(node, StageCore(node)) for node in ("a", "b")}
        for stage in self.stages.values():
            stage.core.add_plan(plan)
            stage.core.plan_loaded("p", batches=self.cohorts)

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (when, next(self.counter), action))

    def start(self, request: str, when: float) -> None:
        sampling = SamplingParams(max_tokens=self.max_tokens)
        frame = StartFrame("o", "p", request, start_of((1, 2, 3, 4, 5), chunk=8, sampling=sampling))
        self.at(
            when, lambda: self._then("a", self.stages["a"].core.on_start(frame, None, self.now))
        )

    def run(self, until: float = 600.0) -> None:
        while self.events and self.now < until:
            self.now, _, action = heapq.heappop(self.events)
            action()
            for stage in self.stages.values():
                self._pump(stage)

    def _pump(self, stage: Stage) -> None:
        if stage.busy_until > self.now:
            return
        works = stage.core.next_batch(self.now, max_items=64)
        if not works:
            return
        for job in self._jobs(works) if self.cohorts else self._cut_ready(stage, works):
            decode = len(job) > 1 or _is_decode(job[0])
            took = pass_s(len(job)) if decode else PROMPT_STEP_S
            stage.busy_until = max(stage.busy_until, self.now) + took
            stage.passes.append((stage.busy_until, tuple(w.request_id for w in job), job[0].cohort))
            self.at(stage.busy_until, lambda s=stage, j=job: self._computed(s, j))

    @staticmethod
    def _jobs(works: list[Work]) -> list[list[Work]]:
        """What the runtime runs: each prompt step alone, the decode steps one pass a cohort."""
        jobs: list[list[Work]] = []
        batched: dict[int | None, list[Work]] = defaultdict(list)
        for work in works:
            if _is_decode(work):
                batched[work.cohort].append(work)
            else:
                jobs.append([work])
        return jobs + list(batched.values())

    def _cut_ready(self, stage: Stage, works: list[Work]) -> list[list[Work]]:
        """The grouping before cohorts: the first stage cut the decode rows that were ready
        into near-equal micro-batches of at most the share of the open requests."""
        jobs = [[work] for work in works if not _is_decode(work)]
        rows = [work for work in works if _is_decode(work)]
        if not rows:
            return jobs
        open_rows = max(len(rows), stage.core.open_requests("p"))
        parts = micro_batches(2, open_rows) if stage.node == "a" else 1
        size = -(-open_rows // parts)
        count = -(-len(rows) // size)
        return jobs + [rows[part::count] for part in range(count)]

    def _computed(self, stage: Stage, job: list[Work]) -> None:
        actions = []
        for work in job:
            if stage.node == "a":
                result = Hidden("decode" if _is_decode(work) else "prompt", 0.0)
            elif work.head:
                result = Sampled(7, b"", 0.0)
            else:
                result = Advanced(0.0)  # a prompt chunk on the last stage: caches only
            actions += stage.core.on_computed(work, result, self.now)
        self._then(stage.node, actions)

    def _then(self, node: str, actions: list) -> None:
        """Carry out a stage's actions: the frames of one step go as one bundle, one hop later
        (the runtime's lanes), and a finished request is ended by its origin on both stages."""
        activations: list[ActivationFrame] = []
        tokens: list[TokenFrame] = []
        for action in actions:
            if isinstance(action, SendActivation):
                activations.append(ActivationFrame(
                    node, "p", action.request_id, action.step, action.payload, 0.0, action.start
                ))  # fmt: skip
            elif isinstance(action, SendToken):
                self.tokens[action.request_id] += 1
                tokens.append(
                    TokenFrame("b", "p", action.request_id, 7, action.index, action.finish)
                )
                if action.finish is not Finish.NONE:
                    self.finished[action.request_id] = self.now
                    self.at(self.now + 2 * HOP_S, lambda r=action.request_id: self._end(r))
        if activations:
            self.at(self.now + HOP_S, lambda: self._deliver("b", activations))
        late = [frame for frame in tokens if frame.request_id in self.late]
        for frame in late:  # one token apart from its bundle, and late
            delay = self.late.pop(frame.request_id)
            self.at(self.now + HOP_S + delay, lambda f=frame: self._deliver("a", [f]))
        if on_time := [frame for frame in tokens if frame not in late]:
            self.at(self.now + HOP_S, lambda: self._deliver("a", on_time))

    def _deliver(self, node: str, frames: list) -> None:
        core = self.stages[node].core
        actions = []
        for frame in frames:
            if isinstance(frame, ActivationFrame):
                actions += core.on_activation(frame, None, self.now)
            else:
                actions += core.on_token(frame, None, self.now)
        self._then(node, actions)

    def _end(self, request: str) -> None:
        for stage in self.stages.values():
            stage.core.on_end(EndFrame("o", "p", request))

    def decode_passes(self, node: str) -> list[tuple[float, tuple[str, ...], int | None]]:
        """The stage's passes of generated tokens' steps (the end time, the requests, the
        cohort): the last prompt token's steps, which also run batched, left out."""
        prompts_done: dict[str, int] = Counter()
        passes = []
        for end, members, cohort in self.stages[node].passes:
            decode = all(prompts_done[m] >= 2 for m in members)
            for member in members:
                prompts_done[member] += 1
            if decode:
                passes.append((end, members, cohort))
        return passes


def _is_decode(work: Work) -> bool:
    """A one-position step: a generated token's step on the first stage, or on the last the
    step whose hidden states came from one (the simulation's payload says which)."""
    if work.tokens is not None:
        return len(work.tokens) == 1 and work.step > 0
    return work.payload == "decode"


def staggered(
    requests: int, max_tokens: int = 40, spacing: float = 0.037, cohorts: bool = True
) -> Pipeline:
    pipeline = Pipeline(max_tokens, cohorts)
    for index in range(requests):
        pipeline.start(f"r{index:02d}", index * spacing)
    return pipeline


def test_sixteen_staggered_requests_run_in_two_passes_a_round() -> None:
    """16 requests arriving over half a second: every one gets all its tokens; the first stage
    keeps two cohorts, each run as one pass; while all 16 decode, each stage computes two
    passes of 8 rows a round, and a round takes two passes' time. (Once fewer than 16 are
    open, MIN_MICRO_BATCH_ROWS makes it one cohort.)"""
    rows = 2 * MIN_MICRO_BATCH_ROWS
    pipeline = staggered(rows)
    pipeline.run()
    assert pipeline.tokens == {f"r{i:02d}": 40 for i in range(rows)}

    first = pipeline.decode_passes("a")
    assert {cohort for _, _, cohort in first} == {0, 1}
    settled = min(t for t, members, _ in first if "r15" in members)
    done = min(pipeline.finished.values())
    for node in ("a", "b"):
        sizes = [len(m) for t, m, _ in pipeline.decode_passes(node) if settled < t <= done]
        assert sizes and set(sizes) == {rows // 2}, (node, sizes)
        rounds = len(sizes) / 2
        assert (done - settled) / rounds < 2 * pass_s(rows // 2) + 4 * HOP_S


def test_cohorts_take_fewer_passes_than_cutting_whoever_is_back() -> None:
    """The same 16 staggered requests with the grouping before cohorts (the first stage cut
    the rows that were back into micro-batches): groups that came back apart stayed apart, so
    each stage ran more passes, each a whole read of its weights, and the last token came
    later."""
    with_cohorts = staggered(16)
    with_cohorts.run()
    before = staggered(16, cohorts=False)
    before.run()
    assert before.tokens == with_cohorts.tokens
    for node in ("a", "b"):
        assert len(with_cohorts.decode_passes(node)) < 0.85 * len(before.decode_passes(node))
    assert max(with_cohorts.finished.values()) < 0.9 * max(before.finished.values())


def test_few_requests_run_as_one_cohort() -> None:
    """Fewer rows than two micro-batches' worth: one cohort, one pass a round per stage."""
    pipeline = staggered(4, max_tokens=20)
    pipeline.run()
    assert pipeline.tokens == {f"r{i:02d}": 20 for i in range(4)}
    first = pipeline.decode_passes("a")
    assert {cohort for _, _, cohort in first} == {0}
    settled = min(t for t, members, _ in first if "r03" in members)
    done = min(pipeline.finished.values())
    assert all(len(m) == 4 for t, m, _ in first if settled <= t <= done)


def test_a_late_member_holds_its_cohort_no_longer_than_the_wait() -> None:
    """One member's token comes apart from its bundle and 3 s late: its cohort waits for it
    COHORT_WAIT_S, then runs on without it; every request still gets all its tokens."""
    pipeline = staggered(16)
    pipeline.at(1.5, lambda: pipeline.late.update({"r00": 3.0}))
    pipeline.run()
    assert pipeline.tokens == {f"r{i:02d}": 40 for i in range(16)}
    cohort_of = {}
    for _, members, cohort in pipeline.decode_passes("a"):
        for member in members:
            cohort_of.setdefault(member, cohort)
    mate = next(r for r, c in cohort_of.items() if c == cohort_of["r00"] and r != "r00")
    times = sorted(t for t, members, _ in pipeline.decode_passes("a") if mate in members)
    longest_gap = max(b - a for a, b in itertools.pairwise(times))
    assert cohorts.COHORT_WAIT_S < longest_gap < cohorts.COHORT_WAIT_S + 4 * pass_s(16)


def test_a_held_step_names_when_it_stops_waiting() -> None:
    """The first stage alone, two requests in one cohort: one's token comes, the other's does
    not. The ready step is held and the core names when it stops waiting (the runtime pumps
    then, frame or not); at that moment it runs alone."""
    core = StageCore("a")
    core.add_plan(plan_of("p", "a", "b"))
    core.plan_loaded("p", batches=True)
    start = start_of((1, 2, 3), chunk=8, sampling=SamplingParams(max_tokens=10))
    for request in ("r1", "r2"):
        core.on_start(StartFrame("o", "p", request, start), None, 0.0)
    for now, index in ((0.0, None), (0.1, 0), (0.2, 1)):
        if index is not None:  # the last stage's token for both
            for request in ("r1", "r2"):
                core.on_token(TokenFrame("b", "p", request, 7, index, Finish.NONE), None, now)
        while works := core.next_batch(now, max_items=64):
            for work in works:
                core.on_computed(work, Hidden("h", 0.0), now)
    assert core.cohort_wait_ends is None
    core.on_token(TokenFrame("b", "p", "r1", 7, 2, Finish.NONE), None, 1.0)
    assert core.next_batch(1.0, max_items=64) == []  # r2 is out: r1 waits for it
    assert core.cohort_wait_ends == pytest.approx(1.0 + cohorts.COHORT_WAIT_S)
    assert core.next_batch(1.5, max_items=64) == []
    (work,) = core.next_batch(1.0 + cohorts.COHORT_WAIT_S, max_items=64)
    assert work.request_id == "r1" and work.cohort == 0
    assert core.cohort_wait_ends is None
