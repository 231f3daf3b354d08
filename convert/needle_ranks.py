#!/usr/bin/env python3
"""Forecast whether heads keep a passkey under eviction, without running llama.cpp.

  needle_ranks.py --heads RUN/heads.safetensors [--heads OTHER ...] [--length 6000] [--keep 0.13,0.055]

Scores the passkey evaluation's own prompt (py/locret/tasks/passkey.py, the prompts of
scripts/eval_passkey.py) with each heads checkpoint in PyTorch, and prints, for each share `keep`,
how many of the key's digit tokens (and of the needle's tokens) rank inside the top `keep` of the
prompt per (layer, KV head). A cache of budget b holds about the top (b - stabilizers - local) / n
of an n-token prompt: 0.13 is 6,000 tokens at b 1024, 0.055 is 32,768 tokens at b 2048. The
"labels" row ranks the model's own attention from the answer (the trainer's targets). Heads are read as --init-heads reads
them: this trainer's heads.safetensors or a published Locret checkpoint (file or directory).
It shows what heads keep, not what the model answers from it (keeping the key is necessary, not
sufficient: heads/README.md). Refusals are one line on stderr ("needle_ranks: error: ...") with
exit status 1.

The command lives in the installed package (locret.train.needle_ranks_cli; also `locret needle-ranks`); this file is the
script the README names.
"""
import sys

from locret.train.needle_ranks_cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
