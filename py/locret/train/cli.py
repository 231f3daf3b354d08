"""Train Locret retaining heads on a frozen model and write them as a heads GGUF.

  train_heads.py --base MODEL.gguf -o HEADS.gguf [--run-dir DIR] [--data FILE.jsonl ...] [options]

With no --data the built-in offline generator supplies the examples (see
locret/train/synthetic.py). The run folder keeps a resumable checkpoint, the training log
(JSON), the loss curve (PNG) and the checkpoint in the published Locret format; running the same
command again resumes. Refusals are one line on stderr ("train_heads: error: ...") with exit status 1.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from locret.train.backbone import TRAINABLE_MODEL_TYPES
from locret.convert.errors import ConversionError, RefusingParser
from locret.convert.gguf_output import WEIGHT_TYPES
from locret.train.synthetic import CONTEXTS, DEFAULT_CONTEXTS, DEFAULT_TASKS, TASKS
from locret.train.trainer import TrainConfig, accuracy_by_layer, mean_of, train

PROGRAM = "train_heads"
DEFAULTS = TrainConfig(base="", gguf="", output="", run_dir="")


def _layers(text: str) -> list[int]:
    """'0-5,7' -> [0, 1, 2, 3, 4, 5, 7]."""
    layers: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        first, _, last = part.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ConversionError(f"--freeze-layers {text}: expected layer numbers and ranges like 0-5,7") from None
        if lo > hi:
            raise ConversionError(f"--freeze-layers {text}: the range {part} is empty")
        layers += range(lo, hi + 1)
    return sorted(set(layers))


def parser() -> RefusingParser:
    p = RefusingParser(prog="train_heads.py", description=__doc__.split("\n\n")[0],
               epilog=f"Backbones the trainer supports (transformers model types): {', '.join(TRAINABLE_MODEL_TYPES)}.")
    p.add_argument("--base", required=True, metavar="MODEL.gguf|HF_DIR|NAME",
                   help="the frozen backbone: a model GGUF (dequantized by transformers), a Hugging Face directory, "
                        "or a model name from `locret models list`")
    p.add_argument("--gguf", metavar="MODEL.gguf",
                   help="the model GGUF the heads are for (default: --base when it is a GGUF)")
    p.add_argument("-o", "--output", required=True, metavar="HEADS.gguf")
    p.add_argument("--run-dir", metavar="DIR", help="checkpoint, log and plot folder (default: OUTPUT without "
                                                     ".gguf, plus '.run')")
    p.add_argument("--data", action="append", default=[], metavar="FILE",
                   help="local SFT data (.jsonl or .json array; sharegpt, messages, or prompt/answer records); "
                        "repeatable. Default: the built-in generator")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help=f"built-in generator's task mix, comma separated; a task named twice is drawn twice as "
                        f"often (known: {','.join(TASKS)}; default {','.join(DEFAULT_TASKS)})")
    p.add_argument("--contexts", default=",".join(DEFAULT_CONTEXTS),
                   help=f"built-in generator's text around the needles, comma separated, one drawn per example "
                        f"(known: {','.join(CONTEXTS)}; pydoc: the Python reference, pypackages: real source and "
                        f"docstrings of packages in the venv, the others the evaluation's generated haystack "
                        f"families; default pydoc)")
    p.add_argument("--d-r", type=int, default=DEFAULTS.d_r, help=f"head hidden width (default {DEFAULTS.d_r})")
    p.add_argument("--steps", type=int, default=DEFAULTS.steps,
                   help=f"optimizer steps, one sequence each (default {DEFAULTS.steps})")
    p.add_argument("--lr", type=float, default=DEFAULTS.lr, help=f"peak learning rate (default {DEFAULTS.lr})")
    p.add_argument("--warmup-steps", type=int, default=DEFAULTS.warmup_steps,
                   help=f"linear warmup steps (default {DEFAULTS.warmup_steps})")
    p.add_argument("--grad-clip", type=float, default=DEFAULTS.grad_clip,
                   help=f"gradient norm clip (default {DEFAULTS.grad_clip})")
    p.add_argument("--min-tokens", type=int, default=DEFAULTS.min_tokens,
                   help=f"shortest built-in example (default {DEFAULTS.min_tokens})")
    p.add_argument("--max-tokens", type=int, default=DEFAULTS.max_tokens,
                   help=f"longest sequence; longer prompts lose their middle (default {DEFAULTS.max_tokens})")
    p.add_argument("--init-heads", metavar="CKPT",
                   help="start from these heads instead of a random init (fine-tuning): a run folder's "
                        "heads.safetensors, a heads GGUF (such as the shipped ones) or a published Locret checkpoint "
                        "(file or directory) of the same d_R")
    p.add_argument("--freeze-layers", metavar="LAYERS", default="",
                   help="with --init-heads: layers whose heads stay as given, e.g. 0-5 or 0,2,4-6 (they still "
                        "count in the loss and the log)")
    p.add_argument("--rank-weight", type=float, default=DEFAULTS.rank_weight, metavar="W",
                   help="add W x KL(softmax(label) || softmax(prediction)) per KV head to the loss: weighs tokens by "
                        "the attention they get, so rare important ones (a needle) count more. Not the paper's "
                        "loss; default 0 (off)")
    p.add_argument("--query-tokens", type=int, default=DEFAULTS.query_tokens, metavar="L_Q",
                   help="Locret-Q (paper sec. 5.4): put the query, at most its last L_Q tokens, in front of the first "
                        "user turn as inference will (the built-in tasks' question; a record's last user turn); "
                        "default 0 (off)")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seed of the heads' init and the data order")
    p.add_argument("--max-minutes", type=float, help="stop (checkpointed, resumable) after this many minutes")
    p.add_argument("--stop-after-steps", type=int, metavar="N",
                   help="stop (checkpointed, resumable) after N more steps in this invocation")
    p.add_argument("--checkpoint-every", type=int, default=DEFAULTS.checkpoint_every,
                   help=f"steps between checkpoints (default {DEFAULTS.checkpoint_every})")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default="auto", help="torch device: auto (cuda when available, else cpu), cpu, cuda, "
                                                   "cuda:N")
    p.add_argument("--no-resume", action="store_true", help="start over even if the run folder has a checkpoint")
    p.add_argument("--type", default=DEFAULTS.weight_type, choices=list(WEIGHT_TYPES),
                   help=f"GGUF weight type (default {DEFAULTS.weight_type})")
    for name in ("budget", "chunk", "stabilizers", "local"):
        p.add_argument(f"--{name}", type=int, default=getattr(DEFAULTS, name),
                       help=f"recommended inference {name} stored in the GGUF (default {getattr(DEFAULTS, name)})")
    return p


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str]) -> int:
    try:
        args = parser().parse_args(argv)
        base = Path(args.base)
        gguf = Path(args.gguf) if args.gguf else base
        if gguf.suffix != ".gguf" and gguf.is_dir():
            raise ConversionError("--base is not a GGUF file: give the model GGUF the heads are for with --gguf")
        output = Path(args.output)
        run_dir = Path(args.run_dir) if args.run_dir else output.with_name(output.stem + ".run")
        config = TrainConfig(base=str(base), gguf=str(gguf), output=str(output), run_dir=str(run_dir),
                             data=list(args.data), tasks=[t for t in args.tasks.split(",") if t], d_r=args.d_r,
                             steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps, grad_clip=args.grad_clip,
                             min_tokens=args.min_tokens, max_tokens=args.max_tokens, seed=args.seed,
                             checkpoint_every=args.checkpoint_every, weight_type=args.type, budget=args.budget,
                             chunk=args.chunk, stabilizers=args.stabilizers, local=args.local,
                             init_heads=args.init_heads or "", freeze_layers=_layers(args.freeze_layers),
                             rank_weight=args.rank_weight, query_tokens=args.query_tokens,
                             contexts=[c for c in args.contexts.split(",") if c])
        summary = train(config, resume=not args.no_resume, max_minutes=args.max_minutes, threads=args.threads,
                        device=_device(args.device), stop_after_steps=args.stop_after_steps,
                        command="train_heads.py " + shlex.join(argv))
    except ConversionError as e:
        print(f"{PROGRAM}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROGRAM}: interrupted; the last checkpoint is kept and the same command resumes", file=sys.stderr)
        return 130
    recent = summary["steps"][-50:]
    if recent:
        print(f"{summary['steps_done']} steps in {summary['train_seconds']:.0f} s; last {len(recent)} steps: loss "
              f"{mean_of(recent, 'loss'):.4f}, top-10% accuracy {mean_of(recent, 'top10_accuracy'):.3f}")
        by_layer = accuracy_by_layer(recent)
        if by_layer:
            print("top-10% accuracy by layer: " + " ".join(f"{i}:{a:.2f}" for i, a in enumerate(by_layer)))
    print(f"wrote {output} (log, plot and checkpoint in {run_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
