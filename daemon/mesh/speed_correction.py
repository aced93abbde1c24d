"""A node's speed correction: its measured decode steps against the cost model's prediction.

The planner predicts a stage's decode step from the node's profile (measured FLOP/s and
memory bandwidth) with partitioner.cost: max(bytes read / bandwidth, rows x FLOPs / compute).
A profile can be off (measured while other processes ran, a BLAS that is slower on the
model's shapes than on the benchmark's, a machine that throttles), and a plan built from it is
then wrong for everyone. So each node times its own decode steps (the forward pass of its
layers, in the stage runtime), predicts the same steps from its own *uncorrected* profile,
and publishes

    factor = median(measured / predicted) over its last WINDOW decode steps of one row,

clamped to [FACTOR_MIN, FACTOR_MAX]. Only steps of one row: a batched step's time moves with
its rows (below), so a factor taken from batched steps moved with the mesh's load (between 2.5x
and 4x over runs of 1, 4 and 16 requests on a 2-node pipeline), and each move re-planned the
mesh under load. A node with no recent steps of one row keeps the factor it published. Planning
divides the node's memory bandwidth (and its FLOP/s, unless it published a compute factor,
below) by the factor (:func:`meshd.mesh.graph.effective_flops`), so a node that runs twice as
slow as its profile says is planned as half as fast. The prediction is taken from the
uncorrected profile, not from the plan (which already used the factor), so the estimate does
not feed on itself.

Batched steps: one factor cannot fit both a step of one row and one of sixteen, since on a CPU
each added row costs far more than the cost model's roofline says (partitioner.cost, "Rows a
node measured"). So from its steps of r > 1 rows the node also takes what each row beyond the
first added to the corrected roofline, (measured - factor x predicted) / (r - 1), with the
factor of its one-row steps (else the published one), and publishes `row_flops` = the stage's
FLOPs per row / the median of that (0 while it has fewer than MIN_SAMPLES such steps, or when
rows add nothing beyond the roofline). The planner adds (r - 1) x FLOPs / row_flops to the
node's batched steps.

Stability: a new factor is published only when at least MIN_SAMPLES steps were measured, it
differs from the published one by more than CHANGE_THRESHOLD (relative, either way), and the
last change is at least MIN_INTERVAL_S old: a factor is an input of the state digest, so every
change may re-plan the mesh; noise on a busy machine must not. A node's first correction is
published at once (its profile was wrong); a later change only once the estimates kept past
the threshold for CONFIRM_S: the start of a burst of requests (their prompts and the first
steps of a few rows on cores the other stages also use) moved the factors of a 2-node
pipeline on one machine by 1.7x for a few seconds, and each such move re-planned the mesh
while it served.

Prompt chunks: a prompt's chunks are compute-bound where decode steps read weights, and a
profile's FLOP/s (a large square matrix product) is not what a chunk of a model's shapes
achieves, nor is its contention the memory's. So the node also times its prompt chunks of at
least 32 positions and publishes `compute_factor` = median(measured / predicted) over them
(from MIN_PROMPT_SAMPLES chunks on, same clamp and threshold): planning then divides the
node's FLOP/s by the compute factor and only its bandwidth by the decode factor.

Tensor-parallel groups: their steps include two all-reduces per layer and a broadcast, whose
cost on a real machine (waking a waiting process, the device's synchronisation, the loop that
carries them) is the cost model's `collective_overhead_s`, by default 60 us, which a CPU mesh
on loopback exceeds many times. So the group's leader (rank 0, whose stage runtime times the
group's steps) takes (measured - the members' predicted compute) / the stage's collectives,
its median over the last WINDOW decode steps, and publishes it as its collective overhead
(from MIN_SAMPLES steps on, same threshold); the planner prices the group's collectives with
the largest of its members'. The members' compute is predicted from the leader's profile for
every member, and the links' own time is left in the overhead. No decode factor is taken
from a group's steps. Its prompt chunks give the leader a compute factor: each chunk's time
less the collectives at that overhead, over the members' predicted compute (three members
sharing two cores computed a prompt ~3x slower than the profile says, and the first token came
2.6x later than predicted). A chunk's collectives carry its positions' hidden states, whose
link time stays in the factor: ~5 % of a 256-token chunk over loopback.

Pure: no clock, no I/O; the node feeds it its recent steps and the time. A correction is not
kept across restarts (a node learns it again from its first requests), and it outlives a
change of model until the new model's steps move it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.cost import DEFAULT_COLLECTIVE_OVERHEAD_S, CostModel, Unit
from partitioner.model import ModelSpec
from partitioner.options import PlanOptions
from partitioner.plan import Plan
from partitioner.quantize import quantize

FACTOR_MIN = 0.1
FACTOR_MAX = 10.0
MIN_SAMPLES = 8
MIN_PROMPT_SAMPLES = 4  # prompt chunks (fewer than decode steps: a prompt is a few chunks)
WINDOW = 64
CHANGE_THRESHOLD = 0.25
MAX_COLLECTIVE_S = 0.1  # a collective's measured overhead, at most
MIN_INTERVAL_S = 30.0  # between two changes of a node's published correction
CONFIRM_S = 20.0  # how long a change must hold before it replaces a published correction


@dataclass(frozen=True)
class StepSample:
    """One decode step of this node's stage: its rows, measured and predicted seconds (the
    roofline, from the uncorrected profile) and the stage's FLOPs per row."""

    rows: int
    measured_s: float
    predicted_s: float
    flops_per_row: float = 0.0


