"""The daemon's whole memory: what its process holds beside MLX, measured and planned.

A node's resident memory (RSS) is MLX's memory (weights, KV caches, activations, and the
freed buffers MLX keeps in its cache) plus everything else: the interpreter and its modules,
gRPC and the HTTP server, mlx-lm and transformers once a model is touched, the model's
tokenizer, glibc's heap. Plans count MLX's part (``partitioner.cost``); this module measures
the rest, the *process overhead*, so that a node's ``--memory-budget`` pays for the whole
process: plans place ``memory_budget - process_overhead`` on it
(``NodeProfile.plannable_budget``), and MLX's cache is bounded by the slack the plan
reserves for its allocator (``mlx_cache_limit``).

How the overhead is measured, and why so:

* ``resident_beside_mlx()``: RSS less MLX's active and cached memory, read now.
* The daemon reads it when it starts and every 2 s, and keeps the most it has seen
  (``OverheadTracker``). A reading that would make the planned overhead grow is taken again
  after ``release_freed_heap``: glibc keeps the pages MLX freed (a stage unloaded, a
  prefill's buffers) resident, which is memory the process can give back, not overhead.
  The high-water mark is remembered per machine in ``state_dir/process_overhead.json``, so
  a restarted daemon plans with what it held before.
* Before this machine's daemon ever loaded a stage, what loading one adds beside MLX's arrays
  cannot be read yet: the process as it started plus ``FIRST_LOAD_ALLOWANCE`` stands in for
  it (measured: a daemon holds ~110 MiB beside MLX before any model, ~210 MiB with a stage of
  SmolLM2 loaded: mlx-lm's and transformers' modules, the tokenizer, load buffers).
* The planned overhead is the high-water mark plus ``HEADROOM`` (glibc's heap grows in steps),
  rounded up to ``OVERHEAD_GRANULE``, and it only grows: a change is a new profile digest and
  a new plan, so it changes on evidence (a measurement above what is planned), never on noise.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from meshd.runtime.files import replace_text

MIB = 2**20
OVERHEAD_FILE = "process_overhead.json"
OVERHEAD_GRANULE = 32 * MIB
HEADROOM = 0.15
FIRST_LOAD_ALLOWANCE = 128 * MIB
MIN_MODEL_ROOM = 64 * MIB  # below this much beside the overhead, no model's layers fit


def resident_beside_mlx() -> int:
    """This process's RSS less what MLX holds (active arrays and its cache of freed buffers)."""
    import mlx.core as mx

    rss = psutil.Process().memory_info().rss
    return max(0, rss - mx.get_active_memory() - mx.get_cache_memory())


