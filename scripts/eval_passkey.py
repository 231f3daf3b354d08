#!/usr/bin/env python3
"""Passkey quality table: full attention vs Locret's scoring policies, in one engine.

    .venv/bin/python scripts/eval_passkey.py                       # the issue's settings (long: hours on 2 cores)
    .venv/bin/python scripts/eval_passkey.py --lengths 6000 --trials 10 --methods full,locret

Each (length, method) row: accuracy over trials whose needle depths are spread over 0-100 %, and
accuracy per depth fifth. Full attention runs only where the prompt fits the model's window.
Writes a JSON (settings, summary, every trial) and a markdown table next to it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "py"))

from tqdm import tqdm  # noqa: E402

from locret import models, passkey_eval  # noqa: E402
from locret.evaluation import runner  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL, help="model name or GGUF path")
    ap.add_argument("--heads", help="trained heads for 'locret' (default: the shipped heads for the model)")
    ap.add_argument("--random-heads", help="heads for 'random-heads' (default: random d_R 256, seed 0)")
    ap.add_argument("--lengths", default="6000,32768,65536", help="prompt lengths in tokens, comma separated")
    ap.add_argument("--trials", default="50,10,6", help="trials per length (one number, or one per length)")
    ap.add_argument("--budgets", default="1024", help="Locret budgets b, comma separated")
    ap.add_argument("--methods", default=",".join(passkey_eval.METHODS),
                    help=f"comma separated, of {','.join(passkey_eval.METHODS)}")
    ap.add_argument("--ubatch", type=int, default=512, help="chunk B (n_ubatch, also n_batch)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-type", choices=["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"],
                    help="K and V cache type for every method (default f16)")
    ap.add_argument("--stabilizers", type=int,
                    help="stabilizers n_s for every evicting method (default: the heads file's recommendation); "
                         "set it to compare trained and random heads with the same n_s")
    ap.add_argument("--pool", type=int, default=0,
                    help="score pooling window (odd) of the heads methods, as locret eval's --pool (default 0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-minutes", type=float, help="stop starting trials after this long; report what ran")
    ap.add_argument("--check-prefix-reuse", action="store_true",
                    help="first run one trial per Locret method with and without the saved-prefix shortcut")
    ap.add_argument("-o", "--output", type=Path, default=Path("results/passkey.json"))
    args = ap.parse_args(argv)

    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        trials = [int(x) for x in args.trials.split(",")]
        budgets = [int(x) for x in args.budgets.split(",")]
    except ValueError:
        ap.error("--lengths, --trials and --budgets take comma-separated integers")
    if len(trials) == 1:
        trials *= len(lengths)
    if len(trials) != len(lengths):
        ap.error(f"--trials gives {len(trials)} numbers for {len(lengths)} lengths")
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in passkey_eval.METHODS]
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(passkey_eval.METHODS)}")
    if (problem := runner.pool_problem(args.pool, methods)) is not None:
        ap.error(problem)
    if any(x <= 0 for x in lengths + trials + budgets):
        ap.error("lengths, trials and budgets must be positive")
    if args.stabilizers is not None and not 0 <= args.stabilizers < min(budgets):
        ap.error(f"--stabilizers {args.stabilizers} must be at least 0 and below the smallest budget {min(budgets)}")

    model_path = str(models.resolve(args.model))
    heads = args.heads or str(models.shipped_heads(args.model) or "")
    if "locret" in methods and not heads:
        ap.error(f"no shipped heads for {args.model}: give --heads")
    random_heads = args.random_heads or (passkey_eval.default_random_heads(model_path)
                                         if "random-heads" in methods else None)
    setup = passkey_eval.Setup(model_path=model_path, heads=heads or None, random_heads=random_heads,
                               n_ubatch=args.ubatch, threads=args.threads, stabilizers=args.stabilizers,
                               kv_type=args.kv_type, pool=args.pool)
    n_ctx_train = _n_ctx_train(model_path)

    if args.check_prefix_reuse:
        for method in [m for m in methods if m != "full"]:
            single, reused = passkey_eval.check_prefix_reuse(setup, method, lengths[0], budgets[0], args.seed)
            print(f"prefix reuse check ({method}, {lengths[0]} tokens): single pass {single!r}, reused {reused!r}")
            if single != reused:
                print("the saved-prefix shortcut changed an answer", file=sys.stderr)
                return 1

    plan = []
    for length, n in zip(lengths, trials):
        for method in methods:
            if method == "full":
                if length + 64 <= n_ctx_train:
                    plan.append((method, length, None, n))
            else:
                plan += [(method, length, b, n) for b in budgets]
    try:
        passkey_eval.check_settings(setup, [(m, length, b) for m, length, b, _ in plan])
    except ValueError as e:  # evaluation.EvalError: the rule book's refusal
        ap.error(str(e))
    deadline = time.monotonic() + args.max_minutes * 60 if args.max_minutes else None
    # every finished trial is appended here at once; running the same command again skips them
    journal = args.output.with_suffix(".trials.jsonl")
    journal.parent.mkdir(parents=True, exist_ok=True)
    recorded = [passkey_eval.Trial(**json.loads(line)) for line in journal.read_text().splitlines()
                if line.strip()] if journal.exists() else []
    done = {(t.method, t.budget, t.key, t.needle_at) for t in recorded}
    if recorded:
        print(f"{len(recorded)} trials already in {journal}: skipped")

    def record(trial):
        with open(journal, "a") as f:
            f.write(json.dumps(dataclasses.asdict(trial)) + "\n")

    with tqdm(total=sum(p[3] for p in plan), initial=len(recorded), desc="passkey trials", unit="trial") as bar:
        for method, length, budget, n in plan:
            passkey_eval.run_length(setup, method, length, budget, n, args.seed, bar, deadline, done, record)
    wanted = {(m, b, length) for m, length, b, _ in plan}
    results = [passkey_eval.Trial(**json.loads(line)) for line in journal.read_text().splitlines() if line.strip()]
    results = [t for t in results if any(t.method == m and t.budget == b and abs(t.length - length) < 200
                                         for m, b, length in wanted)]
    rows = passkey_eval.summarize(results)
    settings = {"model": Path(model_path).name, "heads": Path(heads).name if heads else None,
                "lengths": lengths, "trials": trials, "budgets": budgets, "methods": methods, "ubatch": args.ubatch, "stabilizers": args.stabilizers, "kv_type": args.kv_type, "pool": args.pool,
                "seed": args.seed, "n_ctx_train": n_ctx_train, "command": "scripts/eval_passkey.py " + " ".join(argv)}
    passkey_eval.write_results(args.output, results, rows, settings)
    print(passkey_eval.markdown_table(rows))
    print(f"wrote {args.output} and {args.output.with_suffix('.md')}")
    return 0


def _n_ctx_train(model_path: str) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(model_path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    return int(reader.fields[f"{arch}.context_length"].parts[-1][0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
