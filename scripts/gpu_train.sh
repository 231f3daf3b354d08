#!/usr/bin/env bash
# Train retaining heads on a lent GPU: several runs of convert/train_heads.py side by side on one card, each a
# recipe of its own, then their heads GGUFs and logs in one folder. A GPU session spends its minutes
# training; the heads are evaluated where the project's evaluations run (the CPU here: docs/results.md).
#
#   bash scripts/gpu_train.sh --pack [--model NAME]
#                                           here, where setup.sh ran: write what the GPU machine lacks (the model
#                                           NAME, default smollm2-135m, or gemma3-270m; gguf-py; the shipped heads
#                                           its recipes start from) as one archive cut into ignored folders
#                                           .gpu-train-1, .gpu-train-2, ..., each small enough for one call of the
#                                           device tool beside the tree (64 MiB a call): SmolLM2 takes 2, Gemma-3 5.
#                                           Carry them one a call to the same warm machine (any short command),
#                                           the last with the run.
#   bash scripts/gpu_train.sh [--minutes M] [--out DIR] [--runs a,b,c] [--device cuda] [--extra "ARGS"]
#                                           there: join and check the pack, then train the packed model's runs
#                                           below in parallel, each stopped (checkpointed, resumable) after M
#                                           minutes at most (default 7); DIR (default build-gpu-train/) gets
#                                           <run>.gguf, <run>.train-log.json for each run, and train.log.
#                                           --extra appends trainer arguments to every run (the last of an option
#                                           wins: a smoke test here is --device cpu --extra "--steps 2 --warmup-steps
#                                           1 --min-tokens 256 --max-tokens 640").
#
# SmolLM2's runs (RUNS below): Locret-Q heads fine-tuned from the shipped ones, every layer (the CPU fine-tune of
# 2026-12-03 froze layers 0-5 and changed what is kept, not what is found: heads/README.md), on 2-8K tokens of a broad
# mix (q-broad) and on 4-12K tokens of real source text with the model's own answers as teacher (q-real), and plain
# heads from a random init, as the paper trains them, on the broad mix at 0.5-4K tokens (plain-scratch).
# Gemma-3-270M's: its plain heads (the default for it) fine-tuned on the three full-attention layers whose heads
# evict (5, 11, 17; the window layers' heads are never used), longer than the CPU could: a broad mix with real source
# at 4-16K tokens (g-long), and real source with the model's own answers as teacher at 8-24K (g-real); the CPU's
# 2-4K fine-tune held no more of a real-text needle (heads/README.md#gemma-on-real-text-...). Their steps are sized
# so that an H200 finishes them inside the minutes (data generation on the host, ~0.3-0.6 s an example, is the
# bound); a run cut by --minutes writes its partly trained heads, and continues from its checkpoint when the same
# command runs again on the same machine, or from its GGUF (--init-heads) anywhere. No recipe reads held-out text
# (the evaluation's held-out families, RULER's data, the installed Debian documentation).
#
# Environment: PYTHON (default python3; needs torch, transformers, tokenizers, safetensors, numpy, matplotlib,
# tqdm: the GPU machine's image has them), LOCRET_GPU_TRAIN_PARTS (the folders' common prefix, default .gpu-train:
# .gpu-train-1, .gpu-train-2, ...), LOCRET_GPU_TRAIN_WORK (run folders, default build-gpu-train/work).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

MINUTES=7
OUT_DIR=""
ONLY=""
EXTRA=""
DEVICE=cuda
PACK=0
MODEL_NAME=""
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --pack) PACK=1 ;;
        --model) MODEL_NAME="${2:?--model needs a model name}"; shift ;;
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

# which of the model's shipped heads its recipes start from (packed as init.gguf): the Locret-Q ones or the plain ones
init_kind_of() {
    case "$1" in
        smollm2-135m) echo query ;;
        gemma3-270m) echo plain ;;
        *) fail "--model $1 has no recipes here (smollm2-135m, gemma3-270m)" ;;
    esac
}

