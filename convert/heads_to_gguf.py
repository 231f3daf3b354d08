#!/usr/bin/env python3
"""Convert Locret retaining heads (PyTorch checkpoints) to the heads GGUF format.

  heads_to_gguf.py --base MODEL.gguf --heads CKPT -o HEADS.gguf [options]
      a standalone heads file for MODEL.gguf
  heads_to_gguf.py --merge-into MODEL.gguf --heads CKPT -o MODEL-WITH-HEADS.gguf [options]
      a copy of MODEL.gguf with the heads added
  heads_to_gguf.py make-random --base MODEL.gguf --d-r 256 --seed 0 -o CKPT.safetensors
      randomly initialised heads in the published Locret checkpoint format

The file format is described in convert/HEADS-FORMAT.md. Refusals are one line on stderr
("heads_to_gguf: error: ...") with exit status 1.

The command lives in the installed package (locret.convert.cli; also `locret convert`); this file is the
script the README names.
"""
import sys

from locret.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
