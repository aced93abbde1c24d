"""Fast BLAS for MLX on Linux: load a system OpenBLAS before ``mlx.core`` is imported.

Why: the ``mlx[cpu]`` wheel links a bundled reference BLAS (~3-8 GFLOP/s for a float32
matmul on a 2-core x86 machine). Loading a system OpenBLAS with ``RTLD_GLOBAL`` before
``mlx.core`` puts its ``cblas_sgemm``/``sgemm_`` in the global symbol scope, which the
dynamic linker searches before libmlx's own dependencies, so MLX's matmuls run on
OpenBLAS (~250-470 GFLOP/s on the same machine). Nothing in MLX changes; no subprocess
is started; the whole call costs a few milliseconds, so ``daemon/__init__.py`` can call
``enable_fast_blas()`` on every import of the package.

Choices (measured on a 2-core AMD EPYC with AVX-512, OpenBLAS 0.3.21, float32 matmul):

* Core type. OpenBLAS picks its kernels from ``OPENBLAS_CORETYPE`` when set, else from
  CPUID, and 0.3.21's CPUID tables misdetect some newer CPUs (e.g. as Prescott, ~25-40
  GFLOP/s). Measured: SkylakeX ~465, Cooperlake ~465, Haswell ~250, Zen ~250, Prescott
  ~40 GFLOP/s; all numerically correct. So when no core type is set we choose one from
  the /proc/cpuinfo flags (SkylakeX with AVX-512, Haswell with AVX2+FMA, else OpenBLAS's
  own detection). A user's ``OPENBLAS_CORETYPE`` is kept unless it is known-broken (it
  names kernels that need instructions this CPU lacks, which would crash with SIGILL);
  ``MESHD_BLAS_CORETYPE`` sets the core type for meshd alone and wins over both. The
  chosen value is set only while the library loads (OpenBLAS reads it once, at load),
  and the environment is then restored, so child processes of other software see the
  user's setting.
* Threads. The pthread build is preferred (the OpenMP build's idle threads spin unless
  ``OMP_WAIT_POLICY=PASSIVE``, which we default to if only an OpenMP build is found).
  ``OPENBLAS_NUM_THREADS`` is left at OpenBLAS's default (all cores). Two pipeline stages
  on two cores taking turns (the mesh's case) ran prefill-sized matmuls 25-65% faster with
  default threads than with one thread per process, and decode-sized ones within noise;
  two processes computing at the same time were at most ~10% faster with one thread each.
* Idle threads. After each parallel matmul OpenBLAS's worker threads spin (calling
  ``sched_yield``) for ``2**OPENBLAS_THREAD_TIMEOUT`` CPU cycles before they sleep; the
  default, 2**28 cycles, is ~0.1 s. Pipeline stages on one machine take turns: while one
  computes a token (tens of milliseconds), the other's workers are still spinning and take
  the cores it needs. Measured with two loopback daemons splitting SmolLM2-135M, one request:
  ~110 ms/token with the default (each daemon ~100% CPU), ~74 ms/token with 2**20 cycles
  (~0.4 ms: long enough to bridge the gaps between the matmuls of one forward pass, short
  enough that a stage waiting for its next activation sleeps). So that is what we load with
  unless the user set ``OPENBLAS_THREAD_TIMEOUT``; like the core type, it is set only while
  the library loads.

Environment: ``MESHD_BLAS=reference`` keeps MLX's bundled BLAS; ``MESHD_BLAS=/path/to/
libopenblas.so.0`` loads that library; ``MESHD_BLAS=auto`` (or unset) searches the usual
system paths. On macOS nothing is loaded: MLX uses Accelerate and Metal there.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import sysconfig
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from meshd.runtime.thread_names import named_while

BLAS_ENV = "MESHD_BLAS"
CORETYPE_ENV = "MESHD_BLAS_CORETYPE"
OPENBLAS_CORETYPE_ENV = "OPENBLAS_CORETYPE"
THREAD_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"
# log2 of the CPU cycles an idle OpenBLAS worker spins before it sleeps (OpenBLAS: 4..30,
# default 28): ~0.4 ms at 2.5 GHz, see "Idle threads" above.
IDLE_SPIN_LOG2_CYCLES = 20

BlasKind = Literal["openblas", "reference", "accelerate"]

_AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
_AVX2 = frozenset({"avx2", "fma"})
# CPU flags each OpenBLAS x86 core type's kernels execute (lower-case names). A core type
# whose flags the CPU lacks crashes with SIGILL on the first matmul: that is "known-broken".
_CORETYPE_NEEDS: Mapping[str, frozenset[str]] = {
    "sapphirerapids": _AVX512 | {"avx512_bf16", "amx_tile"},
    "cooperlake": _AVX512 | {"avx512_bf16"},
    "skylakex": _AVX512,
    "haswell": _AVX2,
    "zen": _AVX2,
    "excavator": _AVX2,
    "sandybridge": frozenset({"avx"}),
}
_PARALLEL_NAMES = {0: "serial", 1: "pthread", 2: "openmp"}


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS MLX's CPU matmuls use in this process, for ``meshd status`` and profiles."""

    kind: BlasKind
    name: str  # e.g. "openblas 0.3.21 (pthread, coretype SkylakeX)"
    path: str | None  # the loaded library file, when there is one
    reason: str  # why this BLAS: what was chosen, kept or refused


