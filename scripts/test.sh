#!/usr/bin/env bash
# The one test command: C++ tests (ctest) and Python tests (pytest) against the build that
# scripts/setup.sh made. Exits non-zero if anything fails. Extra arguments go to pytest.
#
#   LOCRET_TEST_WORKERS=0    pytest in this process (for -x, --pdb or a debugger); default 2 workers
#   LOCRET_BUILD_DIR=DIR     test another build of this checkout (scripts/coverage.sh: build-coverage/)
#   LOCRET_PYTEST_RUNNER=... a command that runs `-m pytest ...` instead of the venv's python
#                            (scripts/coverage.sh: coverage.py's `coverage run`)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VPY="$ROOT/.venv/bin/python"
BUILD="${LOCRET_BUILD_DIR:-$ROOT/build}"
if [[ ! -x "$VPY" || ! -f "$BUILD/CMakeCache.txt" ]]; then
    echo "test.sh: no set-up found in $BUILD: run 'bash scripts/setup.sh' first" >&2
    exit 1
fi

# the default model, resolved (and verified) once for the C++ and Python tests
LOCRET_TEST_MODEL="$("$VPY" -m locret models path)" || { echo "test.sh: default model unavailable" >&2; exit 1; }
export LOCRET_TEST_MODEL

status=0
echo "==> ctest"
ctest --test-dir "$BUILD" --output-on-failure || status=1
echo "==> pytest"
# Two workers, each taking whole files (a module's fixtures are built once, in one worker).
# OpenMP threads that wait passively give the core back to the other worker at once: with
# the default (spinning) policy two llama.cpp processes on two cores slow each other 3-4x.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
workers="${LOCRET_TEST_WORKERS:-2}"
parallel=()
# whole files, in the order tests/py/conftest.py gives them (the longest first), not xdist's by number of tests
[[ "$workers" != 0 ]] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
read -r -a runner <<< "${LOCRET_PYTEST_RUNNER:-$VPY}"
# --durations: the 15 slowest tests are listed at the end, to keep CI's time in view; a test
# above 60 s carries a comment saying why it must be that long
"${runner[@]}" -m pytest tests/py -ra "${parallel[@]}" --durations=15 "$@" || status=1
exit $status
