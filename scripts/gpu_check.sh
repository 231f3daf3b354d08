#!/usr/bin/env bash
# The GPU check: on a fresh CUDA machine holding this tree, build what the measurements need (one CUDA architecture,
# no ccache), then run the eviction benchmarks and the correctness checks that differ by backend, and print one
# markdown report. A GPU session spends its time measuring, not setting up.
#
#   bash scripts/gpu_check.sh --pack            here, where setup.sh made third_party/llama.cpp: write the patched
#                                               tree (no .git, no docs or models: ~4 MB) to .gpu/llama.cpp.tar.xz and
#                                               llama-cpp-python's Python package to .gpu/site, so that they travel
#                                               with the working tree (.gpu/ is ignored by git)
#   bash scripts/gpu_check.sh [--arch 90] [--out DIR] [--stage all|build|check|bench]
#                                               there: unpack the tree if missing, build llama-bench (and
#                                               libllama) in build-gpu/, then
#     check: scripts/backend_check.py: selection on the device against the host (the same kept units and logits),
#            the compaction stacked over the layers against the per-layer one on the device (the same again),
#            and F16 / q8_0 / F32 V caches with and without flash attention against the CPU backend (kept units and
#            logits), with positions inplace, keep and compact where it matters;
#     bench: scripts/bench_eviction.py on the SmolLM2-135M shape (Q4_1, the shipped heads: b 2048, ub 512, prefill
#            8K/32K/128K, decode after 128K) and the Llama-3.1-8B shape (Q4_0, d_R 1024 random heads: b 16384,
#            ub 1024, prefill 128K against plain 16K, plain 128K and plain at the same attention depth), with
#            --positions inplace,compact,keep (SmolLM2) and inplace,compact (8B) side by side; for SmolLM2 also the compaction graph's nodes and the host's
#            time to launch them per compaction (--profile-compaction: two more 32K prefills per layout, the
#            compaction stacked over the layers and built layer by layer); for both shapes a generated token's time
#            split into plain llama.cpp's, the heads' graph's and the eviction's (--decode-split: two more decode
#            figures, the heads' graph in a cache that never evicts, stacked over the layers and layer by layer); and
#            for SmolLM2 what a process's first prompt pays once: pp8192 cold and warm for plain llama.cpp, the heads'
#            graph without eviction, and Locret.
#   The stages run in that order; each is idempotent (build skips what is built, the shape models are cached), so a
#   machine that gives 10 minutes a command runs `--stage build,check` then `--stage bench` (on an H200: build 186 s,
#   check 30 s, bench 120 s). The stand-ins' scores are nearly flat, so rounding between backends reorders near-ties:
#   the check reports the share of kept units GPU and CPU agree on, and judges the logits (--min-kept-share 0).
#
# Models: random-weight stand-ins with the exact shapes (py/locret/shapes.py; speed does not depend on weight
# values), made on the machine: the real files do not travel. The report goes to stdout and DIR/gpu-check.md
# (default: build-gpu/); the raw logs to DIR too.
#
# Environment: PYTHON (default python3; needs numpy, torch, safetensors, pyyaml), LOCRET_JOBS (default nproc),
# LOCRET_GPU_CHECK_BUILD (the build folder, default build-gpu; naming an existing CPU build with --stage check runs the
# checks here as a dry run).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ARCH=90
OUT_DIR=""
STAGES="all"
PACK=0
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --pack) PACK=1 ;;
        --arch) ARCH="${2:?--arch needs a CUDA architecture, e.g. 90}"; shift ;;
        --out) OUT_DIR="${2:?--out needs a folder}"; shift ;;
        --stage) STAGES="${2:?--stage needs all, build, check or bench}"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check: error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case ",$STAGES," in
    ,all,) STAGES="build,check,bench" ;;
esac
for s in ${STAGES//,/ }; do
    case "$s" in
        build|check|bench) ;;
        *) echo "gpu_check: error: unknown stage $s (build, check, bench)" >&2; exit 2 ;;
    esac
done
want() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
log() { echo "gpu_check: $*" >&2; }

TREE=third_party/llama.cpp
PACKED=.gpu/llama.cpp.tar.xz

