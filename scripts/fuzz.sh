#!/usr/bin/env bash
# Coverage-guided fuzzing of the three readers that take files from users: the retaining-heads loader
# (lf-locret-heads), the Locret state reader (lf-locret-state) and the converter's GGUF header walk in Python
# (scripts/fuzz_gguf_header.py, atheris). The C++ targets are libFuzzer builds of libllama instrumented with
# AddressSanitizer and UndefinedBehaviorSanitizer (clang, build-fuzz/); leaks are findings too (LeakSanitizer).
#
#   bash scripts/fuzz.sh [--minutes M] [--targets heads,state,gguf-header] [--out DIR] [--jobs N]
#
# Each target runs M minutes (default 1) from its seeds (written by the target itself) plus its regression inputs
# (tests/fuzz-corpus/TARGET) and the corpus of earlier runs in OUT (default fuzz-out/, kept between runs, so a
# campaign can go on in parts). --jobs runs that many targets at once (default 1). A hang is an input that runs
# over 20 s; a slow unit (over 10 s) counts only if it is slow again when run alone after the campaign. Prints one
# markdown table (executions, coverage, corpus, findings per target); every finding is left in OUT/findings/TARGET:
# copy it into tests/fuzz-corpus/TARGET, where ctest (replay-locret-heads, replay-locret-state) and pytest
# (test_fuzz_regressions.py) replay it forever after. Exits 1 when a target found anything.
# Needs clang and libFuzzer (Debian: clang-14 libfuzzer-14-dev; installed here when run as root) and scripts/setup.sh.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MINUTES=1
TARGETS="heads,state,gguf-header"
OUT="$ROOT/fuzz-out"
JOBS=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --minutes) [[ $# -ge 2 && "$2" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "fuzz.sh: --minutes needs a number" >&2; exit 2; }
                   MINUTES="$2"; shift 2 ;;
        --targets) [[ $# -ge 2 && -n "$2" ]] || { echo "fuzz.sh: --targets needs a list (heads,state,gguf-header)" >&2; exit 2; }
                   TARGETS="$2"; shift 2 ;;
        --out) [[ $# -ge 2 && -n "$2" ]] || { echo "fuzz.sh: --out needs a folder" >&2; exit 2; }
               OUT="$(mkdir -p "$2" && cd "$2" && pwd)"; shift 2 ;;
        --jobs) [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: --jobs needs a positive number" >&2; exit 2; }
                JOBS="$2"; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "fuzz.sh: unknown option '$1'" >&2; exit 2 ;;
    esac
done
IFS=, read -r -a TARGET_LIST <<< "$TARGETS"
for t in "${TARGET_LIST[@]}"; do
    [[ "$t" == heads || "$t" == state || "$t" == gguf-header ]] || { echo "fuzz.sh: unknown target '$t' (heads, state, gguf-header)" >&2; exit 2; }
done
SECONDS_PER_TARGET=$(awk -v m="$MINUTES" 'BEGIN { s = int(m * 60); print (s < 1 ? 1 : s) }')
VPY="$ROOT/.venv/bin/python"
[[ -x "$VPY" && -d third_party/llama.cpp ]] || { echo "fuzz.sh: run 'bash scripts/setup.sh' first" >&2; exit 1; }

need_cxx=0
for t in "${TARGET_LIST[@]}"; do [[ "$t" == gguf-header ]] || need_cxx=1; done

# --- clang and libFuzzer, and the instrumented build -------------------------------------------------------------
if [[ $need_cxx == 1 ]]; then
    CLANG=""
    for v in "" -19 -16 -15 -14; do
        if command -v "clang++$v" >/dev/null 2>&1 && echo 'extern "C" int LLVMFuzzerTestOneInput(const char *, long) { return 0; }' \
                | "clang++$v" -x c++ -fsanitize=fuzzer -o /dev/null - >/dev/null 2>&1; then
            CLANG="$v"; break
        fi
    done
    if [[ -z "$CLANG" && $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "installing clang-14 and libfuzzer-14-dev"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-14 libfuzzer-14-dev >/dev/null && CLANG=-14
    fi
    [[ -n "$CLANG" ]] || { echo "fuzz.sh: no clang with libFuzzer (Debian: apt-get install clang-14 libfuzzer-14-dev)" >&2; exit 1; }
    BUILD="$ROOT/build-fuzz"
    # UBSan's `function` check is off: ggml-cpu calls its vec_dot kernels through one pointer type whatever their
    # argument types (upstream code, not a defect of the readers fuzzed here), and it reports that on the first decode
    FLAGS="-O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize=function -fno-sanitize-recover=undefined"
    export CCACHE_BASEDIR="$ROOT"
    if [[ "$(cat "$BUILD/.locret-fuzz-flags" 2>/dev/null)" != "clang$CLANG $FLAGS" ]]; then
        rm -rf "$BUILD"
        cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
            -DCMAKE_C_COMPILER="clang$CLANG" -DCMAKE_CXX_COMPILER="clang++$CLANG" \
            -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" \
            -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
            -DLOCRET_FUZZ=ON -DLOCRET_RPC=OFF -DLOCRET_CUDA=OFF -DGGML_NATIVE=ON >/dev/null || exit 1
        echo "clang$CLANG $FLAGS" > "$BUILD/.locret-fuzz-flags"
    fi
    echo "==> build (clang$CLANG, libFuzzer, ASan + UBSan): lf-locret-heads lf-locret-state"
    cmake --build "$BUILD" --target lf-locret-heads lf-locret-state -j "${LOCRET_JOBS:-$(nproc)}" | tail -1
    [[ ${PIPESTATUS[0]} -eq 0 ]] || exit 1
fi

LOCRET_TEST_MODEL="$("$VPY" -m locret models path)" || { echo "fuzz.sh: the default model is unavailable" >&2; exit 1; }
export LOCRET_TEST_MODEL LOCRET_TEST_HEADS="$ROOT/heads/smollm2-135m-instruct.gguf"
# leaks are findings; the sanitizers stop at the first report
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:halt_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"

# the targets write each input to a file in a scratch folder (in memory where /dev/shm is writable); removed at exit,
# whatever way a target ended
SCRATCH="$(mktemp -d "$( [[ -w /dev/shm ]] && echo /dev/shm || echo "${TMPDIR:-/tmp}")/locret-fuzz.XXXXXX")" || exit 1
trap 'rm -rf "$SCRATCH"' EXIT
export LOCRET_FUZZ_SCRATCH="$SCRATCH"

# libFuzzer keeps an input that took over SLOW_S seconds as a slow unit (a finding), and one over 20 s as a hang
SLOW_S=10

fuzzer() {  # target args...: the target's fuzzer (a campaign with libFuzzer's flags, or one input given as a file)
    local t="$1"; shift
    case "$t" in
        heads) "$BUILD/tests/cpp/lf-locret-heads" "$@" ;;
        state) "$BUILD/tests/cpp/lf-locret-state" "$@" ;;
        gguf-header) "$VPY" scripts/fuzz_gguf_header.py "$@" ;;
    esac
}

run_target() {  # name -> OUT/log/NAME.log; the corpus in OUT/corpus/NAME, findings in OUT/findings/NAME
    local t="$1" corpus="$OUT/corpus/$1" seeds="$OUT/seeds/$1" findings="$OUT/findings/$1" log="$OUT/log/$1.log"
    mkdir -p "$corpus" "$seeds" "$findings" "$OUT/log"
    local flags=(-max_total_time="$SECONDS_PER_TARGET" -timeout=20 -report_slow_units="$SLOW_S" -rss_limit_mb=4096
                 -print_final_stats=1 -artifact_prefix="$findings/" "$corpus" "$seeds" "$ROOT/tests/fuzz-corpus/$t")
    case "$t" in
        heads) LOCRET_FUZZ_SEED_DIR="$seeds" fuzzer heads -max_len=65536 "${flags[@]}" ;;
        state) LOCRET_FUZZ_SEED_DIR="$seeds" fuzzer state -max_len=4194304 "${flags[@]}" ;;
        gguf-header) fuzzer gguf-header --write-seeds "$seeds" >/dev/null &&
                     fuzzer gguf-header -max_len=65536 "${flags[@]}" ;;
    esac > "$log" 2>&1
}