@dataclass(frozen=True)
class Estimate:
    """A factor estimated from ``samples`` steps of one row (None: too few of them), with
    their median times, and the FLOP/s of each row batched steps added (0: not measured)."""

    factor: float | None
    samples: int
    measured_step_s: float
    predicted_step_s: float
    row_flops: float = 0.0
    batched_samples: int = 0  # steps of several rows the row FLOP/s were taken from


def estimate(samples: Sequence[StepSample], published_factor: float = 1.0) -> Estimate | None:
    """The factor of the last WINDOW valid steps of one row, and the row FLOP/s of the last
    WINDOW batched ones over that factor (else over ``published_factor``); None when neither
    kind has MIN_SAMPLES steps."""
    valid = [s for s in samples if s.measured_s > 0 and s.predicted_s > 0]
    single = [s for s in valid if s.rows == 1][-WINDOW:]
    batched = [s for s in valid if s.rows > 1][-WINDOW:]
    if len(single) < MIN_SAMPLES and len(batched) < MIN_SAMPLES:
        return None
    factor = None
    if len(single) >= MIN_SAMPLES:
        ratio = statistics.median(s.measured_s / s.predicted_s for s in single)
        factor = round(min(FACTOR_MAX, max(FACTOR_MIN, ratio)), 3)
        measured_s = statistics.median(s.measured_s for s in single)
        predicted_s = statistics.median(s.predicted_s for s in single)
    else:
        single, measured_s, predicted_s = [], 0.0, 0.0
    basis = factor if factor is not None else (published_factor if published_factor > 0 else 1.0)
    return Estimate(
        factor=factor,
        samples=len(single),
        measured_step_s=measured_s,
        predicted_step_s=predicted_s,
        row_flops=_row_flops(batched, basis),
        batched_samples=len(batched),
    )


def batched_row_flops(samples: Sequence[StepSample], factor: float) -> float:
    """The row FLOP/s of the last WINDOW valid batched steps among ``samples``, over
    ``factor`` (see :func:`_row_flops`)."""
    batched = [s for s in samples if s.measured_s > 0 and s.predicted_s > 0 and s.rows > 1]
    return _row_flops(batched[-WINDOW:], factor)


def _row_flops(batched: Sequence[StepSample], factor: float) -> float:
    """FLOP/s of each row beyond the first in ``batched`` steps, beyond the corrected
    roofline; 0 when too few steps or rows add nothing beyond it."""
    if len(batched) < MIN_SAMPLES or not all(s.flops_per_row > 0 for s in batched):
        return 0.0
    extra = statistics.median(
        (s.measured_s - factor * s.predicted_s) / ((s.rows - 1) * s.flops_per_row) for s in batched
    )  # seconds per FLOP of an added row
    return float(f"{1.0 / extra:.3g}") if extra > 0 else 0.0


def compute_estimate(chunks: Sequence[StepSample]) -> tuple[float, int] | None:
    """The compute factor of the last WINDOW prompt chunks (measured / predicted, clamped)
    and how many; None when fewer than MIN_PROMPT_SAMPLES."""
    valid = [s for s in chunks if s.measured_s > 0 and s.predicted_s > 0][-WINDOW:]
    if len(valid) < MIN_PROMPT_SAMPLES:
        return None
    ratio = statistics.median(s.measured_s / s.predicted_s for s in valid)
    return round(min(FACTOR_MAX, max(FACTOR_MIN, ratio)), 3), len(valid)


def overhead_estimate(per_collective: Sequence[float]) -> float | None:
    """The median seconds per collective of the last WINDOW group steps (at least 0, at most
    MAX_COLLECTIVE_S); None when fewer than MIN_SAMPLES."""
    recent = list(per_collective)[-WINDOW:]
    if len(recent) < MIN_SAMPLES:
        return None
    return float(f"{min(MAX_COLLECTIVE_S, max(0.0, statistics.median(recent))):.3g}")


