"""Print this machine's node profile and how long measuring takes, cold and cached.

Usage: .venv/bin/python benchmarks/bench_profile.py [--state-dir DIR] [--memory-budget 300MB]
Without --state-dir a temporary directory is used (and removed), so the cold run always
measures. Run it as a fresh process: fast BLAS must be enabled before MLX is imported.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from meshd.runtime.blas import enable_fast_blas

BLAS = enable_fast_blas()  # before anything imports mlx.core

from meshd.mesh.profiling import NodeProfile, load_or_measure_profile
from partitioner.humanize import format_bytes, format_flops, format_rate, parse_size


def main() -> None:
    arguments = _parser().parse_args()
    override = parse_size(arguments.memory_budget) if arguments.memory_budget else None
    if arguments.state_dir is not None:
        _bench(arguments.state_dir, override)
        return
    with tempfile.TemporaryDirectory(prefix="meshd-bench-profile-") as state_dir:
        _bench(Path(state_dir), override)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, help="cache directory (default: temporary)")
    parser.add_argument("--memory-budget", help="override the budget, e.g. 300MB or 1.5GiB")
    return parser


def _bench(state_dir: Path, override: int | None) -> None:
    cold, cold_s = _timed(state_dir, override)
    cached, cached_s = _timed(state_dir, override)
    print(json.dumps(cold.to_dict(), indent=2))
    print(f"blas:           {BLAS.name} ({BLAS.reason})")
    print(f"compute:        {format_flops(cold.flops)} ({cold.dtype} matmul)")
    print(f"mem bandwidth:  {format_rate(cold.mem_bandwidth)} (matrix-vector)")
    sizes = (cold.total_memory, cold.memory_budget, cold.available_memory)
    print("memory:         total {}, budget {}, available {}".format(*map(format_bytes, sizes)))
    print(f"first call:     {cold_s:.3f} s (measured unless the cache was valid)")
    print(f"cached call:    {cached_s * 1000:.1f} ms, identical: {cached == cold}")


def _timed(state_dir: Path, override: int | None) -> tuple[NodeProfile, float]:
    started = time.perf_counter()
    profile = load_or_measure_profile(state_dir, memory_budget_override=override)
    return profile, time.perf_counter() - started


if __name__ == "__main__":
    main()
