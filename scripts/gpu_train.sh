#!/usr/bin/env bash
# Train retaining heads on a lent GPU: several runs of convert/train_heads.py side by side on one card, each a
# recipe of its own, then their heads GGUFs and logs in one folder. A GPU session spends its minutes
# training; the heads are evaluated where the project's evaluations run (the CPU here: docs/results.md).
#
#   bash scripts/gpu_train.sh --pack        here, where setup.sh ran: write what travels and the GPU machine lacks
#                                           into two ignored folders, .gpu-train-1 (the first part of the default
#                                           model, gguf-py) and .gpu-train-2 (the rest of the model, its sha256, the
#                                           shipped Locret-Q heads to start from). The model (98 MB) is larger than
#                                           what one call of the device tool carries beside the tree, so it travels
#                                           in two calls to the same warm machine: carry .gpu-train-1 first (any
#                                           short command), then .gpu-train-2 with the run.
#   bash scripts/gpu_train.sh [--minutes M] [--out DIR] [--runs a,b,c] [--device cuda] [--extra "ARGS"]
#                                           there: join and check the model, then train the runs below in parallel,
#                                           each stopped (checkpointed, resumable) after M minutes at most
#                                           (default 7); DIR (default build-gpu-train/) gets <run>.gguf,
#                                           <run>.train-log.json for each run, and train.log.
#                                           --extra appends trainer arguments to every run (the last of an option
#                                           wins: a smoke test here is --device cpu --extra "--steps 2 --warmup-steps
#                                           1 --min-tokens 256 --max-tokens 640").
#
# The runs (RUNS below): Locret-Q heads fine-tuned from the shipped ones, every layer (the CPU fine-tune of 2026-12-03
# froze layers 0-5 and changed what is kept, not what is found: heads/README.md), on 2-8K tokens of a broad mix (q-broad)
# and on 4-12K tokens of real source text with the model's own answers as teacher (q-real), and plain heads from a
# random init, as the paper trains them, on the broad mix at 0.5-4K tokens (plain-scratch). Their steps are sized
# so that an H200 finishes them inside the minutes (data generation on the host, ~0.3-0.6 s an example, is the
# bound); a run cut by --minutes writes its partly trained heads, and continues from its checkpoint when the same
# command runs again on the same machine, or from its GGUF (--init-heads) anywhere.
#
# Environment: PYTHON (default python3; needs torch, transformers, tokenizers, safetensors, numpy, matplotlib,
# tqdm: the GPU machine's image has them), LOCRET_GPU_TRAIN_PARTS (the two folders' common prefix, default
# .gpu-train: .gpu-train-1 and .gpu-train-2), LOCRET_GPU_TRAIN_WORK (run folders, default build-gpu-train/work).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

MINUTES=7
OUT_DIR=""
ONLY=""
EXTRA=""
DEVICE=cuda
PACK=0
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --pack) PACK=1 ;;
        --minutes) MINUTES="${2:?--minutes needs a number}"; shift ;;
        --out) OUT_DIR="${2:?--out needs a folder}"; shift ;;
        --runs) ONLY="${2:?--runs needs run names}"; shift ;;
        --extra) EXTRA="${2?--extra needs trainer arguments}"; shift ;;
        --device) DEVICE="${2:?--device needs cuda, cuda:N or cpu}"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_train: error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
log() { echo "gpu_train: $*" >&2; }
fail() { echo "gpu_train: error: $*" >&2; exit 1; }

# the two folders that travel: ignored by git, inside the tree (the device tool carries only what is in it)
PART1="${LOCRET_GPU_TRAIN_PARTS:-.gpu-train}-1"
PART2="${LOCRET_GPU_TRAIN_PARTS:-.gpu-train}-2"
INIT_Q=heads/smollm2-135m-instruct.query.gguf
SPLIT_AT=56200000   # bytes of the model in the first call: the rest rides with the Locret-Q heads in the second

if [ "$PACK" = 1 ]; then
    [ -x .venv/bin/python ] && [ -d third_party/llama.cpp/gguf-py ] || fail "run bash scripts/setup.sh first"
    model="$(.venv/bin/locret models path smollm2-135m)"
    rm -rf "$PART1" "$PART2"
    mkdir -p "$PART1" "$PART2"
    head -c "$SPLIT_AT" "$model" > "$PART1/model.part"
    tail -c +"$((SPLIT_AT + 1))" "$model" > "$PART2/model.part"
    sha256sum < "$model" | cut -d' ' -f1 > "$PART2/model.sha256"
    cp -r third_party/llama.cpp/gguf-py "$PART1/gguf-py"
    find "$PART1" -name __pycache__ -prune -exec rm -rf {} +
    cp "$INIT_Q" "$PART2/init.query.gguf"
    log "wrote $PART1 ($(du -sh "$PART1" | cut -f1)) and $PART2 ($(du -sh "$PART2" | cut -f1)): carry $PART1 in one" \
        "call and $PART2 in the next, to the same warm machine"
    # what each call carries: the tree that travels (tracked and not ignored) without the heads GGUFs, and one part;
    # the device tool takes 64 MiB a call
    tree=0
    if git rev-parse --git-dir > /dev/null 2>&1; then
        tree="$(git ls-files -co --exclude-standard -z | grep -zv '^heads/.*\.gguf$' | xargs -0 -r du -cb 2>/dev/null \
                | awk 'END { print $1 }')"
    fi
    for part in "$PART1" "$PART2"; do
        bytes=$(( tree + $(du -sb "$part" | cut -f1) ))
        log "a call carrying $part: $(( bytes / 1048576 )) MiB with the tree (the device tool takes 64)"
        [ "$bytes" -le $(( 64 * 1048576 )) ] || fail "a call carrying $part would be over 64 MiB: move SPLIT_AT" \
            "or take more out of the tree for the calls"
    done
    log "for both calls take the heads GGUFs out of what travels: git rm -q --cached heads/*.gguf and" \
        "/heads/*.gguf in .git/info/exclude; afterwards git reset -q -- heads/ and that line out again"
    exit 0
