"""Profiles that hold still: samples, spread and load, the settling of a re-measure (noise
keeps the planned numbers and the digest), and the process overhead planned out of the
budget."""

from __future__ import annotations

import dataclasses

import pytest

from meshd.agreement.service import state_digest
from meshd.mesh import process_memory
from meshd.mesh.graph import mesh_graph, plannable_budget
from meshd.mesh.process_memory import (
    FIRST_LOAD_ALLOWANCE,
    HEADROOM,
    MIB,
    OVERHEAD_GRANULE,
    OverheadTracker,
    Remembered,
    budget_refusal,
    planned_overhead,
    smallest_budget,
)
from meshd.mesh.profiling import (
    MIN_HYSTERESIS,
    NodeProfile,
    Samples,
    is_loaded,
    profile_to_proto,
    settle_profile,
)
from meshd.wire import pb

pytestmark = pytest.mark.unit

GFLOP = 1e9
GB = 1e9


def profile(**changes: object) -> NodeProfile:
    base = NodeProfile(
        total_memory=16 * 2**30,
        available_memory=8 * 2**30,
        memory_budget=8 * 2**30,
        flops=178 * GFLOP,
        mem_bandwidth=8.7 * GB,
        dtype="float32",
        platform="Linux-6.8.0-x86_64",
        chip="AMD EPYC",
        mlx_device="cpu",
        versions={"python": "3.11"},
        blas="openblas",
        cores=2,
        measured_at=1000.0,
        fingerprint="f" * 16,
        flops_spread=0.06,
        mem_bandwidth_spread=0.1,
    )
    return dataclasses.replace(base, **changes)


def digest(p: NodeProfile) -> str:
    return state_digest(pb.NodeState(profile=profile_to_proto(p, "n1", "one")))


# ---------------------------------------------------------------- samples and load


def test_the_value_is_the_upper_quartile_and_the_spread_p10_to_p90() -> None:
    samples = Samples(tuple(float(x) for x in range(1, 12)))  # 1..11
    assert samples.value == pytest.approx(8.5)
    assert samples.spread == pytest.approx((10 - 2) / 8.5)


def test_slow_samples_from_contention_barely_move_the_value() -> None:
    quiet = Samples((100.0, 101.0, 99.0, 100.5, 100.0, 99.5, 100.2, 100.1))
    disturbed = Samples((100.0, 101.0, 99.0, 100.5, 40.0, 35.0, 100.2, 100.1))
    assert disturbed.value == pytest.approx(quiet.value, rel=0.01)
    assert disturbed.spread > quiet.spread


@pytest.mark.parametrize(
    ("busy", "cores", "spread", "loaded"),
    [
        (0.05, 2, 0.05, False),  # an idle machine's background
        (0.3, 2, 0.05, True),  # another process took 15% of two cores
        (0.3, 16, 0.05, False),  # the same on sixteen cores is noise
        (2.0, 16, 0.05, True),
        (0.0, 2, 0.6, True),  # samples this far apart say the machine was busy
    ],
)
def test_load_is_other_processes_cpu_or_a_wide_spread(
    busy: float, cores: int, spread: float, loaded: bool
) -> None:
    assert is_loaded(busy, cores, spread) is loaded


# ---------------------------------------------------------------- settling a re-measure


def test_a_remeasure_within_the_spread_keeps_the_numbers_and_the_digest() -> None:
    before = profile()
    fresh = profile(
        flops=before.flops * 1.12,
        mem_bandwidth=before.mem_bandwidth * 0.9,
        measured_at=2000.0,
        flops_spread=0.2,
    )
    settled = settle_profile(before, fresh)
    assert (settled.flops, settled.mem_bandwidth) == (before.flops, before.mem_bandwidth)
    assert settled.flops_spread == before.flops_spread
    assert settled.measured_at == 2000.0  # confirmed now
    assert digest(settled) == digest(before)


def test_per_dtype_rates_settle_like_the_float32_numbers() -> None:
    """A GPU node's half-precision rates are planned with too: noise in them must not make a
    new digest either, and a real change must."""
    rates = {"float32": 178 * GFLOP, "bfloat16": 9 * GFLOP}
    before = profile(dtype_flops=rates, dtype_bandwidth={"bfloat16": 8 * GB})
    noisy = profile(
        dtype_flops={"float32": 185 * GFLOP, "bfloat16": 8.4 * GFLOP},
        dtype_bandwidth={"bfloat16": 7.5 * GB},
        measured_at=2000.0,
    )
    settled = settle_profile(before, noisy)
    assert settled.dtype_flops == rates and settled.dtype_bandwidth == {"bfloat16": 8 * GB}
    assert digest(settled) == digest(before)
    changed = profile(dtype_flops={"float32": 178 * GFLOP, "bfloat16": 90 * GFLOP})
    assert settle_profile(before, changed).dtype_flops["bfloat16"] == 90 * GFLOP


