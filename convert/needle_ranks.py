#!/usr/bin/env python3
"""Forecast whether heads keep a passkey under eviction, without running llama.cpp.

The command lives in the installed package (locret.train.needle_ranks_cli; also `locret needle-ranks`), whose docstring and `--help`
describe it; this file is the script the README names.
"""
import sys

from locret.train.needle_ranks_cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
