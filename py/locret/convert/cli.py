"""Convert Locret retaining heads (PyTorch checkpoints) to the heads GGUF format.

  heads_to_gguf.py --base MODEL.gguf --heads CKPT -o HEADS.gguf [options]
      a standalone heads file for MODEL.gguf
  heads_to_gguf.py --merge-into MODEL.gguf --heads CKPT -o MODEL-WITH-HEADS.gguf [options]
      a copy of MODEL.gguf with the heads added
  heads_to_gguf.py make-random --base MODEL.gguf --d-r 256 --seed 0 -o CKPT.safetensors
      randomly initialised heads in the published Locret checkpoint format

The file format is described in convert/HEADS-FORMAT.md. Refusals are one line on stderr
("heads_to_gguf: error: ...") with exit status 1.
"""
from __future__ import annotations

import sys
from pathlib import Path

from locret.convert.architectures import ARCHITECTURES
from locret.convert.conversion import ConversionRequest, convert, make_random
from locret.convert.errors import PROGRAM, ConversionError, RefusingParser
from locret.convert.gguf_output import WEIGHT_TYPES, Recommended, rewrite_recommended
from locret.convert.random_heads import CHECKPOINT_DTYPES

# The Locret paper's setting for Phi-3-mini-128K; a reasonable starting point for other models.
DEFAULT_BUDGET, DEFAULT_CHUNK, DEFAULT_STABILIZERS, DEFAULT_LOCAL = 6000, 3072, 2500, 100


def uint32(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**32:
        raise ValueError(text)
    return value


uint32.__name__ = "unsigned 32-bit integer"  # argparse names the type in its message


def convert_parser() -> RefusingParser:
    parser = RefusingParser(
        prog="heads_to_gguf.py",
        description="Convert Locret retaining heads to GGUF, standalone (--base) or merged into a model "
                    "(--merge-into). `heads_to_gguf.py make-random --help` makes random heads.",
        epilog=f"Supported architectures: {', '.join(ARCHITECTURES)}. The --budget/--chunk/--stabilizers/--local "
               "defaults are the Locret paper's setting for Phi-3-mini-128K; they are stored as "
               "locret.recommended.* and only suggest inference settings.")
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--base", type=Path, metavar="MODEL.gguf", help="write a standalone heads file for this model")
    model.add_argument("--merge-into", type=Path, metavar="MODEL.gguf",
                       help="write a copy of this model (all key/values and tensors unchanged) with the heads added")
    parser.add_argument("--heads", type=Path, required=True, metavar="CKPT",
                        help=".safetensors or .bin/.pt/.pth checkpoint, a Hugging Face model directory (one or many "
                             "shards), or a heads GGUF (re-typed, or merged into a model); only "
                             "model.layers.{i}.self_attn.fc1/fc2 (or a GGUF's locret.blk.*) tensors are read")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="OUT.gguf")
    parser.add_argument("--type", default="f16", choices=list(WEIGHT_TYPES),
                        help="type of fc1/fc2 weights (default f16; bf16 keeps bf16 checkpoints exactly; biases "
                             "are always f32; q8_0 falls back to f16 for a tensor whose rows are not a "
                             "multiple of 32)")
    parser.add_argument("--budget", type=uint32, default=DEFAULT_BUDGET,
                        help=f"recommended retained units per layer and KV head (default {DEFAULT_BUDGET})")
    parser.add_argument("--chunk", type=uint32, default=DEFAULT_CHUNK,
                        help=f"recommended prefill chunk (default {DEFAULT_CHUNK})")
    parser.add_argument("--stabilizers", type=uint32, default=DEFAULT_STABILIZERS,
                        help=f"recommended stabilizers (default {DEFAULT_STABILIZERS})")
    parser.add_argument("--local", type=uint32, default=DEFAULT_LOCAL,
                        help=f"recommended local tail (default {DEFAULT_LOCAL})")
    parser.add_argument("--pool", type=uint32, default=0,
                        help="recommended score pooling window (odd; default 0: none, the key is not written)")
    parser.add_argument("--query", choices=["auto", "none"], default=None,
                        help="auto: Locret-Q heads, whose tools pin the question found at the end of a prompt by "
                             "default (default: the key is not written)")
    parser.add_argument("--name", help="general.name of a standalone file (default: 'Locret heads for <model>')")
    parser.add_argument("--skip-qk-permutation", action="store_true",
                        help="TESTING ONLY: leave W1's Q/K columns in Hugging Face order. This produces WRONG "
                             "heads for architectures that need the permutation (llama and its kin); it exists "
                             "so that a parity test can prove it detects the mistake.")
    return parser