def test_noise_across_a_bucket_edge_would_change_the_digest_without_settling() -> None:
    edge = 1.25**115  # a bucket edge (partitioner.quantize): FLOP/s just below and above
    before = profile(flops=edge * 0.99)
    fresh = profile(flops=edge * 1.01, measured_at=2000.0)
    assert digest(fresh) != digest(before)
    assert digest(settle_profile(before, fresh)) == digest(before)


def test_a_wide_previous_spread_keeps_more_than_the_minimum() -> None:
    before = profile(flops_spread=0.3)
    inside = settle_profile(before, profile(flops=before.flops * 1.25))
    outside = settle_profile(before, profile(flops=before.flops * 1.35))
    assert inside.flops == before.flops
    assert outside.flops == before.flops * 1.35


def test_a_real_change_replaces_the_numbers() -> None:
    before = profile()
    fresh = profile(flops=before.flops * (1 + MIN_HYSTERESIS) * 1.1, measured_at=2000.0)
    settled = settle_profile(before, fresh)
    assert settled.flops == fresh.flops
    assert settled.mem_bandwidth == before.mem_bandwidth  # each number settles on its own
    assert digest(settled) != digest(before)


def test_a_loaded_measurement_never_replaces_a_quiet_one() -> None:
    quiet = profile()
    loaded = profile(flops=quiet.flops / 4, loaded=True, other_busy_cores=1.6, measured_at=2e3)
    assert settle_profile(quiet, loaded) == quiet


def test_a_quiet_measurement_replaces_a_loaded_one() -> None:
    loaded = profile(flops=40 * GFLOP, loaded=True, other_busy_cores=1.6)
    quiet = profile(measured_at=2000.0)
    assert settle_profile(loaded, quiet) == quiet


def test_between_loaded_measurements_the_faster_stays() -> None:
    first = profile(flops=60 * GFLOP, loaded=True)
    slower = settle_profile(first, profile(flops=20 * GFLOP, loaded=True, measured_at=2e3))
    faster = settle_profile(first, profile(flops=120 * GFLOP, loaded=True, measured_at=2e3))
    assert slower.flops == 60 * GFLOP
    assert faster.flops == 120 * GFLOP


def test_another_machine_takes_the_fresh_measurement() -> None:
    fresh = profile(fingerprint="0" * 16, flops=1.0 * GFLOP, loaded=True)
    assert settle_profile(profile(), fresh) == fresh
    assert settle_profile(None, fresh) == fresh


def test_a_profile_of_an_older_version_reads_with_defaults() -> None:
    data = profile().to_dict()
    for name in (
        "flops_spread",
        "mem_bandwidth_spread",
        "loaded",
        "other_busy_cores",
        "process_overhead",
    ):
        del data[name]
    old = NodeProfile.from_dict(data)
    assert (old.flops_spread, old.loaded, old.process_overhead) == (0.0, False, 0)


# ---------------------------------------------------------------- process overhead


def test_plans_get_the_budget_less_the_process_overhead() -> None:
    p = profile(memory_budget=477 * MIB, process_overhead=288 * MIB)
    message = profile_to_proto(p, "n1", "one")
    assert p.plannable_budget == plannable_budget(message) == 189 * MIB
    graph = mesh_graph([pb.NodeState(profile=message)])
    assert graph.nodes["n1"]["memory_budget"] == 189 * MIB
    assert digest(p) != digest(dataclasses.replace(p, process_overhead=320 * MIB))
    assert plannable_budget(profile_to_proto(profile(process_overhead=2**40), "n", "")) == 0


