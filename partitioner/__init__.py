"""Pure partitioner: mesh graph + model description in, plan out. No I/O.

Every node runs `plan_model` on the same inputs and gets the same Plan and plan id, so the mesh
can agree on a partition without a master. See partitioner.cost for the cost model,
partitioner.quantize for how noisy measurements are bucketed, partitioner.strategies for the
`memory` baseline and the `speed` search.
"""

from partitioner.cost import CostModel, MemoryBreakdown
from partitioner.errors import InsufficientMemory, MeshError, describe_refusal
from partitioner.model import ModelSpec, ModelSpecError
from partitioner.options import STRATEGIES, PlanOptions, PlanOptionsError
from partitioner.plan import Hop, LeftOut, NodeMemory, Plan, Prediction, Stage
from partitioner.planner import ALGORITHM_VERSION, plan_model, plan_summary
from partitioner.quantize import bucket_index, bucket_value, quantize, sticky_bucket_index

__all__ = [
    "ALGORITHM_VERSION",
    "STRATEGIES",
    "CostModel",
    "Hop",
    "InsufficientMemory",
    "LeftOut",
    "MemoryBreakdown",
    "MeshError",
    "ModelSpec",
    "ModelSpecError",
    "NodeMemory",
    "Plan",
    "PlanOptions",
    "PlanOptionsError",
    "Prediction",
    "Stage",
    "bucket_index",
    "bucket_value",
    "describe_refusal",
    "plan_model",
    "plan_summary",
    "quantize",
    "sticky_bucket_index",
]
