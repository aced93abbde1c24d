"""Tensor-parallel (and expert-parallel) stages: layers split over a group of nodes with
mlx-lm's own ``shard(group)``, run by ``mx.distributed`` in runner processes the daemon owns.

* :mod:`.spec`: the frozen :class:`TensorParallelSpec` every member derives from the committed
  plan; :func:`supports_tensor_parallel` for the planner; the backend's hostfile/environment.
* :mod:`meshd.mesh.link_trust`: which links may carry the (unencrypted) collectives: the pure
  rule (it lives with the mesh, which publishes every link's verdict; re-exported here).
* :mod:`.member`: the daemon's side: :class:`TensorParallelMember` (one rank's runner, the
  async ``run``/``release`` API the data plane calls on rank 0) and :class:`RunnerSupervisor`;
  :mod:`.runner_process`: the runner's process as the daemon spawns, kills and reaps it.
* :mod:`.runner`: the runner process; :mod:`.sharding`: what a rank loads; :mod:`.wire`: frames.

Importing this package does not import MLX (the runner and :mod:`.sharding` do).
"""

from meshd.inference.tensor_parallel.member import (
    RunnerState,
    RunnerSupervisor,
    StepOutput,
    TensorParallelError,
    TensorParallelMember,
)
from meshd.inference.tensor_parallel.spec import (
    GroupMember,
    TensorParallelSpec,
    TensorParallelUnsupported,
    build_group_spec,
    check_tensor_parallel,
    supports_tensor_parallel,
    tensor_parallel_refusal,
)
from meshd.mesh.link_trust import (
    LinkFacts,
    LinkVerdict,
    collective_link_verdict,
    describe_local_link,
    group_link_verdict,
)

__all__ = [
    "GroupMember",
    "LinkFacts",
    "LinkVerdict",
    "RunnerState",
    "RunnerSupervisor",
    "StepOutput",
    "TensorParallelError",
    "TensorParallelMember",
    "TensorParallelSpec",
    "TensorParallelUnsupported",
    "build_group_spec",
    "check_tensor_parallel",
    "collective_link_verdict",
    "describe_local_link",
    "group_link_verdict",
    "supports_tensor_parallel",
    "tensor_parallel_refusal",
]
