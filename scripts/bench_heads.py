#!/usr/bin/env python3
"""Prefill cost of retaining heads: llama-bench with and without heads, alternated in one run.

The heads add two small matmuls per layer (d_in x d_R and d_R x n_head_kv per token). Their share of
the model's per-token multiply-adds is the cost we expect; the target is an added prefill time of
at most that share plus one point. Runs alternate (plain, heads, heads, plain, ...) so that drift
on a shared machine hits both sides alike, and the ratio is taken per round.

    .venv/bin/python scripts/bench_heads.py                      # SmolLM2-135M, random heads d_R=256
    .venv/bin/python scripts/bench_heads.py --heads H.gguf --model M.gguf -p 2048 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def heads_share(heads: Path, n_params: int) -> tuple[float, int]:
    """(share of per-token multiply-adds, head multiply-adds per token) from the heads file."""
    from gguf import GGUFReader

    reader = GGUFReader(heads, "r")
    macs = 0
    for t in reader.tensors:
        if t.name.startswith("locret.blk.") and t.name.endswith(".weight"):
            macs += int(t.shape[0]) * int(t.shape[1])  # one multiply-add per weight per token
    return macs / n_params, macs


def llama_bench(model: Path, heads: Path | None, n_prompt: int, reps: int, threads: int) -> dict:
    from locret import tool_path

    cmd = [str(tool_path("llama-bench")), "-m", str(model), "-p", str(n_prompt), "-n", "0",
           "-r", str(reps), "-t", str(threads), "-o", "json"]
    if heads is not None:
        cmd += ["--locret-heads", str(heads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench_heads: llama-bench failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model name or .gguf path (default: smollm2-135m)")
    ap.add_argument("--heads", type=Path, help="heads GGUF (default: random heads, d_R = --d-r, made here)")
    ap.add_argument("--d-r", type=int, default=256, help="d_R of the random heads (default: 256)")
    ap.add_argument("-p", "--n-prompt", type=int, default=2048, help="prompt tokens per run (default: 2048)")
    ap.add_argument("--rounds", type=int, default=4, help="alternated rounds (default: 4)")
    ap.add_argument("--reps", type=int, default=2, help="llama-bench repetitions per run (default: 2)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="exit 1 if the added time exceeds share + 1 point")
    args = ap.parse_args()

    from locret import models

    model = models.resolve(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        heads = args.heads
        if heads is None:
            ckpt, heads = Path(tmp) / "random.safetensors", Path(tmp) / "heads.gguf"
            for conv in (["make-random", "--base", str(model), "--d-r", str(args.d_r), "--seed", "0", "-o", str(ckpt)],
                         ["--base", str(model), "--heads", str(ckpt), "-o", str(heads)]):
                subprocess.run([sys.executable, str(REPO / "convert" / "heads_to_gguf.py"), *conv], check=True,
                               capture_output=True)

        rows = []
        for r in range(args.rounds):
            order = [None, heads] if r % 2 == 0 else [heads, None]
            got = {}
            for h in order:
                res = llama_bench(model, h, args.n_prompt, args.reps, args.threads)
                got["heads" if h else "plain"] = res
            rows.append((got["plain"]["avg_ts"], got["heads"]["avg_ts"]))
            print(f"round {r + 1}/{args.rounds}: plain {rows[-1][0]:8.1f} tok/s, heads {rows[-1][1]:8.1f} tok/s",
                  file=sys.stderr, flush=True)
        n_params = int(got["plain"]["model_n_params"])
        share, macs = heads_share(heads, n_params)

    ratios = [h / p for p, h in rows]
    ratio = statistics.median(ratios)
    added = 1.0 / ratio - 1.0  # extra prefill time with heads, as a fraction of the plain time
    target = share + 0.01
    print(f"| pp{args.n_prompt} | plain tok/s | heads tok/s | heads/plain |")
    print("|---|---|---|---|")
    for i, (p, h) in enumerate(rows, 1):
        print(f"| round {i} | {p:.1f} | {h:.1f} | {h / p:.3f} |")
    print(f"\nmodel {model.name}: {n_params / 1e6:.2f} M params; heads {macs:,} multiply-adds per token "
          f"= {100 * share:.2f}% of the model's")
    print(f"median throughput ratio {ratio:.3f} -> added prefill time {100 * added:+.2f}% "
          f"(target <= {100 * target:.2f}%): {'OK' if added <= target else 'OVER TARGET'}")
    return 1 if args.check and added > target else 0


if __name__ == "__main__":
    sys.exit(main())
