#!/usr/bin/env bash
# The one test command: C++ tests (ctest) and Python tests (pytest) against the build that
# scripts/setup.sh made. Exits non-zero if anything fails. Extra arguments go to pytest.
#
#   bash scripts/test.sh          the CI lane: ctest and every pytest test but the long lane
#   bash scripts/test.sh --fast   the fast lane (a few minutes): ctest and the quick pytest files; run it first
#   bash scripts/test.sh --long   the long lane only: end-to-end runs of the evaluation and benchmark scripts
#   bash scripts/test.sh --all    everything
#   (tests/py/lanes.py says which test is in which lane, and why)
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

# every test checks a sequence's cells after each change (locret-cells.h's invariants; release builds check only when
# asked): a broken invariant aborts the run that broke it, where it broke
export LOCRET_CHECK_CELLS="${LOCRET_CHECK_CELLS:-1}"

lane=ci
case "${1:-}" in
    --fast|--long|--all) lane="${1#--}"; shift ;;
esac
case "$lane" in
    fast) select=(-m fast) ;;
    long) select=(-m long) ;;
    all) select=() ;;
    *) select=(-m "not long") ;;
esac

status=0
if [[ "$lane" != long ]]; then
    echo "==> ctest"
    ctest --test-dir "$BUILD" --output-on-failure || status=1
fi
echo "==> pytest ($lane lane)"
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
# every run leaves its junit report in the build folder (each test's seconds; a --junitxml given here wins), so the
# time of any run, CI's included, can be read per file afterwards: python tests/py/lanes.py BUILD/pytest-LANE.xml
"${runner[@]}" -m pytest tests/py -ra "${parallel[@]}" ${select[@]+"${select[@]}"} --durations=15 \
    --junitxml="$BUILD/pytest-$lane.xml" "$@" || status=1
if [[ "$lane" == ci ]]; then
    # said at the end, so a green run is not read as the long lane passing
    echo "test.sh: the long lane did not run (bash scripts/test.sh --long; tests/py/lanes.py)"
fi
exit $status
