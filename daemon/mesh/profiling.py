"""Measured node profile: memory, compute and memory bandwidth, cached per machine.

Peers exchange these profiles and the partitioner splits layers by them, so three
properties matter:

* ``memory_budget`` is what plans are built (and hashed) from, so it is derived from
  stable facts only, never from free memory at measure time: 75% of total memory minus
  an OS reserve of min(1 GiB, total/8), rounded down to 256 MiB. Total memory is the
  smaller of physical RAM and this process's cgroup limit (containers). On macOS, when
  ``sysctl iogpu.wired_limit_mb`` is set (> 0) it replaces the 75% rule, capped at total
  minus the reserve: people raise that limit precisely so that the GPU may wire more
  memory for a model. ``--memory-budget`` overrides all of this (tests use it to
  simulate small machines) and never forces a re-measure.
* ``flops`` and ``mem_bandwidth`` are measured, not looked up: float32 FLOP/s of an MLX
  matmul (the size adapts so that a slow BLAS still finishes quickly) and the bytes/s at
  which a matrix-vector product streams a weight matrix far larger than the caches (256 MiB,
  or 8x the largest CPU cache where that is larger) -- the access pattern of token-by-token
  decoding. Both take about a second in total.
* A measurement holds still. Each number is the upper quartile of many short samples
  (another process can only ever make a sample slower, so the fast ones are the machine's),
  and its *spread* (p90 - p10 of the samples, relative to the number) is kept with it.
  Meanwhile the CPU time other processes used is counted (``/proc/stat`` less this
  process's own): a measurement during which they kept more than a tenth of the cores
  (at least a quarter core) busy, or whose samples spread wider than ``WIDE_SPREAD``, is
  marked ``loaded`` -- the machine was busy, not slow. ``settle_profile`` decides what a
  re-measure publishes: a loaded measurement never replaces a quiet one, and a number
  within the previous one's spread (at least ``MIN_HYSTERESIS``) keeps the previous number,
  so the plan built from it does not change on noise.
* ``process_overhead`` is not measured here: the daemon measures what its process holds
  beside MLX's arrays (``meshd.mesh.process_memory``) and plans ``memory_budget`` less it.
* Measuring is cached in ``state_dir/profile.json`` with a machine fingerprint (machine
  id, CPU model, total memory, MLX version, BLAS name, architecture). A cached profile is
  reused while its fingerprint and dtype match and it is younger than 7 days (hardware
  rarely changes; the age bound catches drifting clocks, firmware and thermal setups).

Everything here is blocking and CPU-heavy: the daemon calls it through
``trio.to_thread.run_sync``. It imports MLX only to measure, so a cache hit stays cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import psutil

from meshd.mesh.profile_dtypes import (
    measure_device_profile,
    measured_on_this_device,
    rates_from_mapping,
)
from meshd.runtime.blas import blas_info
from meshd.runtime.files import replace_text
from partitioner.humanize import parse_size

log = logging.getLogger(__name__)

PROFILE_FILE = "profile.json"
# A profile.json that a daemon with no valid cache of its own starts from (when it is valid
# for this machine): daemons on one machine (`meshd demo`, a test's mesh) share one
# measurement instead of each measuring while the others do, which gave identical nodes
# 8-48 GFLOP/s in one demo.
PROFILE_SEED_ENV = "MESHD_PROFILE_SEED"
# Bump when the meaning of a cached field changes (2: quartiles, spread, load; 3: per-dtype
# rates, the device).
CACHE_FORMAT = 3
CACHE_MAX_AGE_S = 7 * 24 * 3600
BUDGET_FRACTION = 0.75
MAX_OS_RESERVE = 2**30
BUDGET_GRANULE = 256 * 2**20
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")

_MATMUL_SIZES = (256, 512, 1024, 2048)
_MATMUL_MIN_RUN_S = 0.01  # grow the matmul until one run takes at least this long
_MATMUL_BUDGET_S = 0.5
_BANDWIDTH_BUDGET_S = 0.3
BANDWIDTH_MATRIX_BYTES = 256 * 2**20
_MIN_RUNS, _MAX_RUNS = 7, 31
# Which sample stands for the machine: the upper quartile (contention only slows a sample
# down, so the fast ones are the machine; the very fastest is one lucky sample).
VALUE_QUANTILE = 0.75
# A measurement is "loaded" when other processes kept this share of the cores busy (at least
# LOADED_MIN_CORES of one) while it ran, or its samples spread wider than WIDE_SPREAD.
LOADED_CORE_SHARE = 0.10
LOADED_MIN_CORES = 0.25
WIDE_SPREAD = 0.40
# A re-measure within the previous measurement's spread, and at least this close (relative),
# keeps the previous number: repeated measurements on an idle machine agree within 15%.
MIN_HYSTERESIS = 0.15


@dataclass(frozen=True)
class NodeProfile:
    """What one machine offers the mesh; sizes in bytes, rates per second."""

    total_memory: int
    available_memory: int  # at measure time; informational only, never planned with
    memory_budget: int  # what the partitioner may place on this node; stable (see module doc)
    flops: float  # measured matmul FLOP/s at ``dtype``
    mem_bandwidth: float  # measured bytes/s streamed by a matrix-vector product
    dtype: str
    platform: str  # e.g. "Linux-6.8.0-x86_64"
    chip: str  # CPU model, or the Apple chip ("Apple M2 Max")
    mlx_device: str  # "cpu" or "gpu"
    versions: Mapping[str, str] = field(hash=False)  # python, mlx, mlx_lm, meshd
    blas: str
    cores: int
    measured_at: float  # unix time
    fingerprint: str
    flops_spread: float = 0.0  # (p90 - p10) / flops of the samples; 0 when not known
    mem_bandwidth_spread: float = 0.0  # the same for mem_bandwidth
    loaded: bool = False  # measured while other processes kept the machine busy
    other_busy_cores: float = 0.0  # cores other processes used on average meanwhile
    process_overhead: int = 0  # bytes the daemon holds beside MLX's arrays; planned from budget
    # Per compute dtype (meshd.mesh.profile_dtypes): FLOP/s and bytes/s; the device MLX computes
    # on (meshd.runtime.device): cuda, metal or cpu, its name, why it was chosen, GPUs seen.
    dtype_flops: Mapping[str, float] = field(default_factory=dict, hash=False)
    dtype_bandwidth: Mapping[str, float] = field(default_factory=dict, hash=False)
    device_backend: str = "cpu"
    device_name: str = ""
    device_reason: str = ""
    gpu_count: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the cache format and the wire's JSON form)."""
        data = asdict(self)
        data["versions"] = dict(self.versions)
        data["dtype_flops"] = dict(self.dtype_flops)
        data["dtype_bandwidth"] = dict(self.dtype_bandwidth)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeProfile:
        """Rebuild from ``to_dict`` output; ValueError names missing or malformed fields."""
        names = [f.name for f in fields(cls)]
        optional = {f.name for f in fields(cls) if f.default is not MISSING}
        missing = [name for name in names if name not in data and name not in optional]
        if missing:
            raise ValueError(f"node profile lacks {', '.join(missing)}; re-measure it")
        try:
            return cls(**{name: _coerce(name, data[name]) for name in names if name in data})
        except (TypeError, ValueError) as error:
            raise ValueError(f"node profile has a malformed field: {error}") from error

    def with_memory_budget(self, memory_budget: int) -> NodeProfile:
        """The same profile with the budget overridden (``--memory-budget``)."""
        return replace(self, memory_budget=_checked_budget(memory_budget))

    @property
    def plannable_budget(self) -> int:
        """What plans may place here: the budget less the process's own overhead."""
        return max(0, self.memory_budget - self.process_overhead)