def test_the_planned_overhead_is_the_mark_with_headroom_in_granules() -> None:
    assert planned_overhead(200 * MIB, loaded_before=True) == 256 * MIB  # 230 -> 256
    assert planned_overhead(100 * MIB, loaded_before=True) == 128 * MIB  # 115 -> 128
    assert planned_overhead(0, loaded_before=True) == 0
    before_load = planned_overhead(120 * MIB, loaded_before=False, at_start=110 * MIB)
    wanted = (110 * MIB + FIRST_LOAD_ALLOWANCE) * (1 + HEADROOM)
    assert before_load == -(-int(wanted) // OVERHEAD_GRANULE) * OVERHEAD_GRANULE
    assert before_load % OVERHEAD_GRANULE == 0


def test_the_tracker_grows_on_evidence_and_never_shrinks_while_running() -> None:
    tracker = OverheadTracker(Remembered())
    assert tracker.observe(110 * MIB, stage_loaded=False)  # the first reading plans one
    first = tracker.planned
    assert first == planned_overhead(110 * MIB, loaded_before=False, at_start=110 * MIB)
    assert not tracker.observe(112 * MIB, stage_loaded=False)  # noise: no new plan
    assert not tracker.observe(210 * MIB, stage_loaded=True)  # fits what was planned
    assert tracker.planned == first
    assert tracker.observe(400 * MIB, stage_loaded=True)  # outgrew it: plan more
    assert tracker.planned == planned_overhead(400 * MIB, loaded_before=True)
    assert not tracker.observe(150 * MIB, stage_loaded=True)
    assert tracker.planned == planned_overhead(400 * MIB, loaded_before=True)
    assert tracker.remembered() == Remembered(400 * MIB, True)
    # A new mark inside the planned amount uses the headroom: no new plan, none squeezed.
    inside = tracker.planned - MIB
    assert inside > 400 * MIB and not tracker.observe(inside, stage_loaded=True)
    assert tracker.planned == planned_overhead(400 * MIB, loaded_before=True)
    assert tracker.remembered() == Remembered(inside, True)  # the next start plans from it


def test_a_remembered_mark_is_planned_from_the_start() -> None:
    tracker = OverheadTracker(Remembered(230 * MIB, True))
    tracker.observe(110 * MIB, stage_loaded=False)
    assert tracker.planned == planned_overhead(230 * MIB, loaded_before=True)


def test_a_given_overhead_is_used_as_is() -> None:
    tracker = OverheadTracker(Remembered(230 * MIB, True), fixed=0)
    assert not tracker.observe(500 * MIB, stage_loaded=True)
    assert tracker.planned == 0
    assert tracker.refusal(90 * 10**6) is None
    fixed = OverheadTracker(Remembered(), fixed=300 * MIB)
    assert "leaves nothing beside --process-overhead 300 MiB" in (fixed.refusal(200 * MIB) or "")


def test_a_budget_below_the_overhead_is_refused_with_the_number_needed() -> None:
    overhead = 288 * MIB
    least = smallest_budget(overhead)
    assert least >= overhead + process_memory.MIN_MODEL_ROOM
    below = budget_refusal(200 * MIB, overhead)
    assert below is not None
    assert below.startswith("--memory-budget 200 MiB is below this daemon's own overhead of 288")
    assert f"give at least {least // MIB} MiB" in below
    tight = budget_refusal(300 * MIB, overhead)
    assert tight is not None and "leaves 12 MiB beside" in tight
    assert budget_refusal(least, overhead) is None
    assert OverheadTracker(Remembered()).refusal(None) is None


# ---------------------------------------------------------------- what status shows


def test_status_shows_spread_load_overhead_and_rss_against_the_budget() -> None:
    from meshd.api import render

    quiet = profile_to_proto(profile(process_overhead=288 * MIB), "n1", "one")
    loaded = profile_to_proto(profile(loaded=True, other_busy_cores=1.6), "n2", "two")
    status = pb.MeshStatus(
        node_id="n1",
        nodes=[
            pb.PeerStatus(profile=quiet, alive=True, source="self"),
            pb.PeerStatus(profile=loaded, alive=True, source="mdns"),
        ],
        memory=pb.RuntimeMemory(
            rss=400 * MIB, budget=477 * MIB, mlx_active=150 * MIB, overhead=288 * MIB
        ),
    )
    table = render.nodes_table(status)
    assert "178 GFLOP/s ±3%" in table and "quiet" in table
    assert "loaded (1.6 cores busy elsewhere)" in table
    assert "process overhead planned out of each budget: n1 288 MiB" in table
    memory = render.memory_text(status.memory)
    assert memory.startswith("memory: RSS 400 MiB of budget 477 MiB (84%)")
    assert "OVER BUDGET" not in memory and "process overhead planned 288 MiB" in memory
    over = render.memory_text(pb.RuntimeMemory(rss=500 * MIB, budget=477 * MIB))
    assert "OVER BUDGET" in over
