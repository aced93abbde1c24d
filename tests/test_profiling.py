"""meshd.mesh.profiling: plausible measurements, a stable budget, and a cache that re-measures
exactly when it should."""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from meshd.mesh.profiling import (
    BUDGET_GRANULE,
    CACHE_MAX_AGE_S,
    PROFILE_FILE,
    PROFILE_SEED_ENV,
    NodeProfile,
    _read_limit,
    bandwidth_matrix_bytes,
    default_memory_budget,
    largest_cpu_cache,
    load_or_measure_profile,
    machine_fingerprint,
    profile_from_proto,
    profile_to_proto,
    total_memory,
)
from meshd.runtime.blas import openblas_candidates
from partitioner.humanize import parse_size
from tests.pyrun import run_json

pytestmark = pytest.mark.integration

GiB = 2**30
HAS_OPENBLAS = sys.platform.startswith("linux") and any(p.exists() for p in openblas_candidates())

# Measures in a fresh interpreter with fast BLAS enabled first, as the daemon does.
MEASURE = """
import json, time
import meshd.runtime.blas
meshd.runtime.blas.enable_fast_blas()
from meshd.mesh.profiling import machine_fingerprint, measure_node_profile
started = time.perf_counter()
profile = measure_node_profile()
elapsed = time.perf_counter() - started
print(json.dumps({"profile": profile.to_dict(), "elapsed": elapsed,
                  "fingerprint_now": machine_fingerprint()}))
"""


@pytest.fixture(scope="module", autouse=True)
def no_profile_seed() -> Iterator[None]:
    """These tests measure: the suite's seed (tests/conftest.py) would stand in for a
    missing or invalid cache."""
    seed = os.environ.pop(PROFILE_SEED_ENV, None)
    yield
    if seed is not None:
        os.environ[PROFILE_SEED_ENV] = seed


@pytest.fixture(scope="module")
def fresh_measurement() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "MESHD_BLAS"}
    return run_json(MEASURE, env=env)


@pytest.fixture(scope="module")
def cached_profile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, NodeProfile]:
    """One measurement into a cache directory, made in a worker thread as the daemon does."""
    state_dir = tmp_path_factory.mktemp("state")
    results: list[NodeProfile] = []
    worker = threading.Thread(target=lambda: results.append(load_or_measure_profile(state_dir)))
    worker.start()
    worker.join(timeout=60)
    assert results, "measuring in a worker thread failed"
    return state_dir, results[0]


def test_measured_numbers_are_plausible(fresh_measurement: dict[str, Any]) -> None:
    profile = NodeProfile.from_dict(fresh_measurement["profile"])
    if HAS_OPENBLAS:
        assert profile.blas.startswith("openblas "), profile.blas
        # The bundled reference BLAS manages 3-8 GFLOP/s here; OpenBLAS 100-470.
        assert profile.flops > 20e9, f"{profile.flops / 1e9:.1f} GFLOP/s with {profile.blas}"
    assert profile.flops > 1e9
    assert 1e9 < profile.mem_bandwidth < 1e13
    assert fresh_measurement["elapsed"] < 5.0, "measuring must stay quick (about a second)"


def test_profile_describes_this_machine(fresh_measurement: dict[str, Any]) -> None:
    profile = NodeProfile.from_dict(fresh_measurement["profile"])
    assert profile.total_memory == total_memory() <= psutil.virtual_memory().total
    assert 0 < profile.available_memory <= profile.total_memory
    assert profile.memory_budget == default_memory_budget(profile.total_memory)
    assert 0 < profile.memory_budget < profile.total_memory
    assert profile.dtype == "float32"
    assert profile.platform.startswith(f"{platform.system()}-")
    assert profile.platform.endswith(platform.machine())
    assert profile.chip
    assert profile.mlx_device == ("gpu" if sys.platform == "darwin" else "cpu")
    assert set(profile.versions) == {"python", "mlx", "mlx_lm", "meshd"}
    assert profile.versions["python"] == platform.python_version()
    assert 1 <= profile.cores <= (os.cpu_count() or 1)
    assert abs(profile.measured_at - time.time()) < 120
    assert profile.fingerprint == fresh_measurement["fingerprint_now"]