def should_publish(published: float, estimated: float) -> bool:
    """Whether ``estimated`` moved far enough from the ``published`` value (0 or less: none
    published, which counts as 1 for a factor) to be published instead."""
    current = published if published > 0 else 1.0
    return abs(math.log(estimated / current)) > math.log(1.0 + CHANGE_THRESHOLD)


def rows_moved(published: float, estimated: float) -> bool:
    """Whether the row FLOP/s (0: none) appeared, vanished or moved past the threshold."""
    if published <= 0 or estimated <= 0:
        return (published > 0) != (estimated > 0)
    return should_publish(published, estimated)


class StepPredictor:
    """The cost model's decode step time for this node's stage of one plan, from the node's
    uncorrected profile; built once per plan (prefix sums over the model's layers)."""

    def __init__(
        self, spec: ModelSpec, plan: Plan, node_id: str, flops: float, mem_bandwidth: float
    ) -> None:
        self.plan_id = plan.plan_id
        self._range: tuple[int, int, bool] | None = None
        self._group: tuple[Unit, int, int, bool] | None = None  # a leader's group stage
        index = plan.stage_of(node_id)
        if index is None or flops <= 0 or mem_bandwidth <= 0:
            return
        stage = plan.stages[index]
        options = PlanOptions(
            context_length=plan.context_length,
            concurrency=plan.concurrency,
            cache_sequences=plan.cache_sequences,
        )
        self._cost = CostModel(spec, options)
        if stage.tensor_parallel:
            if stage.nodes[0] == node_id:  # the leader times the group's steps
                degree = len(stage.nodes)
                members = (quantize(flops),) * degree, (quantize(mem_bandwidth),) * degree
                group = Unit(
                    stage.nodes,
                    degree,
                    members[0][0],
                    members[1][0],
                    member_usable=(1,) * degree,
                    member_flops=members[0],
                    member_bandwidth=members[1],
                )  # no link time, no overhead: the members' compute alone
                self._group = (group, stage.layer_start, stage.layer_end, stage.has_head)
            return
        # What planning reads of the profile: the bucket's representative (the roofline
        # alone: no row FLOP/s, which this node measures here).
        self._unit = Unit((node_id,), 1, quantize(flops), quantize(mem_bandwidth))
        self._range = (stage.layer_start, stage.layer_end, stage.has_head)
        self.flops_per_row = float(self._cost.stage_flops(stage.layer_start, stage.layer_end))
        if stage.has_head:
            self.flops_per_row += self._cost.head_flops

    @property
    def applies(self) -> bool:
        """Whether this node holds a stage of its own in the plan (not a group's share)."""
        return self._range is not None

    def step_s(self, rows: int) -> float:
        """Predicted seconds of a decode step of ``rows`` rows (0 when it does not apply)."""
        if self._range is None:
            return 0.0
        start, end, last = self._range
        return self._cost.stage_step_s(self._unit, start, end, last=last, rows=max(1, rows))

    @property
    def leads_group(self) -> bool:
        """Whether this node leads a tensor-parallel stage of the plan (times its steps)."""
        return self._group is not None

    def collective_samples(self, steps: Sequence[tuple[str, int, float]]) -> list[float]:
        """Seconds per collective in the plan's group steps among ``steps``: (measured - the
        members' predicted compute) / the step's collectives (two per layer, a broadcast)."""
        if self._group is None:
            return []
        unit, start, end, last = self._group
        return [
            (seconds - self._cost.stage_step_s(unit, start, end, last=last, rows=rows))
            / self._collectives()
            for plan_id, rows, seconds in steps
            if plan_id == self.plan_id
        ]

    def _collectives(self) -> int:
        """Collectives in one step of the group this node leads (0: it leads none)."""
        if self._group is None:
            return 0
        _, start, end, _ = self._group
        return 2 * (end - start) + 1

    def chunk_s(self, positions: int) -> float:
        """Predicted seconds of a prompt chunk of ``positions`` (0 when it does not apply):
        this node's stage, or the members' compute alone of the group it leads."""
        if self._group is not None:
            unit, start, end, last = self._group
        elif self._range is not None:
            unit, (start, end, last) = self._unit, self._range
        else:
            return 0.0
        return self._cost.stage_chunk_s(unit, start, end, last=last, tokens=positions)

    def chunk_samples(
        self, chunks: Sequence[tuple[str, int, float]], collective_s: float = 0.0
    ) -> list[StepSample]:
        """The plan's prompt chunks among ``chunks`` ((plan id, positions, seconds)), each
        with its prediction. A group leader's chunks are taken net of the group's collectives,
        ``collective_s`` each (what the planner prices them at), against the members'
        predicted compute: what is left is the group's compute, which a compute factor
        corrects."""
        if self._group is None and self._range is None:
            return []
        collectives_s = self._collectives() * collective_s
        return [
            StepSample(positions, seconds - collectives_s, self.chunk_s(positions))
            for plan_id, positions, seconds in chunks
            if plan_id == self.plan_id
        ]

    def samples(self, steps: Sequence[tuple[str, int, float]]) -> list[StepSample]:
        """The plan's steps among ``steps`` ((plan id, rows, seconds), as the stage runtime
        records them), each with its prediction."""
        if self._range is None:
            return []
        return [
            StepSample(rows, seconds, self.step_s(rows), self.flops_per_row)
            for plan_id, rows, seconds in steps
            if plan_id == self.plan_id
        ]


