"""Measured matmul throughput and memory bandwidth per compute dtype, and the GPU's memory.

A node's float32 FLOP/s says little about a bfloat16 or a 4-bit model: an NVIDIA GPU runs
half precision on its tensor cores many times faster than float32, while a CPU without native
half-precision arithmetic runs float16 3-40x *slower* than float32 (measured on the Linux
x86_64 test machines). So the profile carries, per key, the FLOP/s of a square matmul and the
bytes/s of a matrix-vector product (decode's access pattern) at that dtype:

* ``float32``, ``float16``, ``bfloat16``: dense matmuls at that dtype;
* ``q4/<dtype>``: ``mx.quantized_matmul`` with 4-bit weights (group size 64, MLX's default)
  and activations and scales in ``<dtype>``: what a 4-bit model whose scales are ``<dtype>``
  computes. Bandwidth counts the packed weights, scales and biases read.

The planner prices a model at its compute dtype's key (partitioner.model.compute_key) and falls
back to the float32 ``flops`` where a key is missing (profiles of older nodes).

Every measurement is sized by time, as profiling's float32 matmul is: the operands grow from a
small size until one run takes MIN_RUN_S (or the largest size is reached), and a size whose run
would take longer than MAX_RUN_S is never tried, so a dtype the device computes slowly costs a
few milliseconds, not seconds. All of it takes about a second on a 2-core CPU.

On a CUDA node the memory budget is the GPU's memory (``mx.device_info``), not the host's RAM:
weights, KV cache and activations live there (``meshd.runtime.device.gpu_memory_budget``).
Apple silicon's GPU shares the host's memory, so a Mac keeps profiling's rule (and macOS's
wired limit).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from itertools import pairwise
from typing import Any

from meshd.runtime.device import current_device, device_memory_budget, probe_mlx

DENSE_KEYS = ("float32", "float16", "bfloat16")
QUANT_BITS = 4
QUANT_GROUP_SIZE = 64
QUANT_KEYS = tuple(f"q{QUANT_BITS}/{dtype}" for dtype in DENSE_KEYS)
DTYPE_KEYS = DENSE_KEYS + QUANT_KEYS

MIN_RUN_S = 0.004  # grow the operands until one run takes at least this long
MAX_RUN_S = 0.05  # never try a size predicted to take longer than this per run
BUDGET_S = 0.06  # timed runs per measurement stop once this is spent (at least MIN_RUNS)
MIN_RUNS, MAX_RUNS = 3, 7
_MATMUL_SIDES = (64, 128, 256, 512, 1024, 2048, 4096)  # 4096 on a GPU only
_MATVEC_SIDES = (256, 512, 1024, 2048, 4096, 8192)  # 8192 on a GPU only


def measure_dtype_throughput() -> tuple[dict[str, float], dict[str, float]]:
    """(FLOP/s per key, bytes/s per key) on MLX's default device; blocking, about a second."""
    import mlx.core as mx

    on_gpu = current_device() == "gpu"
    matmul_sides = _MATMUL_SIDES if on_gpu else _MATMUL_SIDES[:-1]
    matvec_sides = _MATVEC_SIDES if on_gpu else _MATVEC_SIDES[:-1]
    flops: dict[str, float] = {}
    bandwidth: dict[str, float] = {}
    for key in DTYPE_KEYS:
        flops[key] = _sized_rate(lambda side, key=key: _matmul_case(mx, key, side), matmul_sides)
        bandwidth[key] = _sized_rate(
            lambda side, key=key: _matvec_case(mx, key, side), matvec_sides
        )
        clear = getattr(mx, "clear_cache", None)
        if clear is not None:
            clear()
    return flops, bandwidth


def measure_device_profile() -> dict[str, Any]:
    """The profile's device fields, measured on MLX's default device: per-dtype rates, the
    backend, the GPU's name and count, and ``memory_budget`` (a CUDA GPU's; 0 on a CPU and on
    Apple silicon, whose GPU shares the host's memory: profiling's rule applies)."""
    devices = probe_mlx()
    flops, bandwidth = measure_dtype_throughput()
    on_gpu = current_device() == "gpu"
    return {
        "dtype_flops": flops,
        "dtype_bandwidth": bandwidth,
        "device_backend": devices.backend if on_gpu else "cpu",
        "device_name": devices.gpu_name if on_gpu else "",
        "device_reason": "",
        "gpu_count": devices.gpu_count,
        "memory_budget": device_memory_budget(on_gpu, devices.backend, devices.gpu_memory),
    }