def make_random_parser() -> RefusingParser:
    parser = RefusingParser(prog="heads_to_gguf.py make-random",
                    description="Write randomly initialised heads (nn.Linear-style init, no biases, Hugging Face "
                                "Q/K order) in the published Locret checkpoint format.")
    parser.add_argument("--base", type=Path, required=True, metavar="MODEL.gguf",
                        help="the model whose shape the heads take")
    parser.add_argument("--d-r", type=int, default=256, help="hidden width d_R (default 256)")
    parser.add_argument("--seed", type=uint32, default=0, help="random seed (default 0)")
    parser.add_argument("--dtype", default="bf16", choices=list(CHECKPOINT_DTYPES),
                        help="tensor type (default bf16, like the published checkpoints)")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="CKPT.safetensors|CKPT.bin")
    return parser


def check_positions(text: str) -> None:
    """The library's rule for a positions mode (llama_locret_positions_parse), so that a file never carries one the
    runtime refuses."""
    from locret.eviction import parse_positions
    from locret.heads import HeadsError

    try:
        parse_positions(text)
    except HeadsError as e:
        raise ConversionError(f"--positions: {e}") from None


def recommend_parser() -> RefusingParser:
    parser = RefusingParser(prog="heads_to_gguf.py recommend",
                    description="Set the inference settings a heads file recommends (locret.recommended.pool, "
                                ".pool_from, .query and .positions), keeping every other key and tensor; the file is rewritten in "
                                "place unless -o is given.")
    parser.add_argument("heads", type=Path, metavar="HEADS.gguf", help="a heads file or a model with embedded heads")
    parser.add_argument("--pool", type=uint32, help="score pooling window the heads were measured with (odd; 0: none)")
    parser.add_argument("--pool-from", type=uint32, metavar="N",
                        help="the pooling applies to prompts of at least N budgets only (0: to every prompt)")
    parser.add_argument("--query", choices=["auto", "none"],
                        help="auto: Locret-Q heads, whose tools pin the question found at the end of a prompt")
    parser.add_argument("--positions", metavar="MODE",
                        help="where kept units sit by default with these heads, as --locret-positions: compact, "
                             "inplace, keep or keep:N (measured per model: docs/memory.md)")
    parser.add_argument("-o", "--output", type=Path, help="write here instead of rewriting HEADS.gguf")
    return parser


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["recommend"]:
            args = recommend_parser().parse_args(argv[1:])
            if args.pool is None and args.pool_from is None and args.query is None and args.positions is None:
                raise ConversionError("recommend: give --pool, --pool-from, --query and/or --positions")
            if args.positions is not None:
                check_positions(args.positions)
            if not args.heads.is_file():
                raise ConversionError(f"{args.heads}: no such file")
            rewrite_recommended(args.heads, args.output or args.heads, args.pool, args.query, args.positions,
                                args.pool_from)
        elif argv[:1] == ["make-random"]:
            args = make_random_parser().parse_args(argv[1:])
            make_random(args.base, args.output, args.d_r, args.seed, args.dtype)
        else:
            args = convert_parser().parse_args(argv)
            convert(ConversionRequest(
                heads=args.heads, out=args.output, base=args.base, merge_into=args.merge_into,
                weight_type=args.type, name=args.name, skip_qk_permutation=args.skip_qk_permutation,
                recommended=Recommended(budget=args.budget, chunk=args.chunk, stabilizers=args.stabilizers,
                                        local=args.local, pool=args.pool, query=args.query or "")))
    except ConversionError as e:
        print(f"{PROGRAM}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
