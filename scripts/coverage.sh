#!/usr/bin/env bash
# Line coverage of the whole test suite: the Python package (coverage.py, subprocesses included) and our C++ sources
# (ggml_ext/src, gcov through gcovr). Runs ctest and pytest exactly as scripts/test.sh does, against the instrumented
# build that `bash scripts/setup.sh --coverage` makes in build-coverage/ (only our sources are instrumented, so the
# model runs at its usual speed). Prints both figures and writes the reports to coverage/.
#
#   bash scripts/setup.sh --coverage && bash scripts/coverage.sh     everything
#   bash scripts/coverage.sh -k eviction                              extra arguments go to pytest
#
# Exits non-zero if a test fails (the figures are printed anyway).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${LOCRET_COVERAGE_BUILD:-$ROOT/build-coverage}"
VPY="$ROOT/.venv/bin/python"
if [[ ! -x "$VPY" || ! -f "$BUILD/CMakeCache.txt" ]] || ! grep -q '^LOCRET_COVERAGE:.*=ON$' "$BUILD/CMakeCache.txt"; then
    echo "coverage.sh: no coverage build in $BUILD: run 'bash scripts/setup.sh --coverage' first" >&2
    exit 1
fi
"$VPY" -c 'import coverage, gcovr' 2>/dev/null || { echo "coverage.sh: coverage/gcovr missing in .venv: run 'bash scripts/setup.sh'" >&2; exit 1; }

OUT="$ROOT/coverage"
rm -rf "$OUT"
mkdir -p "$OUT"
find "$BUILD" -name '*.gcda' -delete   # counts from an earlier run would add up

export LOCRET_BUILD_DIR="$BUILD"
# coverage.py: the package, in this process and in every Python subprocess the tests start (`python -m locret ...`)
RC="$OUT/coveragerc"
cat > "$RC" <<EOF
[run]
source = $ROOT/py/locret
patch = subprocess
parallel = true
data_file = $OUT/.coverage
EOF

# the tests exactly as scripts/test.sh runs them (ctest, then pytest on its workers), against the instrumented build
status=0
LOCRET_PYTEST_RUNNER="$VPY -m coverage run --rcfile=$RC" bash "$ROOT/scripts/test.sh" --all -p no:cacheprovider "$@" || status=1

"$VPY" -m coverage combine --rcfile="$RC" -q
"$VPY" -m coverage report --rcfile="$RC" > "$OUT/python.txt"
"$VPY" -m gcovr --root "$ROOT" --filter "$ROOT/ggml_ext/src" --object-directory "$BUILD" --txt "$OUT/cpp.txt" "$BUILD"
echo "==> line coverage (reports in coverage/)"
echo "Python (py/locret):    $(tail -1 "$OUT/python.txt" | awk '{print $NF}')"
echo "C++ (ggml_ext/src):    $(grep -E '^TOTAL' "$OUT/cpp.txt" | awk '{print $NF}')"
exit $status
