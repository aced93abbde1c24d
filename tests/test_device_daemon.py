"""A real daemon says which device it computes on and why; a forced GPU that is not there
stops it at start-up with what to install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.api.render import status_text
from meshd.mesh.profile_dtypes import DTYPE_KEYS
from meshd.runtime.device import probe_mlx

pytestmark = pytest.mark.integration

LOOPBACK = ["--interface", "127.0.0.1", "--peer-host", "127.0.0.1", "--peer-port", "0", "--no-mdns"]


def test_status_says_the_device_and_the_profile_carries_per_dtype_rates(
    daemons, mesh_token: str
) -> None:
    daemon = daemons([*LOOPBACK, "--join", mesh_token, "--device", "cpu"])
    status = daemon.wait_for(lambda s: s.nodes and s.nodes[0].profile.flops > 0, 60, "its profile")
    profile = status.nodes[0].profile
    assert profile.mlx_device == "cpu" and profile.device_backend == "cpu"
    assert profile.device_reason.startswith("forced by --device cpu")
    assert set(profile.dtype_flops) == set(profile.dtype_bandwidth) == set(DTYPE_KEYS)
    text = status_text(status)
    assert "device: cpu: forced by --device cpu" in text
    assert "DEVICE" in text


def test_forced_gpu_without_one_refuses_to_start(daemons, mesh_token: str) -> None:
    if probe_mlx().gpu_available:
        pytest.skip("this machine has a GPU MLX can use")
    daemon = daemons([*LOOPBACK, "--join", mesh_token, "--device", "gpu"])
    assert daemon.proc is not None
    assert daemon.proc.wait(timeout=60) == 2
    log = daemon.log_tail()
    assert "--device gpu, but MLX" in log and "reports no GPU" in log
    assert "meshd[cuda12]" in log


def test_meshd_profile_measures_on_the_configured_device(tmp_path) -> None:
    import json

    command = [sys.executable, "-m", "meshd.api.cli", "profile", "--state-dir", str(tmp_path)]
    done = subprocess.run(
        [*command, "--device", "cpu", "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    profile = json.loads(done.stdout)
    assert profile["mlx_device"] == "cpu" and profile["device_reason"] == "forced by --device cpu"
    assert set(profile["dtype_flops"]) == set(DTYPE_KEYS)
    if not probe_mlx().gpu_available:
        refused = subprocess.run(
            [*command, "--device", "gpu"], capture_output=True, text=True, timeout=120
        )
        assert refused.returncode == 2 and "reports no GPU" in refused.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="MLX's backend is a wheel of its own on Linux")
def test_an_mlx_without_its_backend_is_named_with_the_extra_to_install(tmp_path) -> None:
    """On Linux the `mlx` wheel is the bindings alone and the backend (mlx-cpu, mlx-cuda-12...)
    an extra: this is that install, MLX's own package without the backend's library folder,
    found first on the path. Commands and the daemon stop with what to install, no traceback."""
    import mlx

    bindings = tmp_path / "site" / "mlx"
    shutil.copytree(
        Path(mlx.__path__[0]), bindings, ignore=shutil.ignore_patterns("lib", "include")
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(bindings.parent), os.environ.get("PYTHONPATH", "")]))}  # fmt: skip
    state = tmp_path / "state"
    commands = [
        ["profile", "--state-dir", str(state)],
        ["run", "--state-dir", str(state), "--http", "off", *LOOPBACK],
    ]
    for command in commands:
        done = subprocess.run(
            [sys.executable, "-m", "meshd.api.cli", *command],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "MLX has no backend on this machine" in done.stderr, done.stderr
        assert "pip install 'meshd[cpu]'" in done.stderr and "Traceback" not in done.stderr
