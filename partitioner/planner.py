"""plan_model: mesh graph + model description + options in, Plan (or a refusal) out.

Pure and deterministic: the same graph content in any insertion order gives the same Plan and
plan id on every machine. The id hashes ALGORITHM_VERSION and exactly the quantized inputs the
planner reads (partitioner.mesh.MeshView.canonical, the ModelSpec, the options), as canonical
JSON of integers and strings; human labels (node names) do not enter it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import networkx as nx

from partitioner.cost import TOKEN_BYTES, CostModel, Unit
from partitioner.errors import InsufficientMemory
from partitioner.fit import find_fitting_layout
from partitioner.humanize import format_bytes
from partitioner.layout import Evaluator, Layout
from partitioner.mesh import MeshView
from partitioner.model import ModelSpec
from partitioner.options import PlanOptions
from partitioner.plan import Hop, LeftOut, NodeMemory, Plan, Prediction, Stage
from partitioner.split import largest_remainder
from partitioner.stage_units import single_units, tensor_parallel_units, usable_bytes
from partitioner.strategies import SpeedSearch, memory_layout

ALGORITHM_VERSION = "meshd-partitioner/2"


def plan_model(mesh: nx.DiGraph, model: ModelSpec, options: PlanOptions | None = None) -> Plan:
    """Plan which node holds which layers of `model`; raises InsufficientMemory if none fits."""
    options = options or PlanOptions()
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model must be a ModelSpec, got {type(model).__name__}")
    view = MeshView.from_graph(mesh, options.exclude, model.hidden_state_bytes)
    cost = CostModel(model, options)
    singles = single_units(view, options.reserve_bytes)
    units = list(singles)
    if options.allow_tensor_parallel:
        units += tensor_parallel_units(view, model, cost, singles)
    evaluator = Evaluator(cost, view)
    layout = _choose_layout(options.strategy, evaluator, singles, units)
    if layout is None:
        raise _refusal(cost, view, singles)
    excluded = sorted(str(node) for node in mesh.nodes if str(node) in options.exclude)
    return _build_plan(layout, evaluator, options, plan_id(view, model, options), excluded)


def plan_id(view: MeshView, model: ModelSpec, options: PlanOptions) -> str:
    """sha256 hex over the algorithm version and the canonical quantized inputs."""
    settings = options.to_dict()
    settings.pop("exclude")
    settings["context_length"] = options.context_length or model.context_length
    payload = {
        "algorithm": ALGORITHM_VERSION,
        "mesh": view.canonical(),
        "model": model.to_dict(),
        "options": settings,
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _choose_layout(
    strategy: str, evaluator: Evaluator, singles: list[Unit], units: list[Unit]
) -> Layout | None:
    """The strategy's layout within one strongly connected part of the mesh.

    A pipeline is a ring, so all its nodes must reach each other. In the usual, connected mesh
    there is one part. Otherwise `memory` takes the first part that fits, largest usable memory
    first, and `speed` the part with the fastest plan.
    """
    best: Layout | None = None
    best_key: tuple[float, Any] | None = None
    for part in evaluator.view.components():
        members = set(part)
        part_singles = [u for u in singles if u.leader in members]
        part_units = [u for u in units if members.issuperset(u.nodes)]
        layout = _layout_in_part(strategy, evaluator, part_singles, part_units)
        if layout is None:
            continue
        if strategy == "memory":
            return layout
        key = (evaluator.score(layout).time_per_token_s, layout.tie_key())
        if best_key is None or key < best_key:
            best, best_key = layout, key
    return best


def _layout_in_part(
    strategy: str, evaluator: Evaluator, singles: list[Unit], units: list[Unit]
) -> Layout | None:
    cost = evaluator.cost
    baseline = memory_layout(cost, singles)
    if strategy == "memory":
        return baseline or find_fitting_layout(cost, singles)
    fitting = None if baseline is not None else find_fitting_layout(cost, units)
    extras = [layout for layout in (baseline, fitting) if layout is not None]
    return SpeedSearch(evaluator, units).run(extras)


# ---- refusal --------------------------------------------------------------------------------


def _refusal(cost: CostModel, view: MeshView, singles: Sequence[Unit]) -> InsufficientMemory:
    needed = cost.whole_model_memory()
    available = sum(unit.usable_bytes for unit in singles)
    return InsufficientMemory(
        model_name=cost.model.name,
        needed_bytes=needed,
        available_bytes=available,
        per_node_shortfall=_proportional_shortfall(cost, singles),
        detail=_refusal_detail(cost, view, singles, needed, available),
    )


def _proportional_shortfall(cost: CostModel, singles: Sequence[Unit]) -> dict[str, int]:
    """Bytes over budget per node when layers are split in proportion to memory."""
    order = sorted(singles, key=lambda u: (-u.usable_bytes, u.nodes))
    shares = largest_remainder(cost.num_layers, [u.usable_bytes for u in order])
    kept = [(u, s) for u, s in zip(order, shares, strict=True) if s > 0]
    shortfall: dict[str, int] = {}
    start = 0
    for index, (unit, share) in enumerate(kept):
        end = start + share
        need = cost.memory(start, end, first=index == 0, last=index == len(kept) - 1).total
        if need > unit.usable_bytes:
            shortfall[unit.leader] = need - unit.usable_bytes
        start = end
    return shortfall


def _refusal_detail(
    cost: CostModel, view: MeshView, singles: Sequence[Unit], needed: int, available: int
) -> str:
    if not view.nodes:
        return "the mesh has no nodes (after exclusions)"
    if not singles:
        return "no node has usable memory (every budget is at or below the reserve)"
    if needed > available:
        return "the mesh has too little memory in total"
    parts = view.components()
    if len(parts) > 1:
        return (
            f"the mesh is split into {len(parts)} parts whose nodes cannot reach each other, "
            "and no part alone can hold the model"
        )
    largest = max(singles, key=lambda u: u.usable_bytes)  # ties: the lowest id
    sizes = [cost.memory(i, i + 1, first=False, last=False).total for i in range(cost.num_layers)]
    biggest = max(range(cost.num_layers), key=lambda i: (sizes[i], -i))
    if sizes[biggest] > largest.usable_bytes:
        return (
            f"layer {biggest} alone needs {format_bytes(sizes[biggest])} with its KV cache, "
            f"but the largest usable budget is {format_bytes(largest.usable_bytes)} "
            f"(node {largest.leader})"
        )
    return (
        "the memory suffices in total but the layers cannot be packed into the nodes' budgets "
        "(each stage holds whole, contiguous layers; the first also the embeddings, the last "
        "also the head)"
    )


# ---- building the Plan ----------------------------------------------------------------------


def _build_plan(
    layout: Layout,
    evaluator: Evaluator,
    options: PlanOptions,
    identifier: str,
    excluded: list[str],
) -> Plan:
    cost = evaluator.cost
    last = len(layout.units) - 1
    stages = tuple(
        Stage(unit.nodes, start, end, has_embedding=i == 0, has_head=i == last)
        for i, (unit, (start, end)) in enumerate(zip(layout.units, layout.ranges(), strict=True))
    )
    hops = _hops(layout, evaluator)
    return Plan(
        plan_id=identifier,
        algorithm_version=ALGORITHM_VERSION,
        strategy=options.strategy,
        model_name=cost.model.name,
        num_layers=cost.num_layers,
        context_length=cost.context_length,
        concurrency=cost.concurrency,
        stages=stages,
        memory=_node_memory(layout, evaluator, options),
        hops=hops,
        prediction=_prediction(layout, evaluator, hops),
        left_out=_left_out(layout, evaluator, options, excluded),
    )


def _node_memory(
    layout: Layout, evaluator: Evaluator, options: PlanOptions
) -> tuple[NodeMemory, ...]:
    cost, view = evaluator.cost, evaluator.view
    last = len(layout.units) - 1
    entries = []
    for index, (unit, (start, end)) in enumerate(zip(layout.units, layout.ranges(), strict=True)):
        use = cost.memory(start, end, first=index == 0, last=index == last, degree=unit.degree)
        for node in unit.nodes:
            entries.append(
                NodeMemory(
                    node=node,
                    stage=index,
                    weights_bytes=use.weights,
                    kv_cache_bytes=use.kv_cache,
                    activation_bytes=use.activations,
                    overhead_bytes=use.overhead,
                    total_bytes=use.total,
                    budget_bytes=view.nodes[node].memory_budget,
                    usable_bytes=usable_bytes(view, node, options.reserve_bytes),
                )
            )
    return tuple(entries)


def _hops(layout: Layout, evaluator: Evaluator) -> tuple[Hop, ...]:
    units = layout.units
    if len(units) < 2:
        return ()
    hidden = evaluator.cost.hidden_bytes
    prompt = hidden * evaluator.cost.prompt_len
    hops = []
    for i in range(len(units) - 1):
        step = evaluator.route(units[i], units[i + 1], hidden)
        whole = evaluator.route(units[i], units[i + 1], prompt)
        assert step is not None and whole is not None, "layouts only join reachable units"
        hops.append(Hop(i, i + 1, "hidden", step.path, step.seconds, whole.seconds))
    back = evaluator.route(units[-1], units[0], TOKEN_BYTES)
    assert back is not None, "layouts only join reachable units"
    hops.append(Hop(len(units) - 1, 0, "token", back.path, back.seconds, None))
    return tuple(hops)


def _prediction(layout: Layout, evaluator: Evaluator, hops: tuple[Hop, ...]) -> Prediction:
    cost = evaluator.cost
    score = evaluator.score(layout)
    last = len(layout.units) - 1
    prefill = tuple(
        cost.stage_prefill_s(unit, start, end, last=i == last)
        for i, (unit, (start, end)) in enumerate(zip(layout.units, layout.ranges(), strict=True))
    )
    ttft = sum(prefill) + sum(hop.prompt_s for hop in hops if hop.prompt_s is not None)
    return Prediction(
        decode_s_per_token=score.decode_s,
        tokens_per_s=_per_second(score.decode_s),
        time_per_token_s=score.time_per_token_s,
        aggregate_tokens_per_s=cost.concurrency * _per_second(score.time_per_token_s),
        ttft_s=ttft,
        prompt_len=cost.prompt_len,
        stage_decode_s=score.stage_s,
        stage_prefill_s=prefill,
        hops_decode_s=score.hops_s,
    )


def _per_second(seconds: float) -> float:
    return 1.0 / seconds if seconds > 0 else 0.0


def _left_out(
    layout: Layout, evaluator: Evaluator, options: PlanOptions, excluded: list[str]
) -> tuple[LeftOut, ...]:
    cost, view = evaluator.cost, evaluator.view
    used = {node for unit in layout.units for node in unit.nodes}
    reachable = next(set(part) for part in view.components() if layout.units[0].leader in part)
    sizes = cost.model.layer_bytes
    smallest = min(range(cost.num_layers), key=lambda i: (sizes[i], i))
    one_layer = cost.memory(smallest, smallest + 1, first=False, last=False).total
    entries = [LeftOut(node, "excluded by the options") for node in excluded]
    for node_id in view.node_ids:
        if node_id in used:
            continue
        usable = usable_bytes(view, node_id, options.reserve_bytes)
        if usable == 0:
            reason = "no usable memory: its budget is at or below the reserve"
        elif node_id not in reachable:
            reason = "no network route between it and the plan's nodes in both directions"
        elif usable < one_layer:
            reason = f"too little memory ({format_bytes(usable)}) for even one layer"
        elif options.strategy == "memory":
            reason = "its memory-proportional share rounded to zero layers"
        else:
            reason = "not needed: the plan is predicted faster without it"
        entries.append(LeftOut(node_id, reason))
    return tuple(sorted(entries, key=lambda entry: entry.node))


def plan_summary(plan: Plan) -> dict[str, Any]:
    """A compact dict for logs: id, strategy, stages as 'node:start-end', ms per token."""
    return {
        "plan_id": plan.short_id,
        "strategy": plan.strategy,
        "stages": [f"{'+'.join(s.nodes)}:{s.layer_start}-{s.layer_end}" for s in plan.stages],
        "ms_per_token": round(plan.prediction.decode_s_per_token * 1e3, 3),
    }