def test_profile_round_trips_through_json(cached_profile: tuple[Path, NodeProfile]) -> None:
    _, profile = cached_profile
    assert NodeProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_profile_round_trips_through_the_wire(cached_profile: tuple[Path, NodeProfile]) -> None:
    _, profile = cached_profile
    message = profile_to_proto(profile, "node-a", "kitchen mac")
    decoded = type(message).FromString(message.SerializeToString())
    assert (decoded.node_id, decoded.name) == ("node-a", "kitchen mac")
    assert profile_from_proto(decoded) == profile


def test_from_dict_names_what_is_missing_or_malformed(
    cached_profile: tuple[Path, NodeProfile],
) -> None:
    data = cached_profile[1].to_dict()
    del data["flops"], data["cores"]
    with pytest.raises(ValueError, match="lacks flops, cores"):
        NodeProfile.from_dict(data)
    malformed = {**cached_profile[1].to_dict(), "total_memory": "lots"}
    with pytest.raises(ValueError, match="malformed"):
        NodeProfile.from_dict(malformed)


def test_cache_hit_is_fast_and_identical(cached_profile: tuple[Path, NodeProfile]) -> None:
    state_dir, first = cached_profile
    started = time.perf_counter()
    again = load_or_measure_profile(state_dir)
    assert time.perf_counter() - started < 0.2
    assert again == first


def test_override_applies_without_remeasuring(cached_profile: tuple[Path, NodeProfile]) -> None:
    state_dir, first = cached_profile
    small = load_or_measure_profile(state_dir, memory_budget_override=parse_size("300MB"))
    assert small.memory_budget == 300_000_000
    assert small.measured_at == first.measured_at
    stored = json.loads((state_dir / PROFILE_FILE).read_text())["profile"]
    assert stored["memory_budget"] == first.memory_budget  # the override is not cached


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_override_must_be_positive_bytes(
    cached_profile: tuple[Path, NodeProfile], bad: Any
) -> None:
    with pytest.raises(ValueError, match="positive number of bytes"):
        load_or_measure_profile(cached_profile[0], memory_budget_override=bad)


def copy_cache(source_dir: Path, target_dir: Path, **changes: Any) -> Path:
    """Copy a cache file into ``target_dir``, changing profile fields on the way."""
    document = json.loads((source_dir / PROFILE_FILE).read_text())
    document["profile"].update(changes)
    target_dir.mkdir(parents=True, exist_ok=True)
    (target_dir / PROFILE_FILE).write_text(json.dumps(document))
    return target_dir


@pytest.mark.parametrize(
    "changes",
    [
        {"fingerprint": "0123456789abcdef"},
        # a stale quiet cache would be kept over a loaded measurement (settle_profile)
        {"measured_at": time.time() - CACHE_MAX_AGE_S - 60, "loaded": True},
        {"measured_at": time.time() + 3600},
        {"dtype": "bfloat16"},
    ],
    ids=["other-machine", "stale", "from-the-future", "other-dtype"],
)
def test_invalid_cache_is_remeasured(
    cached_profile: tuple[Path, NodeProfile], tmp_path: Path, changes: dict[str, Any]
) -> None:
    state_dir, first = cached_profile
    state = copy_cache(state_dir, tmp_path, **changes)
    before = time.time()
    fresh = load_or_measure_profile(state)
    assert fresh.measured_at >= before
    assert fresh.fingerprint == machine_fingerprint() == first.fingerprint
    assert fresh.dtype == "float32"
    stored = json.loads((state / PROFILE_FILE).read_text())["profile"]
    assert stored["measured_at"] == fresh.measured_at


def test_corrupt_cache_is_remeasured(tmp_path: Path) -> None:
    (tmp_path / PROFILE_FILE).write_text("{not json")
    profile = load_or_measure_profile(tmp_path)
    assert profile.fingerprint == machine_fingerprint()
    assert load_or_measure_profile(tmp_path) == profile


