"""A node's speed correction: its measured decode steps against the cost model's prediction.

The planner predicts a stage's decode step from the node's profile (measured FLOP/s and
memory bandwidth) with partitioner.cost: max(bytes read / bandwidth, rows x FLOPs / compute).
A profile can be off (measured while other processes ran, a BLAS that is slower on the
model's shapes than on the benchmark's, a machine that throttles), and a plan built from it is
then wrong for everyone. So each node times its own decode steps (the forward pass of its
layers, in the stage runtime), predicts the same steps from its own *uncorrected* profile,
and publishes

    factor = median(measured / predicted) over its last WINDOW decode steps,

clamped to [FACTOR_MIN, FACTOR_MAX]. Planning divides the node's FLOP/s and memory bandwidth
by the factor (:func:`meshd.mesh.graph.effective_flops`), so a node that runs twice as slow as
its profile says is planned as half as fast. The prediction is taken from the uncorrected
profile, not from the plan (which already used the factor), so the estimate does not feed on
itself.

Stability: a new factor is published only when at least MIN_SAMPLES steps were measured and
it differs from the published one by more than CHANGE_THRESHOLD (relative, either way): a
factor is an input of the state digest, so every change may re-plan the mesh; noise must not.
Stages of a tensor-parallel group are not corrected (their steps include the collectives).

Pure: no clock, no I/O; the node feeds it its recent steps.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.cost import CostModel, Unit
from partitioner.model import ModelSpec
from partitioner.options import PlanOptions
from partitioner.plan import Plan
from partitioner.quantize import quantize

FACTOR_MIN = 0.1
FACTOR_MAX = 10.0
MIN_SAMPLES = 8
WINDOW = 64
CHANGE_THRESHOLD = 0.25


@dataclass(frozen=True)
class StepSample:
    """One decode step of this node's stage: its rows, measured and predicted seconds."""

    rows: int
    measured_s: float
    predicted_s: float


@dataclass(frozen=True)
class Estimate:
    """A factor estimated from ``samples`` steps, with their median times."""

    factor: float
    samples: int
    measured_step_s: float
    predicted_step_s: float


def estimate(samples: Sequence[StepSample]) -> Estimate | None:
    """The factor of the last WINDOW valid steps; None when fewer than MIN_SAMPLES."""
    valid = [s for s in samples if s.measured_s > 0 and s.predicted_s > 0][-WINDOW:]
    if len(valid) < MIN_SAMPLES:
        return None
    ratio = statistics.median(s.measured_s / s.predicted_s for s in valid)
    return Estimate(
        factor=round(min(FACTOR_MAX, max(FACTOR_MIN, ratio)), 3),
        samples=len(valid),
        measured_step_s=statistics.median(s.measured_s for s in valid),
        predicted_step_s=statistics.median(s.predicted_s for s in valid),
    )


def should_publish(published: float, estimated: float) -> bool:
    """Whether ``estimated`` moved far enough from the ``published`` factor (0 or less:
    none published, which counts as 1) to be published instead."""
    current = published if published > 0 else 1.0
    return abs(math.log(estimated / current)) > math.log(1.0 + CHANGE_THRESHOLD)


class StepPredictor:
    """The cost model's decode step time for this node's stage of one plan, from the node's
    uncorrected profile; built once per plan (prefix sums over the model's layers)."""

    def __init__(
        self, spec: ModelSpec, plan: Plan, node_id: str, flops: float, mem_bandwidth: float
    ) -> None:
        self.plan_id = plan.plan_id
        self._range: tuple[int, int, bool] | None = None
        index = plan.stage_of(node_id)
        if index is None or flops <= 0 or mem_bandwidth <= 0:
            return
        stage = plan.stages[index]
        if stage.tensor_parallel:
            return
        options = PlanOptions(
            context_length=plan.context_length,
            concurrency=plan.concurrency,
            cache_sequences=plan.cache_sequences,
        )
        self._cost = CostModel(spec, options)
        # What planning reads of the profile: the bucket's representative.
        self._unit = Unit((node_id,), 1, quantize(flops), quantize(mem_bandwidth))
        self._range = (stage.layer_start, stage.layer_end, stage.has_head)

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

    def samples(self, steps: Sequence[tuple[str, int, float]]) -> list[StepSample]:
        """The plan's steps among ``steps`` ((plan id, rows, seconds), as the stage runtime
        records them), each with its prediction."""
        if self._range is None:
            return []
        return [
            StepSample(rows, seconds, self.step_s(rows))
            for plan_id, rows, seconds in steps
            if plan_id == self.plan_id
        ]


class SpeedCorrector:
    """This node's factor over time: a predictor per plan (and profile), and the rule for
    when a new estimate replaces the published factor."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._predictor: StepPredictor | None = None
        self._key: tuple[str, float, float] | None = None

    def update(
        self,
        spec: ModelSpec,
        plan: Plan,
        flops: float,
        mem_bandwidth: float,
        steps: Sequence[tuple[str, int, float]],
        published: float,
    ) -> Estimate | None:
        """A new factor to publish for the plan's recent ``steps``, or None (too few steps,
        a tensor-parallel share, or no move past the threshold from ``published``)."""
        key = (plan.plan_id, flops, mem_bandwidth)
        if self._predictor is None or self._key != key:
            self._predictor = StepPredictor(spec, plan, self.node_id, flops, mem_bandwidth)
            self._key = key
        found = estimate(self._predictor.samples(steps))
        if found is None or not should_publish(published, found.factor):
            return None
        return found
