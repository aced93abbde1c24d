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
  which a matrix-vector product streams a 64 MiB weight matrix (256 MiB on a GPU) -- the
  access pattern of token-by-token decoding. Both take well under a second in total.
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
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import psutil

from meshd.mesh.profile_dtypes import (
    measure_device_profile,
    measured_on_this_device,
    rates_from_mapping,
)
from meshd.runtime.blas import blas_info

PROFILE_FILE = "profile.json"
CACHE_FORMAT = 2  # bump when the meaning of a cached field changes (2: per-dtype rates, GPU)
CACHE_MAX_AGE_S = 7 * 24 * 3600
BUDGET_FRACTION = 0.75
MAX_OS_RESERVE = 2**30
BUDGET_GRANULE = 256 * 2**20
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")

_MATMUL_SIZES = (256, 512, 1024, 2048)
_MATMUL_MIN_RUN_S = 0.01  # grow the matmul until one run takes at least this long
_MATMUL_BUDGET_S = 0.3
_BANDWIDTH_BUDGET_S = 0.2
_MIN_RUNS, _MAX_RUNS = 3, 9


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
        missing = [name for name in names if name not in data]
        if missing:
            raise ValueError(f"node profile lacks {', '.join(missing)}; re-measure it")
        try:
            return cls(**{name: _coerce(name, data[name]) for name in names})
        except (TypeError, ValueError) as error:
            raise ValueError(f"node profile has a malformed field: {error}") from error

    def with_memory_budget(self, memory_budget: int) -> NodeProfile:
        """The same profile with the budget overridden (``--memory-budget``)."""
        return replace(self, memory_budget=_checked_budget(memory_budget))


_INTS = {"total_memory", "available_memory", "memory_budget", "cores", "gpu_count"}
_FLOATS = {"flops", "mem_bandwidth", "measured_at"}


def _coerce(name: str, value: Any) -> Any:
    if name in _INTS:
        return int(value)
    if name in _FLOATS:
        return float(value)
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
    return NodeProfile(
        total_memory=total,
        available_memory=int(psutil.virtual_memory().available),
        memory_budget=budget,
        flops=measure_matmul_flops(dtype),
        mem_bandwidth=measure_memory_bandwidth(total),
        dtype=dtype,
        platform=f"{platform.system()}-{platform.release()}-{platform.machine()}",
        chip=cpu_model(),
        mlx_device=_mlx_device(),
        versions=package_versions(),
        blas=blas_info().name,
        cores=usable_cores(),
        measured_at=time.time(),
        fingerprint=machine_fingerprint(total),
        **device,
    )


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
    it never triggers a re-measure. A missing, corrupt or stale cache is re-measured.
    """
    _check_dtype(dtype)
    cache = state_dir / PROFILE_FILE
    profile = None if remeasure else _read_cache(cache, dtype=dtype, max_age_s=max_age_s)
    if profile is None:
        profile = measure_node_profile(dtype=dtype)
        _write_cache(cache, profile)
    if memory_budget_override is not None:
        profile = profile.with_memory_budget(memory_budget_override)
    return profile


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


def measure_matmul_flops(dtype: str = "float32") -> float:
    """Median FLOP/s of square MLX matmuls, grown until one run takes >= 10 ms (max 2048).

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
    seconds = _median_seconds(lambda: mx.eval(a @ b), _MATMUL_BUDGET_S)
    _release_mlx_memory(mx)
    return 2 * size**3 / seconds


def measure_memory_bandwidth(total: int | None = None) -> float:
    """Median bytes/s of ``x @ w.T`` over a float32 ``w`` too big for caches (decode's pattern).

    The matrix is 64 MiB (256 MiB on a GPU, whose caches and bandwidth are larger), but
    never more than 1/16 of total memory.
    """
    import mlx.core as mx

    target = 256 * 2**20 if _mlx_device() == "gpu" else 64 * 2**20
    nbytes = min(target, (total or total_memory()) // 16)
    side = max(64, int((nbytes // 4) ** 0.5))
    seconds = _matvec_seconds(mx, side)
    _release_mlx_memory(mx)
    return side * side * 4 / seconds


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


def _matvec_seconds(mx: Any, side: int) -> float:
    """Median time of one (1 x side) @ (side x side).T product, as mlx-lm's Linear does it."""
    weight = mx.full((side, side), 0.5, dtype=mx.float32)
    vector = mx.full((1, side), 1.0, dtype=mx.float32)
    mx.eval(weight, vector)
    return _median_seconds(lambda: mx.eval(vector @ weight.T), _BANDWIDTH_BUDGET_S)


def _median_seconds(run: Callable[[], object], budget_s: float) -> float:
    """One warm-up, then 3-9 timed runs, stopping once ``budget_s`` is spent."""
    run()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < _MIN_RUNS or (len(times) < _MAX_RUNS and time.perf_counter() < deadline):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return max(statistics.median(times), 1e-9)


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


def _write_cache(cache: Path, profile: NodeProfile) -> None:
    """Write atomically, so a crash mid-write leaves the old cache or none, never half."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    document = {"format": CACHE_FORMAT, "profile": profile.to_dict()}
    partial = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(partial, cache)


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
