"""Which device MLX computes on: the GPU when MLX reports one, else the CPU, or what is forced.

One decision per daemon, made once at start-up (``--device auto|cpu|gpu``, ``MESHD_DEVICE``,
``device`` in meshd.toml) and honoured by every process the daemon runs MLX in: the daemon
applies it to itself before anything computes and exports the outcome as
``MESHD_COMPUTE_DEVICE=<cpu|gpu>`` (not the setting's own variable, so a daemon a test process
starts later still decides for itself) so that the processes it spawns (tensor-parallel
runners) call :func:`apply_from_env` and compute where the daemon does.

What MLX reports (mlx 0.32): ``mx.is_available(mx.gpu)`` is true on Apple silicon (Metal) and
with a CUDA build of MLX on a machine with an NVIDIA GPU (``pip install "mlx[cuda12]"``); the
Linux CPU wheel (``mlx[cpu]``) reports no GPU. ``mx.device_count(mx.gpu)`` counts the GPUs and
``mx.device_info(mx.gpu)`` names one (``device_name``; ``total_memory`` on CUDA, ``memory_size``
on Metal). MLX computes on GPU 0 of those the process sees: on a host with several NVIDIA GPUs,
``CUDA_VISIBLE_DEVICES=2`` makes the third one GPU 0 for that daemon (one daemon per GPU, each
with its own state directory, HTTP address and ports).

Nothing here imports MLX at import time: :func:`probe_mlx` does, when called.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

DEVICE_CHOICES = ("auto", "cpu", "gpu")
DEVICE_ENV = "MESHD_COMPUTE_DEVICE"  # the chosen device, for spawned processes
# What to install for a GPU, per platform, named in the refusal of a forced GPU that is not there.
CUDA_INSTALL_HINT = (
    "install MLX's CUDA backend: packaging/install.sh --cuda 12 (CUDA 12 driver) or --cuda 13, "
    'or pip install "meshd[cuda12]" in an environment without mlx-cpu (the backends share '
    "files); `nvidia-smi` must list the GPU"
)
METAL_INSTALL_HINT = "MLX uses the GPU of Apple silicon (M1 or later) on macOS 14 or later"
# A discrete GPU's memory holds nothing but what processes put there; keep room for the CUDA
# context, cuBLAS workspaces and MLX's buffers in flight.
GPU_BUDGET_FRACTION = 0.90
GPU_RESERVE = 2**30
BUDGET_GRANULE = 256 * 2**20


class DeviceUnavailable(RuntimeError):
    """The device asked for is not there; the message says what to install or change."""


@dataclass(frozen=True)
class MlxDevices:
    """What MLX reports about this machine's GPUs (see the module docstring)."""

    gpu_available: bool
    gpu_count: int
    backend: str  # "cuda", "metal" or "" (no GPU)
    gpu_name: str
    gpu_memory: int  # bytes of GPU 0's memory; 0 when MLX does not say
    mlx_version: str


@dataclass(frozen=True)
class DeviceChoice:
    """The device this daemon computes on, and why, in words for status and doctor."""

    requested: str  # auto, cpu or gpu
    device: str  # cpu or gpu
    backend: str  # cuda, metal or cpu
    name: str  # "NVIDIA H200", "Apple M2 Max (GPU)", or the CPU's
    index: int  # MLX's device index: always 0 (see the module docstring)
    gpu_count: int  # GPUs MLX sees (0 on the CPU wheel)
    gpu_memory: int  # bytes of the chosen GPU's memory; 0 on the CPU
    reason: str

    @property
    def summary(self) -> str:
        """One line: "gpu 0 of 2 (cuda, NVIDIA H200): GPU reported by MLX"."""
        if self.device == "gpu":
            where = f"gpu {self.index} of {self.gpu_count} ({self.backend}, {self.name})"
        else:
            where = "cpu"
        return f"{where}: {self.reason}"


def read_device_choice(value: Any) -> str:
    """A ``--device`` value; ValueError names the choices."""
    text = str(value).strip().lower()
    if text not in DEVICE_CHOICES:
        raise ValueError(f"use one of {', '.join(DEVICE_CHOICES)}")
    return text


def probe_mlx() -> MlxDevices:
    """Ask MLX (imported here) what GPUs it can compute on."""
    import importlib.metadata

    import mlx.core as mx

    try:
        version = importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    available = bool(mx.is_available(mx.gpu))
    if not available:
        return MlxDevices(False, 0, "", "", 0, version)
    count = int(mx.device_count(mx.gpu))
    info = dict(mx.device_info(mx.gpu))
    backend = "metal" if sys.platform == "darwin" else "cuda"
    memory = int(info.get("total_memory") or info.get("memory_size") or 0)
    name = str(info.get("device_name") or info.get("architecture") or backend)
    return MlxDevices(True, max(1, count), backend, name, memory, version)