fi

PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT_DIR:-build-gpu-train}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
WORK="${LOCRET_GPU_TRAIN_WORK:-$ROOT/build-gpu-train/work}"
mkdir -p "$WORK"
MODEL="$WORK/SmolLM2-135M-Instruct.Q4_1.gguf"

# the model: joined from the two parts, checked against the sha256 packed with them
[ -f "$PART1/model.part" ] || fail "$PART1/model.part is missing: carry $PART1 in a call to this machine first" \
    "(the machine went back between the calls if it was carried: start again with both)"
[ -f "$PART2/model.part" ] || fail "$PART2/model.part is missing: carry $PART2 with this command"
cat "$PART1/model.part" "$PART2/model.part" > "$MODEL"
[ "$(sha256sum < "$MODEL" | cut -d' ' -f1)" = "$(cat "$PART2/model.sha256")" ] \
    || fail "the joined model's sha256 differs from the one packed with it (a part from another --pack?)"

export PYTHONPATH="$ROOT/py:$ROOT/$PART1/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
export LOCRET_CACHE_DIR="${LOCRET_CACHE_DIR:-$WORK/cache}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# name | arguments of convert/train_heads.py beyond the model, output, run folder and device
COMMON="--checkpoint-every 25 --budget 2048 --chunk 512 --stabilizers 128 --local 100"
BROAD_TASKS="lookup,lookup,combine,tracking,passkey,quote,fact,fact,docstring,explain,summarize"
BROAD_TEXT="pydoc,prose,code,legal,logs,pypackages,pypackages"
RUNS=(
    "q-broad|--init-heads $PART2/init.query.gguf --query-tokens 64 --rank-weight 1
        --tasks $BROAD_TASKS --contexts $BROAD_TEXT --steps 360 --lr 5e-4 --warmup-steps 10
        --min-tokens 2048 --max-tokens 8192 --seed 21"
    "q-real|--init-heads $PART2/init.query.gguf --query-tokens 64 --rank-weight 1
        --tasks fact,fact,docstring,explain,summarize,lookup --contexts pypackages --steps 160 --lr 5e-4
        --warmup-steps 10 --min-tokens 4096 --max-tokens 12288 --seed 22"
    "plain-scratch|--d-r 256 --tasks $BROAD_TASKS --contexts $BROAD_TEXT --steps 700 --lr 1e-3 --warmup-steps 30
        --min-tokens 512 --max-tokens 4096 --seed 23"
)

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >&2 || true
START=$(date +%s)
pids=()
names=()
for run in "${RUNS[@]}"; do
    name="${run%%|*}"
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
    read -r -a args <<< "$(echo "${run#*|} $EXTRA" | tr '\n' ' ')"
    log "starting $name"
    "$PYTHON" convert/train_heads.py --base "$MODEL" -o "$WORK/$name.gguf" --run-dir "$WORK/$name.run" \
        --device "$DEVICE" --max-minutes "$MINUTES" $COMMON "${args[@]}" > "$WORK/$name.log" 2>&1 &
    pids+=("$!")
    names+=("$name")
done
[ "${#names[@]}" -gt 0 ] || fail "--runs $ONLY names none of the runs"

failed=0
for i in "${!pids[@]}"; do
    name="${names[$i]}"
    if wait "${pids[$i]}"; then
        log "$name done ($(( $(date +%s) - START )) s)"
    else
        log "$name FAILED ($(( $(date +%s) - START )) s):"
        tail -20 "$WORK/$name.log" >&2
        failed=1
    fi
    # the tqdm bar's last state and the trainer's last lines, then what comes back
    tr '\r' '\n' < "$WORK/$name.log" | grep -v '^\s*$' | tail -4 | sed "s/^/  $name: /" >&2
    # no plot: the device tool brings back 8 files, and the log draws it again (locret.train.trainer.plot_loss)
    for f in "$name.gguf:$name.gguf" "$name.run/train-log.json:$name.train-log.json"; do
        [ -f "$WORK/${f%%:*}" ] && cp "$WORK/${f%%:*}" "$OUT_DIR/${f#*:}"
    done
    { echo "== $name"; tr '\r' '\n' < "$WORK/$name.log" | grep -v '^\s*$' | tail -40; } >> "$OUT_DIR/train.log"
done
log "all runs in $(( $(date +%s) - START )) s; results in $OUT_DIR"
exit "$failed"