_INTS = {
    "total_memory",
    "available_memory",
    "memory_budget",
    "cores",
    "process_overhead",
    "gpu_count",
}
_FLOATS = {
    "flops",
    "mem_bandwidth",
    "measured_at",
    "flops_spread",
    "mem_bandwidth_spread",
    "other_busy_cores",
}


def _coerce(name: str, value: Any) -> Any:
    if name in _INTS:
        return int(value)
    if name in _FLOATS:
        return float(value)
    if name == "loaded":
        if not isinstance(value, bool):
            raise ValueError(f"loaded must be true or false, got {value!r}")
        return value
    if name == "versions":
        if not isinstance(value, Mapping):
            raise ValueError(f"versions must be a mapping, got {value!r}")
        return {str(key): str(version) for key, version in value.items()}
    if name in ("dtype_flops", "dtype_bandwidth"):
        return rates_from_mapping(value, name)
    return str(value)


def measure_node_profile(
    *, memory_budget_override: int | None = None, dtype: str = "float32"
) -> NodeProfile:
    """Measure this machine now (about a second); blocking, call it off the event loop."""
    _check_dtype(dtype)
    total = total_memory()
    device = measure_device_profile()
    budget = device.pop("memory_budget") or default_memory_budget(
        total, wired_limit=gpu_wired_limit()
    )
    if memory_budget_override is not None:
        budget = _checked_budget(memory_budget_override)
    watch = OtherLoad.start()
    flops = measure_matmul_flops_samples(dtype)
    bandwidth = measure_memory_bandwidth_samples(total)
    busy_cores = watch.stop()
    cores = usable_cores()
    # The careful measurement (many samples, their spread, the load check) is the rate of the
    # profile's own dtype too: one figure for it, whichever of the two the planner reads.
    device["dtype_flops"] = {**device["dtype_flops"], dtype: flops.value}
    device["dtype_bandwidth"] = {**device["dtype_bandwidth"], dtype: bandwidth.value}
    return NodeProfile(
        total_memory=total,
        available_memory=int(psutil.virtual_memory().available),
        memory_budget=budget,
        flops=flops.value,
        mem_bandwidth=bandwidth.value,
        dtype=dtype,
        platform=f"{platform.system()}-{platform.release()}-{platform.machine()}",
        chip=cpu_model(),
        mlx_device=_mlx_device(),
        versions=package_versions(),
        blas=blas_info().name,
        cores=cores,
        measured_at=time.time(),
        fingerprint=machine_fingerprint(total),
        flops_spread=flops.spread,
        mem_bandwidth_spread=bandwidth.spread,
        loaded=is_loaded(busy_cores, cores, flops.spread, bandwidth.spread),
        other_busy_cores=busy_cores,
        **device,
    )