def measured_on_this_device(profile: Any) -> bool:
    """Whether a cached profile was measured on the device MLX computes on now (a daemon
    started with --device cpu on a GPU node must not plan with its GPU's numbers)."""
    device = current_device()
    if profile.mlx_device != device:
        return False
    return device != "gpu" or profile.device_name == probe_mlx().gpu_name


def rates_from_mapping(value: Any, what: str) -> dict[str, float]:
    """A {key: positive rate} mapping from a cache or the wire; ValueError when malformed."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a mapping of dtype to a rate, got {value!r}")
    rates = {str(key): float(rate) for key, rate in value.items()}
    bad = sorted(key for key, rate in rates.items() if not rate > 0)
    if bad:
        raise ValueError(f"{what} has rates that are not positive for {bad}")
    return rates


# ---------------------------------------------------------------- the measurements


def _matmul_case(mx: Any, key: str, side: int) -> tuple[Callable[[], None], float]:
    """A (rows x side) @ (side x side)^T product at ``key``; its FLOPs."""
    dtype, bits = _parse_key(mx, key)
    rows = side
    a = _pattern(mx, rows, side, dtype)
    if bits is None:
        b = _pattern(mx, side, side, dtype) + 0.5
        mx.eval(a, b)
        return (lambda: mx.eval(a @ b.T)), 2.0 * rows * side * side
    packed, scales, biases = mx.quantize(
        _pattern(mx, side, side, dtype), group_size=QUANT_GROUP_SIZE, bits=bits
    )
    mx.eval(a, packed, scales, biases)

    def run() -> None:
        mx.eval(
            mx.quantized_matmul(
                a, packed, scales, biases, transpose=True, group_size=QUANT_GROUP_SIZE, bits=bits
            )
        )

    return run, 2.0 * rows * side * side


def _matvec_case(mx: Any, key: str, side: int) -> tuple[Callable[[], None], float]:
    """A (1 x side) @ (side x side)^T product at ``key``; the bytes of weights it reads."""
    dtype, bits = _parse_key(mx, key)
    vector = mx.full((1, side), 1.0, dtype=dtype)
    weight = _pattern(mx, side, side, dtype)
    if bits is None:
        mx.eval(vector, weight)
        return (lambda: mx.eval(vector @ weight.T)), float(weight.nbytes)
    packed, scales, biases = mx.quantize(weight, group_size=QUANT_GROUP_SIZE, bits=bits)
    mx.eval(vector, packed, scales, biases)

    def run() -> None:
        mx.eval(
            mx.quantized_matmul(
                vector,
                packed,
                scales,
                biases,
                transpose=True,
                group_size=QUANT_GROUP_SIZE,
                bits=bits,
            )
        )

    return run, float(packed.nbytes + scales.nbytes + biases.nbytes)


def _sized_rate(make: Callable[[int], tuple[Callable[[], None], float]], sides: tuple) -> float:
    """Work per second of the case ``make(side)``, the side grown by time (module docstring)."""
    run, work = make(sides[0])
    seconds = _timed_once(run)
    for previous, side in pairwise(sides):
        if seconds >= MIN_RUN_S:
            break
        growth = (side / previous) ** 3  # matmul work grows with the cube, a matvec's less
        if seconds * growth > MAX_RUN_S:
            break
        run, work = make(side)
        seconds = _timed_once(run)
    return work / _median_seconds(run)


def _timed_once(run: Callable[[], None]) -> float:
    run()  # warm-up: allocation, kernels compiled or loaded
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def _median_seconds(run: Callable[[], None]) -> float:
    times: list[float] = []
    deadline = time.perf_counter() + BUDGET_S
    while len(times) < MIN_RUNS or (len(times) < MAX_RUNS and time.perf_counter() < deadline):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return max(statistics.median(times), 1e-9)


def _pattern(mx: Any, rows: int, cols: int, dtype: Any) -> Any:
    """Fixed, varied values, made arithmetically (MLX's CPU random numbers are slow)."""
    return (((mx.arange(rows * cols) % 7) - 3).astype(dtype) * 0.25).reshape(rows, cols)


def _parse_key(mx: Any, key: str) -> tuple[Any, int | None]:
    if "/" in key:
        quant, dtype = key.split("/", 1)
        return getattr(mx, dtype), int(quant.removeprefix("q"))
    return getattr(mx, key), None
