"""Installing on a GPU node: the cuda12 / cuda13 extras resolve on PyPI to MLX's CUDA backends,
and packaging/install.sh picks the backend from `nvidia-smi`, or as told.

The registry test asks PyPI (as pip does, metadata only, no wheel downloaded) to resolve exactly
what the extras name, at the MLX version installed here; it skips only when the registry cannot
be reached. The install script's choice is tested with an `nvidia-smi` stand-in on PATH that
answers as a driver of a given version would: this machine has no GPU and no NVIDIA driver.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ROOT / "packaging" / "install.sh"
BACKENDS = {"cpu": "mlx-cpu", "cuda12": "mlx-cuda-12", "cuda13": "mlx-cuda-13"}
UNREACHABLE = re.compile(
    r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
    r"Network is unreachable|Could not fetch URL|ProxyError|timed out",
    re.IGNORECASE,
)


def _extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"]


def test_each_backend_is_an_extra_and_the_base_names_none() -> None:
    """The backends' wheels hold the same files: the base must not pull one of its own."""
    extras = _extras()
    for extra in BACKENDS:
        assert extras[extra] == [
            f"mlx[{extra}]>={'0.20' if extra == 'cpu' else '0.30'}; sys_platform == 'linux'"
        ]
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [dep for dep in base if dep.startswith("mlx") and not dep.startswith("mlx-lm")] == [
        "mlx>=0.20"
    ]


def test_pypi_resolves_the_cuda_extras_to_mlxs_cuda_backends(tmp_path: Path) -> None:
    """mlx[cuda12] / mlx[cuda13] at the installed MLX version name mlx-cuda-12 / -13 of the
    same version, and those exist for this platform (pip reads the metadata, no wheel)."""
    version = importlib.metadata.version("mlx")
    report = tmp_path / "report.json"
    wanted = [
        f"mlx[cuda12]=={version}",
        f"mlx-cuda-12=={version}",
        f"mlx[cuda13]=={version}",
        f"mlx-cuda-13=={version}",
    ]
    command = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
        "--disable-pip-version-check", "--quiet", "--report", str(report), *wanted,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.skip("the package registry did not answer within 240 s")
    if done.returncode != 0 and UNREACHABLE.search(done.stderr + done.stdout):
        pytest.skip(f"the package registry is unreachable: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr
    resolved = {
        item["metadata"]["name"]: item["metadata"]
        for item in json.loads(report.read_text())["install"]
    }
    assert resolved["mlx-cuda-12"]["version"] == resolved["mlx-cuda-13"]["version"] == version
    requires = resolved["mlx"]["requires_dist"]
    for extra, package in (("cuda12", "mlx-cuda-12"), ("cuda13", "mlx-cuda-13")):
        assert (
            f'{package}=={version}; platform_system == "Linux" and extra == "{extra}"' in requires
        )
    assert any("nvidia-cublas" in dep for dep in resolved["mlx-cuda-12"]["requires_dist"])


def _fake_nvidia_smi(folder: Path, driver: str | None) -> Path:
    """An `nvidia-smi` that lists one H200 with this driver (None: lists no GPU)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    listing = "GPU 0: NVIDIA H200 (UUID: GPU-0)" if driver else "No devices were found"
    script.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *--query-gpu*) echo "{driver or ""}" ;; *) echo "{listing}" ;; esac\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder


def _backend(*args: str, path: Path | None = None) -> str:
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = f"{path}:{env['PATH']}"
    done = subprocess.run(
        ["bash", str(INSTALL), *args, "--print-backend"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(sys.platform != "linux", reason="the backend extras are Linux's")
def test_install_sh_picks_the_backend_from_nvidia_smi_or_as_told(tmp_path: Path) -> None:
    real_gpu = subprocess.run(["sh", "-c", "command -v nvidia-smi"], capture_output=True)
    if real_gpu.returncode != 0:
        assert _backend() == "cpu"
    assert _backend(path=_fake_nvidia_smi(tmp_path / "old", "575.57.08")) == "cuda12"
    assert _backend(path=_fake_nvidia_smi(tmp_path / "new", "580.65.06")) == "cuda13"
    assert _backend(path=_fake_nvidia_smi(tmp_path / "none", None)) == "cpu"
    new = tmp_path / "new"
    assert _backend("--cpu", path=new) == "cpu"
    assert _backend("--cuda", "12", path=new) == "cuda12"
    assert _backend("--cuda=13") == "cuda13"
    refused = subprocess.run(
        ["bash", str(INSTALL), "--cuda", "11"], capture_output=True, text=True, timeout=30
    )
    assert refused.returncode == 2 and "--cuda takes 12 or 13" in refused.stderr
