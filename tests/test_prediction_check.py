"""The comparison of a plan's predictions with its requests, and the speed correction rule."""

from __future__ import annotations

import dataclasses

import networkx as nx
import pytest

from meshd.inference.prediction_check import (
    FinishedRequest,
    compare,
    decoding_together,
    predicted_ttft_s,
    prefilled_alone,
)
from meshd.mesh.graph import effective_bandwidth, effective_flops, mesh_graph
from meshd.mesh.speed_correction import (
    FACTOR_MAX,
    FACTOR_MIN,
    MIN_PROMPT_SAMPLES,
    MIN_SAMPLES,
    Correction,
    Published,
    SpeedCorrector,
    StepPredictor,
    StepSample,
    estimate,
    should_publish,
)
from meshd.wire import pb
from partitioner import ModelSpec, Plan, PlanOptions, plan_model
from partitioner.humanize import format_token_rate, format_wait

pytestmark = pytest.mark.unit

MiB = 2**20
GB = 10**9


def model() -> ModelSpec:
    layers = (16 * MiB,) * 8
    return ModelSpec(
        name="tiny",
        layer_bytes=layers,
        layer_params=tuple(size // 4 for size in layers),
        embedding_bytes=2 * MiB,
        head_bytes=2 * MiB,
        tie_word_embeddings=False,
        kv_bytes_per_token_per_layer=1024,
        hidden_size=256,
        intermediate_size=512,
        vocab_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        activation_bytes=4,
        dtype="float32",
        context_length=512,
    )


def two_node_plan(concurrency: int = 1) -> Plan:
    graph = nx.DiGraph()
    for node in ("a", "b"):
        graph.add_node(node, memory_budget=170 * MiB, flops=20e9, mem_bandwidth=2 * GB)
    graph.add_edge("a", "b", latency_s=1e-4, bandwidth=1e9)
    graph.add_edge("b", "a", latency_s=1e-4, bandwidth=1e9)
    options = PlanOptions(concurrency=concurrency, prompt_len=128, context_length=256)
    plan = plan_model(graph, model(), options)
    assert len(plan.stages) == 2  # neither node holds the whole model
    return plan


def request(plan: Plan, start: float, ttft: float, decode: float, **kw: int) -> FinishedRequest:
    values = {"prompt_tokens": 128, "cached_tokens": 0, "completion_tokens": 33} | kw
    return FinishedRequest(plan.plan_id, start, start + ttft, start + ttft + decode, **values)


def test_requests_one_after_another_are_compared_with_the_prediction_alone() -> None:
    plan = two_node_plan()
    predicted_rate = plan.prediction.tokens_per_s
    # 32 tokens after the first, at half the predicted rate; each request alone.
    decode = 32 / (predicted_rate / 2)
    ttft = plan.prediction.ttft_s * 3
    finished = [request(plan, i * 100.0, ttft, decode) for i in range(5)]
    found = compare(plan, finished)
    assert found.requests == 5
    assert found.decode_alone.requests == 5
    assert found.decode_alone.ratio == pytest.approx(0.5)
    assert found.ttft.requests == 5
    assert found.ttft.ratio == pytest.approx(3.0)
    assert found.prefill.ratio == pytest.approx(1 / 3)
    assert found.decode_concurrent is None  # the plan is for one sequence


def test_overlapping_requests_count_at_the_plans_concurrency_not_alone() -> None:
    plan = two_node_plan(concurrency=4)
    per_sequence = 1 / plan.prediction.time_per_token_s
    decode = 32 / per_sequence  # exactly as predicted
    finished = [request(plan, 0.0, 1.0, decode) for _ in range(4)]
    found = compare(plan, finished)
    assert found.decode_alone.requests == 0
    assert found.decode_concurrent is not None
    assert found.decode_concurrent.requests == 4
    assert found.decode_concurrent.ratio == pytest.approx(1.0)
    # Their prompts ran together: no TTFT or prefill is compared.
    assert found.ttft.requests == 0 and found.prefill.requests == 0
    assert found.ttft.predicted == pytest.approx(plan.prediction.ttft_s)


def test_a_request_that_overlapped_at_another_concurrency_is_not_compared() -> None:
    plan = two_node_plan(concurrency=16)
    finished = [request(plan, 0.0, 1.0, 10.0) for _ in range(2)]
    found = compare(plan, finished)
    assert found.decode_alone.requests == 0
    assert found.decode_concurrent is not None and found.decode_concurrent.requests == 0
    assert decoding_together(finished[0], finished) == pytest.approx(2.0)


def test_a_prefix_cache_hit_or_a_prompt_behind_another_request_is_no_prefill_sample() -> None:
    plan = two_node_plan()
    cached = request(plan, 0.0, 0.1, 1.0, cached_tokens=100)
    first = request(plan, 10.0, 0.5, 5.0)
    behind = request(plan, 12.0, 4.0, 1.0)  # started while `first` decoded
    found = compare(plan, [cached, first, behind])
    assert found.ttft.requests == 1
    assert not prefilled_alone(behind, [first, behind])
    assert prefilled_alone(first, [cached, first])


def test_other_plans_requests_and_old_ones_beyond_the_window_are_left_out() -> None:
    plan = two_node_plan()
    other = dataclasses.replace(request(plan, 0.0, 1.0, 1.0), plan_id="another")
    finished = [other] + [request(plan, i * 100.0, 1.0, 1.0) for i in range(40)]
    found = compare(plan, finished)
    assert found.requests == 32


def test_the_ttft_prediction_scales_with_the_prompt_from_the_weights_read_floor() -> None:
    plan = two_node_plan()
    at_prompt_len = predicted_ttft_s(plan, plan.prediction.prompt_len)
    assert at_prompt_len == pytest.approx(plan.prediction.ttft_s)
    assert predicted_ttft_s(plan, 1) >= sum(plan.prediction.stage_decode_s)
    assert predicted_ttft_s(plan, 10 * 128) > at_prompt_len


def test_no_request_yet_shows_the_prediction_and_nothing_measured() -> None:
    found = compare(two_node_plan(), [])
    assert found.decode_alone.measured == 0 and found.decode_alone.ratio == 0
    assert found.decode_alone.predicted > 0


# ---------------------------------------------------------------- the speed correction


def update(
    corrector: SpeedCorrector,
    plan: Plan,
    steps: list[tuple[str, int, float]],
    published: Published | None = None,
    *,
    chunks: list[tuple[str, int, float]] | None = None,
    now: float = 0.0,
) -> Correction | None:
    """The corrector's update for a node whose profile says 20 GFLOP/s and 2 GB/s."""
    return corrector.update(
        model(), plan, 20e9, 2 * GB, steps, chunks or [], published or Published(), now
    )


def samples(ratio: float, count: int, rows: int = 1) -> list[StepSample]:
    return [StepSample(rows, 0.01 * ratio, 0.01) for _ in range(count)]


def test_the_factor_is_the_median_ratio_and_robust_to_outliers() -> None:
    found = estimate(samples(2.0, 20) + samples(50.0, 5))
    assert found is not None
    assert found.factor == pytest.approx(2.0)
    assert found.samples == 25


def test_too_few_steps_give_no_factor_and_extremes_are_clamped() -> None:
    assert estimate(samples(2.0, MIN_SAMPLES - 1)) is None
    assert estimate(samples(1000.0, MIN_SAMPLES)).factor == FACTOR_MAX  # type: ignore[union-attr]
    assert estimate(samples(0.001, MIN_SAMPLES)).factor == FACTOR_MIN  # type: ignore[union-attr]


def test_a_factor_changes_only_past_the_threshold() -> None:
    assert not should_publish(0.0, 1.1)  # none published counts as 1
    assert should_publish(0.0, 1.5)
    assert not should_publish(2.0, 2.3)
    assert not should_publish(2.0, 1.7)
    assert should_publish(2.0, 3.0)
    assert should_publish(2.0, 1.2)


def test_the_predictor_prices_this_nodes_stage_from_the_uncorrected_profile() -> None:
    plan = two_node_plan()
    stage = plan.stages[0]
    node = stage.nodes[0]
    slow = StepPredictor(model(), plan, node, 20e9, 2 * GB)
    fast = StepPredictor(model(), plan, node, 40e9, 4 * GB)
    assert slow.applies and slow.step_s(1) > 0
    assert slow.step_s(1) == pytest.approx(plan.prediction.stage_decode_s[0], rel=0.25)
    assert fast.step_s(1) == pytest.approx(slow.step_s(1) / 2, rel=0.25)
    assert not StepPredictor(model(), plan, "not-a-member", 20e9, 2 * GB).applies
    steps = [(plan.plan_id, 1, 0.5), ("another plan", 1, 9.0)]
    assert [s.measured_s for s in slow.samples(steps)] == [0.5]


def test_the_corrector_publishes_a_slow_nodes_factor_once() -> None:
    plan = two_node_plan()
    node = plan.stages[0].nodes[0]
    corrector = SpeedCorrector(node)
    predicted = StepPredictor(model(), plan, node, 20e9, 2 * GB).step_s(1)
    steps = [(plan.plan_id, 1, 3 * predicted)] * MIN_SAMPLES
    found = update(corrector, plan, steps)
    assert found is not None and found.factor == pytest.approx(3.0, rel=0.01)
    assert found.compute_factor == 0 and found.row_flops == 0  # no news of either
    assert update(SpeedCorrector(node), plan, steps, Published(found.factor)) is None


def test_planning_divides_a_nodes_speed_by_its_published_factor() -> None:
    profile = pb.NodeProfile(node_id="a", memory_budget=GB, flops=100e9, mem_bandwidth=10e9)
    plain = pb.NodeState(profile=profile)
    slowed = pb.NodeState(profile=profile, speed_correction=pb.SpeedCorrection(factor=2.0))
    assert effective_flops(plain) == 100e9 and effective_bandwidth(plain) == 10e9
    assert effective_flops(slowed) == 50e9 and effective_bandwidth(slowed) == 5e9
    graph = mesh_graph([slowed])
    assert graph.nodes["a"]["flops"] == 50e9


def test_a_correction_changes_the_planning_digest() -> None:
    from meshd.agreement.service import state_digest

    profile = pb.NodeProfile(node_id="a", memory_budget=GB, flops=100e9, mem_bandwidth=10e9)
    plain = pb.NodeState(profile=profile)
    slowed = pb.NodeState(profile=profile, speed_correction=pb.SpeedCorrection(factor=2.0))
    assert state_digest(plain) != state_digest(slowed)


def test_waits_and_rates_read_as_people_say_them() -> None:
    assert format_wait(0.57) == "0.57 s"
    assert format_wait(56.791) == "57 s"
    assert format_wait(5.2) == "5.2 s"
    assert format_wait(0.045) == "45 ms"
    assert format_token_rate(6.54) == "6.5 tokens/s"
    assert format_token_rate(123.4) == "123 tokens/s"


def test_batched_steps_give_the_flops_of_each_added_row() -> None:
    # One row: 2x the roofline. Four rows: the corrected roofline + 3 rows at 1 GFLOP/s.
    flops = 1e8  # per row
    single = [StepSample(1, 0.02, 0.01, flops) for _ in range(MIN_SAMPLES)]
    batched = [StepSample(4, 0.02 + 3 * flops / 1e9, 0.01, flops) for _ in range(MIN_SAMPLES)]
    found = estimate(single + batched)
    assert found is not None
    assert found.factor == pytest.approx(2.0)
    assert found.samples == MIN_SAMPLES  # the factor comes from the steps of one row
    assert found.row_flops == pytest.approx(1e9, rel=0.01)
    # Rows that add nothing beyond the roofline report no row FLOP/s.
    flat = [StepSample(4, 0.02, 0.01, flops) for _ in range(MIN_SAMPLES)]
    assert estimate(single + flat).row_flops == 0.0  # type: ignore[union-attr]


def test_the_factor_comes_from_one_row_steps_only_and_batched_load_leaves_it() -> None:
    """Batched steps cost more per step the more rows they hold: a factor taken from them
    moved with the load and re-planned a busy mesh. Busy spells leave the factor as it is."""
    flops = 1e8
    single = [StepSample(1, 0.02, 0.01, flops) for _ in range(MIN_SAMPLES)]
    busy = [StepSample(16, 0.02 + 15 * flops / 1e9, 0.01, flops) for _ in range(3 * MIN_SAMPLES)]
    found = estimate(single + busy)  # one-row steps older than many batched ones
    assert found is not None and found.factor == pytest.approx(2.0)
    assert found.row_flops == pytest.approx(1e9, rel=0.01)
    only_busy = estimate(busy, published_factor=2.0)
    assert only_busy is not None and only_busy.factor is None and only_busy.samples == 0
    assert only_busy.row_flops == pytest.approx(1e9, rel=0.01)  # over the published factor


def test_a_corrector_under_batched_load_keeps_its_factor_and_learns_the_rows() -> None:
    plan = two_node_plan()
    node = plan.stages[0].nodes[0]
    predictor = StepPredictor(model(), plan, node, 20e9, 2 * GB)
    alone = [(plan.plan_id, 1, 3 * predictor.step_s(1))] * MIN_SAMPLES
    first = update(SpeedCorrector(node), plan, alone)
    assert first is not None and first.factor == pytest.approx(3.0, rel=0.01)
    # Sixteen rows at three times the one-row step each: far beyond the corrected roofline.
    busy = [(plan.plan_id, 16, 9 * predictor.step_s(16))] * (2 * MIN_SAMPLES)
    later = update(SpeedCorrector(node), plan, busy, Published(first.factor))
    assert later is not None and later.factor == first.factor and later.row_flops > 0
    rows = Published(later.factor, later.row_flops)
    assert update(SpeedCorrector(node), plan, busy, rows) is None  # nothing new: no re-plan


def test_the_cost_model_adds_each_batched_row_at_the_nodes_row_flops() -> None:
    from partitioner.cost import CostModel, Unit

    cost = CostModel(model(), PlanOptions(concurrency=16, context_length=256))
    plain = Unit(("a",), 1, 20e9, 2 * GB)
    measured = Unit(("a",), 1, 20e9, 2 * GB, row_flops=1e9)
    per_row = cost.stage_flops(0, 4) / 1e9
    assert cost.stage_step_s(measured, 0, 4, last=False, rows=1) == pytest.approx(
        cost.stage_step_s(plain, 0, 4, last=False, rows=1)
    )
    assert cost.stage_step_s(measured, 0, 4, last=False, rows=16) == pytest.approx(
        cost.stage_step_s(plain, 0, 4, last=False, rows=16) + 15 * per_row
    )


def test_a_nodes_row_flops_reach_the_planner_and_its_digest() -> None:
    from meshd.agreement.service import state_digest

    profile = pb.NodeProfile(node_id="a", memory_budget=GB, flops=100e9, mem_bandwidth=10e9)
    rows = pb.NodeState(profile=profile, speed_correction=pb.SpeedCorrection(row_flops=5e9))
    assert mesh_graph([rows]).nodes["a"]["row_flops"] == 5e9
    assert "row_flops" not in mesh_graph([pb.NodeState(profile=profile)]).nodes["a"]
    assert state_digest(rows) != state_digest(pb.NodeState(profile=profile))


def test_only_moved_row_flops_republish_with_the_factor_kept() -> None:
    plan = two_node_plan(concurrency=4)
    node = plan.stages[0].nodes[0]
    predictor = StepPredictor(model(), plan, node, 20e9, 2 * GB)
    one, four = predictor.step_s(1), predictor.step_s(4)
    extra = 3 * predictor.flops_per_row / 1e9
    steps = [(plan.plan_id, 1, 1.1 * one)] * MIN_SAMPLES
    steps += [(plan.plan_id, 4, 1.1 * four + extra)] * MIN_SAMPLES
    found = update(SpeedCorrector(node), plan, steps)
    assert found is not None
    assert found.factor == 1.0  # 1.1 is within the threshold: kept
    assert found.row_flops == pytest.approx(1e9, rel=0.05)
    again = update(SpeedCorrector(node), plan, steps, Published(1.0, found.row_flops))
    assert again is None
    # A plan of one sequence has no batched steps: the row FLOP/s measured before are kept.
    alone = steps[:MIN_SAMPLES]
    assert update(SpeedCorrector(node), plan, alone, Published(1.0, 1e9)) is None


def test_a_correction_changes_at_most_once_in_the_interval_and_only_once_it_held() -> None:
    from meshd.mesh.speed_correction import CONFIRM_S, MIN_INTERVAL_S

    plan = two_node_plan()
    node = plan.stages[0].nodes[0]
    predicted = StepPredictor(model(), plan, node, 20e9, 2 * GB).step_s(1)
    corrector = SpeedCorrector(node)
    slow = [(plan.plan_id, 1, 3 * predicted)] * MIN_SAMPLES
    slower = [(plan.plan_id, 1, 6 * predicted)] * MIN_SAMPLES
    first = update(corrector, plan, slow, now=100.0)
    assert first is not None
    assert update(corrector, plan, slower, Published(first.factor), now=110.0) is None
    # A change of a published correction must hold for CONFIRM_S: a burst's first seconds
    # (its prompts, steps of a few rows) move the factor and would re-plan a serving mesh.
    start = 100.0 + MIN_INTERVAL_S
    assert update(corrector, plan, slower, Published(first.factor), now=start) is None
    assert update(corrector, plan, slow, Published(first.factor), now=start + 5) is None  # back
    assert update(corrector, plan, slower, Published(first.factor), now=start + 10) is None
    assert (
        update(corrector, plan, slower, Published(first.factor), now=start + 10 + CONFIRM_S / 2)
        is None
    )
    later = update(corrector, plan, slower, Published(first.factor), now=start + 10 + CONFIRM_S)
    assert later is not None and later.factor == pytest.approx(6.0, rel=0.01)


def test_prompt_chunks_give_the_compute_factor_apart_from_decode() -> None:
    plan = two_node_plan()
    node = plan.stages[0].nodes[0]
    predictor = StepPredictor(model(), plan, node, 20e9, 2 * GB)
    steps = [(plan.plan_id, 1, 1.0 * predictor.step_s(1))] * MIN_SAMPLES  # decode as predicted
    chunks = [(plan.plan_id, 256, 4.0 * predictor.chunk_s(256))] * MIN_PROMPT_SAMPLES
    found = update(SpeedCorrector(node), plan, steps, chunks=chunks)
    assert found is not None
    assert found.factor == 1.0 and found.compute_factor == pytest.approx(4.0, rel=0.01)
    assert found.prompt_samples == MIN_PROMPT_SAMPLES
    assert update(SpeedCorrector(node), plan, steps[:1], chunks=chunks[:1]) is None  # too few
    # Planning divides FLOP/s by the compute factor, bandwidth by the decode factor.
    profile = pb.NodeProfile(node_id="a", memory_budget=GB, flops=100e9, mem_bandwidth=10e9)
    both = pb.SpeedCorrection(factor=2.0, compute_factor=4.0)
    state = pb.NodeState(profile=profile, speed_correction=both)
    assert effective_flops(state) == 25e9 and effective_bandwidth(state) == 5e9


def test_the_chunk_prediction_counts_the_head_once() -> None:
    from partitioner.cost import CostModel, Unit

    cost = CostModel(model(), PlanOptions(context_length=256))
    unit = Unit(("a",), 1, 1e9, 1e15)  # compute-bound
    layers = cost.stage_flops(0, 8)
    seconds = cost.stage_chunk_s(unit, 0, 8, last=True, tokens=100)
    assert seconds == pytest.approx((100 * layers + cost.head_flops) / 1e9)


def test_a_group_leader_measures_what_each_collective_costs() -> None:
    graph = nx.DiGraph()
    for node in ("a", "b"):
        graph.add_node(node, memory_budget=170 * MiB, flops=20e9, mem_bandwidth=2 * GB)
    for src, dst in (("a", "b"), ("b", "a")):
        graph.add_edge(src, dst, latency_s=1e-4, bandwidth=1e9, trusted=True)
    spec = dataclasses.replace(model(), supports_tensor_parallel=True)
    options = PlanOptions(parallelism="tensor", context_length=256)
    plan = plan_model(graph, spec, options)
    stage = plan.stages[0]
    assert stage.tensor_parallel
    leader, member = stage.nodes
    predictor = StepPredictor(spec, plan, leader, 20e9, 2 * GB)
    assert predictor.leads_group and not predictor.applies  # no factor from a group's steps
    assert not StepPredictor(spec, plan, member, 20e9, 2 * GB).leads_group
    collectives = 2 * stage.num_layers + 1
    compute = predictor.collective_samples([(plan.plan_id, 1, 0.0)])[0] * -collectives
    steps = [(plan.plan_id, 1, compute + collectives * 2e-3)] * MIN_SAMPLES  # 2 ms each
    corrector = SpeedCorrector(leader)
    found = corrector.update(spec, plan, 20e9, 2 * GB, steps, [], Published(), 0.0)
    assert found is not None
    assert found.collective_overhead_s == pytest.approx(2e-3, rel=0.01)
    assert found.factor == 1.0 and found.row_flops == 0
    # Prompt chunks, net of their collectives at that overhead, give a compute factor.
    chunk_compute = predictor.chunk_samples([(plan.plan_id, 256, 0.0)], 2e-3)[0].predicted_s
    chunks = [(plan.plan_id, 256, 3.0 * chunk_compute + collectives * 2e-3)] * MIN_PROMPT_SAMPLES
    overhead = Published(collective_overhead_s=found.collective_overhead_s)
    timed_prompts = SpeedCorrector(leader).update(
        spec, plan, 20e9, 2 * GB, steps, chunks, overhead, 0.0
    )
    assert timed_prompts is not None
    assert timed_prompts.compute_factor == pytest.approx(3.0, rel=0.01)
    assert timed_prompts.collective_overhead_s == pytest.approx(2e-3, rel=0.01)
    # The planner prices the group's collectives with it.
    profile = pb.NodeProfile(node_id=leader, memory_budget=GB, flops=100e9, mem_bandwidth=10e9)
    timed = pb.SpeedCorrection(collective_overhead_s=2e-3)
    assert mesh_graph([pb.NodeState(profile=profile, speed_correction=timed)]).nodes[leader][
        "collective_overhead_s"
    ] == pytest.approx(2e-3)


def test_status_text_shows_predicted_measured_and_each_correction() -> None:
    from meshd.api import render

    figure = pb.PredictedMeasured(predicted=6.5, measured=6.9, requests=12, ratio=6.9 / 6.5)
    ttft = pb.PredictedMeasured(predicted=0.57, measured=56.791, requests=1, ratio=99.6)
    status = pb.MeshStatus(
        prediction_check=pb.PredictionCheck(
            plan_id="abc", concurrency=1, decode_alone=figure, prefill=figure, ttft=ttft
        ),
        speed_corrections=[
            pb.SpeedCorrection(node_id="n1", factor=1.5, samples=9, measured_step_s=0.06),
            pb.SpeedCorrection(node_id="n2", factor=1.0, collective_overhead_s=0.0097),
        ],
    )
    text = render.prediction_text(status)
    assert "decode alone   predicted 6.5 tokens/s, measured 6.9 tokens/s (1.06x" in text
    assert "first token    predicted 0.57 s, measured 57 s" in text
    assert "decode at" not in text  # a plan for one sequence
    assert "speed correction n1: 1.50x (decode step 60.0 ms measured" in text
    assert "speed correction n2: 1.00x (collectives 9.7 ms each)" in text


def _machine_states(
    fingerprints: tuple[str, str], factors: tuple[float, ...], rows: bool = True
) -> list:
    """Two nodes of one profile (each too small for the model alone), linked both ways, with
    the given fingerprints and published decode factors (none where the tuple is short), and
    with ``rows`` row FLOP/s of 4e9 and 8e9."""
    states = []
    for index, node in enumerate(("a", "b")):
        profile = pb.NodeProfile(
            node_id=node,
            memory_budget=170 * MiB,
            flops=20e9,
            mem_bandwidth=2 * GB,
            fingerprint=fingerprints[index],
        )
        other = "b" if node == "a" else "a"
        link = pb.LinkMeasurement(src=node, dst=other, latency_s=1e-4, bandwidth=1e9)
        state = pb.NodeState(profile=profile, links=[link])
        if index < len(factors):
            state.speed_correction.CopyFrom(
                pb.SpeedCorrection(
                    node_id=node, factor=factors[index], row_flops=4e9 * (index + 1) * rows
                )
            )
        states.append(state)
    return states


def _layers(states: list) -> dict[str, int]:
    """How many layers each node holds in the plan of ``states``."""
    options = PlanOptions(concurrency=4, prompt_len=128, context_length=256)
    plan = plan_model(mesh_graph(states), model(), options)
    return {stage.nodes[0]: stage.layer_end - stage.layer_start for stage in plan.stages}


def test_nodes_of_one_machine_are_planned_with_one_shared_correction() -> None:
    """Two daemons on one machine (one fingerprint) each publish what their steps measured
    under the other's load: both are planned with the median of what they published, so they
    stay as fast as each other and the layout is the one without corrections. On two machines
    the same factors move layers to the faster node."""
    from meshd.mesh.graph import machine_corrections

    uncorrected = _layers(_machine_states(("m1", "m1"), ()))
    colocated = _machine_states(("m1", "m1"), (2.0, 4.0))
    graph = mesh_graph(colocated)
    assert graph.nodes["a"]["mem_bandwidth"] == graph.nodes["b"]["mem_bandwidth"] == 2 * GB / 3.0
    assert graph.nodes["a"]["row_flops"] == graph.nodes["b"]["row_flops"] == 6e9
    assert _layers(colocated) == uncorrected
    # one of them published: the machine's factor is that one, for both
    alone = machine_corrections(_machine_states(("m1", "m1"), (2.0,)))
    assert {node: c.factor for node, c in alone.items()} == {"a": 2.0, "b": 2.0}
    # two machines: each keeps its own, and the slower one gets fewer layers
    apart = _machine_states(("m1", "m2"), (2.0, 4.0), rows=False)
    assert machine_corrections(apart) == {}
    assert mesh_graph(apart).nodes["b"]["mem_bandwidth"] == 2 * GB / 4.0
    held = _layers(apart)
    assert held["a"] > held["b"] and uncorrected["a"] == uncorrected["b"]
