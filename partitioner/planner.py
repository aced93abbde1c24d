"""plan_model: mesh graph + model description + options in, Plan (or a refusal) out.

Pure and deterministic: the same graph content in any insertion order gives the same Plan and
plan id on every machine.

A plan's identity is its layout (`layout_plan_id`): the id hashes the model description, the
settings the stages run with (context length, concurrency, prefill chunk) and the ordered
stages (node ids, layer ranges, embedding and head, tensor-parallel groups and their experts),
as canonical JSON. Inputs that only chose the layout (measured links, speeds, budgets, the
strategy) do not enter it: two plans that run the same stages on the same nodes are one plan,
with one fencing token, however the measurements that produced them moved.

Nodes earn their place (PlanOptions.min_gain, default 10 %): of the layouts the search finds,
the one with the fewest nodes whose predicted time per token (at the plan's concurrency) is
within (1 + min_gain) of the fastest is taken; a node that the model needs for memory is always
used (partitioner.strategies, step 7).

Sticky layouts (`incumbent`): the layout the mesh runs now is kept while it still fits and its
nodes are in the mesh, unless a different layout is predicted more than SWITCH_GAIN faster
(speed strategy; the memory strategy reads no measurement, so it never moves on noise). Going
back needs the same margin the other way, so predictions that move within noise cannot make
the mesh flap between two layouts, and a re-plan that gains little does not reload weights.
The two rules agree: an incumbent that uses more nodes than the fresh layout must still earn
them, so it is dropped once it is no longer at least min_gain / 2 faster (it joined with
min_gain; the half is a band against noise), and a fresh layout with more nodes replaces a
smaller incumbent only when it is both min_gain faster than the fewest nodes (else it would not
be the fresh choice) and SWITCH_GAIN faster than the incumbent.

Choosing the kind of layout (PlanOptions.parallelism): the search runs over single nodes and,
where the model can shard and trusted links join nodes, tensor-parallel groups
(partitioner.stage_units), restricted to the sets of units the kind allows:
- solo: one node holds everything; pipeline: two or more one-node stages;
- tensor: one stage that is a group; hybrid: two or more stages, at least one a group.
"auto" allows every set, so it takes the fastest predicted layout of any kind; one node alone
is always among the candidates, so a split is chosen only when it is predicted faster than the
fastest node that holds the model by more than min_gain. `plan_alternatives` plans each kind
separately for side-by-side comparisons.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import networkx as nx

from partitioner.cost import TOKEN_BYTES, CostModel, Unit
from partitioner.errors import InsufficientMemory, ParallelismUnavailable
from partitioner.experts import expert_ranges, place_experts
from partitioner.fit import find_fitting_layout
from partitioner.humanize import format_bytes
from partitioner.layout import Evaluator, Layout
from partitioner.mesh import MeshView
from partitioner.model import ModelSpec
from partitioner.options import PlanOptions
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
)
from partitioner.split import largest_remainder
from partitioner.stage_units import (
    TP_MAX_DEGREE,
    single_units,
    tensor_parallel_degrees,
    tensor_parallel_units,
    trusted_link_graph,
    usable_bytes,
)
from partitioner.strategies import (
    Accept,
    SpeedSearch,
    choose_within_margin,
    memory_layout,
    node_count,
)

ALGORITHM_VERSION = "meshd-partitioner/4"
# A different layout replaces the incumbent only when predicted more than this much faster.
SWITCH_GAIN = 0.10
LAYOUTS = ("solo", "pipeline", "tensor", "hybrid")


def layout_kind(units: Sequence[Unit]) -> str:
    """Which of LAYOUTS a sequence of stage units is."""
    grouped = any(unit.degree > 1 for unit in units)
    if len(units) == 1:
        return "tensor" if grouped else "solo"
    return "hybrid" if grouped else "pipeline"


_ACCEPTS: dict[str, Accept] = {
    "auto": lambda unit_set: True,
    "solo": lambda unit_set: layout_kind(list(unit_set)) == "solo",
    "pipeline": lambda unit_set: layout_kind(list(unit_set)) == "pipeline",
    "tensor": lambda unit_set: layout_kind(list(unit_set)) == "tensor",
    "hybrid": lambda unit_set: layout_kind(list(unit_set)) == "hybrid",
}


# How a plan's note names the kind of layout served instead of the one asked for.
_SERVED_INSTEAD = {
    "solo": "one node alone",
    "pipeline": "a pipeline",
    "tensor": "one tensor-parallel group",
    "hybrid": "a hybrid (pipeline stages of tensor-parallel groups)",
}


def plan_model(
    mesh: nx.DiGraph,
    model: ModelSpec,
    options: PlanOptions | None = None,
    incumbent: Sequence[Stage] | None = None,
    *,
    fallback: bool = True,
) -> Plan:
    """Plan which node holds which layers of `model`.

    `incumbent`: the stages the mesh runs now, kept unless no longer possible or a different
    layout is predicted more than SWITCH_GAIN faster (see the module docstring).
    A forced kind of layout (PlanOptions.parallelism) that cannot run falls back to the best
    plan of any kind, whose `note` says what is missing and what serves instead (a mesh that
    lost a tensor-parallel member goes on serving); with `fallback=False` it raises
    ParallelismUnavailable instead. Raises InsufficientMemory when no layout fits the mesh's
    memory (the message says where memory is missing).
    """
    options = options or PlanOptions()
    try:
        return _plan(mesh, model, options, options.parallelism, incumbent)
    except ParallelismUnavailable as refusal:
        if not fallback:
            raise
        plan = _plan(mesh, model, options, "auto", incumbent)
        return replace(plan, note=fallback_note(refusal, plan.layout))


def fallback_note(refusal: ParallelismUnavailable, served: str) -> str:
    """What a plan that falls back from a forced kind says: what is missing, what serves
    instead, and what would let the asked-for kind run."""
    text = f"{refusal.missing}: serving {_SERVED_INSTEAD.get(served, served)} instead"
    return f"{text}; {refusal.remedy}" if refusal.remedy else text


def plan_alternatives(
    mesh: nx.DiGraph, model: ModelSpec, options: PlanOptions | None = None
) -> dict[str, Plan | InsufficientMemory | ParallelismUnavailable]:
    """The fastest plan of each kind in LAYOUTS, or why that kind cannot run (speed strategy)."""
    options = options or PlanOptions()
    outcomes: dict[str, Plan | InsufficientMemory | ParallelismUnavailable] = {}
    for kind in LAYOUTS:
        try:
            outcomes[kind] = _plan(mesh, model, options, kind)
        except (InsufficientMemory, ParallelismUnavailable) as refusal:
            outcomes[kind] = refusal
    return outcomes


def _plan(
    mesh: nx.DiGraph,
    model: ModelSpec,
    options: PlanOptions,
    kind: str,
    incumbent: Sequence[Stage] | None = None,
) -> Plan:
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model must be a ModelSpec, got {type(model).__name__}")
    view = MeshView.from_graph(
        mesh, options.exclude, model.hidden_state_bytes, compute_key=model.compute_key
    )
    cost = CostModel(model, options)
    singles = single_units(view, options.reserve_bytes)
    groups: list[Unit] = []
    if kind in ("auto", "tensor", "hybrid") and options.strategy == "speed":
        groups = tensor_parallel_units(view, model, cost, singles)
    evaluator = Evaluator(cost, view)
    layout = _choose_layout(
        options.strategy, kind, evaluator, singles, singles + groups, options.min_gain
    )
    if layout is None:
        refusal = _refusal(cost, view, singles)
        if kind == "auto" or (
            kind in ("solo", "pipeline") and find_fitting_layout(cost, singles) is None
        ):
            raise refusal
        missing, remedy = _unavailable_reason(kind, cost, view, singles, groups)
        raise ParallelismUnavailable(kind, model.name, missing, remedy)
    if incumbent and options.strategy == "speed":
        kept = _incumbent_layout(incumbent, evaluator, singles + groups, _ACCEPTS[kind])
        if kept is not None and _keeps(kept, layout, evaluator, options.min_gain):
            layout = kept
    excluded = sorted(str(node) for node in mesh.nodes if str(node) in options.exclude)
    return _build_plan(layout, evaluator, options, excluded)


def layout_plan_id(model: ModelSpec, options: PlanOptions, stages: Sequence[Stage]) -> str:
    """A plan's id: sha256 hex of the model, the settings its stages run with, and the stages.

    Equal layouts have equal ids whatever measurements chose them (see the module docstring).
    """
    payload = {
        "model": model.to_dict(),
        "runtime": {
            "context_length": options.context_length or model.context_length,
            "concurrency": options.concurrency,
            "prefill_chunk": options.prefill_chunk,
            # Only when set: the ids of plans without it stay what they were.
            **({"cache_sequences": options.cache_sequences} if options.cache_sequences else {}),
        },
        "stages": json.loads(layout_key(stages)),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _incumbent_layout(
    stages: Sequence[Stage], evaluator: Evaluator, units: Sequence[Unit], accept: Accept
) -> Layout | None:
    """The incumbent's stages as a layout of this mesh, or None when it cannot run any more:
    a node left or is excluded, a group is no longer a candidate, the layers changed, it no
    longer fits, or the kind of layout asked for excludes it."""
    by_nodes = {unit.nodes: unit for unit in units}
    chosen = [by_nodes.get(tuple(stage.nodes)) for stage in stages]
    if not chosen or any(unit is None for unit in chosen):
        return None
    bounds = (0, *(stage.layer_end for stage in stages))
    ranges_ok = all(
        stage.layer_start == start for stage, start in zip(stages, bounds[:-1], strict=True)
    )
    if not ranges_ok or bounds[-1] != evaluator.cost.num_layers:
        return None
    layout = Layout(tuple(unit for unit in chosen if unit is not None), bounds)
    if not accept(frozenset(layout.units)) or not evaluator.fits(layout):
        return None
    return layout


def _keeps(incumbent: Layout, fresh: Layout, evaluator: Evaluator, min_gain: float) -> bool:
    """Keep the incumbent unless `fresh` is predicted more than SWITCH_GAIN faster, or the
    incumbent uses more nodes than `fresh` and no longer earns them: it must stay at least
    half of `min_gain` faster (half: a band, so that a prediction near the margin does not
    move the mesh back and forth; see the module docstring)."""
    if incumbent == fresh:
        return True
    kept_s = evaluator.score(incumbent).time_per_token_s
    fresh_s = evaluator.score(fresh).time_per_token_s
    if node_count(incumbent) > node_count(fresh) and kept_s * (1.0 + min_gain / 2) > fresh_s:
        return False
    return kept_s <= (1.0 + SWITCH_GAIN) * fresh_s


def _choose_layout(
    strategy: str,
    kind: str,
    evaluator: Evaluator,
    singles: list[Unit],
    units: list[Unit],
    min_gain: float,
) -> Layout | None:
    """The strategy's layout within one strongly connected part of the mesh.

    A pipeline is a ring, so all its nodes must reach each other. In the usual, connected mesh
    there is one part. Otherwise `memory` takes the first part that fits, largest usable memory
    first, and `speed` the part with the fastest plan (fewer nodes within `min_gain`).
    """
    found: list[tuple[float, Layout]] = []
    for part in evaluator.view.components():
        members = set(part)
        part_singles = [u for u in singles if u.leader in members]
        part_units = [u for u in units if members.issuperset(u.nodes)]
        layout = _layout_in_part(strategy, kind, evaluator, part_singles, part_units, min_gain)
        if layout is None:
            continue
        if strategy == "memory":
            return layout
        found.append((evaluator.score(layout).time_per_token_s, layout))
    return choose_within_margin(found, min_gain)[1] if found else None


def _layout_in_part(
    strategy: str,
    kind: str,
    evaluator: Evaluator,
    singles: list[Unit],
    units: list[Unit],
    min_gain: float,
) -> Layout | None:
    cost = evaluator.cost
    accept = _ACCEPTS[kind]
    if strategy == "memory":
        layout = memory_layout(cost, singles) or find_fitting_layout(cost, singles)
        return layout if layout is not None and accept(frozenset(layout.units)) else None
    baseline = memory_layout(cost, singles)
    fitting = None if baseline is not None else find_fitting_layout(cost, units)
    extras = [layout for layout in (baseline, fitting) if layout is not None]
    return SpeedSearch(evaluator, units, accept, min_gain).run(extras)


# ---- refusal --------------------------------------------------------------------------------


def _unavailable_reason(
    kind: str, cost: CostModel, view: MeshView, singles: Sequence[Unit], groups: Sequence[Unit]
) -> tuple[str, str]:
    """Why a forced kind of layout has no plan (the memory as a whole would fit): what is
    missing, and what to do."""
    model = cost.model
    count = len(singles)
    left = f"{count} node{'' if count == 1 else 's'} with usable memory"
    if kind == "solo":
        largest = max(singles, key=lambda unit: (unit.usable_bytes, unit.nodes))
        need = cost.need(largest, 0, cost.num_layers, first=True, last=True)
        return (
            f"one node alone needs {format_bytes(need)} for the model; the largest usable "
            f"budget is {format_bytes(largest.usable_bytes)} (node {largest.leader})",
            "split it with --parallelism auto or pipeline, or use a more strongly quantized model",
        )
    if kind == "pipeline":
        if count < 2:
            return (
                f"a pipeline needs at least 2 nodes with usable memory; {count} left",
                "add a node, or use --parallelism auto",
            )
        return (
            f"no pipeline over the {left} fits their memory (each stage holds whole layers, "
            "the first also the embeddings, the last the head)",
            "use --parallelism auto, add memory, or lower --context or --concurrency",
        )
    what = "tensor parallelism" if kind == "tensor" else "a hybrid layout (tensor parallelism)"
    if not model.supports_tensor_parallel:
        return (
            f"{what} is not available for architecture {model.architecture or 'of this model'}"
            ", whose mlx-lm shard(group) meshd has not verified on pipeline stages "
            "(docs/architectures.md lists the architectures it has)",
            "use --parallelism pipeline or auto",
        )
    degrees = tensor_parallel_degrees(model)
    heads = (
        f"the attention heads ({model.num_attention_heads}) and the KV heads "
        f"({model.num_key_value_heads})"
    )
    if not degrees:
        return (
            f"{what} needs a group size that divides both {heads}; none from 2 to "
            f"{TP_MAX_DEGREE} does",
            "use --parallelism pipeline or auto",
        )
    sizes = _sizes_text(degrees)
    smallest = degrees[0]
    if kind == "hybrid" and count < smallest + 1:
        return (
            f"a hybrid layout needs a tensor-parallel group of {smallest} nodes and another "
            f"stage, so at least {smallest + 1} nodes; {count} left",
            "add a node, or use --parallelism auto",
        )
    if not groups:
        if count < smallest:
            return (
                f"tensor parallelism needs {smallest} nodes with a trusted link; {count} left",
                "add a node joined to it by a trusted link, such as a Thunderbolt or direct "
                "cable, or use --parallelism auto",
            )
        trusted = trusted_link_graph(view, [unit.leader for unit in singles])
        if trusted.number_of_edges() == 0:
            return (
                f"{what} needs a group of {sizes} nodes joined by links marked trusted in both "
                f"directions (tensor-parallel traffic is unencrypted); none of the {left} are",
                "join them by a point-to-point link (Thunderbolt, a direct cable) or name "
                "their private network with --tensor-parallel-trusted-network (a mesh file: "
                '"trusted": true), or use --parallelism auto',
            )
        largest = max(len(clique) for clique in nx.find_cliques(trusted))
        return (
            f"{what} needs a group of {sizes} nodes all joined pairwise by trusted links (the "
            f"sizes that divide {heads}); the largest such set here has {largest} nodes",
            "mark the links between more nodes trusted, or use --parallelism auto",
        )
    if kind == "tensor":
        largest_group = max(groups, key=lambda unit: (unit.usable_bytes, unit.nodes))
        need = cost.need(largest_group, 0, cost.num_layers, first=True, last=True)
        member = min(largest_group.member_usable)
        return (
            f"no tensor-parallel group (sizes {sizes}) holds the whole model: group "
            f"{'+'.join(largest_group.nodes)} needs up to {format_bytes(need)} per member, its "
            f"smallest member has {format_bytes(member)}",
            "use --parallelism hybrid or auto, add memory, or lower --context or --concurrency",
        )
    return (
        f"no layout of two or more stages with a tensor-parallel group (sizes {sizes}) fits "
        f"in the memory of the {left}",
        "use --parallelism auto, add memory, or lower --context or --concurrency",
    )


def _sizes_text(degrees: Sequence[int]) -> str:
    """'2', '2 or 4', '2, 4 or 8'."""
    words = [str(degree) for degree in degrees]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


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
        return "the mesh has no nodes left after the exclusions: start a node or exclude fewer"
    if not singles:
        return (
            "no node has usable memory: every memory budget is at or below the reserve; "
            "lower --reserve or raise --memory-budget"
        )
    if needed > available:
        return "the mesh has too little memory in total"
    parts = view.components()
    if len(parts) > 1:
        return (
            f"the mesh is split into {len(parts)} parts whose nodes cannot reach each other, "
            "and no part alone can hold the model: check the network between them (a firewall, "
            "another subnet)"
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
    layout: Layout, evaluator: Evaluator, options: PlanOptions, excluded: list[str]
) -> Plan:
    cost = evaluator.cost
    layout = _placed(layout, evaluator)
    last = len(layout.units) - 1
    moe = set(cost.model.moe_layers)
    stages = []
    for i, (unit, (start, end)) in enumerate(zip(layout.units, layout.ranges(), strict=True)):
        stage_moe = tuple(layer for layer in range(start, end) if layer in moe)
        experts: tuple[ExpertShard, ...] = ()
        if unit.degree > 1 and stage_moe and unit.expert_counts:
            experts = tuple(ExpertShard(*entry) for entry in expert_ranges(unit))
        stages.append(
            Stage(
                unit.nodes,
                start,
                end,
                has_embedding=i == 0,
                has_head=i == last,
                experts=experts,
                moe_layers=stage_moe if experts else (),
            )
        )
    hops = _hops(layout, evaluator)
    return Plan(
        plan_id=layout_plan_id(cost.model, options, stages),
        algorithm_version=ALGORITHM_VERSION,
        strategy=options.strategy,
        layout=layout_kind(layout.units),
        model_name=cost.model.name,
        num_layers=cost.num_layers,
        context_length=cost.context_length,
        concurrency=cost.concurrency,
        cache_sequences=cost.cache_sequences,
        stages=tuple(stages),
        memory=_node_memory(layout, evaluator, options),
        hops=hops,
        prediction=_prediction(layout, evaluator, hops),
        left_out=_left_out(layout, evaluator, options, excluded),
        compute_key=cost.model.compute_key,
        priced=_priced(layout, evaluator),
    )


def _priced(layout: Layout, evaluator: Evaluator) -> tuple[PricedRate, ...]:
    """The rates each node holding layers was priced at, and which measurement they are."""
    view = evaluator.view
    key = evaluator.cost.model.compute_key
    return tuple(
        PricedRate(
            node=node,
            flops=view.nodes[node].flops,
            mem_bandwidth=view.nodes[node].mem_bandwidth,
            source=_priced_source(view.nodes[node].priced_as, key),
        )
        for unit in layout.units
        for node in unit.nodes
    )


def _priced_source(priced_as: str, key: str) -> str:
    if priced_as != "flops":
        return priced_as
    return "flops" if key == "float32" else f"flops (no {key} figure)"


def _placed(layout: Layout, evaluator: Evaluator) -> Layout:
    """The layout with each group's experts placed by speed within memory (partitioner.experts),
    kept only when that is predicted at least as fast as the search's memory-proportional
    placement."""
    if all(unit.degree == 1 for unit in layout.units):
        return layout
    last = len(layout.units) - 1
    placed = Layout(
        tuple(
            place_experts(evaluator.cost, unit, start, end, first=i == 0, last=i == last)
            for i, (unit, (start, end)) in enumerate(
                zip(layout.units, layout.ranges(), strict=True)
            )
        ),
        layout.bounds,
    )
    before = evaluator.score(layout).time_per_token_s
    return placed if evaluator.score(placed).time_per_token_s <= before else layout


def _node_memory(
    layout: Layout, evaluator: Evaluator, options: PlanOptions
) -> tuple[NodeMemory, ...]:
    cost, view = evaluator.cost, evaluator.view
    last = len(layout.units) - 1
    entries = []
    for index, (unit, (start, end)) in enumerate(zip(layout.units, layout.ranges(), strict=True)):
        for member, node in enumerate(unit.nodes):
            use = cost.memory(
                start, end, first=index == 0, last=index == last, unit=unit, member=member
            )
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
        elif options.min_gain > 0:
            reason = (
                f"not needed: no layout using it is predicted more than {options.min_gain:.0%} "
                "faster (min_gain: what a node must add to join)"
            )
        else:
            reason = "not needed: the plan is predicted faster without it"
        entries.append(LeftOut(node_id, reason))
    return tuple(sorted(entries, key=lambda entry: entry.node))


def plan_summary(plan: Plan) -> dict[str, Any]:
    """A compact dict for logs: id, strategy, stages as 'node:start-end', ms per token."""
    return {
        "plan_id": plan.short_id,
        "strategy": plan.strategy,
        "layout": plan.layout,
        "stages": [f"{'+'.join(s.nodes)}:{s.layer_start}-{s.layer_end}" for s in plan.stages],
        "ms_per_token": round(plan.prediction.decode_s_per_token * 1e3, 3),
    }
