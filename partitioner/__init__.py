"""Pure partitioner: mesh graph + model description in, plan out. No I/O.

Every node runs `plan_model` on the same inputs and gets the same Plan and plan id, so the mesh
can agree on a partition without a master. See partitioner.cost for the cost model,
partitioner.quantize for how noisy measurements are bucketed, partitioner.strategies for the
`memory` baseline and the `speed` search, partitioner.planner for how the kind of layout
(one node, pipeline, tensor parallel, hybrid) is chosen.
"""

from partitioner.cost import CostModel, MemoryBreakdown
from partitioner.errors import (
    InsufficientMemory,
    MeshError,
    ParallelismUnavailable,
    describe_refusal,
)
from partitioner.model import ModelSpec, ModelSpecError
from partitioner.options import (
    DEFAULT_MIN_GAIN,
    PARALLELISMS,
    STRATEGIES,
    PlanOptions,
    PlanOptionsError,
)
from partitioner.plan import (
    ExpertShard,
    Hop,
    LeftOut,
    NodeMemory,
    Plan,
    Prediction,
    PricedRate,
    Stage,
    layout_key,
    stages_from_layout_key,
)
from partitioner.planner import (
    ALGORITHM_VERSION,
    LAYOUTS,
    SWITCH_GAIN,
    layout_kind,
    layout_plan_id,
    plan_alternatives,
    plan_model,
    plan_summary,
)
from partitioner.quantize import bucket_index, bucket_value, quantize, sticky_bucket_index

__all__ = [
    "ALGORITHM_VERSION",
    "DEFAULT_MIN_GAIN",
    "LAYOUTS",
    "PARALLELISMS",
    "STRATEGIES",
    "SWITCH_GAIN",
    "CostModel",
    "ExpertShard",
    "Hop",
    "InsufficientMemory",
    "LeftOut",
    "MemoryBreakdown",
    "MeshError",
    "ModelSpec",
    "ModelSpecError",
    "NodeMemory",
    "ParallelismUnavailable",
    "Plan",
    "PlanOptions",
    "PlanOptionsError",
    "Prediction",
    "PricedRate",
    "Stage",
    "bucket_index",
    "bucket_value",
    "describe_refusal",
    "layout_key",
    "layout_kind",
    "layout_plan_id",
    "plan_alternatives",
    "plan_model",
    "plan_summary",
    "quantize",
    "stages_from_layout_key",
    "sticky_bucket_index",
]