def is_loaded(busy_cores: float, cores: int, *spreads: float) -> bool:
    """Whether a measurement says more about other processes than about this machine."""
    threshold = max(LOADED_MIN_CORES, LOADED_CORE_SHARE * max(1, cores))
    return busy_cores > threshold or any(spread > WIDE_SPREAD for spread in spreads)


def settle_profile(previous: NodeProfile | None, fresh: NodeProfile) -> NodeProfile:
    """What a re-measure publishes, given the profile published before it (pure).

    * Another machine, dtype or nothing before: the fresh measurement.
    * A loaded measurement never replaces a quiet one: the quiet one is kept whole (its
      ``measured_at`` too, so its age still counts).
    * Otherwise each number that lies within the previous number's spread (and at least
      within ``MIN_HYSTERESIS``) keeps the previous number and spread: noise never makes a new
      plan. A number outside it is the new number (the machine changed, or was loaded before),
      except that between two loaded measurements the faster number stays: contention only
      ever slows a measurement down.
    """
    if previous is None or (previous.fingerprint, previous.dtype) != (
        fresh.fingerprint,
        fresh.dtype,
    ):
        return fresh
    if fresh.loaded and not previous.loaded:
        return replace(
            previous,
            available_memory=fresh.available_memory,
            memory_budget=fresh.memory_budget,
            process_overhead=fresh.process_overhead,
        )
    both_loaded = previous.loaded and fresh.loaded
    flops, flops_spread = _settled(
        (previous.flops, previous.flops_spread), (fresh.flops, fresh.flops_spread), both_loaded
    )
    bandwidth, bandwidth_spread = _settled(
        (previous.mem_bandwidth, previous.mem_bandwidth_spread),
        (fresh.mem_bandwidth, fresh.mem_bandwidth_spread),
        both_loaded,
    )
    return replace(
        fresh,
        flops=flops,
        flops_spread=flops_spread,
        mem_bandwidth=bandwidth,
        mem_bandwidth_spread=bandwidth_spread,
        dtype_flops=_settled_rates(
            previous.dtype_flops, fresh.dtype_flops, previous.flops_spread, both_loaded
        ),
        dtype_bandwidth=_settled_rates(
            previous.dtype_bandwidth,
            fresh.dtype_bandwidth,
            previous.mem_bandwidth_spread,
            both_loaded,
        ),
    )


