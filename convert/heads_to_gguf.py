#!/usr/bin/env python3
"""Convert Locret retaining heads (PyTorch checkpoints) to the heads GGUF format.

The command lives in the installed package (locret.convert.cli; also `locret convert`), whose docstring and `--help`
describe it; this file is the script the README names.
"""
import sys

from locret.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