@dataclass(frozen=True)
class Published:
    """What a node publishes: decode factor (0 or less: none, which counts as 1), row FLOP/s
    (0: none), compute factor (0: none, its FLOP/s follow the decode factor)."""

    factor: float = 1.0
    row_flops: float = 0.0
    compute_factor: float = 0.0
    collective_overhead_s: float = 0.0

    def as_tuple(self) -> tuple[float, float, float, float]:
        factor = self.factor if self.factor > 0 else 1.0
        return (factor, self.row_flops, self.compute_factor, self.collective_overhead_s)


@dataclass(frozen=True)
class Correction:
    """A node's new correction, to publish: the three values, and what they were taken from."""

    factor: float
    row_flops: float
    compute_factor: float
    samples: int  # decode steps
    measured_step_s: float
    predicted_step_s: float
    prompt_samples: int  # prompt chunks
    collective_overhead_s: float = 0.0


class SpeedCorrector:
    """This node's correction over time: a predictor per plan (and profile), and the rules
    for when new estimates replace what it published."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._predictor: StepPredictor | None = None
        self._key: tuple[str, float, float] | None = None
        self._changed_at: float | None = None
        self._moving_since: float | None = None  # since when the estimates differ

    def update(
        self,
        spec: ModelSpec,
        plan: Plan,
        flops: float,
        mem_bandwidth: float,
        steps: Sequence[tuple[str, int, float]],
        chunks: Sequence[tuple[str, int, float]],
        published: Published,
        now: float,
    ) -> Correction | None:
        """A new correction for the plan's recent decode ``steps`` and prompt ``chunks``, or
        None: too few of them, a tensor-parallel share, nothing moved past the threshold from
        what is ``published``, the last change is less than MIN_INTERVAL_S before ``now``
        (a monotonic time), or (after the first) the change has not held for CONFIRM_S. A
        value with no news (no batched steps, too few chunks) stays as published."""
        if self._changed_at is not None and now - self._changed_at < MIN_INTERVAL_S:
            return None
        key = (plan.plan_id, flops, mem_bandwidth)
        if self._predictor is None or self._key != key:
            self._predictor = StepPredictor(spec, plan, self.node_id, flops, mem_bandwidth)
            self._key = key
        factor, row_flops, compute_factor, overhead = published.as_tuple()
        decode_samples = self._predictor.samples(steps)
        decode = estimate(decode_samples, factor)
        measured = overhead_estimate(self._predictor.collective_samples(steps))
        if measured is not None and rows_moved(overhead, measured):
            overhead = measured
        collective_s = overhead if overhead > 0 else DEFAULT_COLLECTIVE_OVERHEAD_S
        compute = compute_estimate(self._predictor.chunk_samples(chunks, collective_s))
        if decode and decode.factor is not None and should_publish(factor, decode.factor):
            factor = decode.factor
        if decode is not None and decode.batched_samples >= MIN_SAMPLES:
            measured_rows = batched_row_flops(decode_samples, factor)  # over what is published
            if rows_moved(row_flops, measured_rows):
                row_flops = measured_rows
        if compute is not None and should_publish(compute_factor or factor, compute[0]):
            compute_factor = compute[0]
        if (factor, row_flops, compute_factor, overhead) == published.as_tuple():
            self._moving_since = None
            return None
        if self._changed_at is not None:  # a change of a published correction: must hold
            if self._moving_since is None:
                self._moving_since = now
            if now - self._moving_since < CONFIRM_S:
                return None
        self._moving_since = None
        self._changed_at = now
        return Correction(
            factor=factor,
            row_flops=row_flops,
            compute_factor=compute_factor,
            samples=decode.samples if decode else 0,
            measured_step_s=decode.measured_step_s if decode else 0.0,
            predicted_step_s=decode.predicted_step_s if decode else 0.0,
            prompt_samples=compute[1] if compute else 0,
            collective_overhead_s=overhead,
        )
