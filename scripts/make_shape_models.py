#!/usr/bin/env python3
"""Write (or find in the cache) a shape-alike benchmark model and its random retaining heads (locret.shapes): a
random-weight GGUF with the exact shapes, RoPE and weight type of a model the Locret paper ran (Llama-3.1-8B-Instruct,
Phi-3-mini-128K-instruct) or of its scaled-down variant, plus untrained heads with d_R 1024. Prints two lines: the
model's path, then the heads' path.

  scripts/make_shape_models.py --shape llama3.1-8b [--out DIR] [--weight-type q4_0] [--seed 0] [--d-r 1024]
  scripts/make_shape_models.py --list

Without --out the files go to $LOCRET_CACHE_DIR/shapes (default ~/.cache/locret/shapes). Runs from a bare copy of
the repository tree too (no pip install, no llama.cpp build), given numpy, torch, safetensors, pyyaml and tqdm
(torch and safetensors make the heads; pyyaml is gguf-py's):

  PYTHONPATH=py:third_party/llama.cpp/gguf-py python3 scripts/make_shape_models.py --shape llama3.1-8b --out DIR
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # `import locret` warns when libllama is not built; files need no library
    try:
        from locret import shapes
    except ImportError:  # not installed and not on PYTHONPATH: this checkout's package
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "py"))
        from locret import shapes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(shapes.SHAPES), help="the shape to write")
    parser.add_argument("--out", type=Path, help="folder for the build (default: the cache)")
    parser.add_argument("--weight-type", default="q4_0", choices=list(shapes.WEIGHT_TYPES),
                        help="type of the weight matrices (default q4_0)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights and heads (default 0)")
    parser.add_argument("--d-r", type=int, default=shapes.PUBLISHED_D_R,
                        help=f"hidden size of the retaining heads (default {shapes.PUBLISHED_D_R}, as published)")
    parser.add_argument("--list", action="store_true", help="list the shapes and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, s in shapes.SHAPES.items():
            print(f"{name}\t{s.stands_for}: {s.n_layer} layers, n_embd {s.n_embd}, {s.n_head}/{s.n_head_kv} heads "
                  f"of {s.head_dim}, FFN {s.n_ff}, vocab {s.n_vocab}, {s.rope_scaling} RoPE, "
                  f"{shapes.n_parameters(s) / 1e9:.2f}B parameters")
        return 0
    if args.shape is None:
        parser.error("--shape is required (or --list)")
    try:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
        model, heads = shapes.make_shape_models(args.shape, args.out, weight_type=args.weight_type, seed=args.seed,
                                                d_r=args.d_r)
    except (shapes.ShapeError, OSError) as e:
        print(f"make_shape_models: error: {e}", file=sys.stderr)
        return 1
    print(model)
    print(heads)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
