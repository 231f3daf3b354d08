#!/usr/bin/env bash
# The one test command: C++ tests (ctest) and Python tests (pytest) against the build that
# scripts/setup.sh made. Exits non-zero if anything fails. Extra arguments go to pytest.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VPY="$ROOT/.venv/bin/python"
if [[ ! -x "$VPY" || ! -f build/CMakeCache.txt ]]; then
    echo "test.sh: no set-up found: run 'bash scripts/setup.sh' first" >&2
    exit 1
fi

# the default model, resolved (and verified) once for the C++ and Python tests
LOCRET_TEST_MODEL="$("$VPY" -m locret models path)" || { echo "test.sh: default model unavailable" >&2; exit 1; }
export LOCRET_TEST_MODEL

status=0
echo "==> ctest"
ctest --test-dir build --output-on-failure || status=1
echo "==> pytest"
# --durations: the slowest tests are listed at the end, to keep CI's time in view
"$VPY" -m pytest tests/py -ra --durations=25 --durations-min=20 "$@" || status=1
exit $status
