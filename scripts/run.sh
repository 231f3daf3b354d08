#!/usr/bin/env bash
# The main job: the patched llama-cli on the default model.
#
# Until eviction lands (--locret-budget), this proves the whole chain on a fresh machine: the
# patched libllama is built and loaded (its Locret version marker is printed), the default model
# resolves to a verified GGUF, and llama-cli answers a prompt with greedy decoding.
# Arguments replace the prompt: bash scripts/run.sh "Write a haiku about memory."
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VPY="$ROOT/.venv/bin/python"
[[ -x "$VPY" && -x build/bin/llama-cli ]] || { echo "run.sh: run 'bash scripts/setup.sh' first" >&2; exit 1; }

PROMPT="${*:-What is the capital of France? Answer in one word.}"
MODEL="$("$VPY" -m locret models path)"

"$VPY" -m locret version
echo "model: $MODEL"
echo "prompt: $PROMPT"
echo "---"
build/bin/llama-cli -m "$MODEL" -p "$PROMPT" -st --simple-io --no-display-prompt \
    --temp 0 --seed 42 -n 128 -c 4096 -t "$(nproc)" --log-disable
