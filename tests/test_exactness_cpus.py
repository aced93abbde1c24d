"""Exactness holds whichever OpenBLAS kernels this CPU runs.

OpenBLAS picks its matrix kernels per CPU type, and each rounds some matrix shapes its own
way: on an AMD EPYC the mesh used to differ from mlx-lm by ~1e-6 where an Intel machine
matched. The mesh now computes with exactly mlx-lm's shapes, so it must be bit-identical to
mlx-lm under every kernel choice, not only under the one this machine's CPU selects. Each
choice runs in a fresh interpreter (OpenBLAS reads it once, when it loads):
``MESHD_BLAS_CORETYPE`` forces a kernel set, and OpenBLAS's own detection runs when the
library is preloaded without one (see :mod:`meshd.runtime.blas`). The main suite covers the
default choice; choices whose instructions this CPU lacks are skipped.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.runtime.blas import (
    BLAS_ENV,
    CORETYPE_ENV,
    OPENBLAS_CORETYPE_ENV,
    cpu_flags,
    openblas_candidates,
)
from tests.support.random_model import make_random_model_dir

REPO = Path(__file__).resolve().parents[1]
OPENBLAS = next((path for path in openblas_candidates() if path.exists()), None)
X86 = platform.machine() in ("x86_64", "AMD64")
AVX2 = frozenset({"avx2", "fma"})
AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        OPENBLAS is None or not sys.platform.startswith("linux"), reason="no system OpenBLAS"
    ),
]

# (label, core type forced through MESHD_BLAS_CORETYPE or None for OpenBLAS's detection,
#  CPU flags the kernels need)
CHOICES = [
    ("Haswell", "Haswell", AVX2),
    ("SkylakeX", "SkylakeX", AVX512),
    ("Zen", "Zen", AVX2),
    ("Prescott", "Prescott", frozenset({"pni"})),  # SSE3 ("pni"), the oldest kernels
    ("OpenBLAS detection", None, frozenset()),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model_dir(
        tmp_path_factory.mktemp("model") / "llama",
        "llama",
        layers=6,
        hidden=64,
        heads=4,
        kv_heads=2,
        vocab=320,
        seed=11,
    )


def probe_env(coretype: str | None) -> dict[str, str]:
    """This environment with only the kernel choice under test (a preloaded OpenBLAS, or a
    core type set by the caller, would decide instead)."""
    unset = (CORETYPE_ENV, OPENBLAS_CORETYPE_ENV, BLAS_ENV, "LD_PRELOAD")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    if coretype is not None:
        env[CORETYPE_ENV] = coretype
    else:
        env["LD_PRELOAD"] = str(OPENBLAS)  # loaded before Python: OpenBLAS detects the CPU
    return env


@pytest.mark.parametrize(("label", "coretype", "needs"), CHOICES, ids=[c[0] for c in CHOICES])
def test_mesh_equals_mlx_lm_under_each_blas_kernel_choice(
    model_dir: Path, tmp_path: Path, label: str, coretype: str | None, needs: frozenset[str]
) -> None:
    if coretype is not None and (not X86 or not needs <= cpu_flags()):
        pytest.skip(f"this CPU cannot run OpenBLAS's {label} kernels")
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.exactness_probe", str(model_dir), str(tmp_path)],
        cwd=REPO,
        env=probe_env(coretype),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if coretype is not None:
        assert f"coretype {coretype}" in result["blas"], result
    assert result["tokens_equal"] and result["steps_compared"] == 12, result
    assert result["max_abs_diff"] == 0.0, result
