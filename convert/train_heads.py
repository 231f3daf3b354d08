#!/usr/bin/env python3
"""Train Locret retaining heads on a frozen model and write them as a heads GGUF.

The command lives in the installed package (locret.train.cli; also `locret train`), whose docstring and `--help`
describe it; this file is the script the README names.
"""
import sys

from locret.train.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
