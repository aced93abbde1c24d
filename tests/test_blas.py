"""meshd.runtime.blas: OpenBLAS is really used by MLX, computes correctly, and can be opted out of.

Loading a BLAS is per process and irreversible, so each case runs in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from typing import Any

import pytest

from meshd.runtime.blas import (
    BLAS_ENV,
    CORETYPE_ENV,
    IDLE_SPIN_LOG2_CYCLES,
    OPENBLAS_CORETYPE_ENV,
    THREAD_TIMEOUT_ENV,
    choose_coretype,
    choose_thread_timeout,
    cpu_flags,
    openblas_candidates,
)
from tests.pyrun import run_json

pytestmark = pytest.mark.integration

HAS_OPENBLAS = sys.platform.startswith("linux") and any(p.exists() for p in openblas_candidates())
needs_openblas = pytest.mark.skipif(not HAS_OPENBLAS, reason="no system OpenBLAS installed")

AVX2_FLAGS = frozenset({"avx", "avx2", "fma"})
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}

# Enables BLAS, imports MLX, checks matmuls of awkward shapes against float64 numpy and
# reports what is mapped. Shapes include a decode-like vector and transposed operands.
PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    started = time.process_time()  # CPU, not wall: a loaded host must not fail the check
    if sys.argv[1] == "mlx-first":
        import mlx.core
    import meshd.runtime.blas as blas
    info = blas.enable_fast_blas()
    enable_s = time.process_time() - started
    coretype_after = os.environ.get("OPENBLAS_CORETYPE")
    import mlx.core as mx
    # CPU time this process spends in the 0.3 s after a threaded matmul (before numpy's
    # own OpenBLAS, which spins by its own rules, runs any): idle
    # workers that spin show up here, sleeping ones do not.
    x = mx.random.normal((512, 512), key=mx.random.key(1))
    mx.eval(x @ x)
    idle_started = time.process_time()
    time.sleep(0.3)
    idle_cpu_s = time.process_time() - idle_started
    spin_after = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
    import numpy as np
    worst = 0.0
    for m, k, n, transpose in [(1, 576, 1536, True), (7, 33, 65, False),
                               (257, 129, 513, True), (512, 512, 512, False)]:
        a = mx.random.normal((m, k), key=mx.random.key(m))
        b = mx.random.normal((n, k) if transpose else (k, n), key=mx.random.key(n))
        c = a @ (b.T if transpose else b)
        b64 = np.array(b).astype(np.float64)
        ref = np.array(a).astype(np.float64) @ (b64.T if transpose else b64)
        worst = max(worst, float(np.max(np.abs(np.array(c) - ref))) / k**0.5)
    with open("/proc/self/maps") as maps:
        mapped = sorted({line.split()[-1] for line in maps if "libopenblas" in line})
    print(json.dumps({"info": info.__dict__, "blas_info": blas.blas_info().__dict__,
                      "enable_s": enable_s, "coretype_after": coretype_after,
                      "scaled_error": worst, "mapped": mapped, "idle_cpu_s": idle_cpu_s,
                      "spin_after": spin_after}))
    """
)


def changed_environment(env_changes: Mapping[str, str | None]) -> dict[str, str]:
    """This process's environment with variables set, or removed where the value is None."""
    env = dict(os.environ)
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_probe(env_changes: Mapping[str, str | None], mode: str = "normal") -> dict[str, Any]:
    """Run PROBE in a fresh interpreter with the environment changed as given."""
    return run_json(PROBE, mode, env=changed_environment(env_changes))


@needs_openblas
@pytest.mark.parametrize(
    "env_changes",
    [{}, {OPENBLAS_CORETYPE_ENV: None}, {CORETYPE_ENV: "Haswell"}],
    ids=["environment-as-is", "coretype-from-cpu-flags", "meshd-coretype"],
)
def test_openblas_is_mapped_and_correct(env_changes: dict[str, str | None]) -> None:
    user_coretype = os.environ.get(OPENBLAS_CORETYPE_ENV)
    env_changes = {BLAS_ENV: None, **env_changes}
    expected_coretype, expected_reason = choose_coretype(
        changed_environment(env_changes), cpu_flags()
    )
    spin_reason = choose_thread_timeout(changed_environment(env_changes))[1]
    result = run_probe(env_changes)
    info = result["info"]
    assert info["reason"] == f"{expected_reason}; {spin_reason}"
    if expected_coretype is not None:
        assert info["name"].endswith(f"coretype {expected_coretype})"), info
    assert info["kind"] == "openblas", info
    assert info["name"].startswith("openblas 0."), info
    assert result["blas_info"] == info
    assert any(info["path"] == path for path in result["mapped"]), result["mapped"]
    assert result["scaled_error"] < 1e-4, f"wrong matmul results with {info['name']}"
    # ~0.07 s of CPU here; a bound 7x over it catches a probe or benchmark creeping in.
    assert result["enable_s"] < 0.5, "enable_fast_blas must stay cheap: it runs on import"
    # The core type is set only while OpenBLAS loads; the user's environment is restored.
    expected_after = user_coretype if OPENBLAS_CORETYPE_ENV not in env_changes else None
    assert result["coretype_after"] == expected_after
    assert result["spin_after"] == os.environ.get(THREAD_TIMEOUT_ENV)


