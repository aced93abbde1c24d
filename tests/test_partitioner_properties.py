"""Property-based tests of the partitioner over random small meshes and models.

Refusals are checked against a brute force that tries every ordered subset of nodes inside
every strongly connected part of the mesh and every split of the layers into contiguous ranges.
"""

from __future__ import annotations

import json
import math
from itertools import combinations, pairwise, permutations

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner import (
    PARALLELISMS,
    InsufficientMemory,
    ModelSpec,
    ParallelismUnavailable,
    Plan,
    PlanOptions,
    plan_alternatives,
    plan_model,
)
from partitioner.cost import CostModel
from partitioner.layout import Evaluator, Layout
from partitioner.mesh import MeshView
from partitioner.stage_units import single_units

pytestmark = pytest.mark.unit

MiB = 2**20
NODE_IDS = "abcdefgh"
SMALL = (3, 2, 4, 1)  # node counts for brute-force checks
LARGE = (9, 12, 16)  # node counts where the planner switches to heuristics
LINK_SPEEDS = [1e6, 1.25e8, 1.25e8, 1.25e9, 1.25e9, 1e10, 1e10]
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def meshes(
    draw: st.DrawFn, counts: tuple[int, ...] = SMALL, scale: int = 1600 * MiB, base: int = 0
) -> nx.DiGraph:
    """Random meshes; budgets are `base` plus a share of `scale` around 1 / node count, so
    that the nodes together hold about one to two times `scale`; some links are missing and
    some dead (bandwidth 0)."""
    count = draw(st.sampled_from(counts))
    names = NODE_IDS if count <= len(NODE_IDS) else [f"n{i:02d}" for i in range(count)]
    ids = draw(st.lists(st.sampled_from(names), min_size=count, max_size=count, unique=True))
    graph = nx.DiGraph()
    for node in ids:
        graph.add_node(
            node,
            memory_budget=base + scale * draw(st.integers(60 // count, 260 // count + 10)) // 100,
            flops=draw(st.floats(1e9, 1e13)),
            mem_bandwidth=draw(st.floats(1e9, 1e12)),
        )
    for src in ids:
        for dst in ids:
            if src != dst and draw(st.integers(0, 7)) > 0:
                graph.add_edge(
                    src,
                    dst,
                    latency_s=draw(st.floats(0.0, 0.05)),
                    bandwidth=draw(st.sampled_from([0.0, *LINK_SPEEDS])),
                )
    return graph


@st.composite
def models(draw: st.DrawFn, max_layers: int = 6, tensor_parallel: bool = False) -> ModelSpec:
    layers = draw(st.lists(st.integers(0, 300), min_size=1, max_size=max_layers))
    return ModelSpec(
        name="random",
        layer_bytes=tuple(size * MiB for size in layers),
        layer_params=tuple(size * MiB // 2 for size in layers),
        embedding_bytes=draw(st.integers(0, 120)) * MiB,
        head_bytes=draw(st.integers(0, 120)) * MiB,
        tie_word_embeddings=draw(st.booleans()),
        kv_bytes_per_token_per_layer=draw(st.integers(0, 8 * 1024)),
        hidden_size=64,
        intermediate_size=128,
        vocab_size=256,
        num_attention_heads=draw(st.sampled_from([2, 3, 4])),
        num_key_value_heads=2,
        activation_bytes=2,
        dtype="float16",
        context_length=draw(st.integers(16, 2048)),
        supports_tensor_parallel=tensor_parallel,
    )


@st.composite
def options(draw: st.DrawFn) -> PlanOptions:
    return PlanOptions(
        reserve_bytes=draw(st.sampled_from([0, 32 * MiB])),
        concurrency=draw(st.sampled_from([1, 2, 3, 16, 24])),  # one batch; micro-batches
        exclude=frozenset(draw(st.lists(st.sampled_from(NODE_IDS), max_size=1))),
        prefill_chunk=draw(st.sampled_from([16, 512])),
    )


@st.composite
def cases(
    draw: st.DrawFn,
    counts: tuple[int, ...] = SMALL,
    max_layers: int = 6,
    tensor_parallel: bool = False,
) -> tuple[nx.DiGraph, ModelSpec, PlanOptions]:
    """A model, options, and a mesh whose budgets are scaled to the model's size (above the
    fixed per-stage overhead), so one-stage, multi-stage and refused cases all occur often."""
    model = draw(models(max_layers=max_layers, tensor_parallel=tensor_parallel))
    opts = draw(options())
    cost = CostModel(model, opts)
    fixed = cost.memory(0, 0, first=False, last=False).total + opts.reserve_bytes
    mesh = draw(meshes(counts, scale=cost.whole_model_memory() - fixed, base=fixed))
    return mesh, model, opts


def usable(graph: nx.DiGraph, node: str, opts: PlanOptions) -> int:
    return max(0, graph.nodes[node]["memory_budget"] - opts.reserve_bytes)


def brute_force_fits(graph: nx.DiGraph, model: ModelSpec, opts: PlanOptions) -> bool:
    """Whether any ordered set of connected nodes and any contiguous split fits in memory."""
    cost = CostModel(model, opts)
    total = model.num_layers
    nodes = sorted(n for n in graph.nodes if n not in opts.exclude)
    live = nx.DiGraph()
    live.add_nodes_from(nodes)
    live.add_edges_from(
        (u, v)
        for u, v, d in graph.edges(data=True)
        if u in live and v in live and d["bandwidth"] > 0
    )
    for part in nx.strongly_connected_components(live):
        for count in range(1, min(len(part), total) + 1):
            for order in permutations(sorted(part), count):
                for cuts in combinations(range(1, total), count - 1):
                    bounds = (0, *cuts, total)
                    if all(
                        cost.memory(
                            bounds[i], bounds[i + 1], first=i == 0, last=i == count - 1
                        ).total
                        <= usable(graph, order[i], opts)
                        for i in range(count)
                    ):
                        return True
    return False


def brute_force_fastest(graph: nx.DiGraph, model: ModelSpec, opts: PlanOptions) -> float:
    """The least predicted time per token over every fitting layout of single nodes."""
    return min(brute_force_by_count(graph, model, opts).values(), default=math.inf)


def brute_force_by_count(
    graph: nx.DiGraph, model: ModelSpec, opts: PlanOptions
) -> dict[int, float]:
    """Node count -> the least predicted time per token over every fitting layout of that
    many single nodes."""
    cost = CostModel(model, opts)
    view = MeshView.from_graph(graph, opts.exclude, model.hidden_state_bytes)
    evaluator = Evaluator(cost, view)
    units = single_units(view, opts.reserve_bytes)
    total = model.num_layers
    best: dict[int, float] = {}
    for count in range(1, min(len(units), total) + 1):
        for order in permutations(units, count):
            for cuts in combinations(range(1, total), count - 1):
                layout = Layout(order, (0, *cuts, total))
                if evaluator.fits(layout):
                    seconds = evaluator.score(layout).time_per_token_s
                    best[count] = min(best.get(count, math.inf), seconds)
    return best


def assert_valid(plan: Plan, graph: nx.DiGraph, model: ModelSpec, opts: PlanOptions) -> None:
    """Every layer exactly once, contiguous, no empty stage, roles right, nobody over budget."""
    cost = CostModel(model, opts)
    stages = plan.stages
    assert stages and stages[0].layer_start == 0 and stages[-1].layer_end == model.num_layers
    for before, after in pairwise(stages):
        assert before.layer_end == after.layer_start
    assert all(stage.num_layers >= 1 for stage in stages)
    assert [s.has_embedding for s in stages] == [i == 0 for i in range(len(stages))]
    assert [s.has_head for s in stages] == [i == len(stages) - 1 for i in range(len(stages))]
    members = [node for stage in stages for node in stage.nodes]
    assert len(members) == len(set(members)) and not set(members) & opts.exclude
    recorded = {entry.node: entry for entry in plan.memory}
    for index, stage in enumerate(stages):
        need = cost.memory(
            stage.layer_start,
            stage.layer_end,
            first=index == 0,
            last=index == len(stages) - 1,
            degree=len(stage.nodes),
        ).total
        for node in stage.nodes:
            assert need <= usable(graph, node, opts)
            assert recorded[node].total_bytes == need
    for hop in plan.hops:
        for u, v in pairwise(hop.path):
            assert graph.edges[u, v]["bandwidth"] > 0
    assert plan.prediction.time_per_token_s >= plan.prediction.decode_s_per_token - 1e-15


def shuffled_copy(graph: nx.DiGraph, node_order: list[str], edge_order: list[int]) -> nx.DiGraph:
    copy = nx.DiGraph()
    for node in node_order:
        copy.add_node(node, **graph.nodes[node])
    edges = list(graph.edges(data=True))
    for index in edge_order:
        u, v, data = edges[index]
        copy.add_edge(u, v, **data)
    return copy


@SETTINGS
@given(case=cases())
def test_plans_are_valid_and_refused_exactly_when_nothing_fits(
    case: tuple[nx.DiGraph, ModelSpec, PlanOptions],
) -> None:
    graph, model, opts = case
    fits = brute_force_fits(graph, model, opts)
    results = {}
    for strategy in ("memory", "speed"):
        chosen = PlanOptions.from_dict({**opts.to_dict(), "strategy": strategy})
        try:
            plan = plan_model(graph, model, chosen)
        except InsufficientMemory as refusal:
            assert not fits, f"{strategy} refused a model that fits: {refusal}"
            assert refusal.needed_bytes > 0 and str(refusal).startswith("not enough memory")
            continue
        assert fits, "planned a model that brute force says cannot fit"
        assert_valid(plan, graph, model, chosen)
        assert Plan.from_dict(json.loads(json.dumps(plan.to_dict(), allow_nan=False))) == plan
        results[strategy] = plan
    if results:
        speed, memory = results["speed"], results["memory"]
        fastest = speed.prediction.time_per_token_s
        if len(speed.nodes) >= len(memory.nodes):
            assert fastest <= memory.prediction.time_per_token_s * (1 + 1e-9)
        else:  # fewer nodes than the baseline, within the margin
            margin = 1 + chosen.min_gain
            assert fastest <= memory.prediction.time_per_token_s * margin * (1 + 1e-9)


@settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(case=cases())
def test_speed_finds_the_brute_force_optimum_on_small_meshes(
    case: tuple[nx.DiGraph, ModelSpec, PlanOptions],
) -> None:
    """Up to six nodes the search over node sets is exhaustive and up to four stages every
    order is tried; only the boundaries are found by local search."""
    graph, model, opts = case
    opts = PlanOptions.from_dict({**opts.to_dict(), "min_gain": 0.0})
    try:
        plan = plan_model(graph, model, opts)
    except InsufficientMemory:
        return
    optimum = brute_force_fastest(graph, model, opts)
    assert plan.prediction.time_per_token_s <= optimum * 1.02


@settings(
    max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(case=cases())
def test_a_node_joins_only_where_it_adds_the_margin(
    case: tuple[nx.DiGraph, ModelSpec, PlanOptions],
) -> None:
    """With min_gain the plan uses no more nodes than the fewest whose best layout is within
    the margin of the fastest (brute force), and is itself within that margin."""
    graph, model, opts = case
    try:
        plan = plan_model(graph, model, opts)
    except InsufficientMemory:
        return
    by_count = brute_force_by_count(graph, model, opts)
    fastest = min(by_count.values())
    limit = fastest * (1 + opts.min_gain)
    fewest = min(count for count, seconds in by_count.items() if seconds <= limit * (1 + 1e-9))
    assert len(plan.nodes) <= fewest
    assert plan.prediction.time_per_token_s <= limit * 1.02


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases((3, 2, 4, 5, 1)), data=st.data())
def test_same_plan_for_any_input_order(
    case: tuple[nx.DiGraph, ModelSpec, PlanOptions], data: st.DataObject
) -> None:
    graph, model, opts = case
    node_order = data.draw(st.permutations(sorted(graph.nodes)))
    edge_order = data.draw(st.permutations(range(graph.number_of_edges())))
    other = shuffled_copy(graph, list(node_order), list(edge_order))
    outcomes = []
    for mesh in (graph, other):
        try:
            outcomes.append(plan_model(mesh, model, opts).to_dict())
        except InsufficientMemory as refusal:
            outcomes.append(refusal.to_dict())
    assert outcomes[0] == outcomes[1]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases((3, 2, 4, 5, 1), tensor_parallel=True))
def test_tensor_parallel_plans_are_valid(case: tuple[nx.DiGraph, ModelSpec, PlanOptions]) -> None:
    graph, model, opts = case
    for u, v in graph.edges:
        graph.edges[u, v]["latency_s"] = 5e-6  # every link fast enough for a group
        graph.edges[u, v]["trusted"] = True
    try:
        plan = plan_model(graph, model, opts)
    except InsufficientMemory:
        assert not brute_force_fits(graph, model, opts)
        return
    assert_valid(plan, graph, model, opts)
    for stage in plan.stages:
        heads = (model.num_attention_heads, model.num_key_value_heads)
        assert all(count % len(stage.nodes) == 0 for count in heads)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(LARGE, max_layers=24), data=st.data())
def test_larger_meshes_give_valid_deterministic_plans(
    case: tuple[nx.DiGraph, ModelSpec, PlanOptions], data: st.DataObject
) -> None:
    """Meshes beyond the exact searches (ring order > 8 units, fit search > 10 nodes)."""
    graph, model, opts = case
    node_order = data.draw(st.permutations(sorted(graph.nodes)))
    other = shuffled_copy(graph, list(node_order), list(range(graph.number_of_edges()))[::-1])
    try:
        plan = plan_model(graph, model, opts)
    except InsufficientMemory as refusal:
        with pytest.raises(InsufficientMemory) as again:
            plan_model(other, model, opts)
        assert again.value.to_dict() == refusal.to_dict()
        return
    assert_valid(plan, graph, model, opts)
    assert plan_model(other, model, opts) == plan


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases((3, 2, 4), tensor_parallel=True))
def test_forced_layouts_are_of_their_kind_or_refused(
    case: tuple[nx.DiGraph, ModelSpec, PlanOptions],
) -> None:
    """Every forced kind gives a valid plan of that kind, or a refusal that says why, and
    without `fallback=False` the auto plan with a note that says the same; `auto` is never
    predicted slower than the one-node plan it could have made (by more than the margin, when
    it uses more nodes)."""
    graph, model, opts = case
    for u, v in graph.edges:
        graph.edges[u, v]["trusted"] = True
    outcomes: dict[str, Plan] = {}
    for kind in PARALLELISMS:
        forced = PlanOptions.from_dict({**opts.to_dict(), "parallelism": kind})
        try:
            plan = plan_model(graph, model, forced, fallback=False)
        except InsufficientMemory:
            assert not brute_force_fits(graph, model, forced)
            continue
        except ParallelismUnavailable as refusal:
            assert kind != "auto" and refusal.missing and refusal.remedy
            try:
                served = plan_model(graph, model, forced)
            except InsufficientMemory:  # nothing serves: the same refusal as `auto`
                with pytest.raises(InsufficientMemory):
                    plan_model(graph, model, opts)
                continue
            assert served.note.startswith(f"{refusal.missing}: serving ")
            assert served.plan_id == plan_model(graph, model, opts).plan_id
            continue
        assert_valid(plan, graph, model, forced)
        assert kind == "auto" or plan.layout == kind
        assert plan.note == ""
        assert Plan.from_dict(json.loads(json.dumps(plan.to_dict(), allow_nan=False))) == plan
        outcomes[kind] = plan
    solo = plan_alternatives(graph, model, opts)["solo"]
    if isinstance(solo, Plan) and "auto" in outcomes:
        auto = outcomes["auto"].prediction.time_per_token_s
        assert auto <= solo.prediction.time_per_token_s * (1 + 1e-9)
