"""Unit tests of the partitioner on hand-made meshes with known answers."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from itertools import pairwise

import networkx as nx
import pytest

from partitioner import (
    InsufficientMemory,
    MeshError,
    ModelSpec,
    ModelSpecError,
    ParallelismUnavailable,
    Plan,
    PlanOptions,
    PlanOptionsError,
    bucket_index,
    bucket_value,
    describe_refusal,
    plan_model,
    quantize,
    sticky_bucket_index,
)
from partitioner.cost import OVERHEAD_FIXED_BYTES, CostModel, Unit
from partitioner.split import capped_proportional, largest_remainder

pytestmark = pytest.mark.unit

MiB = 2**20
GiB = 2**30
GB = 10**9

NodeSpec = tuple[int, float, float]  # memory budget, FLOP/s, memory bandwidth
LinkSpec = tuple[float, ...]  # latency s, bandwidth bytes/s, optionally trusted (1.0)


def make_mesh(
    nodes: Mapping[str, NodeSpec],
    links: Mapping[tuple[str, str], LinkSpec] | None = None,
    *,
    default_link: LinkSpec | None = (0.5e-3, 125e6),
    order: Iterable[str] | None = None,
) -> nx.DiGraph:
    """A mesh graph; every ordered pair gets `default_link` unless listed in `links` (pass
    default_link=None for only the listed links). `order` sets node insertion order."""
    graph = nx.DiGraph()
    for node in order or nodes:
        budget, flops, bandwidth = nodes[node]
        graph.add_node(node, memory_budget=budget, flops=flops, mem_bandwidth=bandwidth)
    links = dict(links or {})
    for src in graph.nodes:
        for dst in graph.nodes:
            if src == dst:
                continue
            spec = links.get((src, dst), default_link)
            if spec is not None:
                trusted = len(spec) > 2 and bool(spec[2])
                graph.add_edge(src, dst, latency_s=spec[0], bandwidth=spec[1], trusted=trusted)
    return graph


def tiny_model(layer_bytes: Iterable[int], **overrides: object) -> ModelSpec:
    """A model with small activations, so layer sizes dominate memory."""
    layers = tuple(layer_bytes)
    values: dict[str, object] = {
        "name": "tiny",
        "layer_bytes": layers,
        "layer_params": tuple(size // 2 for size in layers),
        "embedding_bytes": 4 * MiB,
        "head_bytes": 4 * MiB,
        "tie_word_embeddings": False,
        "kv_bytes_per_token_per_layer": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "activation_bytes": 2,
        "dtype": "float16",
        "context_length": 256,
    }
    values.update(overrides)
    return ModelSpec(**values)  # type: ignore[arg-type]


def layer_counts(plan: Plan) -> list[int]:
    return [stage.num_layers for stage in plan.stages]


def stage_nodes(plan: Plan) -> list[tuple[str, ...]]:
    return [stage.nodes for stage in plan.stages]


FAST = (1e12, 400e9)
SLOW = (1e11, 40e9)


# ---- the memory baseline -------------------------------------------------------------------


def test_exo_case_16_8_8_gb_over_32_layers_splits_16_8_8() -> None:
    mesh = make_mesh({"a": (16 * GB, *FAST), "b": (8 * GB, *FAST), "c": (8 * GB, *FAST)})
    model = tiny_model([100 * MiB] * 32)
    plan = plan_model(mesh, model, PlanOptions(strategy="memory"))
    assert stage_nodes(plan) == [("a",), ("b",), ("c",)]
    assert layer_counts(plan) == [16, 8, 8]
    assert [s.layer_start for s in plan.stages] == [0, 16, 24]
    assert plan.stages[0].has_embedding and plan.stages[-1].has_head


def test_largest_remainder_loses_no_layer_where_equal_splits_do() -> None:
    # mlx-lm's equal split gives 10 // 3 = 3 layers each and drops one
    assert largest_remainder(10, [1, 1, 1]) == [4, 3, 3]
    assert largest_remainder(7, [5, 3, 2]) == [4, 2, 1]
    assert sum(largest_remainder(80, [7, 11, 13, 17])) == 80
    assert largest_remainder(5, [0, 0]) == [0, 0]


def test_capped_proportional_redistributes_what_a_cap_refuses() -> None:
    assert capped_proportional(10, [1, 1], [3, 10]) == [3, 7]
    assert capped_proportional(10, [1, 1], [3, 3]) is None


def test_memory_strategy_never_makes_an_empty_stage_with_more_nodes_than_layers() -> None:
    nodes = {f"n{i}": (GiB, *FAST) for i in range(6)}
    plan = plan_model(make_mesh(nodes), tiny_model([10 * MiB] * 4), PlanOptions(strategy="memory"))
    assert layer_counts(plan) == [1, 1, 1, 1]
    assert stage_nodes(plan) == [("n0",), ("n1",), ("n2",), ("n3",)]
    assert [entry.node for entry in plan.left_out] == ["n4", "n5"]
    assert all("rounded to zero" in entry.reason for entry in plan.left_out)


def test_memory_strategy_corrects_uneven_layers_so_every_node_fits() -> None:
    # Equal budgets: the proportional split 3/3 puts both 300 MiB layers on node a, which
    # cannot hold them; the correction moves the boundary to after the first layer.
    model = tiny_model([300 * MiB, 300 * MiB] + [10 * MiB] * 4)
    budget = 480 * MiB
    mesh = make_mesh({"a": (budget, *FAST), "b": (budget, *FAST)})
    plan = plan_model(mesh, model, PlanOptions(strategy="memory"))
    assert [(s.layer_start, s.layer_end) for s in plan.stages] == [(0, 1), (1, 6)]
    assert all(entry.total_bytes <= entry.usable_bytes for entry in plan.memory)


def test_memory_estimate_counts_kv_cache_activations_and_overhead() -> None:
    model = tiny_model([100 * MiB] * 2, context_length=1000)
    mesh = make_mesh({"a": (4 * GiB, *FAST)})
    plan = plan_model(mesh, model, PlanOptions(concurrency=3, prefill_chunk=128))
    entry = plan.memory_of("a")
    assert entry is not None
    assert entry.weights_bytes == 200 * MiB + 8 * MiB
    assert entry.kv_cache_bytes == 1024 * 2 * 1000 * 3
    assert entry.activation_bytes == 128 * 2 * (4 * 64 + 3 * 128) + 128 * 256 * 2
    base = entry.weights_bytes + entry.kv_cache_bytes + entry.activation_bytes
    assert entry.overhead_bytes == base * 5 // 100 + OVERHEAD_FIXED_BYTES
    assert entry.total_bytes == base + entry.overhead_bytes


def test_prefix_cache_sequences_are_reserved_beside_the_running_ones() -> None:
    """--prefix-cache-sequences 2: the plan's KV holds 3 + 2 sequences, and names them; a
    plan without it keeps the id it always had."""
    model = tiny_model([100 * MiB] * 2, context_length=1000)
    mesh = make_mesh({"a": (4 * GiB, *FAST)})
    plain = plan_model(mesh, model, PlanOptions(concurrency=3, prefill_chunk=128))
    cached = plan_model(
        mesh, model, PlanOptions(concurrency=3, cache_sequences=2, prefill_chunk=128)
    )
    entry = cached.memory_of("a")
    assert entry is not None and entry.kv_cache_bytes == 1024 * 2 * 1000 * 5
    assert cached.cache_sequences == 2 and plain.cache_sequences == 0
    assert cached.plan_id != plain.plan_id
    assert Plan.from_dict(json.loads(json.dumps(cached.to_dict()))) == cached
    with pytest.raises(PlanOptionsError, match="cache_sequences"):
        PlanOptions(cache_sequences=-1)


def test_kv_cache_for_a_long_context_turns_a_fit_into_a_refusal() -> None:
    model = tiny_model([100 * MiB] * 4, kv_bytes_per_token_per_layer=64 * 1024)
    mesh = make_mesh({"a": (GiB, *FAST)})
    plan_model(mesh, model, PlanOptions(context_length=256))
    with pytest.raises(InsufficientMemory) as refused:
        plan_model(mesh, model, PlanOptions(context_length=8192))
    assert refused.value.needed_bytes > refused.value.available_bytes == GiB


def test_tied_embeddings_are_held_by_first_and_last_stage_but_once_on_one_node() -> None:
    model = tiny_model([100 * MiB] * 4, tie_word_embeddings=True, head_bytes=MiB)
    alone = plan_model(make_mesh({"a": (2 * GiB, *FAST)}), model)
    assert alone.memory[0].weights_bytes == 400 * MiB + 4 * MiB + MiB
    pair = make_mesh({"a": (300 * MiB, *FAST), "b": (300 * MiB, *FAST)})
    plan = plan_model(pair, model, PlanOptions(strategy="memory"))
    weights = [entry.weights_bytes for entry in plan.memory]
    assert weights == [200 * MiB + 4 * MiB, 200 * MiB + MiB + 4 * MiB]


# ---- refusals -------------------------------------------------------------------------------


def test_refusal_says_how_much_is_missing_and_where() -> None:
    mesh = make_mesh({"a": (GiB, *FAST), "b": (512 * MiB, *FAST)})
    model = tiny_model([200 * MiB] * 10)
    with pytest.raises(InsufficientMemory) as refused:
        plan_model(mesh, model)
    error = refused.value
    assert error.available_bytes == GiB + 512 * MiB
    assert error.missing_bytes == error.needed_bytes - error.available_bytes > 0
    assert set(error.per_node_shortfall) == {"a", "b"}
    assert str(error).startswith("not enough memory in this mesh for tiny: need ")
    assert "missing" in str(error) and "too little memory in total" in str(error)
    text = describe_refusal(error)
    assert "a" in text.splitlines()[2] and "more" in text
    assert json.loads(json.dumps(error.to_dict()))["missing_bytes"] == error.missing_bytes


def test_refusal_names_a_layer_that_fits_no_node() -> None:
    mesh = make_mesh({"a": (GiB, *FAST), "b": (GiB, *FAST)})
    model = tiny_model([100 * MiB, 1200 * MiB, 100 * MiB])
    with pytest.raises(InsufficientMemory, match=r"layer 1 alone needs .*\(node a\)"):
        plan_model(mesh, model)


def test_refusal_when_everything_is_excluded() -> None:
    mesh = make_mesh({"a": (GiB, *FAST)})
    with pytest.raises(InsufficientMemory, match="no nodes"):
        plan_model(mesh, tiny_model([MiB]), PlanOptions(exclude={"a"}))


def test_reserve_is_taken_from_every_budget() -> None:
    mesh = make_mesh({"a": (GiB, *FAST)})
    model = tiny_model([200 * MiB] * 4)
    plan = plan_model(mesh, model)
    assert plan.memory[0].usable_bytes == GiB
    with pytest.raises(InsufficientMemory):
        plan_model(mesh, model, PlanOptions(reserve_bytes=GiB - plan.memory[0].total_bytes + 1))


# ---- the speed strategy ---------------------------------------------------------------------


def test_speed_leaves_out_a_weak_node_that_the_memory_split_uses() -> None:
    mesh = make_mesh({"fast": (8 * GiB, *FAST), "weak": (8 * GiB, *SLOW)})
    model = tiny_model([200 * MiB] * 16)
    memory = plan_model(mesh, model, PlanOptions(strategy="memory"))
    speed = plan_model(mesh, model)
    assert layer_counts(memory) == [8, 8]
    assert stage_nodes(speed) == [("fast",)]
    assert speed.left_out[0].node == "weak" and speed.left_out[0].reason.startswith(
        "not needed: no layout using it"
    )
    ratio = memory.prediction.decode_s_per_token / speed.prediction.decode_s_per_token
    assert ratio > 4


def test_speed_fills_the_fast_node_and_gives_the_slow_one_only_the_rest() -> None:
    mesh = make_mesh({"fast": (GiB, *FAST), "slow": (4 * GiB, *SLOW)})
    model = tiny_model([100 * MiB] * 12)
    plan = plan_model(mesh, model)
    counts = dict(zip([s.nodes[0] for s in plan.stages], layer_counts(plan), strict=True))
    fast_cap = max(
        n
        for n in range(13)
        if CostModel(model, PlanOptions()).memory(0, n, first=True, last=False).total <= GiB
    )
    assert counts["fast"] in (fast_cap, fast_cap - 1)  # role of first/last decides the last one
    assert counts["slow"] == 12 - counts["fast"]


def test_speed_orders_the_ring_around_a_slow_link() -> None:
    # a->b and b->c are slow; the ring a->c->b->a avoids both slow directions.
    nodes = {name: (300 * MiB, *FAST) for name in "abc"}
    slow = (50e-3, 1e6)
    mesh = make_mesh(nodes, {("a", "b"): slow, ("b", "c"): slow})
    plan = plan_model(mesh, tiny_model([100 * MiB] * 6))
    order = [s.nodes[0] for s in plan.stages]
    assert len(order) == 3
    pairs = set(pairwise(order))
    assert not pairs & {("a", "b"), ("b", "c")}
    assert plan.prediction.hops_decode_s < 10e-3


def test_missing_link_is_relayed_and_the_route_recorded() -> None:
    nodes = {"a": (300 * MiB, *FAST), "relay": (10 * MiB, *FAST), "c": (300 * MiB, *FAST)}
    links = {("a", "relay"): (1e-3, 1e9), ("relay", "a"): (1e-3, 1e9)}
    links |= {("relay", "c"): (1e-3, 1e9), ("c", "relay"): (1e-3, 1e9)}
    mesh = make_mesh(nodes, links, default_link=None)
    plan = plan_model(mesh, tiny_model([100 * MiB] * 4))
    assert sorted(stage_nodes(plan)) == [("a",), ("c",)]
    assert all(hop.path[1] == "relay" and len(hop.path) == 3 for hop in plan.hops)
    assert {e.node for e in plan.left_out} == {"relay"}


def test_disconnected_mesh_plans_in_the_part_that_fits() -> None:
    nodes = {"a": (GiB, *FAST), "b": (GiB, *FAST), "big": (4 * GiB, *SLOW)}
    links = {("a", "b"): (1e-3, 1e9), ("b", "a"): (1e-3, 1e9)}
    mesh = make_mesh(nodes, links, default_link=None)
    plan = plan_model(mesh, tiny_model([300 * MiB] * 5))
    assert sorted(stage_nodes(plan)) == [("a",), ("b",)]
    assert "no network route" in plan.left_out[0].reason
    memory_plan = plan_model(mesh, tiny_model([300 * MiB] * 5), PlanOptions(strategy="memory"))
    assert stage_nodes(memory_plan) == [("big",)]


def test_concurrency_splits_only_where_micro_batches_keep_every_stage_busy() -> None:
    """The stages batch concurrent decode steps (partitioner.cost): 4 sequences go round as
    one batch, and splitting them over two nodes only adds hops, so they stay on one node; 16
    decode in two micro-batches of 8, each stage computing one while the other computes the
    other, so on these compute-bound nodes balanced stages double the aggregate throughput."""
    fast = {"a": (4 * GiB, *FAST), "b": (4 * GiB, *FAST)}
    mesh = make_mesh(fast, default_link=(1e-5, 1e10))
    model = tiny_model([200 * MiB] * 8)
    alone = plan_model(mesh, model)
    four = plan_model(mesh, model, PlanOptions(concurrency=4))
    sixteen = plan_model(mesh, model, PlanOptions(concurrency=16))
    one_node = plan_model(make_mesh({"a": fast["a"]}), model, PlanOptions(concurrency=16))
    assert len(alone.stages) == 1 and len(four.stages) == 1
    assert four.prediction.aggregate_tokens_per_s > 1.5 * alone.prediction.tokens_per_s
    assert layer_counts(sixteen) == [4, 4]
    assert (
        sixteen.prediction.aggregate_tokens_per_s > 1.9 * one_node.prediction.aggregate_tokens_per_s
    )


def test_prediction_follows_the_stated_cost_model() -> None:
    flops, bandwidth = 2e12, 100e9
    model = tiny_model([100 * MiB] * 3)
    plan = plan_model(make_mesh({"a": (GiB, flops, bandwidth)}), model, PlanOptions(prompt_len=64))
    q_flops, q_bw = quantize(flops), quantize(bandwidth)
    read = 300 * MiB + 4 * MiB
    head = 2 * 256 * 64
    work = 2 * (300 * MiB // 2) + head
    assert plan.prediction.decode_s_per_token == pytest.approx(max(read / q_bw, work / q_flops))
    prompt_work = 64 * (work - head) + head  # the head runs for the last position only
    assert plan.prediction.ttft_s == pytest.approx(max(read / q_bw, prompt_work / q_flops))
    assert plan.prediction.tokens_per_s == pytest.approx(1 / plan.prediction.decode_s_per_token)


@pytest.mark.parametrize("concurrency", [1, 3, 8, 40])
def test_one_node_decodes_concurrent_sequences_as_one_batch(concurrency: int) -> None:
    """On one node all sequences decode as one batch: a step reads the weights once and
    computes every row, so tokens come max(read / bandwidth, C x FLOPs / compute) apart."""
    flops, bandwidth = 2e12, 100e9
    model = tiny_model([100 * MiB] * 3)
    options = PlanOptions(concurrency=concurrency)
    plan = plan_model(make_mesh({"a": (GiB, flops, bandwidth)}), model, options)
    q_flops, q_bw = quantize(flops), quantize(bandwidth)
    read = 300 * MiB + 4 * MiB
    work = 2 * (300 * MiB // 2) + 2 * 256 * 64
    step = max(read / q_bw, concurrency * work / q_flops)
    assert plan.prediction.time_per_token_s == pytest.approx(step)
    assert plan.prediction.aggregate_tokens_per_s == pytest.approx(concurrency / step)
    assert plan.prediction.decode_s_per_token == pytest.approx(max(read / q_bw, work / q_flops))


def test_micro_batches_take_turns_at_the_slowest_stage() -> None:
    """16 sequences on 2 stages: two micro-batches of 8 rows; a token every max(one micro-
    batch's round: both steps and both hops with 8 rows, 2 x the slower step)."""
    latency, link_bw = 1e-4, 1e9
    nodes = {"a": (600 * MiB, *FAST), "b": (600 * MiB, *SLOW)}  # neither holds the model
    mesh = make_mesh(nodes, default_link=(latency, link_bw))
    model = tiny_model([100 * MiB] * 8)
    plan = plan_model(mesh, model, PlanOptions(concurrency=16))
    assert len(plan.stages) == 2
    cost = CostModel(model, PlanOptions(concurrency=16))
    assert (cost.micro_batches(2), cost.step_rows(2)) == (2, 8)
    steps = []
    for index, stage in enumerate(plan.stages):
        flops, bandwidth = nodes[stage.nodes[0]][1:]
        unit = Unit((stage.nodes[0],), 600 * MiB, quantize(flops), quantize(bandwidth))
        start, end = stage.layer_start, stage.layer_end
        steps.append(cost.stage_step_s(unit, start, end, last=index == 1, rows=8))
    q_lat, q_bw = quantize(latency), quantize(link_bw)
    hops = q_lat + 8 * 64 * 2 / q_bw + q_lat + 8 * 8 / q_bw
    expected = max(sum(steps) + hops, 2 * max(steps))
    assert plan.prediction.time_per_token_s == pytest.approx(expected)
    assert plan.prediction.aggregate_tokens_per_s == pytest.approx(16 / expected)


def test_two_stage_prediction_counts_forward_hop_and_token_hop() -> None:
    latency, link_bw = 2e-3, 1e8
    mesh = make_mesh(
        {"a": (300 * MiB, *FAST), "b": (300 * MiB, *FAST)}, default_link=(latency, link_bw)
    )
    plan = plan_model(mesh, tiny_model([100 * MiB] * 4))
    assert [hop.carries for hop in plan.hops] == ["hidden", "token"]
    q_lat, q_bw = quantize(latency), quantize(link_bw)
    assert plan.hops[0].decode_s == pytest.approx(q_lat + 64 * 2 / q_bw)
    assert plan.hops[1].decode_s == pytest.approx(q_lat + 8 / q_bw)
    total = sum(plan.prediction.stage_decode_s) + plan.hops[0].decode_s + plan.hops[1].decode_s
    assert plan.prediction.decode_s_per_token == pytest.approx(total)


# ---- tensor parallel ------------------------------------------------------------------------


def test_tensor_parallel_group_on_a_thunderbolt_pair() -> None:
    nodes = {"tb-a": (GiB, *FAST), "tb-b": (GiB, *FAST), "eth": (GiB, *SLOW)}
    tb5 = (5e-6, 9e9, 1.0)
    links = {("tb-a", "tb-b"): tb5, ("tb-b", "tb-a"): tb5}
    mesh = make_mesh(nodes, links, default_link=(1e-3, 1.25e9))
    model = tiny_model([150 * MiB] * 8, supports_tensor_parallel=True)
    plain = plan_model(mesh, model, PlanOptions(parallelism="pipeline"))
    grouped = plan_model(mesh, model)
    assert grouped.layout == "tensor"
    assert grouped.stages[0].nodes == ("tb-a", "tb-b")
    assert grouped.node_layers("tb-b") == range(0, 8)
    assert grouped.prediction.decode_s_per_token < plain.prediction.decode_s_per_token
    halves = {entry.node: entry.weights_bytes for entry in grouped.memory}
    assert halves["tb-a"] == halves["tb-b"] == 4 * 150 * MiB + 8 * MiB


def test_a_tensor_parallel_group_decodes_concurrent_sequences_one_by_one() -> None:
    """A group's runners keep one cache per request, so the daemon steps them request by
    request: 16 sequences cost a group 16 steps of one where a pipeline stage batches them.
    The group that wins for one sequence on a Thunderbolt pair loses at 4 and 16 to a pipeline."""
    tb5 = (5e-6, 9e9, 1.0)
    mesh = make_mesh({"x": (GiB, *FAST), "y": (GiB, *FAST)}, default_link=tb5)
    model = tiny_model([150 * MiB] * 8, supports_tensor_parallel=True)
    alone = plan_model(mesh, model, PlanOptions(parallelism="tensor"))
    busy = plan_model(mesh, model, PlanOptions(parallelism="tensor", concurrency=16))
    assert alone.layout == busy.layout == "tensor"
    assert busy.prediction.time_per_token_s == pytest.approx(
        16 * alone.prediction.decode_s_per_token
    )
    assert busy.prediction.aggregate_tokens_per_s == pytest.approx(alone.prediction.tokens_per_s)
    assert plan_model(mesh, model).layout == "tensor"
    for concurrency in (4, 16):  # priced batched, the group won at 4 on 3x its real speed
        assert plan_model(mesh, model, PlanOptions(concurrency=concurrency)).layout != "tensor"


def test_no_tensor_parallel_group_when_heads_do_not_divide() -> None:
    tb5 = (5e-6, 9e9, 1.0)
    mesh = make_mesh({"x": (GiB, *FAST), "y": (GiB, *FAST)}, default_link=tb5)
    model = tiny_model(
        [150 * MiB] * 8,
        num_attention_heads=11,
        num_key_value_heads=11,
        supports_tensor_parallel=True,
    )
    plan = plan_model(mesh, model)
    assert not any(stage.tensor_parallel for stage in plan.stages)
    with pytest.raises(ParallelismUnavailable, match="divides both the attention heads"):
        plan_model(mesh, model, PlanOptions(parallelism="tensor"), fallback=False)


# ---- determinism, quantization, ids ---------------------------------------------------------


def test_same_plan_and_id_for_any_insertion_order() -> None:
    nodes = {f"n{i}": ((i + 1) * 200 * MiB, 1e11 * (i + 1), 5e10 * (i % 3 + 1)) for i in range(6)}
    model = tiny_model([100 * MiB] * 9)
    first = plan_model(make_mesh(nodes), model)
    second = plan_model(make_mesh(nodes, order=reversed(list(nodes))), model)
    assert first == second
    assert len(first.plan_id) == 64 and first.short_id == first.plan_id[:12]


def test_measurement_noise_inside_a_bucket_keeps_the_plan_id() -> None:
    base = 100e9 * 1.125**0.5  # well inside a bucket
    model = tiny_model([100 * MiB] * 4)
    ids = {
        plan_model(make_mesh({"a": (GiB, 1e12, base * factor)}), model).plan_id
        for factor in (0.97, 1.0, 1.03)
    }
    assert len(ids) == 1


def test_plan_id_is_the_layout() -> None:
    """Equal stages on equal nodes are one plan, whatever chose them; anything the stages run
    with (the model, the KV cache they reserve) or where they run makes another."""
    mesh = make_mesh({"a": (GiB, *FAST)})
    model = tiny_model([100 * MiB] * 4)
    reference = plan_model(mesh, model).plan_id
    renamed = mesh.copy()
    renamed.nodes["a"]["name"] = "a friendly label"
    assert plan_model(renamed, model).plan_id == reference
    assert plan_model(mesh, model, PlanOptions(strategy="memory")).plan_id == reference
    assert plan_model(make_mesh({"a": (GiB + 1, *FAST)}), model).plan_id == reference
    slower = make_mesh({"a": (GiB, FAST[0] / 2, FAST[1])})
    assert plan_model(slower, model).plan_id == reference
    assert plan_model(mesh, tiny_model([100 * MiB] * 5)).plan_id != reference
    assert plan_model(mesh, model, PlanOptions(context_length=64)).plan_id != reference
    assert plan_model(make_mesh({"b": (GiB, *FAST)}), model).plan_id != reference


def test_an_incumbent_layout_stays_unless_another_is_materially_faster() -> None:
    """Two nodes that each hold the model: the faster alone is the fresh plan, but the mesh
    keeps running on the other while the gain is within SWITCH_GAIN, and only then moves."""
    from partitioner import SWITCH_GAIN

    model = tiny_model([100 * MiB] * 4)

    def mesh(a_speed: float) -> nx.DiGraph:
        return make_mesh({"a": (GiB, FAST[0], FAST[1] * a_speed), "b": (GiB, *FAST)})

    on_b = plan_model(mesh(0.5), model)
    assert on_b.nodes == ("b",)
    near = mesh(1.0 + SWITCH_GAIN / 2)
    assert plan_model(near, model).nodes == ("a",)  # fresh: a is a little faster
    kept = plan_model(near, model, incumbent=on_b.stages)
    assert kept.nodes == ("b",) and kept.plan_id == on_b.plan_id
    moved = plan_model(mesh(1.5), model, incumbent=on_b.stages)
    assert moved.nodes == ("a",)
    # Hysteresis: back on a, b must now be materially faster to win it back.
    assert plan_model(mesh(1.0 - SWITCH_GAIN / 2), model, incumbent=moved.stages).nodes == ("a",)


def test_an_incumbent_that_cannot_run_any_more_is_replaced() -> None:
    model = tiny_model([100 * MiB] * 4)
    both = make_mesh({"a": (GiB, *FAST), "b": (GiB, *FAST)})
    on_b = plan_model(make_mesh({"b": (GiB, *FAST)}), model)
    assert plan_model(make_mesh({"a": (GiB, *FAST)}), model, incumbent=on_b.stages).nodes == (
        "a",
    )  # b left
    small_b = make_mesh({"a": (GiB, *FAST), "b": (300 * MiB, *FAST)})
    assert plan_model(small_b, model, incumbent=on_b.stages).nodes == ("a",)  # b too small
    excluded = PlanOptions(exclude=frozenset({"b"}))
    assert plan_model(both, model, excluded, incumbent=on_b.stages).nodes == ("a",)
    other_model = tiny_model([100 * MiB] * 5)
    assert plan_model(both, other_model, incumbent=on_b.stages).num_layers == 5
    memory = PlanOptions(strategy="memory")
    assert plan_model(both, model, memory, incumbent=on_b.stages).nodes != ("b",)


def test_layout_key_round_trips() -> None:
    from partitioner import layout_key, stages_from_layout_key

    mesh = make_mesh({"a": (300 * MiB, *FAST), "b": (300 * MiB, *FAST)})
    plan = plan_model(mesh, tiny_model([100 * MiB] * 4))
    assert len(plan.stages) == 2
    assert stages_from_layout_key(plan.layout_key) == plan.stages
    assert layout_key(stages_from_layout_key(plan.layout_key)) == plan.layout_key
    with pytest.raises(ValueError, match="not a layout"):
        stages_from_layout_key('{"nodes": 1}')


def test_buckets_are_25_percent_wide_and_stable() -> None:
    index = bucket_index(1e9)
    assert bucket_index(bucket_value(index)) == index
    assert 1e9 / 1.25 < bucket_value(index) < 1e9 * 1.25
    assert bucket_index(1e9 * 1.26) == index + 1 or bucket_index(1e9 * 1.26) == index + 2
    with pytest.raises(ValueError, match="positive"):
        bucket_index(0.0)


def test_sticky_bucket_keeps_the_previous_bucket_near_an_edge() -> None:
    edge = float(1.25**40)
    below, above = edge * 0.99, edge * 1.01
    assert bucket_index(below) != bucket_index(above)
    assert sticky_bucket_index(above, bucket_index(below)) == bucket_index(below)
    assert sticky_bucket_index(edge * 1.3, bucket_index(below)) == bucket_index(edge * 1.3)


def test_plan_round_trips_through_json() -> None:
    mesh = make_mesh({"a": (300 * MiB, *FAST), "b": (300 * MiB, *SLOW)})
    plan = plan_model(mesh, tiny_model([100 * MiB] * 4))
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert plan.node_layers("nobody") == range(0)


# ---- input validation -----------------------------------------------------------------------


def test_missing_measurement_is_a_clear_mesh_error() -> None:
    graph = nx.DiGraph()
    graph.add_node("a", memory_budget=GiB, mem_bandwidth=1e11)
    with pytest.raises(MeshError, match=r"node 'a': flops must be a positive number"):
        plan_model(graph, tiny_model([MiB]))


def test_dead_link_counts_as_no_link() -> None:
    mesh = make_mesh({"a": (300 * MiB, *FAST), "b": (300 * MiB, *FAST)})
    mesh.edges["a", "b"]["bandwidth"] = 0.0
    with pytest.raises(InsufficientMemory, match="cannot reach each other"):
        plan_model(mesh, tiny_model([100 * MiB] * 4))


def test_model_spec_round_trip_and_shorthand() -> None:
    model = tiny_model([MiB, 2 * MiB])
    assert ModelSpec.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    data = {k: v for k, v in model.to_dict().items() if not k.startswith("layer_")}
    data |= {"layer_bytes": 3 * MiB, "num_layers": 5, "quant_bits": 4}
    short = ModelSpec.from_dict(data)
    assert short.layer_bytes == (3 * MiB,) * 5
    assert short.layer_params == (3 * MiB * 2,) * 5
    with pytest.raises(ModelSpecError, match="unknown model spec field"):
        ModelSpec.from_dict({**model.to_dict(), "layres": 3})
    with pytest.raises(ModelSpecError, match="no layers"):
        tiny_model([])


def test_options_are_validated() -> None:
    with pytest.raises(PlanOptionsError, match="unknown strategy"):
        PlanOptions(strategy="fastest")
    with pytest.raises(PlanOptionsError, match="concurrency"):
        PlanOptions(concurrency=0)
    with pytest.raises(PlanOptionsError, match="collection of node ids"):
        PlanOptions(exclude="a")  # type: ignore[arg-type]
    assert PlanOptions.from_dict(PlanOptions(exclude={"x"}).to_dict()) == PlanOptions(
        exclude=frozenset({"x"})
    )


def test_infinite_values_never_reach_json() -> None:
    plan = plan_model(make_mesh({"a": (GiB, *FAST)}), tiny_model([0, 0]))
    text = json.dumps(plan.to_dict(), allow_nan=False)
    assert math.isfinite(json.loads(text)["prediction"]["tokens_per_s"])