@needs_openblas
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no workers on one CPU")
def test_idle_openblas_workers_sleep_instead_of_spinning() -> None:
    """Stages on one machine take turns: a stage waiting for its next activation must leave
    the cores to the one computing. OpenBLAS's own default (2**28 cycles, ~0.1 s of spinning
    after every parallel matmul) is the control: it spends more CPU time while idle."""
    ours = run_probe({BLAS_ENV: None, THREAD_TIMEOUT_ENV: None})
    assert f"2**{IDLE_SPIN_LOG2_CYCLES} cycles" in ours["info"]["reason"]
    assert ours["spin_after"] is None  # set only while the library loaded
    spinning = run_probe({BLAS_ENV: None, THREAD_TIMEOUT_ENV: "28"})
    assert f"{THREAD_TIMEOUT_ENV}=28 kept from the environment" in spinning["info"]["reason"]
    assert ours["idle_cpu_s"] < 0.02, ours
    assert spinning["idle_cpu_s"] > ours["idle_cpu_s"], (spinning, ours)


def test_thread_timeout_keeps_the_users_value() -> None:
    assert choose_thread_timeout({})[0] == str(IDLE_SPIN_LOG2_CYCLES)
    assert choose_thread_timeout({THREAD_TIMEOUT_ENV: " 26 "}) == (
        "26",
        f"{THREAD_TIMEOUT_ENV}=26 kept from the environment",
    )


def test_reference_opt_out_does_not_load_openblas() -> None:
    result = run_probe({BLAS_ENV: "reference"})
    assert result["info"]["kind"] == "reference"
    assert result["info"]["reason"] == f"{BLAS_ENV}=reference"
    assert result["mapped"] == []
    assert result["scaled_error"] < 1e-4


def test_mlx_imported_first_is_reported_not_patched() -> None:
    result = run_probe({BLAS_ENV: None}, mode="mlx-first")
    assert result["info"]["kind"] == "reference"
    assert "imported before enable_fast_blas" in result["info"]["reason"]
    assert result["mapped"] == []


@pytest.mark.parametrize("value", ["openblass", "fast"])
def test_unknown_blas_setting_is_an_error_that_says_what_to_use(value: str) -> None:
    env = {**os.environ, BLAS_ENV: value}
    code = "import meshd.runtime.blas as b; b.enable_fast_blas()"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert f"{BLAS_ENV}={value!r} is not understood" in done.stderr
    assert "'reference'" in done.stderr


def test_coretype_chosen_from_flags_when_unset() -> None:
    assert choose_coretype({}, AVX512_FLAGS)[0] == "SkylakeX"
    assert choose_coretype({}, AVX2_FLAGS)[0] == "Haswell"
    assert choose_coretype({}, frozenset({"sse2"})) == (
        None,
        "coretype detected by OpenBLAS (no AVX2 flags to choose from)",
    )


def test_user_coretype_is_kept_unless_the_cpu_cannot_run_it() -> None:
    kept, reason = choose_coretype({OPENBLAS_CORETYPE_ENV: "Haswell"}, AVX512_FLAGS)
    assert kept == "Haswell"
    assert "kept" in reason
    assert CORETYPE_ENV in reason  # tells the user how to get the faster kernels
    broken, reason = choose_coretype({OPENBLAS_CORETYPE_ENV: "SkylakeX"}, AVX2_FLAGS)
    assert broken == "Haswell"
    assert "avx512" in reason
    unknown_cpu, _ = choose_coretype({OPENBLAS_CORETYPE_ENV: "SkylakeX"}, frozenset())
    assert unknown_cpu == "SkylakeX"


def test_meshd_coretype_wins_over_everything() -> None:
    env = {OPENBLAS_CORETYPE_ENV: "Haswell", CORETYPE_ENV: "Zen"}
    assert choose_coretype(env, AVX512_FLAGS) == ("Zen", f"{CORETYPE_ENV}=Zen")


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.uname().machine != "x86_64",
    reason="x86 flags come from /proc/cpuinfo on Linux",
)
def test_cpu_flags_reads_this_machine() -> None:
    assert {"sse2", "fpu"} <= cpu_flags()


def test_blas_threads_can_be_shared_and_restored() -> None:
    """Co-located stages use their share of the cores while busy, then all of them again."""
    code = """
import ctypes, json
from meshd.runtime.blas import blas_info, default_blas_threads, enable_fast_blas
from meshd.runtime.blas import set_blas_threads
enable_fast_blas()
import mlx.core as mx
lib = ctypes.CDLL(blas_info().path)
before = lib.openblas_get_num_threads()
assert set_blas_threads(1)
during = lib.openblas_get_num_threads()
a = mx.random.normal((256, 256)); mx.eval(a @ a)
assert set_blas_threads(None)
after = lib.openblas_get_num_threads()
print(json.dumps([before, during, after, default_blas_threads()]))
"""
    before, during, after, default = run_json(code, env=os.environ, timeout_s=60)
    assert during == 1
    assert before == after == default >= 1
