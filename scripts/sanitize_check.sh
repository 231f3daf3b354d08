#!/usr/bin/env bash
# The C++ tests and the Python tests of eviction, heads and the policies against the AddressSanitizer +
# UndefinedBehaviorSanitizer build that `bash scripts/setup.sh --sanitize` makes (build-sanitize/). Any report
# stops the process that made it, so the test fails. Exits non-zero if anything fails.
#
#   bash scripts/sanitize_check.sh            the C++ tests and the Python eviction/heads/policy tests
#   bash scripts/sanitize_check.sh --quick    the C++ tests and test_lagkv.py / test_transactions.py only
#   bash scripts/sanitize_check.sh --only tests/py/test_a.py,tests/py/test_b.py    the C++ tests and these files
#   extra arguments after -- go to pytest
#
# Python itself is not instrumented: the sanitizer runtimes are preloaded so that the instrumented libllama can load
# into it, and leak checking is off (the interpreter keeps allocations until exit by design). The tools the tests
# start are instrumented executables and check their own leaks.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${LOCRET_SANITIZE_BUILD:-$ROOT/build-sanitize}"
VPY="$ROOT/.venv/bin/python"
if [[ ! -x "$VPY" || ! -f "$BUILD/CMakeCache.txt" ]] || ! grep -q '^LLAMA_SANITIZE_ADDRESS:BOOL=ON$' "$BUILD/CMakeCache.txt"; then
    echo "sanitize_check.sh: no sanitizer build in $BUILD: run 'bash scripts/setup.sh --sanitize' first" >&2
    exit 1
fi

TESTS=(tests/py/test_eviction.py tests/py/test_lagkv.py tests/py/test_policies.py tests/py/test_transactions.py
       tests/py/test_sequences.py tests/py/test_state_files.py tests/py/test_heads_runtime.py tests/py/test_cis_parity.py
       tests/py/test_locret_q.py tests/py/test_iswa.py tests/py/test_sage.py tests/py/test_schedule.py)
PYTEST_ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) TESTS=(tests/py/test_lagkv.py tests/py/test_transactions.py); shift ;;
        --only) [[ $# -ge 2 && -n "$2" ]] || { echo "sanitize_check.sh: --only needs a comma-separated list of test files" >&2; exit 2; }
                IFS=, read -r -a TESTS <<< "$2"; shift 2 ;;
        --) shift; PYTEST_ARGS=("$@"); break ;;
        *) echo "sanitize_check.sh: unknown option '$1'" >&2; exit 2 ;;
    esac
done

export LOCRET_BUILD_DIR="$BUILD"
LOCRET_TEST_MODEL="$("$VPY" -m locret models path)" || { echo "sanitize_check.sh: default model unavailable" >&2; exit 1; }
export LOCRET_TEST_MODEL
# halt at the first report, with the stack; UBSan's reports are errors too
export ASAN_OPTIONS="abort_on_error=1:halt_on_error=1:detect_stack_use_after_return=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"

status=0
echo "==> ctest (instrumented)"
ctest --test-dir "$BUILD" --output-on-failure || status=1
echo "==> pytest (instrumented libllama and tools)"
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=0" \
    "$VPY" -m pytest -p no:cacheprovider -ra "${TESTS[@]}" ${PYTEST_ARGS[@]+"${PYTEST_ARGS[@]}"} || status=1
exit $status