# the folders that travel: ignored by git, inside the tree (the device tool carries only what is in it)
PREFIX="${LOCRET_GPU_TRAIN_PARTS:-.gpu-train}"
CALL_BYTES=$(( 64 * 1048576 ))   # what one call of the device tool carries: the tree and one part
MARGIN_BYTES=$(( 1048576 ))      # beside them: the part's info line, and files the tree gains before the calls

if [ "$PACK" = 1 ]; then
    [ -x .venv/bin/python ] && [ -d third_party/llama.cpp/gguf-py ] || fail "run bash scripts/setup.sh first"
    MODEL_NAME="${MODEL_NAME:-smollm2-135m}"
    kind="$(init_kind_of "$MODEL_NAME")"
    model="$(.venv/bin/locret models path "$MODEL_NAME")" || fail "the model $MODEL_NAME is not installed"
    # the heads file by the library's own rule (locret.models.shipped_heads)
    init="$(.venv/bin/python -c 'import sys; from locret import models
p = models.shipped_heads(sys.argv[1], query=sys.argv[2] == "query"); print(p or "")' "$MODEL_NAME" "$kind")"
    [ -n "$init" ] || fail "no shipped $kind heads for $MODEL_NAME in heads/"
    # the tree that travels with each call (tracked and not ignored) without the heads GGUFs
    tree=0
    if git rev-parse --git-dir > /dev/null 2>&1; then
        tree="$(git ls-files -co --exclude-standard -z | grep -zv '^heads/.*\.gguf$' | xargs -0 -r du -cb 2>/dev/null \
                | awk 'END { print $1 }')"
    fi
    part_bytes=$(( CALL_BYTES - tree - MARGIN_BYTES ))
    [ "$part_bytes" -gt $(( 8 * 1048576 )) ] || fail "the tree alone takes $(( tree / 1048576 )) MiB of a call's 64"
    # one archive: the model, gguf-py and the initial heads; cut into parts of part_bytes
    stage="$(mktemp -d)"
    trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage/pack"
    ln -s "$model" "$stage/pack/$(basename "$model")"
    ln -s "$init" "$stage/pack/init.gguf"
    cp -r third_party/llama.cpp/gguf-py "$stage/pack/gguf-py"
    find "$stage/pack" -name __pycache__ -prune -exec rm -rf {} +
    basename "$model" > "$stage/pack/model.file"
    tar -C "$stage" -chf "$stage/pack.tar" pack
    sha="$(sha256sum < "$stage/pack.tar" | cut -d' ' -f1)"
    split -b "$part_bytes" -d -a 3 "$stage/pack.tar" "$stage/part."
    parts=("$stage"/part.*)      # split's suffixes sort in order
    n=${#parts[@]}
    rm -rf "$PREFIX"-[0-9]*
    i=1
    for part in "${parts[@]}"; do
        mkdir -p "$PREFIX-$i"
        mv "$part" "$PREFIX-$i/pack.part"
        echo "$i $n $sha $MODEL_NAME" > "$PREFIX-$i/pack.info"
        bytes=$(( tree + $(du -sb "$PREFIX-$i" | cut -f1) ))
        log "a call carrying $PREFIX-$i: $(( bytes / 1048576 )) MiB with the tree (the device tool takes 64)"
        [ "$bytes" -le "$CALL_BYTES" ] || fail "a call carrying $PREFIX-$i would be over 64 MiB"
        i=$(( i + 1 ))
    done
    log "wrote $n parts of $MODEL_NAME's pack ($(du -sh "$stage/pack.tar" | cut -f1)): carry $PREFIX-1 to $PREFIX-$n," \
        "one a call, to the same warm machine, the last with the run"
    log "for those calls take the heads GGUFs out of what travels: git rm -q --cached heads/*.gguf and" \
        "/heads/*.gguf in .git/info/exclude; afterwards git reset -q -- heads/ and that line out again"
    exit 0
fi

PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT_DIR:-build-gpu-train}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
WORK="${LOCRET_GPU_TRAIN_WORK:-$ROOT/build-gpu-train/work}"
mkdir -p "$WORK"