def choose_device(
    requested: str, devices: MlxDevices, *, source: str = "--device", cpu_name: str = ""
) -> DeviceChoice:
    """The device for ``requested`` given what MLX reports; DeviceUnavailable for a forced GPU
    that MLX does not report. ``source`` says where a forced choice came from, for the reason."""
    requested = read_device_choice(requested)
    if requested == "cpu":
        reason = f"forced by {source} cpu"
        if devices.gpu_available:
            reason += f" ({devices.gpu_count} GPU(s) left unused)"
        return _cpu(requested, devices, reason, cpu_name)
    if not devices.gpu_available:
        if requested == "gpu":
            raise DeviceUnavailable(
                f"{source} gpu, but MLX {devices.mlx_version} reports no GPU on this machine: "
                f"{_install_hint()}; or run with --device auto (use the CPU when there is no GPU)"
            )
        return _cpu(requested, devices, "no GPU reported by MLX", cpu_name)
    reason = f"forced by {source} gpu" if requested == "gpu" else "GPU reported by MLX"
    if devices.gpu_count > 1:
        reason += (
            f"; MLX uses GPU 0 of the {devices.gpu_count} this process sees "
            "(CUDA_VISIBLE_DEVICES chooses which)"
        )
    return DeviceChoice(
        requested=requested,
        device="gpu",
        backend=devices.backend,
        name=devices.gpu_name,
        index=0,
        gpu_count=devices.gpu_count,
        gpu_memory=devices.gpu_memory,
        reason=reason,
    )


def select_device(requested: str, *, source: str = "--device", cpu_name: str = "") -> DeviceChoice:
    """Choose, make MLX's default device the chosen one in this process, and export it for the
    processes this one spawns (``MESHD_COMPUTE_DEVICE``). DeviceUnavailable as in choose_device."""
    choice = choose_device(requested, probe_mlx(), source=source, cpu_name=cpu_name)
    apply_device(choice.device)
    os.environ[DEVICE_ENV] = choice.device
    return choice


def apply_device(device: str) -> None:
    """Make ``device`` (cpu or gpu) MLX's default in this process (every thread's arrays)."""
    import mlx.core as mx

    target = mx.gpu if device == "gpu" else mx.cpu
    if mx.default_device() != target:
        mx.set_default_device(target)


def apply_from_env() -> str | None:
    """In a process the daemon spawned: compute where the daemon does (``MESHD_COMPUTE_DEVICE``).

    Returns the device applied, or None when the variable is unset (MLX's own default).
    """
    value = os.environ.get(DEVICE_ENV, "").strip().lower()
    if not value:
        return None
    if value == "auto":
        return select_device("auto", source=DEVICE_ENV).device
    choice = choose_device(value, probe_mlx(), source=DEVICE_ENV)
    apply_device(choice.device)
    return choice.device


def follow_in_thread() -> None:
    """At the start of a thread that computes (the compute thread): the device this process
    chose, in case MLX keeps a default per thread; a no-op where nothing was chosen."""
    value = os.environ.get(DEVICE_ENV, "").strip().lower()
    if value in ("cpu", "gpu") and "mlx.core" in sys.modules:
        apply_device(value)


def current_device() -> str:
    """MLX's default device in this process: "cpu" or "gpu"."""
    import mlx.core as mx

    return str(mx.default_device().type.name)


def device_memory_budget(on_gpu: bool, backend: str, gpu_memory: int) -> int:
    """A CUDA GPU's budget from its own memory; 0 (profiling's host rule) on a CPU and on Apple
    silicon, whose GPU shares the host's memory under macOS's wired limit."""
    return gpu_memory_budget(gpu_memory) if on_gpu and backend == "cuda" else 0


def gpu_memory_budget(gpu_memory: int) -> int:
    """What a plan may place on a GPU of ``gpu_memory`` bytes: 90% less 1 GiB, rounded down."""
    budget = int(gpu_memory * GPU_BUDGET_FRACTION) - GPU_RESERVE
    return max(0, budget // BUDGET_GRANULE * BUDGET_GRANULE)


def _cpu(requested: str, devices: MlxDevices, reason: str, cpu_name: str) -> DeviceChoice:
    return DeviceChoice(
        requested=requested,
        device="cpu",
        backend="cpu",
        name=cpu_name,
        index=0,
        gpu_count=devices.gpu_count,
        gpu_memory=0,
        reason=reason,
    )


def _install_hint() -> str:
    return METAL_INSTALL_HINT if sys.platform == "darwin" else CUDA_INSTALL_HINT