def release_freed_heap() -> bool:
    """Hand the heap glibc keeps after frees back to the OS (``malloc_trim``); False where
    there is no glibc. MLX frees a stage's buffers on unload and between steps; glibc keeps
    the freed pages of its heap resident, so RSS would count memory nothing uses. Blocking
    (it walks the heap): call it off the event loop."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def planned_overhead(high_water: int, *, loaded_before: bool, at_start: int = 0) -> int:
    """The overhead plans reserve for a process that held ``high_water`` bytes beside MLX.

    ``loaded_before``: whether the high-water mark includes a stage load on this machine;
    until then the process as it started (``at_start``) plus ``FIRST_LOAD_ALLOWANCE`` stands
    for what a first load brings, when that is more than the mark.
    """
    measured = high_water if loaded_before else max(high_water, at_start + FIRST_LOAD_ALLOWANCE)
    wanted = int(measured * (1 + HEADROOM))
    return -(-wanted // OVERHEAD_GRANULE) * OVERHEAD_GRANULE


def smallest_budget(overhead: int) -> int:
    """The least ``--memory-budget`` a daemon with this overhead can place a model's layers in."""
    return -(-(overhead + MIN_MODEL_ROOM) // OVERHEAD_GRANULE) * OVERHEAD_GRANULE


def budget_refusal(budget: int, overhead: int) -> str | None:
    """Why ``budget`` cannot hold this daemon's measured overhead and a model (None: it can)."""
    least = smallest_budget(overhead)
    if budget >= least:
        return None
    what = (
        f"this daemon's own overhead of {overhead / MIB:.0f} MiB (its process beside a model: "
        "Python, gRPC, MLX's runtime, a tokenizer; measured, with headroom)"
    )
    if budget < overhead:
        said = f"is below {what}"
    else:
        said = f"leaves {(budget - overhead) / MIB:.0f} MiB beside {what}, too little for a model"
    return (
        f"--memory-budget {budget / MIB:.0f} MiB {said}; give at least {least / MIB:.0f} MiB, "
        "plus what the model's layers need"
    )


@dataclass(frozen=True)
class Remembered:
    """What a daemon on this machine held beside MLX at most, and whether with a stage."""

    high_water: int = 0
    loaded_before: bool = False


def read_remembered(state_dir: Path) -> Remembered:
    """The remembered high-water mark; none (zero) when missing or unreadable."""
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        data = json.loads((state_dir / OVERHEAD_FILE).read_text(encoding="utf-8"))
        return Remembered(int(data["high_water"]), bool(data["loaded_before"]))
    return Remembered()


def write_remembered(state_dir: Path, remembered: Remembered) -> None:
    """Atomically, like the profile cache."""
    document = {"high_water": remembered.high_water, "loaded_before": remembered.loaded_before}
    replace_text(state_dir / OVERHEAD_FILE, json.dumps(document) + "\n")


class OverheadTracker:
    """The high-water mark of this process's memory beside MLX, and the overhead to plan.

    ``observe`` takes a reading and says whether the planned overhead must grow: only when the
    reading no longer fits in what is planned (its headroom used up), and then to the new mark
    with headroom again. A new mark within the planned amount changes nothing, so a mesh is not
    re-planned, and squeezed, at every small rise. The planned overhead never shrinks while the
    daemon runs: the next start plans with the remembered mark.
    """

    def __init__(self, remembered: Remembered, fixed: int | None = None) -> None:
        self.high_water = remembered.high_water
        self.loaded_before = remembered.loaded_before
        self.fixed = fixed  # --process-overhead: the user's number, never measured
        self.planned = fixed if fixed is not None else 0
        self.last = 0
        self.at_start = 0  # the first reading: the process before any model was touched

    def outgrows(self, reading: int, *, stage_loaded: bool) -> bool:
        """Whether this reading would make the planned overhead grow (before taking it)."""
        if self.fixed is not None:
            return False
        if self.planned and reading <= self.planned:
            return False
        high_water = max(self.high_water, reading)
        loaded_before = self.loaded_before or stage_loaded
        at_start = self.at_start or reading
        wanted = planned_overhead(high_water, loaded_before=loaded_before, at_start=at_start)
        return wanted > self.planned

    def observe(self, reading: int, *, stage_loaded: bool) -> bool:
        """Take a reading; True when the planned overhead grew (re-publish the profile)."""
        grows = self.outgrows(reading, stage_loaded=stage_loaded)
        self.last = reading
        self.at_start = self.at_start or reading
        self.high_water = max(self.high_water, reading)
        self.loaded_before = self.loaded_before or stage_loaded
        if grows:
            self.planned = planned_overhead(
                self.high_water, loaded_before=self.loaded_before, at_start=self.at_start
            )
        return grows

    def refusal(self, budget: int | None) -> str | None:
        """Why ``--memory-budget`` cannot run this daemon (None: it can, or none was given).

        A measured overhead needs room for a model's layers beside it; a given one
        (``--process-overhead``) only needs to be smaller than the budget.
        """
        if budget is None:
            return None
        if self.fixed is None:
            return budget_refusal(budget, self.planned)
        if budget > self.fixed:
            return None
        return (
            f"--memory-budget {budget / MIB:.0f} MiB leaves nothing beside "
            f"--process-overhead {self.fixed / MIB:.0f} MiB; give a larger budget"
        )

    def remembered(self) -> Remembered:
        return Remembered(self.high_water, self.loaded_before)


def mlx_cache_limit(overhead_bytes: int) -> int:
    """MLX's cache bound for a stage whose plan reserves ``overhead_bytes`` of allocator slack.

    The plan counts MLX's live arrays (weights, KV cache, activations) plus that slack; freed
    buffers MLX keeps for reuse must fit in the slack, or RSS outgrows the plan.
    """
    return max(0, overhead_bytes)