# the pack: every part carried, all of one --pack, joined and checked against the sha256 packed with them
[ -f "$PREFIX-1/pack.info" ] || fail "$PREFIX-1/pack.part is missing: carry the parts --pack wrote, one a call to" \
    "this machine (the machine went back between the calls if they were carried: start again with all)"
read -r _ n sha packed_model < "$PREFIX-1/pack.info"
[ -z "$MODEL_NAME" ] || [ "$MODEL_NAME" = "$packed_model" ] \
    || fail "--model $MODEL_NAME, but the parts carried are $packed_model's: pack it (--pack --model $MODEL_NAME)"
MODEL_NAME="$packed_model"
for i in $(seq 1 "$n"); do
    [ -f "$PREFIX-$i/pack.part" ] || fail "$PREFIX-$i/pack.part is missing: carry it ($n parts, one a call, to" \
        "the same warm machine)"
    read -r _ n_i sha_i _ < "$PREFIX-$i/pack.info"
    [ "$n_i $sha_i" = "$n $sha" ] || fail "$PREFIX-$i is a part of another --pack than $PREFIX-1: carry one pack's parts"
done
for i in $(seq 1 "$n"); do cat "$PREFIX-$i/pack.part"; done > "$WORK/pack.tar"
[ "$(sha256sum < "$WORK/pack.tar" | cut -d' ' -f1)" = "$sha" ] \
    || fail "the joined pack's sha256 differs from the one packed with it (a part from another --pack?)"
rm -rf "$WORK/pack"
tar -C "$WORK" -xf "$WORK/pack.tar"
rm -f "$WORK/pack.tar"
PACKED="$WORK/pack"
MODEL="$PACKED/$(cat "$PACKED/model.file")"
INIT="$PACKED/init.gguf"

export PYTHONPATH="$ROOT/py:$PACKED/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
export LOCRET_CACHE_DIR="${LOCRET_CACHE_DIR:-$WORK/cache}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# name | arguments of convert/train_heads.py beyond the model, output, run folder and device
COMMON="--checkpoint-every 25 --budget 2048 --chunk 512 --stabilizers 128 --local 100"
BROAD_TASKS="lookup,lookup,combine,tracking,passkey,quote,fact,fact,docstring,explain,summarize"
BROAD_TEXT="pydoc,prose,code,legal,logs,pypackages,pypackages"
case "$MODEL_NAME" in
    smollm2-135m) RUNS=(
        "q-broad|--init-heads $INIT --query-tokens 64 --rank-weight 1
            --tasks $BROAD_TASKS --contexts $BROAD_TEXT --steps 360 --lr 5e-4 --warmup-steps 10
            --min-tokens 2048 --max-tokens 8192 --seed 21"
        "q-real|--init-heads $INIT --query-tokens 64 --rank-weight 1
            --tasks fact,fact,docstring,explain,summarize,lookup --contexts pypackages --steps 160 --lr 5e-4
            --warmup-steps 10 --min-tokens 4096 --max-tokens 12288 --seed 22"
        "plain-scratch|--d-r 256 --tasks $BROAD_TASKS --contexts $BROAD_TEXT --steps 700 --lr 1e-3 --warmup-steps 30
            --min-tokens 512 --max-tokens 4096 --seed 23"
    ) ;;
    gemma3-270m) RUNS=(
        "g-long|--init-heads $INIT --freeze-layers 0-4,6-10,12-16 --rank-weight 1
            --tasks $BROAD_TASKS --contexts $BROAD_TEXT --steps 240 --lr 5e-4 --warmup-steps 10
            --min-tokens 4096 --max-tokens 16384 --seed 31"
        "g-real|--init-heads $INIT --freeze-layers 0-4,6-10,12-16 --rank-weight 1
            --tasks fact,fact,docstring,explain,summarize,lookup --contexts pypackages --steps 120 --lr 5e-4
            --warmup-steps 8 --min-tokens 8192 --max-tokens 24576 --seed 32"
    ) ;;
esac

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
