"""One rank's part of a tensor-parallel stage: the stage's layers, sharded over the group.

Loading reuses the pipeline stage loader (:func:`meshd.inference.stage.shard.load_stage`: mlx-lm's
own loader, only the stage's tensors, pruned to the stage) and, while the weights are still lazy,
applies mlx-lm's own ``shard(group)`` to the stage's layers. Each layer is then evaluated on its
own, so a rank holds its shards plus, for a moment, one layer's whole tensors (``mx.load`` reads
a tensor whole; the slice is what stays).

Which rank holds what: every rank holds its slice of each layer (heads, MLP columns, every
expert's columns: mlx-lm's even split). The embedding is replicated where the stage has it
(each rank embeds the token ids itself); the final norm and LM head only on rank 0, the only
rank whose output is used.

Expert placement (``spec.expert_ranges``): instead of a slice of every expert, rank ``r`` holds
whole experts ``[start_r, end_r)`` of each MoE layer, as the planner placed them (in proportion
to the members' memory and speed). The router stays replicated; every rank routes every token,
runs the chosen experts it holds (:class:`ExpertRange` zeroes the others' outputs), and the MoE
block's own all-reduce (``sharding_group``, set by mlx-lm's ``shard``) sums the ranks' parts:
the same sum as one process, in a different order. Shared experts and attention stay split by
mlx-lm's even split.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from meshd.inference.stage.model import StageModel
from meshd.inference.stage.shard import load_stage, only_stage_layers
from meshd.inference.tensor_parallel.spec import (
    TensorParallelSpec,
    TensorParallelUnsupported,
    check_tensor_parallel,
    tensor_parallel_refusal,
)
from meshd.models.tensor_parallel_support import DEFAULT_EXPERTS_ATTRIBUTE, EXPERTS_ATTRIBUTES


class ExpertRange(nn.Module):
    """The routed experts ``[start, start + count)`` of one MoE layer, on one rank.

    Called like the SwitchGLU it wraps (``(x, indices) -> (..., k, hidden)``) with the router's
    global expert indices: outputs of experts held elsewhere are zero, so the MoE block's
    weighted sum over ``k`` holds exactly this rank's share, and the block's all-reduce adds the
    other ranks' shares.
    """

    def __init__(self, experts: nn.Module | None, start: int, count: int, hidden: int) -> None:
        super().__init__()
        if experts is not None:
            self.experts = experts
        self.start = start
        self.count = count
        self.hidden = hidden

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self.count == 0:  # this rank holds none of this layer's experts
            return mx.zeros((*indices.shape, self.hidden), dtype=x.dtype)
        local = indices.astype(mx.int32) - self.start
        held = (local >= 0) & (local < self.count)
        y = self.experts(x, mx.where(held, local, 0).astype(indices.dtype))
        return y * mx.expand_dims(held, -1).astype(y.dtype)


def load_rank_stage(
    spec: TensorParallelSpec, rank: int, group: Any, *, refuse_unverified: bool = True
) -> StageModel:
    """Rank ``rank``'s part of the stage (``group`` = this rank's ``mx.distributed`` group, or
    None for a group of one, which runs the stage unsharded). ``refuse_unverified=False`` only
    for the verification that makes meshd.models.architecture_table."""
    check_tensor_parallel(
        spec.model_dir, spec.size, spec.expert_ranges, refuse_unverified=refuse_unverified
    )

    def prepare(model: nn.Module, layers: list[nn.Module]) -> None:
        if group is not None and spec.size > 1:
            shard_stage(model, spec, rank, group, refuse_unverified=refuse_unverified)
        for layer in layers:  # one layer's whole tensors at a time
            mx.eval(layer.parameters())

    return load_stage(
        Path(spec.model_dir),
        spec.layer_start,
        spec.layer_end,
        has_embedding=spec.has_embedding,
        has_head=spec.has_head and rank == 0,
        prepare=prepare,
        refuse_unverified=refuse_unverified,
    )


def shard_stage(
    model: nn.Module,
    spec: TensorParallelSpec,
    rank: int,
    group: Any,
    *,
    refuse_unverified: bool = True,
) -> None:
    """mlx-lm's ``shard(group)`` on the stage's layers, then expert placement if the spec has
    one. Weights stay lazy."""
    architecture = _architecture(model)
    refusal = tensor_parallel_refusal(architecture) if refuse_unverified else None
    if refusal is None and not hasattr(model, "shard"):
        refusal = f"mlx-lm's {architecture} model has no shard(group)"
    if refusal is not None:
        raise TensorParallelUnsupported(refusal)
    experts_attr = EXPERTS_ATTRIBUTES.get(architecture, DEFAULT_EXPERTS_ATTRIBUTE)
    with only_stage_layers(model, spec.layer_range) as layers:
        placed: list[_PlacedExperts] = []
        if spec.expert_ranges:
            start, end = spec.expert_ranges[rank]
            placed = _take_experts(layers, experts_attr, start, end)
            if not placed:
                raise TensorParallelUnsupported(
                    f"expert placement given for layers {spec.layer_range}, which have no "
                    "routed experts; the plan must leave expert_ranges empty for this stage"
                )
        model.shard(group)
    for entry in placed:
        entry.install()


def _architecture(model: nn.Module) -> str:
    """The mlx-lm model module of ``model`` (the stage loader subclasses mlx-lm's class)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("mlx_lm.models."):
            return cls.__module__.rsplit(".", 1)[-1]
    return type(model).__module__


@dataclass
class _PlacedExperts:
    """One MoE layer's routed experts ``[start, end)`` for this rank, taken (lazily) before
    ``shard`` slices every expert: mlx-lm's shard also changes some of these arrays in place
    (gpt_oss divides the experts' output bias by the group size), so the slices must be taken
    from the untouched checkpoint arrays."""

    block: nn.Module
    attr: str
    experts: nn.Module
    mine: dict[str, mx.array]
    start: int
    count: int
    hidden: int

    def install(self) -> None:
        """Replace mlx-lm's slice of every expert with this rank's whole experts."""
        if self.count:
            self.experts.update(tree_unflatten(list(self.mine.items())))
        experts = self.experts if self.count else None
        setattr(self.block, self.attr, ExpertRange(experts, self.start, self.count, self.hidden))


def _take_experts(
    layers: list[nn.Module], attr: str | None, start: int, end: int
) -> list[_PlacedExperts]:
    placed = []
    for layer in layers:
        block = layer.get("mlp") if attr else None
        experts = block.get(attr) if isinstance(block, nn.Module) else None
        if attr is None or experts is None or not hasattr(block, "sharding_group"):
            continue
        whole = dict(tree_flatten(experts.parameters()))
        sizes = {value.shape[0] for value in whole.values()}
        down = [v for k, v in whole.items() if k.startswith("down_proj.") and k.endswith("weight")]
        if len(sizes) != 1 or end > sizes.pop() or len(down) != 1:
            raise TensorParallelUnsupported(
                f"the routed experts' tensors do not share one leading expert axis holding "
                f"experts [{start}, {end}): {[(k, v.shape) for k, v in whole.items()]}"
            )
        mine = {name: value[start:end] for name, value in whole.items()}
        placed.append(
            _PlacedExperts(block, attr, experts, mine, start, end - start, down[0].shape[1])
        )
    return placed