_enabled: BlasInfo | None = None


def enable_fast_blas() -> BlasInfo:
    """Load OpenBLAS globally so that a later ``import mlx.core`` uses it; idempotent.

    Must run before ``mlx.core`` is imported; if it already was, nothing is loaded and the
    returned info says so. Raises ValueError when ``MESHD_BLAS`` holds a value that cannot
    be honoured (an unknown word, or a path that is not a loadable OpenBLAS).
    """
    global _enabled
    if _enabled is None:
        _enabled = _enable()
    return _enabled


def blas_info() -> BlasInfo:
    """Describe the BLAS in use now, without loading anything."""
    if _enabled is not None:
        return _enabled
    if sys.platform == "darwin":
        return _accelerate_info()
    mapped = _mapped_openblas()
    if mapped is not None:
        return _describe_openblas(mapped, "loaded outside enable_fast_blas (e.g. LD_PRELOAD)")
    return _reference_info("enable_fast_blas() has not run in this process")


def choose_coretype(env: Mapping[str, str], cpu_flags: frozenset[str]) -> tuple[str | None, str]:
    """Pick the OPENBLAS_CORETYPE to load with, and say why; None leaves OpenBLAS to detect.

    Pure function of the environment and the CPU flags, so it is testable on any machine.
    """
    own = env.get(CORETYPE_ENV, "").strip()
    if own:
        return own, f"{CORETYPE_ENV}={own}"
    from_flags = _coretype_from_flags(cpu_flags)
    user = env.get(OPENBLAS_CORETYPE_ENV, "").strip()
    if not user:
        if from_flags is None:
            return None, "coretype detected by OpenBLAS (no AVX2 flags to choose from)"
        return from_flags, f"coretype {from_flags} chosen from CPU flags"
    missing = _CORETYPE_NEEDS.get(user.lower(), frozenset()) - cpu_flags
    if missing and cpu_flags:
        why = f"{OPENBLAS_CORETYPE_ENV}={user} needs {', '.join(sorted(missing))}, absent here"
        return from_flags, f"{why}; using {from_flags or 'OpenBLAS detection'} instead"
    reason = f"{OPENBLAS_CORETYPE_ENV}={user} kept from the environment"
    if from_flags == "SkylakeX" and user.lower() not in {"skylakex", "cooperlake"}:
        reason += f" (SkylakeX measured ~1.9x faster on AVX-512; {CORETYPE_ENV}=SkylakeX uses it)"
    return user, reason


def cpu_flags() -> frozenset[str]:
    """The first processor's flags from /proc/cpuinfo (x86 Linux), or an empty set."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def openblas_candidates() -> list[Path]:
    """System OpenBLAS locations, pthread builds first (Debian/Ubuntu, Fedora/RHEL, Arch)."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    lib = Path("/usr/lib") / multiarch
    return [
        lib / "openblas-pthread" / "libopenblas.so.0",
        Path("/usr/lib64/libopenblasp.so.0"),
        lib / "libopenblas.so.0",
        Path("/usr/lib64/libopenblas.so.0"),
        Path("/usr/lib/libopenblas.so.0"),
        Path("/usr/local/lib/libopenblas.so.0"),
        lib / "openblas-openmp" / "libopenblas.so.0",
        Path("/usr/lib64/libopenblaso.so.0"),
        lib / "openblas-serial" / "libopenblas.so.0",
    ]