if [ "$PACK" = 1 ]; then
    [ -f "$TREE/CMakeLists.txt" ] || { echo "gpu_check: error: no $TREE: run bash scripts/setup.sh first" >&2; exit 1; }
    mkdir -p .gpu
    # what a CUDA build of the tools reads: no history, documentation, model vocabularies, web UI, tests or other
    # GPU backends
    tar -C third_party -cJf "$PACKED.partial" --exclude=.git --exclude=llama.cpp/docs --exclude=llama.cpp/models \
        --exclude=llama.cpp/media --exclude=llama.cpp/benches --exclude=llama.cpp/tests --exclude=llama.cpp/examples \
        --exclude=llama.cpp/.github --exclude=llama.cpp/.devops --exclude=llama.cpp/conversion \
        --exclude=llama.cpp/tools/ui/src --exclude=llama.cpp/tools/ui/tests --exclude=llama.cpp/tools/server/tests \
        $(for b in vulkan sycl metal opencl cann musa hip hexagon openvino virtgpu webgpu zdnn zendnn et; do
            echo "--exclude=llama.cpp/ggml/src/ggml-$b"; done) \
        llama.cpp llama.cpp.json
    mv "$PACKED.partial" "$PACKED"
    # llama-cpp-python's Python package (and its one pure-Python need) for backend_check.py: the GPU machine has none
    SITE="$(.venv/bin/python -c 'import os, llama_cpp; print(os.path.dirname(llama_cpp.__path__[0]))')"
    rm -rf .gpu/site && mkdir -p .gpu/site
    cp -r "$SITE/llama_cpp" "$SITE/diskcache" .gpu/site/
    find .gpu/site -name __pycache__ -prune -exec rm -rf {} +
    log "wrote $PACKED ($(du -h "$PACKED" | cut -f1)); carry .gpu to the GPU machine and run scripts/gpu_check.sh there"
    exit 0
fi

PYTHON="${PYTHON:-python3}"
JOBS="${LOCRET_JOBS:-$(nproc)}"
BUILD="${LOCRET_GPU_CHECK_BUILD:-build-gpu}"   # another build folder (a CPU build: a dry run of the stages here)
OUT_DIR="${OUT_DIR:-$BUILD}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
REPORT="$OUT_DIR/gpu-check.md"
export LOCRET_BUILD_DIR="$ROOT/$BUILD"
export PYTHONPATH="$ROOT/py:$ROOT/$TREE/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .gpu/site ]; then PYTHONPATH="$PYTHONPATH:$ROOT/.gpu/site"; fi  # llama-cpp-python, from --pack
export LOCRET_CACHE_DIR="${LOCRET_CACHE_DIR:-$ROOT/$BUILD/cache}"
START=$(date +%s)
elapsed() { echo "$(( $(date +%s) - START )) s"; }

if [ ! -f "$TREE/CMakeLists.txt" ]; then
    if [ ! -f "$PACKED" ]; then
        echo "gpu_check: error: no $TREE and no $PACKED (run --pack where setup.sh ran)" >&2
        exit 1
    fi
    log "unpacking $PACKED"
    mkdir -p third_party
    tar -C third_party -xJf "$PACKED"
fi

# The shape models are written by Python on one core while the build uses the others.
shape_models() {  # name weight_type -> "model heads" in $OUT_DIR/shape-<name>.paths
    "$PYTHON" scripts/make_shape_models.py --shape "$1" --weight-type "$2" > "$OUT_DIR/shape-$1.paths" \
        2> "$OUT_DIR/shape-$1.log"
}
need_shapes() { want check || want bench; }
if need_shapes; then
    log "making the shape models in the background"
    # both, whatever the stages: a `--stage build,check` call leaves the 8B model ready for the next one
    ( shape_models smollm2-135m q4_1 && shape_models llama3.1-8b q4_0 ) &
    SHAPES_PID=$!
fi

if want build || [ ! -x "$BUILD/bin/llama-bench" ]; then
    log "configuring and building for sm_$ARCH with $JOBS jobs ($(elapsed))"
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOCRET_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
        -DLOCRET_TESTS=OFF > "$OUT_DIR/configure.log" 2>&1 || { tail -30 "$OUT_DIR/configure.log" >&2; exit 1; }
    cmake --build "$BUILD" -j "$JOBS" --target llama-bench > "$OUT_DIR/build.log" 2>&1 \
        || { grep -m 20 -B2 -A8 "error" "$OUT_DIR/build.log" >&2; exit 1; }
    log "built ($(elapsed))"
fi

if need_shapes; then
    if ! wait "$SHAPES_PID"; then
        cat "$OUT_DIR"/shape-*.log >&2
        echo "gpu_check: error: the shape models failed" >&2
        exit 1
    fi
    read -r SMOL_MODEL < "$OUT_DIR/shape-smollm2-135m.paths"
    if want bench; then { read -r BIG_MODEL; read -r BIG_HEADS; } < "$OUT_DIR/shape-llama3.1-8b.paths"; fi
    SMOL_HEADS=heads/smollm2-135m-instruct.gguf   # the shipped heads fit the shape (and travel: tracked)
    log "shape models ready ($(elapsed))"