echo "==> fuzzing ${TARGET_LIST[*]}, $SECONDS_PER_TARGET s each, $JOBS at once, into $OUT"
running=0
for t in "${TARGET_LIST[@]}"; do
    run_target "$t" &
    running=$((running + 1))
    if [[ $running -ge $JOBS ]]; then wait -n; running=$((running - 1)); fi
done
wait

# On a busy machine one input can stall past SLOW_S (14 s once, fuzzing beside two evaluations, for a heads file that
# runs in 0.8 s alone, the model's load included): each slow unit is run again after the campaign, alone, and stays a
# finding only if it is slow again or fails; otherwise it moves to OUT/slow-not-reproduced/TARGET, and the run says so.
for t in "${TARGET_LIST[@]}"; do
    for f in "$OUT/findings/$t"/slow-unit-*; do
        [[ -e "$f" ]] || continue
        t0=$(date +%s%N)
        fuzzer "$t" "$f" > "$OUT/log/$t.slow-recheck.log" 2>&1
        rc=$?
        ms=$(( ($(date +%s%N) - t0) / 1000000 ))
        if [[ $rc -eq 0 && $ms -lt $((SLOW_S * 1000)) ]]; then
            mkdir -p "$OUT/slow-not-reproduced/$t" && mv "$f" "$OUT/slow-not-reproduced/$t/"
            echo "fuzz.sh: $t: $(basename "$f") ran in $ms ms alone: slow only while the machine was busy, not a finding"
        else
            echo "fuzz.sh: $t: $(basename "$f") ran again in $ms ms (exit $rc): a finding" >&2
        fi
    done
done

status=0
echo
echo "| target | executions | exec/s | coverage (edges) | features | corpus (inputs) | findings |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for t in "${TARGET_LIST[@]}"; do
    log="$OUT/log/$t.log"
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | awk '{print $2}' | tail -1)
    rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | awk '{print $2}' | tail -1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | awk '{print $2}' | tail -1)
    ft=$(grep -o 'ft: [0-9]*' "$log" | awk '{print $2}' | tail -1)
    corpus=$(find "$OUT/corpus/$t" -type f | wc -l)
    found=$(find "$OUT/findings/$t" -type f | wc -l)
    if [[ -z "$execs" ]] || [[ $found -gt 0 ]] || grep -q 'ERROR: \(libFuzzer\|AddressSanitizer\|LeakSanitizer\)\|runtime error:' "$log"; then
        status=1
    fi
    echo "| $t | ${execs:-?} | ${rate:-?} | ${cov:-?} | ${ft:-?} | $corpus | $found |"
done
if [[ $status -ne 0 ]]; then
    echo
    echo "fuzz.sh: a target found something or did not run: see $OUT/log and $OUT/findings" >&2
    for t in "${TARGET_LIST[@]}"; do
        grep -m3 'ERROR\|runtime error\|Uncaught\|SUMMARY' "$OUT/log/$t.log" | sed "s/^/  $t: /" >&2
    done
fi
exit $status
