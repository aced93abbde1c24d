"""How still a node profile holds: repeated measurements, quiet and under a CPU burner.

Measures this machine's profile ``--runs`` times (as the daemon does: samples, their upper
quartile and spread, other processes' CPU meanwhile) and prints, for FLOP/s and memory
bandwidth, the median, min/max, the samples' typical spread and the largest deviation of a
run from the median; then the same ``--loaded-runs`` times with one bounded CPU burner per
core (tests/support/cpu_load.busy_core), and how many of those were marked loaded. Goals: on
an idle machine every run within 15% of the median and none marked loaded; under the
burners every run marked loaded.

    .venv/bin/python benchmarks/bench_profile_stability.py [--runs 10] [--loaded-runs 5]

Run it on an otherwise idle machine: other processes' load is exactly what it detects.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshd.runtime.blas import enable_fast_blas

BLAS = enable_fast_blas()  # before anything imports mlx.core

from meshd.mesh.profiling import NodeProfile, measure_node_profile, usable_cores
from tests.support.cpu_load import busy_core

PAUSE_S = 0.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="quiet measurements")
    parser.add_argument("--loaded-runs", type=int, default=5, help="measurements under burners")
    parser.add_argument("--burners", type=int, default=0, help="busy cores (default: all)")
    args = parser.parse_args()
    print(f"BLAS {BLAS.name}; {usable_cores()} cores; {time.strftime('%Y-%m-%d %H:%M')}")
    quiet = _measure(args.runs)
    ok = _report("no burner", quiet)
    burners = args.burners or usable_cores()
    if args.loaded_runs:
        with contextlib.ExitStack() as stack:
            for _ in range(burners):
                stack.enter_context(busy_core(args.loaded_runs * 3.0 + 5.0))
            time.sleep(0.5)  # the burners are running
            loaded = _measure(args.loaded_runs)
        _report(f"{burners} burner(s)", loaded)
        ok = ok and all(p.loaded for p in loaded)
    return 0 if ok else 1


def _measure(runs: int) -> list[NodeProfile]:
    profiles = []
    for index in range(runs):
        profile = measure_node_profile()
        profiles.append(profile)
        print(
            f"  run {index + 1:2}: {profile.flops / 1e9:7.1f} GFLOP/s"
            f" ±{50 * profile.flops_spread:3.0f}%"
            f"  {profile.mem_bandwidth / 1e9:6.2f} GB/s ±{50 * profile.mem_bandwidth_spread:3.0f}%"
            f"  others {profile.other_busy_cores:4.2f} cores"
            f"  {'LOADED' if profile.loaded else 'quiet'}",
            flush=True,
        )
        time.sleep(PAUSE_S)
    return profiles


def _report(what: str, profiles: list[NodeProfile]) -> bool:
    """Print the summary of one phase; True when every run is within 15% of the median."""
    within = True
    for name, value, spread, unit in (
        ("compute", lambda p: p.flops / 1e9, lambda p: p.flops_spread, "GFLOP/s"),
        ("memory bw", lambda p: p.mem_bandwidth / 1e9, lambda p: p.mem_bandwidth_spread, "GB/s"),
    ):
        values = [value(p) for p in profiles]
        deviation = _max_deviation(values)
        within = within and deviation <= 0.15
        print(
            f"{what:12} {name:9}: median {statistics.median(values):7.2f} {unit}, "
            f"min {min(values):7.2f}, max {max(values):7.2f}, "
            f"spread (median of runs) ±{50 * statistics.median(map(spread, profiles)):.0f}%, "
            f"max deviation from the median {100 * deviation:.1f}%"
        )
    marked = sum(p.loaded for p in profiles)
    print(f"{what:12} marked loaded: {marked} of {len(profiles)}")
    return within


def _max_deviation(values: list[float]) -> float:
    middle = statistics.median(values)
    return max(abs(v - middle) / middle for v in values)


if __name__ == "__main__":
    sys.exit(main())
