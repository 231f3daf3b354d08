#!/usr/bin/env python3
"""Train Locret retaining heads on a frozen model and write them as a heads GGUF.

  train_heads.py --base MODEL.gguf -o HEADS.gguf [--run-dir DIR] [--data FILE.jsonl ...] [options]

With no --data the built-in offline generator supplies the examples (see
locret/train/synthetic.py). The run folder keeps a resumable checkpoint, the training log
(JSON), the loss curve (PNG) and the checkpoint in the published Locret format; running the same
command again resumes. Refusals are one line on stderr ("train_heads: error: ...") with exit status 1.

The command lives in the installed package (locret.train.cli; also `locret convert`); this file is the
script the README names.
"""
import sys

from locret.train.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