def test_remeasure_on_request(cached_profile: tuple[Path, NodeProfile], tmp_path: Path) -> None:
    state = copy_cache(cached_profile[0], tmp_path, loaded=True)  # any measurement replaces it
    fresh = load_or_measure_profile(state, remeasure=True)
    assert fresh.measured_at > cached_profile[1].measured_at


def test_a_state_without_a_profile_starts_from_the_seed(
    cached_profile: tuple[Path, NodeProfile], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Daemons on one machine share one measurement: no cache of its own, a valid seed."""
    seed = copy_cache(cached_profile[0], tmp_path / "seed")
    monkeypatch.setenv(PROFILE_SEED_ENV, str(seed / PROFILE_FILE))
    state = tmp_path / "state"
    profile = load_or_measure_profile(state)
    assert profile == cached_profile[1]  # the seed's measurement, not a new one
    assert json.loads((state / PROFILE_FILE).read_text())["profile"] == profile.to_dict()


def test_a_seed_that_is_not_valid_here_is_measured_instead(
    cached_profile: tuple[Path, NodeProfile],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    seed = copy_cache(cached_profile[0], tmp_path / "seed", fingerprint="0123456789abcdef")
    monkeypatch.setenv(PROFILE_SEED_ENV, str(seed / PROFILE_FILE))
    before = time.time()
    profile = load_or_measure_profile(tmp_path / "state")
    assert profile.measured_at >= before and profile.fingerprint == machine_fingerprint()
    assert f"{PROFILE_SEED_ENV}={seed / PROFILE_FILE} is not a usable profile here" in caplog.text


def test_unknown_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="float32"):
        load_or_measure_profile(tmp_path, dtype="float64")
    assert not (tmp_path / PROFILE_FILE).exists()


def test_budget_is_three_quarters_minus_an_os_reserve() -> None:
    assert default_memory_budget(16 * GiB) == 11 * GiB
    assert default_memory_budget(1 * GiB) == 512 * 2**20  # reserve shrinks to total/8
    assert default_memory_budget(128 * 2**20) == 0


def test_budget_is_stable_under_small_changes_of_total_memory() -> None:
    total = 16 * GiB + 100 * 2**20
    budgets = {default_memory_budget(total - delta) for delta in range(0, 50 * 2**20, 2**20)}
    assert len(budgets) == 1
    assert budgets.pop() % BUDGET_GRANULE == 0


def test_bandwidth_is_measured_beyond_the_caches() -> None:
    """256 MiB, or 8x the largest cache where that is more, within 1/16 of the memory."""
    assert bandwidth_matrix_bytes(24 * GiB, 32 * 2**20) == 256 * 2**20
    assert bandwidth_matrix_bytes(64 * GiB, 384 * 2**20) == 3 * GiB  # a large server L3
    assert bandwidth_matrix_bytes(2 * GiB, 0) == 128 * 2**20  # a small machine
    # Where Linux names this CPU's caches (many arm64 kernels do not), the largest is read;
    # where it names none, there is nothing to size by and the 256 MiB floor applies.
    named = list(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    if named:
        assert 2**15 <= largest_cpu_cache() <= 2**32
    else:
        assert largest_cpu_cache() == 0


def test_budget_follows_a_raised_gpu_wired_limit() -> None:
    assert default_memory_budget(64 * GiB, wired_limit=60 * GiB) == 60 * GiB
    assert default_memory_budget(64 * GiB, wired_limit=100 * GiB) == 63 * GiB
    assert default_memory_budget(64 * GiB, wired_limit=8 * GiB) == 8 * GiB


@pytest.mark.parametrize(
    ("content", "limit"),
    [("max\n", None), ("9223372036854771712\n", None), ("1073741824\n", GiB), (None, None)],
    ids=["v2-unlimited", "v1-unlimited", "limited", "absent"],
)
def test_cgroup_limit_files_are_read(
    tmp_path: Path, content: str | None, limit: int | None
) -> None:
    path = tmp_path / "memory.max"
    if content is not None:
        path.write_text(content)
    assert _read_limit(path) == limit
    assert total_memory() <= psutil.virtual_memory().total
