#!/usr/bin/env bash
# The main job: the patched llama-cli reads a bundled ~37K-token document (SmolLM2's window is 8K)
# with Locret eviction (--locret-budget 2048), answers a question about it and prints the memory
# figures. Arguments go to scripts/main_job.py: bash scripts/run.sh --budget 1024
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VPY="$ROOT/.venv/bin/python"
[[ -x "$VPY" && -x build/bin/llama-cli ]] || { echo "run.sh: run 'bash scripts/setup.sh' first" >&2; exit 1; }

"$VPY" -m locret version
exec "$VPY" scripts/main_job.py "$@"