def _enable() -> BlasInfo:
    if sys.platform == "darwin":
        return _accelerate_info()
    if not sys.platform.startswith("linux"):
        return _reference_info(f"no fast-BLAS loader for {sys.platform}")
    choice = os.environ.get(BLAS_ENV, "auto").strip()
    if choice == "reference":
        return _reference_info(f"{BLAS_ENV}=reference")
    explicit = _explicit_path(choice)
    mapped = _mapped_openblas()
    if "mlx.core" in sys.modules:
        if mapped is not None:
            return _describe_openblas(mapped, "already loaded before enable_fast_blas()")
        return _reference_info(
            "mlx.core was imported before enable_fast_blas(); call "
            "meshd.runtime.blas.enable_fast_blas() before anything imports mlx"
        )
    if mapped is not None:
        # Loaded already (LD_PRELOAD or a local dlopen): promote it to the global scope.
        _load_global(mapped)
        return _describe_openblas(mapped, "already loaded (LD_PRELOAD?); made global")
    if explicit is not None:
        return _load_explicit(explicit)
    return _load_first_candidate()


def _explicit_path(choice: str) -> Path | None:
    if choice in {"", "auto", "openblas"}:
        return None
    if "/" in choice:
        return Path(choice)
    raise ValueError(
        f"{BLAS_ENV}={choice!r} is not understood: use 'auto' (default), 'reference' to keep "
        f"MLX's bundled BLAS, or an absolute path to libopenblas.so.0"
    )


def _load_explicit(path: Path) -> BlasInfo:
    try:
        return _load_openblas(path)
    except OSError as error:
        raise ValueError(
            f"{BLAS_ENV}={path} could not be loaded ({error}); point it at an OpenBLAS "
            f"shared library or unset it"
        ) from error


def _load_first_candidate() -> BlasInfo:
    failures: list[str] = []
    for path in openblas_candidates():
        if not path.exists():
            continue
        try:
            return _load_openblas(path)
        except OSError as error:
            failures.append(f"{path}: {error}")
    if failures:
        return _reference_info("no OpenBLAS could be loaded: " + "; ".join(failures))
    return _reference_info(
        "no OpenBLAS found; install libopenblas0-pthread (Debian/Ubuntu) or openblas "
        "for ~50x faster float32 matmuls"
    )


def _load_openblas(path: Path) -> BlasInfo:
    """Load ``path`` globally with the chosen core type set only during the load."""
    if "openmp" in str(path.resolve()) or path.name.startswith("libopenblaso"):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read by libgomp at its load
    coretype, reason = choose_coretype(os.environ, cpu_flags())
    spin, spin_reason = choose_thread_timeout(os.environ)
    settings = {OPENBLAS_CORETYPE_ENV: coretype, THREAD_TIMEOUT_ENV: spin}
    lib = _load_with_env(path, settings)
    if not hasattr(lib, "openblas_get_config"):
        raise OSError(f"{path} does not export openblas_get_config, so it is not OpenBLAS")
    return _describe_openblas(path, f"{reason}; {spin_reason}")


def choose_thread_timeout(env: Mapping[str, str]) -> tuple[str, str]:
    """The OPENBLAS_THREAD_TIMEOUT to load with (how long idle workers spin), and why: the
    user's value is kept, else :data:`IDLE_SPIN_LOG2_CYCLES`. Pure, testable anywhere."""
    user = env.get(THREAD_TIMEOUT_ENV, "").strip()
    if user:
        return user, f"{THREAD_TIMEOUT_ENV}={user} kept from the environment"
    return str(IDLE_SPIN_LOG2_CYCLES), (
        f"idle threads spin 2**{IDLE_SPIN_LOG2_CYCLES} cycles, then sleep (stages that take "
        f"turns on one machine leave each other the cores)"
    )


