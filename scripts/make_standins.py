#!/usr/bin/env python3
"""Build (or find in the cache) the tiny stand-ins of the models users bring: random-weight Hugging Face models with the
RoPE of Phi-3-mini-128K (LongRoPE, both factor sets), Llama-3.1 (llama3 frequencies), Qwen2 (YaRN, q/k/v biases) and
StableLM-2 (partial NEOX rotary), converted with the pinned llama.cpp tree's own convert_hf_to_gguf.py, each with
random retaining heads (locret.standins). Prints one line per stand-in: its name and its folder.

  scripts/make_standins.py [NAME ...]        default: all of them
"""
from __future__ import annotations

import argparse
import sys

from locret import standins


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"stand-ins to build (default all: {', '.join(standins.SPECS)})")
    args = parser.parse_args(argv)
    try:
        for name in args.names or list(standins.SPECS):
            s = standins.build(name)
            print(f"{name}\t{s.folder}")
    except standins.StandinError as e:
        print(f"make_standins: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
