"""The Plan: ordered stages, per-node memory, predictions and a stable id. JSON round-trippable."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ExpertShard:
    """The routed experts one member of a tensor-parallel stage holds: [expert_start,
    expert_end) of every MoE layer of the stage."""

    node: str
    expert_start: int
    expert_end: int

    @property
    def count(self) -> int:
        return self.expert_end - self.expert_start


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a node (or a tensor-parallel group) holding layers [start, end).

    experts: for a tensor-parallel stage with MoE layers, which member holds which routed
    experts of each of `moe_layers` (the stage's MoE layers); empty otherwise (a single node
    holds all of them).
    """

    nodes: tuple[str, ...]
    layer_start: int
    layer_end: int
    has_embedding: bool
    has_head: bool
    experts: tuple[ExpertShard, ...] = ()
    moe_layers: tuple[int, ...] = ()

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def tensor_parallel(self) -> bool:
        return len(self.nodes) > 1


@dataclass(frozen=True)
class NodeMemory:
    """Predicted peak memory of one node (bytes); total_bytes <= usable_bytes always."""

    node: str
    stage: int
    weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    overhead_bytes: int
    total_bytes: int
    budget_bytes: int
    usable_bytes: int


@dataclass(frozen=True)
class Hop:
    """A transfer between stages: hidden states forward, or the sampled token back to stage 0.

    path: the nodes the payload travels through (two when there is a direct link).
    decode_s: one decode step's transfer; prompt_s: the prompt's hidden states (None for the
    token hop, which does not occur during prefill).
    """

    src_stage: int
    dst_stage: int
    carries: str
    path: tuple[str, ...]
    decode_s: float
    prompt_s: float | None


@dataclass(frozen=True)
class Prediction:
    """Predicted speed under partitioner.cost's model.

    decode_s_per_token: one sequence alone (sum of stages and hops); tokens_per_s = its inverse.
    time_per_token_s: between two tokens of one sequence when `concurrency` sequences decode
        together (what the speed strategy minimises); aggregate_tokens_per_s over all of them.
    ttft_s: time to first token for a prompt of prompt_len tokens.
    """

    decode_s_per_token: float
    tokens_per_s: float
    time_per_token_s: float
    aggregate_tokens_per_s: float
    ttft_s: float
    prompt_len: int
    stage_decode_s: tuple[float, ...]
    stage_prefill_s: tuple[float, ...]
    hops_decode_s: float


@dataclass(frozen=True)
class PricedRate:
    """The compute and memory rates a node's stage was priced at, and which measurement they
    are: the model's compute key ("bfloat16", "q4/bfloat16") when the node measured it, else
    the node's float32 `flops` / `mem_bandwidth` (partitioner.mesh explains the fallback)."""

    node: str
    flops: float
    mem_bandwidth: float
    source: str


@dataclass(frozen=True)
class LeftOut:
    """A mesh node that holds no layers in this plan, and why."""

    node: str
    reason: str


@dataclass(frozen=True)
class Plan:
    """Which node holds which layers, what that costs, and an id every node agrees on.

    plan_id: sha256 hex of the layout (partitioner.planner.layout_plan_id: the model, the
    settings the stages run with, the ordered stages), the same on every machine; equal
    layouts share one id. `short_id` for display.
    layout: "solo" (one node), "pipeline" (stages of one node), "tensor" (one tensor-parallel
    group) or "hybrid" (several stages, at least one a group).
    """

    plan_id: str
    algorithm_version: str
    strategy: str
    model_name: str
    num_layers: int
    context_length: int
    concurrency: int
    stages: tuple[Stage, ...]
    memory: tuple[NodeMemory, ...]
    hops: tuple[Hop, ...]
    prediction: Prediction
    left_out: tuple[LeftOut, ...]
    layout: str = ""
    cache_sequences: int = 0  # KV sequences reserved beyond `concurrency` for prefix caches
    # Why this plan is not the kind of layout asked for ("" when it is): a forced kind that
    # cannot run falls back to the best plan of another kind (partitioner.planner).
    note: str = ""
    compute_key: str = ""  # the model's compute dtype key its nodes were priced at
    priced: tuple[PricedRate, ...] = ()  # per node holding layers, in stage order

    @property
    def short_id(self) -> str:
        return self.plan_id[:12]

    @property
    def nodes(self) -> tuple[str, ...]:
        """Nodes holding layers, in stage order."""
        return tuple(node for stage in self.stages for node in stage.nodes)

    def stage_of(self, node_id: str) -> int | None:
        for index, stage in enumerate(self.stages):
            if node_id in stage.nodes:
                return index
        return None

    def node_layers(self, node_id: str) -> range:
        """The layers node_id holds (for a tensor-parallel member: its stage's layers, split by
        heads); an empty range when it holds none."""
        index = self.stage_of(node_id)
        return range(0) if index is None else self.stages[index].layers

    @property
    def layout_key(self) -> str:
        """The stages as canonical JSON (what the plan id hashes besides model and settings)."""
        return layout_key(self.stages)

    def memory_of(self, node_id: str) -> NodeMemory | None:
        return next((entry for entry in self.memory if entry.node == node_id), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (lists, ints, floats, strings); `Plan.from_dict(p.to_dict()) == p`."""
        return _to_jsonable(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(
            plan_id=data["plan_id"],
            algorithm_version=data["algorithm_version"],
            strategy=data["strategy"],
            layout=data.get("layout", ""),
            model_name=data["model_name"],
            num_layers=data["num_layers"],
            context_length=data["context_length"],
            concurrency=data["concurrency"],
            cache_sequences=data.get("cache_sequences", 0),
            note=data.get("note", ""),
            stages=tuple(_stage_from_dict(item) for item in data["stages"]),
            memory=tuple(NodeMemory(**item) for item in data["memory"]),
            hops=tuple(Hop(**{**item, "path": tuple(item["path"])}) for item in data["hops"]),
            prediction=Prediction(
                **{
                    **data["prediction"],
                    "stage_decode_s": tuple(data["prediction"]["stage_decode_s"]),
                    "stage_prefill_s": tuple(data["prediction"]["stage_prefill_s"]),
                }
            ),
            left_out=tuple(LeftOut(**item) for item in data["left_out"]),
            compute_key=data.get("compute_key", ""),
            priced=tuple(PricedRate(**item) for item in data.get("priced", ())),
        )


def layout_key(stages: Sequence[Stage]) -> str:
    """Canonical JSON of ordered stages: equal layouts give equal text on every machine."""
    return json.dumps(
        [_to_jsonable(stage) for stage in stages], sort_keys=True, separators=(",", ":")
    )


def stages_from_layout_key(text: str) -> tuple[Stage, ...]:
    """The stages `layout_key` wrote; ValueError when the text is not such a list."""
    try:
        items = json.loads(text)
        stages = tuple(_stage_from_dict(item) for item in items)
    except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as error:
        raise ValueError(f"not a layout: {error}") from error
    if not isinstance(items, list):
        raise ValueError("not a layout: expected a list of stages")
    return stages


def _stage_from_dict(item: dict[str, Any]) -> Stage:
    return Stage(
        **{
            **item,
            "nodes": tuple(item["nodes"]),
            "experts": tuple(ExpertShard(**shard) for shard in item.get("experts", ())),
            "moe_layers": tuple(item.get("moe_layers", ())),
        }
    )


def _to_jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return {field.name: _to_jsonable(getattr(value, field.name)) for field in fields(value)}
    if isinstance(value, tuple | list):
        return [_to_jsonable(item) for item in value]
    return value