def within_spread(value: float, previous: float, spread: float) -> bool:
    """Whether ``value`` lies within ``previous``'s spread (at least ``MIN_HYSTERESIS``)."""
    return previous > 0 and abs(value - previous) <= previous * max(spread, MIN_HYSTERESIS)


def _settled(
    previous: tuple[float, float], fresh: tuple[float, float], both_loaded: bool
) -> tuple[float, float]:
    """(number, spread) to publish of one measured quantity."""
    if within_spread(fresh[0], *previous) or (both_loaded and fresh[0] < previous[0]):
        return previous
    return fresh


def _settled_rates(
    previous: Mapping[str, float], fresh: Mapping[str, float], spread: float, both_loaded: bool
) -> dict[str, float]:
    """Per-dtype rates to publish: each settled as its float32 counterpart is (same spread)."""
    settled = dict(fresh)
    for key, rate in fresh.items():
        if key in previous:
            settled[key] = _settled((previous[key], spread), (rate, spread), both_loaded)[0]
    return settled


def load_or_measure_profile(
    state_dir: Path,
    *,
    memory_budget_override: int | None = None,
    remeasure: bool = False,
    dtype: str = "float32",
    max_age_s: float = CACHE_MAX_AGE_S,
) -> NodeProfile:
    """The cached profile if still valid for this machine, else a fresh measurement.

    The override is applied on top of whatever is returned and is not stored, so changing
    it never triggers a re-measure. A missing, corrupt or stale cache is re-measured; a
    re-measure is settled against the cached profile of this machine (``settle_profile``:
    a loaded measurement keeps the quiet one cached, noise keeps the cached numbers).
    """
    _check_dtype(dtype)
    cache = state_dir / PROFILE_FILE
    profile = None if remeasure else _read_cache(cache, dtype=dtype, max_age_s=max_age_s)
    if profile is None and not remeasure:
        profile = _from_seed(cache, dtype=dtype, max_age_s=max_age_s)
    if profile is None:
        profile = measure_and_settle(state_dir, dtype=dtype).published
    if memory_budget_override is not None:
        profile = profile.with_memory_budget(memory_budget_override)
    return profile


@dataclass(frozen=True)
class Remeasured:
    """A re-measure: what was measured now, and what is published (and cached) after it."""

    fresh: NodeProfile
    published: NodeProfile

    @property
    def kept_quiet(self) -> bool:
        """The fresh measurement was loaded and a quiet one was kept instead."""
        return self.fresh.loaded and not self.published.loaded


def measure_and_settle(state_dir: Path, *, dtype: str = "float32") -> Remeasured:
    """Measure now, settle it against this machine's cached profile (of any age), cache and
    return both (blocking: about a second)."""
    cache = state_dir / PROFILE_FILE
    previous = _read_cache(cache, dtype=dtype, max_age_s=math.inf)
    fresh = measure_node_profile(dtype=dtype)
    published = settle_profile(previous, fresh)
    if published != previous:
        _write_cache(cache, published)
    return Remeasured(fresh, published)


def profile_to_proto(profile: NodeProfile, node_id: str, name: str) -> Any:
    """The wire form (``meshd.v1.NodeProfile``) that peers exchange, tagged with who it is."""
    from meshd.wire import pb

    data = profile.to_dict()
    versions = data.pop("versions")
    message = pb.NodeProfile(node_id=node_id, name=name, **data)
    message.versions.update(versions)
    return message


def profile_from_proto(message: Any) -> NodeProfile:
    """Inverse of ``profile_to_proto`` (node_id and name are the caller's to keep)."""
    data = {f.name: getattr(message, f.name) for f in fields(NodeProfile)}
    data["versions"] = dict(message.versions)
    data["dtype_flops"] = dict(message.dtype_flops)
    data["dtype_bandwidth"] = dict(message.dtype_bandwidth)
    return NodeProfile.from_dict(data)


