"""`locret loadtest`: play a user script against a running OpenAI-compatible server (llama-server, `locret serve`)
and write its figures.

    locret loadtest --url http://127.0.0.1:8080 --users 16 --lengths 4096:7168 --turns 2 -o loadtest.json

The model names the tokenizer the documents are measured with (the server's own model). With --server-pid (a
server on this machine) the server's RSS is sampled too. Exit 1 on bad input, 2 when the server does not answer.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import models
from . import drive, figures, users as users_module, watch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the server: http://HOST:PORT (its OpenAI API under /v1)")
    p.add_argument("--server-pid", type=int, help="the server's process id, to sample its RSS (a local server)")
    add_script_arguments(p)
    p.add_argument("-o", "--output", required=True, help="JSON file: settings, figures, every request")


def add_script_arguments(p: argparse.ArgumentParser) -> None:
    """The user script's options (shared with scripts/loadtest_side_by_side.py)."""
    p.add_argument("--model", default=models.DEFAULT_MODEL,
                   help=f"the server's model, name or .gguf path: its tokenizer sizes the documents "
                        f"(default {models.DEFAULT_MODEL})")
    p.add_argument("--users", type=int, default=16, help="simulated users, one conversation each (default 16)")
    p.add_argument("--lengths", default="4096:7168", help="document length in tokens, LO:HI or N (default 4096:7168)")
    p.add_argument("--turns", type=int, default=2, help="questions per conversation, the first and its follow-ups "
                   "(default 2)")
    p.add_argument("--arrival-gap-s", type=float, default=10.0,
                   help="mean seconds between two users' arrivals (a Poisson process; default 10)")
    p.add_argument("--think-s", type=float, default=1.0, help="seconds a user waits before a follow-up (default 1)")
    p.add_argument("--max-tokens", type=int, default=48, help="answer length limit (default 48)")
    p.add_argument("--seed", type=int, default=0, help="the script's seed: same seed, same users (default 0)")
    p.add_argument("--timeout-s", type=float, default=3600, help="per request (default 3600)")


def build_users(args: argparse.Namespace) -> list[users_module.User]:
    """The script's users; ValueError / models.ModelError on bad input."""
    from tqdm import tqdm

    from ..evaluation import items

    lengths = users_module.parse_lengths(args.lengths)
    vocab = items.vocab_model(str(models.resolve(args.model)))
    try:
        with tqdm(total=args.users, unit="user", desc="documents", file=sys.stderr) as bar:
            return users_module.build(vocab, n_users=args.users, lengths=lengths, turns=args.turns,
                                      mean_gap_s=args.arrival_gap_s, seed=args.seed, progress=bar)
    finally:
        vocab.close()


def play(url: str, pid: int | None, users: list[users_module.User], args: argparse.Namespace,
         journal: Path | None = None) -> dict:
    """Play `users` against `url`: {"figures", "memory" (watch.Watch.summary), "requests"}. Each request also goes
    to `journal` (JSON lines) as it ends."""
    from tqdm import tqdm

    total = len(users) * args.turns
    if journal is not None:
        journal.write_text("")
    with tqdm(total=total, unit="request", desc=url, file=sys.stderr) as bar, watch.Watch(url, pid) as w:
        def on_request(r: drive.Request) -> None:
            bar.update()
            if journal is not None:
                with open(journal, "a") as j:
                    j.write(json.dumps(r.as_dict()) + "\n")

        records, wall = drive.run(url, users, max_tokens=args.max_tokens, think_s=args.think_s,
                                  timeout_s=args.timeout_s, on_request=on_request)
    rows = [r.as_dict() for r in records]
    return {"figures": figures.summarize(rows, len(users), args.turns, wall), "memory": w.summary(), "requests": rows}


def one_line(name: str, f: dict) -> str:
    """A run's figures as one markdown table row (table_header() names the columns)."""
    def val(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)
    return (f"| {name} | {f['conversations_completed']}/{f['users']} | {val(f['conversations_per_min'])} | "
            f"{val(f['ttft_s']['p50'])} / {val(f['ttft_s']['p95'])} | {val(f['e2e_s']['p50'])} / "
            f"{val(f['e2e_s']['p95'])} | {val(f['decode_tok_s']['p50'], '{:.1f}')} | "
            f"{f['turns_right']:g}/{f['turns_asked']} | {f['requests_failed']} |")


def table_header() -> str:
    return ("| server | conversations done | per min | TTFT p50 / p95 s | latency p50 / p95 s | decode tok/s p50 | "
            "right (turns) | failed requests |\n|---|---:|---:|---:|---:|---:|---:|---:|")


def _reachable(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def run_cli(args: argparse.Namespace) -> int:
    try:
        script = build_users(args)
    except (ValueError, models.ModelError) as e:
        print(f"locret loadtest: {e}", file=sys.stderr)
        return 1
    if not _reachable(args.url):
        print(f"locret loadtest: no server answers GET {args.url.rstrip('/')}/health", file=sys.stderr)
        return 2
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = play(args.url, args.server_pid, script, args, journal=out.with_suffix(".requests.jsonl"))
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    out.write_text(json.dumps({"settings": settings, **result}, indent=1))
    print(table_header())
    print(one_line(args.url, result["figures"]))
    return 0