fi

{
    echo "# GPU check"
    echo
    gpu="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'no GPU')"
    rev="$(git rev-parse --short HEAD 2>/dev/null || echo 'tree without git')"
    echo "$gpu, sm_$ARCH build, $rev, $(date -u +%Y-%m-%dT%H:%MZ)"
} > "$REPORT"

if want check; then
    log "correctness checks ($(elapsed))"
    {
        echo
        echo "## Eviction on the GPU against the CPU (scripts/backend_check.py: SmolLM2-135M shape, shipped heads)"
        echo
        "$PYTHON" scripts/backend_check.py --model "$SMOL_MODEL" --heads "$SMOL_HEADS" --gpu-layers 99 \
            --tokens 6000 --budget 1024 --ubatch 512 --min-kept-share 0 2> "$OUT_DIR/backend-check.log" \
            || echo "(a check FAILED)"
    } >> "$REPORT"
    log "checks done ($(elapsed))"
fi

if want bench; then
    log "benchmarks: SmolLM2-135M shape ($(elapsed))"
    {
        echo
        echo "## SmolLM2-135M shape (Q4_1, shipped heads), b 2048, ub 512, all layers on the GPU"
        echo
        "$PYTHON" scripts/bench_eviction.py --model "$SMOL_MODEL" --heads "$SMOL_HEADS" --gpu-layers -1 \
            --budget 2048 --ubatch 512 --lengths 8192,32768,131072 --plain-lengths 8192,32768 --decode-depth 131072 \
            --positions inplace,compact,keep --profile-compaction --decode-split --save-stderr "$OUT_DIR/runs-smollm2" \
            2> "$OUT_DIR/bench-smollm2.log" \
            || echo "(bench_eviction exit $?: a target missed)"
    } >> "$REPORT"
    log "benchmarks: first use ($(elapsed))"
    {
        echo
        echo "## First use: SmolLM2-135M shape prefill 8192 cold (one run, no warm-up) and warm (llama-bench's warm-up, 3 runs)"
        echo
        echo "What a process's first prompt pays once: plain llama.cpp, the heads' graph in a cache that never evicts"
        echo "(b 8192), and Locret b 2048 (the heads' graph and the first evictions' graphs)."
        echo
        echo "| run | cold tok/s | warm tok/s | cold / warm |"
        echo "|---|---:|---:|---:|"
        for cfg in "plain|" "heads' graph, no eviction (b 8192)|--locret-heads $SMOL_HEADS --locret-budget 8192" \
                   "Locret b 2048|--locret-heads $SMOL_HEADS --locret-budget 2048"; do
            name="${cfg%%|*}"
            read -r -a extra <<< "${cfg#*|}"
            tps() {  # llama-bench's tok/s of pp8192 with the given arguments
                "$BUILD/bin/llama-bench" -m "$SMOL_MODEL" -p 8192 -n 0 -ngl 99 -ub 512 -b 512 -o csv "$@" "${extra[@]}" \
                    2>> "$OUT_DIR/first-use.log" | awk -F, 'END { gsub(/"/, "", $(NF-1)); printf "%.0f\n", $(NF-1) }'
            }
            cold="$(tps -r 1 --no-warmup)"
            warm="$(tps -r 3)"
            echo "| $name | $cold | $warm | $(awk -v c="$cold" -v w="$warm" 'BEGIN { if (w > 0) printf "%.3f", c / w; else print "-" }') |"
        done
    } >> "$REPORT"
    log "benchmarks: Llama-3.1-8B shape ($(elapsed))"
    {
        echo
        echo "## Llama-3.1-8B shape (Q4_0, random heads d_R 1024), b 16384, ub 1024, all layers on the GPU"
        echo
        "$PYTHON" scripts/bench_eviction.py --model "$BIG_MODEL" --heads "$BIG_HEADS" --gpu-layers -1 \
            --budget 16384 --ubatch 1024 --lengths 131072 --plain-lengths 16384,131072 --plain-reference 16384 \
            --decode-depth 32768 --positions inplace,compact --decode-split --save-stderr "$OUT_DIR/runs-8b" \
            2> "$OUT_DIR/bench-8b.log" \
            || echo "(bench_eviction exit $?: a target missed)"
    } >> "$REPORT"
    log "benchmarks done ($(elapsed))"
fi

echo >> "$REPORT"
echo "gpu_check: $STAGES in $(elapsed)" >> "$REPORT"
cat "$REPORT"