def _load_with_env(path: Path, settings: Mapping[str, str | None]) -> ctypes.CDLL:
    """Set each of ``settings`` (None: remove it) only while the library's constructor
    reads the environment, then restore what was there."""
    previous = {name: os.environ.get(name) for name in settings}
    for name, value in settings.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        return _load_global(path)
    finally:
        for name, value in previous.items():
            _restore_env(name, value)


def _restore_env(name: str, previous: str | None) -> None:
    if previous is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = previous


def _load_global(path: Path) -> ctypes.CDLL:
    with named_while("meshd-blas"):  # OpenBLAS starts its worker threads as it loads
        return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def _describe_openblas(path: Path, reason: str) -> BlasInfo:
    """Ask the loaded library for its version, threading and core type."""
    lib = ctypes.CDLL(str(path))  # same handle as the loaded one; loads nothing new
    version = _openblas_version(lib)
    details = [_PARALLEL_NAMES.get(_call_int(lib, "openblas_get_parallel"), "unknown threading")]
    corename = _call_str(lib, "openblas_get_corename")
    if corename:
        details.append(f"coretype {corename}")
    name = f"openblas {version} ({', '.join(details)})"
    return BlasInfo(kind="openblas", name=name, path=str(path.resolve()), reason=reason)


def _openblas_version(lib: ctypes.CDLL) -> str:
    config = _call_str(lib, "openblas_get_config") or ""
    words = config.split()
    return words[1] if len(words) > 1 and words[0] == "OpenBLAS" else "(unknown version)"


def _call_str(lib: ctypes.CDLL, symbol: str) -> str | None:
    function = getattr(lib, symbol, None)
    if function is None:
        return None
    function.restype = ctypes.c_char_p
    result = function()
    return result.decode("ascii", errors="replace") if result else None


def _call_int(lib: ctypes.CDLL, symbol: str) -> int | None:
    function = getattr(lib, symbol, None)
    if function is None:
        return None
    function.restype = ctypes.c_int
    return int(function())


def _coretype_from_flags(flags: frozenset[str]) -> str | None:
    if flags >= _AVX512:
        return "SkylakeX"
    if flags >= _AVX2:
        return "Haswell"
    return None


def _mapped_openblas() -> Path | None:
    """The OpenBLAS file mapped into this process, if any (e.g. via LD_PRELOAD)."""
    for path in _mapped_files():
        if path.name.startswith("libopenblas"):
            return path
    return None


def _mapped_files() -> Iterator[Path]:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    yield Path(fields[5].rstrip("\n"))
    except OSError:
        return


def _accelerate_info() -> BlasInfo:
    return BlasInfo(
        kind="accelerate", name="accelerate", path=None, reason="macOS: MLX uses Accelerate/Metal"
    )


def _reference_info(reason: str) -> BlasInfo:
    return BlasInfo(kind="reference", name="reference (mlx wheel)", path=None, reason=reason)


_thread_control: dict[str, object] = {}


def set_blas_threads(count: int | None) -> bool:
    """Set how many threads OpenBLAS uses for later calls; None restores its start-up count.

    Why: daemons that share a machine (co-located pipeline stages) each default to every
    core. With one request in flight they take turns and all cores help; with several in
    flight they compute at the same time and oversubscribe the cores, so each should use
    its share. Returns False where OpenBLAS is not the BLAS in use (nothing changes).
    Call it only from the thread that runs MLX's matmuls, between them.
    """
    info = blas_info()
    if info.kind != "openblas" or not info.path:
        return False
    if "set" not in _thread_control:
        lib = ctypes.CDLL(info.path)  # the already-loaded library: same handle
        setter = getattr(lib, "openblas_set_num_threads", None)
        getter = getattr(lib, "openblas_get_num_threads", None)
        if setter is None or getter is None:
            return False
        setter.argtypes = [ctypes.c_int]
        _thread_control.update(set=setter, default=int(getter()), current=int(getter()))
    wanted = int(_thread_control["default"]) if count is None else max(1, int(count))
    if wanted != _thread_control["current"]:
        _thread_control["set"](wanted)  # type: ignore[operator]
        _thread_control["current"] = wanted
    return True


def default_blas_threads() -> int:
    """OpenBLAS's thread count at start-up (all cores), or the CPU count."""
    if "default" in _thread_control:
        return int(_thread_control["default"])  # type: ignore[arg-type]
    return os.cpu_count() or 1
