#!/usr/bin/env python3
"""RULER's table over several `locret eval --suite ruler` folders (the same methods on more prompts: another --seed a
folder), pooled sample by sample: a task's score is the mean over every prompt, n counts them.

    .venv/bin/python scripts/ruler_table.py results/ruler-4k-seed1 results/ruler-4k-seed2
    .venv/bin/python scripts/ruler_table.py results/ruler-4k-r0.75 results/ruler-4k-r0.875 --plot plots/ruler.png

Where the folders hold several compression ratios (kvpress's grid run a ratio at a time), the average against the
ratio follows the table, one row a method, as `locret eval` writes it; `--plot` draws it (one PNG a length).

Refused (exit 1, naming the folder): a folder that is not a RULER run, another model or RULER mode, a method whose
heads differ between folders, and a prompt asked twice (the same method, item and seed in two folders).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "py"))

from locret.ruler.pool import PoolError, markdown  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="`locret eval --suite ruler` output folders (-o)")
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="draw the average against compression ratio, kvpress's way, into PNG (-LENGTH added)")
    args = p.parse_args(argv)
    try:
        print(markdown(args.folders, plot=args.plot))
    except PoolError as e:
        print(f"ruler_table: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
