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
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from locret.train.backbone import load_backbone
from locret.convert.base_model import read_base_model
from locret.convert.checkpoint import read_checkpoint
from locret.convert.errors import ConversionError, RefusingParser
from locret.convert.heads import check_layout
from locret.train.heads_model import RetainingHeads
from locret.train.needle_ranks import NeedlePrompt, needle_ranks
from locret.train.trainer import check_backbone_matches_gguf, load_init_heads, resolve_model

PROGRAM = "needle_ranks"


def passkey_prompts(model_path: Path, length: int, depths: list[float], seed: int,
                    answer_tokens) -> list[NeedlePrompt]:
    """The evaluation's passkey prompts, with the digit tokens of each key located."""
    from locret.evaluation import items
    from locret.tasks import passkey

    vocab = items.vocab_model(str(model_path))
    try:
        prompts = []
        for item in items.task_items(vocab, ["passkey"], [length], depths, 1, seed=seed):
            _, start, end = item.extra["needles"][0]
            tokens = list(item.tokens)
            digits = [start + k for k in passkey.key_token_offsets(tokens[start:end], vocab.detokenize)]
            answer = answer_tokens(item.answers[0])
            prompts.append(NeedlePrompt(f"passkey-{length}-d{item.depth:.2f}", tokens + answer, len(tokens), digits,
                                        list(range(start, end))))
        return prompts
    finally:
        vocab.close()


def _run(argv: list[str]) -> int:
    p = RefusingParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="model GGUF or name from `locret models list`")
    p.add_argument("--heads", action="append", required=True, metavar="CKPT",
                   help="heads checkpoint (repeatable): a heads.safetensors or a published Locret checkpoint")
    p.add_argument("--length", type=int, default=6000, help="prompt tokens (default 6000)")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths, comma separated (default 0.1,0.5,0.9)")
    p.add_argument("--keep", default="0.13,0.055", help="top shares to report, comma separated (default 0.13,0.055)")
    p.add_argument("--seed", type=int, default=0, help="passkey seed (eval_passkey's default is 0)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", metavar="FILE", help="also write every digit's rank share per layer and KV head")
    args = p.parse_args(argv)
    try:
        depths = [float(d) for d in args.depths.split(",")]
        keeps = [float(k) for k in args.keep.split(",")]
    except ValueError:
        raise ConversionError("--depths and --keep take comma separated numbers") from None
    if not all(0 < k < 1 for k in keeps):
        raise ConversionError(f"--keep shares must be in (0, 1), got {args.keep}")
    if args.length < 256:
        raise ConversionError(f"--length must be at least 256 tokens, got {args.length}")
    for path in args.heads:
        if not Path(path).exists():
            raise ConversionError(f"--heads {path}: no such file or directory")

    model_path = resolve_model(args.model)
    base = read_base_model(model_path)
    layouts = {path: check_layout(read_checkpoint(Path(path)), base) for path in args.heads}  # before the slow load
    backbone = load_backbone(model_path, threads=args.threads)
    check_backbone_matches_gguf(backbone, model_path)
    heads: dict[str, RetainingHeads] = {}
    for path, layout in layouts.items():
        model = RetainingHeads(backbone.n_layer, backbone.d_in, layout.d_r, backbone.n_head_kv, backbone.activation, 0)
        load_init_heads(model, Path(path), base)
        heads[path] = model

    def answer_tokens(key: str) -> list[int]:
        return backbone.tokenizer.encode(key, add_special_tokens=False)

    prompts = passkey_prompts(model_path, args.length, depths, args.seed, answer_tokens)
    last = keeps[-1]
    keep_head = "  ".join(f"top {k:g}" for k in keeps)
    print(f"share of the key's digits (needle: of the whole needle sentence) ranked in the top share of the prompt; "
          f"pairs: (layer, KV head) holding every digit; per layer: tenths of digits held in the top {last:g}")
    print(f"{'prompt':<20} {'source':<36} {keep_head}  needle  pairs  per layer")
    records = []
    for prompt in prompts:
        for r in needle_ranks(backbone, prompt, heads):
            layers = "".join(str(min(9, int(10 * x))) for x in r.layers_inside(last))
            cells = "  ".join(f"{r.inside(k):>{len(f'top {k:g}')}.2f}" for k in keeps)
            source = r.source if len(r.source) <= 36 else "..." + r.source[-33:]
            print(f"{r.prompt:<20} {source:<36} {cells}  {r.needle_inside(last):>6.2f}  {r.pairs_holding_all(last):>5}  "
                  f"{layers}", flush=True)
            records.append({"prompt": r.prompt, "source": r.source, "digits": len(prompt.digit_positions),
                            "inside": {str(k): r.inside(k) for k in keeps},
                            "needle_inside": {str(k): r.needle_inside(k) for k in keeps},
                            "shares": r.shares.round(5).tolist()})
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(args.model), "length": args.length, "depths": depths,
                                               "seed": args.seed, "records": records}, indent=1))
    return 0


def main(argv: list[str]) -> int:
    try:
        return _run(argv)
    except ConversionError as e:
        print(f"{PROGRAM}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
