#!/usr/bin/env python3
"""--locret-budget-mib against what a context allocates: for each installed model (SmolLM2-135M, Gemma-3-270M) and
memory size, the budget the library's rule resolves to (llama_locret_budget_for_mib), the cells, the memory it
predicts per sequence, the memory a context created with that size really holds (its K/V tensors, window cache and
Locret stores), and what one unit more would need. Prints a markdown table.

    .venv/bin/python experiments/budget_mib_table.py [--sizes 16,32,64,128] [--ubatch 512] [--n-ctx 131072]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "py"))

MIB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,32,64,128", help="memory sizes in MiB per sequence, comma-separated")
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--n-ctx", type=int, default=131072)
    args = ap.parse_args()
    try:
        sizes = [float(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error("--sizes must be numbers separated by commas")

    from locret import eviction, models
    from locret.heads import HeadsError
    from locret.llama import Llama

    print("| model | MiB | budget | cells | predicted MiB | allocated MiB | one unit more, MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in ("smollm2-135m", "gemma3-270m"):
        if not models.is_installed(name):
            continue
        model, heads = str(models.resolve(name, fetch=False)), str(models.shipped_heads(name))
        # the tools' window cache (llama.cpp's own default is a full-size one)
        kw = dict(heads=heads, n_ctx=args.n_ctx, n_ubatch=args.ubatch, swa_full=False)
        for mib in sizes:
            try:
                r = eviction.budget_for_mib(model, mib, **kw)
            except HeadsError as e:
                print(f"| {name} | {mib:g} | refused: {e} | | | | |")
                continue
            llm = Llama(model, n_ctx=args.n_ctx, n_ubatch=args.ubatch, n_batch=args.ubatch, locret_heads=heads,
                        locret_budget_mib=mib, swa_full=False, verbose=False)
            buffers = eviction.locret_buffers(llm._ctx.ctx)
            allocated = llm.locret_stats()["kv_bytes"] + buffers["score_store"] + buffers["query_store"]
            llm.close()
            predicted = r["kv_bytes"] + r["window_bytes"] + r["store_bytes"]
            above = eviction.resolve_file(model, budget=r["budget"] + 1, **kw)
            above_bytes = above["kv_bytes"] + above["window_bytes"] + above["store_bytes"]
            print(f"| {name} | {mib:g} | {r['budget']} | {r['n_cells']} | {predicted / MIB:.2f} | "
                  f"{allocated / MIB:.2f} | {above_bytes / MIB:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
