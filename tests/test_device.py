"""The device MLX computes on: chosen from what MLX reports, forced by --device, said why.

The choice is a pure function of the setting and of what MLX reports (``MlxDevices``); these
tests give it what a CUDA host with two GPUs, a Mac and this CPU machine report, and ask this
machine's MLX for real where it matters (auto picks the CPU here, with the reason; a forced GPU
refuses to start and names what to install). The per-dtype measurement runs for real on this
CPU and must stay quick.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from meshd.config import ConfigError, load_config
from meshd.runtime.device import (
    DEVICE_ENV,
    DeviceUnavailable,
    MlxDevices,
    choose_device,
    probe_mlx,
    read_device_choice,
)

pytestmark = pytest.mark.unit

CPU_ONLY = MlxDevices(False, 0, "", "", 0, "0.32.4")
TWO_H200 = MlxDevices(True, 2, "cuda", "NVIDIA H200", 141 * 10**9, "0.32.4")
ONE_H200 = replace(TWO_H200, gpu_count=1)
MAC = MlxDevices(True, 1, "metal", "Apple M3 Ultra", 256 * 2**30, "0.32.4")


def test_auto_takes_the_gpu_mlx_reports() -> None:
    choice = choose_device("auto", ONE_H200)
    assert (choice.device, choice.backend, choice.name, choice.index) == (
        "gpu",
        "cuda",
        "NVIDIA H200",
        0,
    )
    assert choice.reason == "GPU reported by MLX"
    assert choice.gpu_memory == 141 * 10**9
    assert choose_device("auto", MAC).backend == "metal"


def test_several_gpus_say_which_one_and_how_to_choose() -> None:
    choice = choose_device("auto", TWO_H200)
    assert "GPU 0 of the 2" in choice.reason
    assert "CUDA_VISIBLE_DEVICES" in choice.reason
    assert choice.summary.startswith("gpu 0 of 2 (cuda, NVIDIA H200)")


def test_cpu_forced_on_a_gpu_node_says_so() -> None:
    choice = choose_device("cpu", TWO_H200, cpu_name="AMD EPYC")
    assert (choice.device, choice.backend, choice.name) == ("cpu", "cpu", "AMD EPYC")
    assert choice.reason == "forced by --device cpu (2 GPU(s) left unused)"
    assert choice.gpu_memory == 0


def test_auto_without_a_gpu_is_the_cpu_with_the_reason() -> None:
    choice = choose_device("auto", CPU_ONLY)
    assert (choice.device, choice.reason) == ("cpu", "no GPU reported by MLX")
    assert choice.summary == "cpu: no GPU reported by MLX"


def test_forced_gpu_without_one_names_what_to_install() -> None:
    with pytest.raises(DeviceUnavailable) as refused:
        choose_device("gpu", CPU_ONLY)
    text = str(refused.value)
    assert "--device gpu" in text and "reports no GPU" in text
    if sys.platform != "darwin":
        assert "meshd[cuda12]" in text and "install.sh --cuda" in text


def test_this_machine_reports_no_gpu_and_auto_is_the_cpu() -> None:
    """The CPU wheel (mlx[cpu]) here: MLX itself says there is no GPU."""
    devices = probe_mlx()
    if devices.gpu_available:
        pytest.skip(f"this machine has a GPU MLX can use ({devices.gpu_name})")
    assert devices.gpu_count == 0
    assert choose_device("auto", devices).reason == "no GPU reported by MLX"
    with pytest.raises(DeviceUnavailable):
        choose_device("gpu", devices)


def test_the_setting_reads_from_flags_env_and_toml(tmp_path: Path) -> None:
    assert read_device_choice(" GPU ") == "gpu"
    with pytest.raises(ValueError, match="auto, cpu, gpu"):
        read_device_choice("tpu")
    assert load_config({"state_dir": tmp_path}, env={}).device == "auto"
    (tmp_path / "meshd.toml").write_text('device = "cpu"\n')
    assert load_config({"state_dir": tmp_path}, env={}).device == "cpu"
    assert load_config({"state_dir": tmp_path}, env={"MESHD_DEVICE": "gpu"}).device == "gpu"
    flags = {"state_dir": tmp_path, "device": "auto"}
    assert load_config(flags, env={"MESHD_DEVICE": "gpu"}).device == "auto"
    with pytest.raises(ConfigError, match="MESHD_DEVICE"):
        load_config({"state_dir": tmp_path}, env={"MESHD_DEVICE": "npu"})


def test_a_spawned_process_computes_where_the_daemon_chose() -> None:
    """The tensor-parallel runners call apply_from_env: the daemon's choice, not MLX's default."""
    code = (
        "from meshd.runtime.device import apply_from_env, current_device;"
        "print(apply_from_env(), current_device())"
    )
    env = {**os.environ, DEVICE_ENV: "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["cpu", "cpu"], out.stderr
    if not probe_mlx().gpu_available:
        env[DEVICE_ENV] = "gpu"
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode != 0 and "reports no GPU" in out.stderr


def test_per_dtype_rates_are_measured_quickly_on_this_device() -> None:
    """Every key is measured, with positive rates, and the slow dtypes of a CPU stay cheap."""
    from meshd.mesh.profile_dtypes import DTYPE_KEYS, measure_dtype_throughput

    started = time.perf_counter()
    flops, bandwidth = measure_dtype_throughput()
    elapsed = time.perf_counter() - started
    assert set(flops) == set(bandwidth) == set(DTYPE_KEYS)
    assert all(rate > 0 for rate in (*flops.values(), *bandwidth.values()))
    # ~1 s on an idle 2-core machine; the bound leaves room for a machine shared with others.
    assert elapsed < 15, f"per-dtype measurement took {elapsed:.1f} s"


def test_gpu_budget_is_the_gpus_memory_less_a_reserve() -> None:
    from meshd.runtime.device import gpu_memory_budget

    budget = gpu_memory_budget(141 * 10**9)
    assert 120 * 10**9 < budget < 0.9 * 141 * 10**9
    assert budget % (256 * 2**20) == 0
    assert gpu_memory_budget(2**30) == 0


def test_only_a_cuda_gpus_memory_replaces_the_host_rule() -> None:
    from meshd.runtime.device import device_memory_budget, gpu_memory_budget

    h200 = 141 * 10**9
    assert device_memory_budget(True, "cuda", h200) == gpu_memory_budget(h200)
    assert device_memory_budget(True, "metal", 256 * 2**30) == 0  # unified memory: host rule
    assert device_memory_budget(False, "cuda", h200) == 0  # --device cpu on a GPU node
