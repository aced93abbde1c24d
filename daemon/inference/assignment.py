"""What a node is asked to serve: a committed plan as the data plane needs it.

An :class:`Assignment` is the plan id (the epoch every frame carries), the model directory
and the ordered stages, each a node with its address and its contiguous layer range. Every
node of the mesh installs the same assignment; a node that holds no stage can still be the
origin of requests (it needs the tokenizer only).

A tensor-parallel stage is a group of nodes (``StageSpec.members``, in rank order) that split
its layers; its rank 0 (``node_id``) is the stage's data-plane endpoint: the previous stage
sends to it and it runs the stage through the group's runners. The other members receive no
frames; they only run their ranks (see :mod:`meshd.inference.tensor_parallel`).

:func:`check_stage_chain` is the one validator of a chain of pipeline stages (contiguous
layers from 0, embedding first, head last); anything that chains stages (an assignment, a
pipeline of loaded stages in one process) checks itself with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class InvalidAssignment(ValueError):
    """A plan or a chain of stages that cannot be run as a pipeline; the message says why."""


class LayerSpan(Protocol):
    """What :func:`check_stage_chain` reads of a stage."""

    @property
    def layer_start(self) -> int: ...

    @property
    def layer_end(self) -> int: ...

    @property
    def has_embedding(self) -> bool: ...

    @property
    def has_head(self) -> bool: ...


def check_stage_chain(
    stages: Sequence[LayerSpan], *, num_layers: int | None = None, what: str = "the pipeline"
) -> None:
    """Raise InvalidAssignment unless ``stages`` run a whole model in order: contiguous
    non-empty layer ranges from layer 0 (to ``num_layers`` when given), the first stage alone
    embeds, the last alone holds the head. ``what`` names the chain in messages."""
    if not stages:
        raise InvalidAssignment(f"{what} has no stages")
    if not stages[0].has_embedding or not stages[-1].has_head:
        raise InvalidAssignment(f"{what}: the first stage must embed and the last hold the head")
    if any(s.has_embedding for s in stages[1:]) or any(s.has_head for s in stages[:-1]):
        raise InvalidAssignment(f"{what}: only the first stage embeds, only the last has a head")
    expected = 0
    for index, stage in enumerate(stages):
        if stage.layer_start != expected or stage.layer_end <= stage.layer_start:
            raise InvalidAssignment(
                f"{what}: stage {index} holds layers [{stage.layer_start}, {stage.layer_end}), "
                f"expected a contiguous, non-empty range starting at layer {expected}"
            )
        expected = stage.layer_end
    if num_layers is not None and expected != num_layers:
        raise InvalidAssignment(
            f"{what}: the stages end at layer {expected} but the model has {num_layers} layers"
        )


@dataclass(frozen=True)
class StageSpec:
    """One stage of an assignment: which node holds which layers, and where to reach it.

    members: a tensor-parallel stage's nodes in rank order (``members[0] == node_id``, the
        endpoint); empty for a stage of one node.
    experts: for a tensor-parallel stage with MoE layers, ``(node, first, end)`` routed
        experts per member in rank order (the plan's placement); empty = mlx-lm's even split.
    """

    node_id: str
    address: str
    layer_start: int
    layer_end: int
    has_embedding: bool
    has_head: bool
    members: tuple[str, ...] = ()
    experts: tuple[tuple[str, int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(self, "experts", tuple(tuple(e) for e in self.experts))
        if self.members and self.members[0] != self.node_id:
            raise InvalidAssignment(
                f"stage of {self.node_id}: a tensor-parallel stage's endpoint is its rank 0, "
                f"but its members are {list(self.members)}"
            )

    @property
    def tensor_parallel(self) -> bool:
        return len(self.members) > 1

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node that holds a part of this stage (rank order)."""
        return self.members or (self.node_id,)


@dataclass(frozen=True)
class Assignment:
    """A committed plan as the data plane needs it: its id, the model and the ordered stages."""

    plan_id: str
    model_dir: Path
    stages: tuple[StageSpec, ...]
    # Tokens of KV cache the plan reserves per sequence (its memory prediction counts them):
    # a request whose prompt plus max_tokens exceeds it is refused. 0: no limit (a pipeline
    # built by hand, without a plan).
    context_length: int = 0
    # Sequences the plan reserves KV cache for (the partitioner's ``concurrency``): with
    # ``context_length``, the KV tokens the first stage may admit at once (see
    # :attr:`kv_budget_tokens`). 0: no bound but the stages' request limit.
    concurrency: int = 0
    # Sequences of KV the plan reserves beyond ``concurrency`` for the prefix cache's kept
    # prefixes (:mod:`meshd.inference.stage.prefix`); they also use what running requests
    # leave free of the ``concurrency`` ones.
    cache_sequences: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.plan_id:
            raise InvalidAssignment("an assignment needs a plan id (the epoch its frames carry)")
        what = f"plan {self.plan_id}"
        check_stage_chain(self.stages, what=what)
        nodes = self.member_ids
        if len(set(nodes)) != len(nodes):
            raise InvalidAssignment(f"{what}: a node holds more than one stage ({list(nodes)})")
        if self.concurrency < 0:
            raise InvalidAssignment(f"{what}: concurrency {self.concurrency} < 0")
        if self.context_length < 0:
            raise InvalidAssignment(f"{what}: context length {self.context_length} < 0")
        if self.cache_sequences < 0:
            raise InvalidAssignment(f"{what}: cache sequences {self.cache_sequences} < 0")

    def context_error(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of ``prompt_tokens`` and ``max_tokens`` does not fit the context the
        plan reserves per sequence, or None when it fits (or the plan sets no limit)."""
        needed = prompt_tokens + max_tokens
        if not self.context_length or needed <= self.context_length:
            return None
        room = self.context_length - prompt_tokens
        advice = (
            f"shorten the prompt or lower max_tokens (at most {room} for this prompt)"
            if room > 0
            else f"the prompt alone fills it: shorten it below {self.context_length} tokens"
        )
        return (
            f"the prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}) need "
            f"{needed} tokens of context, but plan {self.plan_id[:12]} reserves "
            f"{self.context_length} per sequence; {advice}"
        )

    @property
    def kv_budget_tokens(self) -> int:
        """KV tokens the plan's memory prediction reserves on every node (context length x
        concurrency): the requests running at once may together reserve no more (0: no bound).
        """
        return self.context_length * self.concurrency

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The stages' endpoints (a tensor-parallel stage's rank 0), in stage order."""
        return tuple(stage.node_id for stage in self.stages)

    @property
    def member_ids(self) -> tuple[str, ...]:
        """Every node holding a part of a stage (tensor-parallel members included)."""
        return tuple(node for stage in self.stages for node in stage.nodes)

    def stage_index(self, node_id: str) -> int | None:
        """Index of the stage ``node_id`` is the endpoint of, or None."""
        return next((i for i, s in enumerate(self.stages) if s.node_id == node_id), None)

    def member_stage(self, node_id: str) -> int | None:
        """Index of the stage ``node_id`` holds a part of (any rank), or None."""
        return next((i for i, s in enumerate(self.stages) if node_id in s.nodes), None)

    def address_of(self, node_id: str) -> str | None:
        """The data-plane address of a stage's node, or None for a node that holds none."""
        index = self.stage_index(node_id)
        return None if index is None else self.stages[index].address

    @classmethod
    def from_plan(cls, plan: Any, model_dir: Path, addresses: Mapping[str, str]) -> Assignment:
        """From a :class:`partitioner.plan.Plan` and the peers' data-plane addresses (only
        the stages' endpoints need one)."""
        stages = []
        for stage in plan.stages:
            node = stage.nodes[0]
            if node not in addresses:
                raise InvalidAssignment(f"no address known for node {node} of plan {plan.plan_id}")
            stages.append(
                StageSpec(
                    node_id=node,
                    address=addresses[node],
                    layer_start=stage.layer_start,
                    layer_end=stage.layer_end,
                    has_embedding=stage.has_embedding,
                    has_head=stage.has_head,
                    members=tuple(stage.nodes) if len(stage.nodes) > 1 else (),
                    experts=tuple(
                        (shard.node, shard.expert_start, shard.expert_end)
                        for shard in stage.experts
                    ),
                )
            )
        return cls(
            plan_id=plan.plan_id,
            model_dir=Path(model_dir),
            stages=tuple(stages),
            context_length=int(getattr(plan, "context_length", 0) or 0),
            concurrency=int(getattr(plan, "concurrency", 0) or 0),
            cache_sequences=int(getattr(plan, "cache_sequences", 0) or 0),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan_id": self.plan_id,
            "model_dir": str(self.model_dir),
            "stages": [
                {
                    **vars(stage),
                    "members": list(stage.members),
                    "experts": [list(shard) for shard in stage.experts],
                }
                for stage in self.stages
            ],
            "context_length": self.context_length,
            "concurrency": self.concurrency,
            "cache_sequences": self.cache_sequences,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Assignment:
        return cls(
            plan_id=data["plan_id"],
            model_dir=Path(data["model_dir"]),
            stages=tuple(StageSpec(**stage) for stage in data["stages"]),
            context_length=int(data.get("context_length", 0)),
            concurrency=int(data.get("concurrency", 0)),
            cache_sequences=int(data.get("cache_sequences", 0)),
        )