def default_memory_budget(total: int, *, wired_limit: int | None = None) -> int:
    """The stable budget from total memory (and macOS's GPU wired limit when set)."""
    reserve = min(MAX_OS_RESERVE, total // 8)
    if wired_limit:
        budget = min(wired_limit, total - reserve)
    else:
        budget = int(total * BUDGET_FRACTION) - reserve
    return max(0, budget // BUDGET_GRANULE * BUDGET_GRANULE)


def machine_fingerprint(total: int | None = None) -> str:
    """A short hash of what makes measurements valid: same machine, memory, MLX and BLAS."""
    parts = [
        machine_id(),
        cpu_model(),
        str(total_memory() if total is None else total),
        package_versions()["mlx"],
        blas_info().name,
        platform.machine(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Samples:
    """Rates measured by short repeated runs: the number that stands for them and how
    widely they spread."""

    rates: tuple[float, ...]

    @property
    def value(self) -> float:
        """The upper quartile (``VALUE_QUANTILE``): contention only ever slows a sample."""
        return _quantile(self.rates, VALUE_QUANTILE)

    @property
    def spread(self) -> float:
        """(p90 - p10) / value: 0 for samples that agree, ~1 for ones twice apart."""
        return (_quantile(self.rates, 0.9) - _quantile(self.rates, 0.1)) / self.value


def measure_matmul_flops(dtype: str = "float32") -> float:
    """FLOP/s of square MLX matmuls (see ``measure_matmul_flops_samples``)."""
    return measure_matmul_flops_samples(dtype).value


def measure_matmul_flops_samples(dtype: str = "float32") -> Samples:
    """FLOP/s of square MLX matmuls, grown until one run takes >= 10 ms (max 2048), sampled
    7-31 times within half a second.

    Small matmuls understate a multi-threaded BLAS (thread wake-up dominates) and large
    ones take seconds on a slow BLAS, so the size adapts to the machine.
    """
    import mlx.core as mx

    mx_dtype = getattr(mx, dtype)
    for size in _MATMUL_SIZES:
        a, b = _matmul_operands(mx, size, mx_dtype)
        mx.eval(a @ b)  # warm-up: allocation, thread start-up
        started = time.perf_counter()
        mx.eval(a @ b)
        if time.perf_counter() - started >= _MATMUL_MIN_RUN_S:
            break
    seconds = _sample_seconds(lambda: mx.eval(a @ b), _MATMUL_BUDGET_S)
    _release_mlx_memory(mx)
    return Samples(tuple(2 * size**3 / s for s in seconds))


def measure_memory_bandwidth(total: int | None = None) -> float:
    """Bytes/s streamed by a matrix-vector product (see ``measure_memory_bandwidth_samples``)."""
    return measure_memory_bandwidth_samples(total).value


def measure_memory_bandwidth_samples(total: int | None = None) -> Samples:
    """Bytes/s of ``x @ w.T`` over a float32 ``w`` too big for caches (decode's pattern),
    sampled 7-31 times within 0.3 s.

    The matrix is ``bandwidth_matrix_bytes``: a model's weights stream from memory, not
    from a cache.
    """
    import mlx.core as mx

    nbytes = bandwidth_matrix_bytes(total or total_memory(), largest_cpu_cache())
    side = max(64, int((nbytes // 4) ** 0.5))
    seconds = _matvec_seconds(mx, side)
    _release_mlx_memory(mx)
    return Samples(tuple(side * side * 4 / s for s in seconds))


def bandwidth_matrix_bytes(total: int, largest_cache: int) -> int:
    """Size of the matrix the bandwidth is measured with (pure): 256 MiB, or 8x the largest
    CPU cache where that is more, but never more than 1/16 of total memory.

    A matrix that partly stays in a cache reads faster than memory: on a VM with a 32 MiB
    L3, a 64 MiB matrix measured 13.6 GB/s and 256 or 512 MiB 11.0 and 10.4 GB/s (the
    median of 12 runs each). Server CPUs carry caches of 256 MiB and more.
    """
    return min(max(BANDWIDTH_MATRIX_BYTES, 8 * largest_cache), total // 16)


def largest_cpu_cache() -> int:
    """Bytes of this CPU's largest cache as Linux reports it (sysfs), 0 where unknown."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            sizes.append(parse_size(path.read_text().strip() + "iB"))
    return max(sizes, default=0)


class OtherLoad:
    """CPU time other processes use while this one measures, in cores on average.

    System-wide busy time (``/proc/stat`` through psutil: user, nice, system, irq, softirq
    and steal, which a hypervisor's other guests take) less this process's own CPU time,
    over the wall-clock time between ``start`` and ``stop``.
    """

    def __init__(self) -> None:
        self._wall = time.monotonic()
        self._busy = _system_busy_s()
        self._own = _own_cpu_s()

    @classmethod
    def start(cls) -> OtherLoad:
        return cls()

    def stop(self) -> float:
        wall = max(time.monotonic() - self._wall, 1e-6)
        others = (_system_busy_s() - self._busy) - (_own_cpu_s() - self._own)
        return max(0.0, others / wall)


def _system_busy_s() -> float:
    times = psutil.cpu_times()
    busy = ("user", "nice", "system", "irq", "softirq", "steal")
    return sum(getattr(times, name, 0.0) for name in busy)


def _own_cpu_s() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


def _quantile(values: tuple[float, ...], q: float) -> float:
    """Linear interpolation between the order statistics (numpy's default method)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def total_memory() -> int:
    """Physical memory, or the cgroup memory limit of this process if that is smaller."""
    physical = int(psutil.virtual_memory().total)
    limit = cgroup_memory_limit()
    return min(physical, limit) if limit else physical


def cgroup_memory_limit() -> int | None:
    """This process's cgroup (v2 or v1) memory limit in bytes; None when unlimited."""
    limits = [_read_limit(path) for path in _cgroup_limit_files()]
    numeric = [limit for limit in limits if limit is not None]
    return min(numeric) if numeric else None


def gpu_wired_limit() -> int | None:
    """macOS's ``iogpu.wired_limit_mb`` in bytes when set (> 0), else None."""
    if sys.platform != "darwin":
        return None
    value = _sysctl("iogpu.wired_limit_mb")
    return int(value) * 2**20 if value and value.isdigit() and int(value) > 0 else None


def machine_id() -> str:
    """A per-installation id: /etc/machine-id on Linux, IOPlatformUUID on macOS."""
    if sys.platform == "darwin":
        return _mac_platform_uuid() or "unknown-machine"
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        with contextlib.suppress(OSError):
            text = Path(path).read_text(encoding="ascii").strip()
            if text:
                return text
    return "unknown-machine"


def cpu_model() -> str:
    """The CPU's marketing name ("AMD EPYC 7763", "Apple M2 Max"), or the architecture."""
    if sys.platform == "darwin":
        return _sysctl("machdep.cpu.brand_string") or platform.machine()
    info = _cpuinfo_fields()
    for key in ("model name", "Model", "Hardware", "cpu model"):
        if info.get(key):
            return info[key]
    return platform.processor() or platform.machine()


def package_versions() -> dict[str, str]:
    """Versions that change measured numbers or the wire: python, mlx, mlx_lm, meshd."""
    versions = {"python": platform.python_version()}
    for key, distribution in (("mlx", "mlx"), ("mlx_lm", "mlx-lm"), ("meshd", "meshd")):
        try:
            versions[key] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[key] = "not installed"
    return versions


def usable_cores() -> int:
    """CPUs this process may run on (respects affinity and cpusets where the OS has them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _matmul_operands(mx: Any, size: int, dtype: Any) -> tuple[Any, Any]:
    """Two fixed, varied matrices; made arithmetically because MLX's CPU RNG is slow."""
    pattern = ((mx.arange(size * size) % 7) - 3).astype(dtype) * 0.25
    a = pattern.reshape(size, size)
    b = a.T + 0.5
    mx.eval(a, b)
    return a, b


def _matvec_seconds(mx: Any, side: int) -> list[float]:
    """Times of one (1 x side) @ (side x side).T product, as mlx-lm's Linear does it."""
    weight = mx.full((side, side), 0.5, dtype=mx.float32)
    vector = mx.full((1, side), 1.0, dtype=mx.float32)
    mx.eval(weight, vector)
    return _sample_seconds(lambda: mx.eval(vector @ weight.T), _BANDWIDTH_BUDGET_S)


def _sample_seconds(run: Callable[[], object], budget_s: float) -> list[float]:
    """One warm-up, then 7-31 timed runs, stopping once ``budget_s`` is spent."""
    run()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < _MIN_RUNS or (len(times) < _MAX_RUNS and time.perf_counter() < deadline):
        started = time.perf_counter()
        run()
        times.append(max(time.perf_counter() - started, 1e-9))
    return times


def _release_mlx_memory(mx: Any) -> None:
    """Hand benchmark buffers back so the daemon does not keep them cached."""
    clear = getattr(mx, "clear_cache", None)
    if clear is not None:
        clear()


def _mlx_device() -> str:
    import mlx.core as mx

    return str(mx.default_device().type.name)


def _check_dtype(dtype: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not measurable; use one of {SUPPORTED_DTYPES}")


def _checked_budget(budget: int) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(
            f"memory budget must be a positive number of bytes (see units.parse_size), "
            f"got {budget!r}"
        )
    return budget


def _read_cache(cache: Path, *, dtype: str, max_age_s: float) -> NodeProfile | None:
    """The cached profile when it is readable, this machine's, of ``dtype`` and fresh."""
    try:
        document = json.loads(cache.read_text(encoding="utf-8"))
        if document.get("format") != CACHE_FORMAT:
            return None
        profile = NodeProfile.from_dict(document["profile"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    age = time.time() - profile.measured_at
    if profile.dtype != dtype or not 0 <= age <= max_age_s:
        return None
    if profile.fingerprint != machine_fingerprint() or not measured_on_this_device(profile):
        return None
    return profile


def _from_seed(cache: Path, *, dtype: str, max_age_s: float) -> NodeProfile | None:
    """The profile in the file MESHD_PROFILE_SEED names, cached as this daemon's own, when
    it is valid here (see _read_cache); None when unset or not valid."""
    seed = os.environ.get(PROFILE_SEED_ENV, "")
    if not seed:
        return None
    profile = _read_cache(Path(seed), dtype=dtype, max_age_s=max_age_s)
    if profile is None:
        log.warning(
            "%s=%s is not a usable profile here (missing or unreadable, measured on another "
            "machine, older than %d days, or of another dtype than %s): measuring this machine "
            "instead",
            PROFILE_SEED_ENV,
            seed,
            max_age_s // 86400,
            dtype,
        )
        return None
    _write_cache(cache, profile)
    return profile


def seed_profile(folder: Path) -> Path:
    """Measure this machine once into ``folder`` (blocking: a few seconds) and return the
    file for MESHD_PROFILE_SEED."""
    measure_and_settle(folder)
    return folder / PROFILE_FILE


def _write_cache(cache: Path, profile: NodeProfile) -> None:
    """Write atomically, so a crash mid-write leaves the old cache or none, never half."""
    document = {"format": CACHE_FORMAT, "profile": profile.to_dict()}
    replace_text(cache, json.dumps(document, indent=2, sort_keys=True) + "\n")


def _cgroup_limit_files() -> list[Path]:
    """memory.max (v2) and memory.limit_in_bytes (v1) at the root and at our cgroup path."""
    root = Path("/sys/fs/cgroup")
    candidates = [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text(encoding="ascii").splitlines():
            _, controllers, path = line.split(":", 2)
            relative = path.lstrip("/")
            if controllers == "" and relative:
                candidates.append(root / relative / "memory.max")
            elif "memory" in controllers.split(",") and relative:
                candidates.append(root / "memory" / relative / "memory.limit_in_bytes")
    return candidates


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) >= 2**60:  # "max" or v1's "unlimited" sentinel
        return None
    return int(text)


def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields from /proc/cpuinfo (plus board-wide ones on ARM)."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, separator, value = line.partition(":")
            if separator and key.strip() not in found:
                found[key.strip()] = value.strip()
    return found


def _sysctl(name: str) -> str | None:
    """``sysctl -n name`` on macOS; None when the key does not exist."""
    return _run_text(["sysctl", "-n", name])


def _mac_platform_uuid() -> str | None:
    output = _run_text(["ioreg", "-rd1", "-c", "IOPlatformExpertDevice"]) or ""
    match = re.search(r'"IOPlatformUUID"\s*=\s*"([^"]+)"', output)
    return match.group(1) if match else None


def _run_text(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None
