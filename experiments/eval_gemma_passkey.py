#!/usr/bin/env python3
"""One passkey prompt past a sliding-window model's training context, answered from a bounded cache.

    .venv/bin/python experiments/eval_gemma_passkey.py                    # Gemma-3-270M, 33,000 tokens, b 2048, ub 512
    .venv/bin/python experiments/eval_gemma_passkey.py --tokens 33000 --prompts 4 --depths 0,0.33,0.67,1

Gemma-3-270M (iSWA: five of every six layers keep llama.cpp's 512-token window cache, the others evict) with its
shipped trained heads (heads/gemma3-270m.gguf), flash attention, one ubatch per batch. Each prompt is the passkey
task's (locret.tasks passkey: seed --seed, prompt index i, the key at the i-th depth of --depths) of --tokens
tokens, past the model's 32,768-token training context. Per prompt it checks and prints:
  - the cache holds b + ubatch cells and never uses more;
  - the prompt went through about (tokens - b) / ubatch evictions;
  - the greedy answer (16 tokens) holds the key.
This was the CI test `test_gemma_shipped_heads_answer_a_passkey_past_32k_tokens` (about 150 s per prompt on 2 cores);
tests/py/test_iswa.py keeps the same path at a few thousand tokens, and this script records the accuracy past 32K
(docs/results.md). Exits 0 when every prompt kept the cache bounded, evicted as expected and was answered right,
1 otherwise; --output writes the per-prompt results as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "py"))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m", help="model name or GGUF path (default gemma3-270m)")
    ap.add_argument("--heads", help="heads GGUF (default: the model's shipped heads)")
    ap.add_argument("--tokens", type=int, default=33000, help="prompt length in tokens (default 33000)")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=1, help="prompts, one per depth (default 1)")
    ap.add_argument("--depths", default="0.0", help="the key's depths, comma separated, 0-1 (default 0: right after "
                                                    "the instructions); one per prompt, the last one repeated")
    ap.add_argument("--seed", type=int, default=3, help="passkey task seed (default 3, the former test's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--output", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    try:
        depths = [float(x) for x in args.depths.split(",") if x.strip()]
    except ValueError:
        ap.error("--depths takes comma-separated numbers")
    if args.tokens < 1 or args.budget < 1 or args.ubatch < 1 or args.prompts < 1 or not depths \
            or not all(0.0 <= d <= 1.0 for d in depths):
        ap.error("--tokens, --budget, --ubatch and --prompts must be positive, --depths within 0-1")
    depths = (depths + [depths[-1]] * args.prompts)[:args.prompts]

    import locret  # noqa: F401  (points llama_cpp at our library)
    from locret import models, tasks
    from locret.evaluation import decoding
    from locret.llama import Llama

    model = models.resolve(args.model)
    heads = args.heads or models.shipped_heads(args.model)
    if not heads:
        ap.error(f"no shipped heads for {args.model}: give --heads")
    llm = Llama(model_path=str(model), n_ctx=args.tokens + 8192, n_batch=args.ubatch, n_ubatch=args.ubatch,
                locret_heads=str(heads), locret_budget=args.budget, flash_attn=True, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False)
    results, ok = [], True
    try:
        for i, depth in enumerate(depths):
            t0 = time.monotonic()
            sample = tasks.get("passkey").generate(args.seed, i, tokenize=decoding.tokenizer(llm),
                                                   n_tokens=args.tokens, depth=depth,
                                                   chat_format=decoding.chat_format(llm))
            llm.reset()
            llm.eval(sample.tokens)
            st = llm.locret_stats()
            answer, _ = decoding.greedy(llm, 16)
            bounded = st["n_cells"] == args.budget + args.ubatch and st["n_cells_used"] <= args.budget + args.ubatch
            evicted = st["n_evictions"] >= (len(sample.tokens) - args.budget) // args.ubatch - 1
            right = sample.score(answer) == 1.0
            ok &= bounded and evicted and right
            results.append({"prompt": i, "depth": depth, "prompt_tokens": len(sample.tokens), "key": sample.answers[0],
                            "answer": answer, "right": right, "n_cells": st["n_cells"],
                            "n_cells_used": st["n_cells_used"], "n_evictions": st["n_evictions"],
                            "bounded": bounded, "evicted_as_expected": evicted,
                            "seconds": round(time.monotonic() - t0, 1)})
            r = results[-1]
            print(f"prompt {i}: {r['prompt_tokens']} tokens, key at depth {depth:.2f}: {r['key']} -> {answer!r} "
                  f"({'right' if right else 'WRONG'}); cells {r['n_cells_used']}/{r['n_cells']} "
                  f"({'bounded' if bounded else 'NOT BOUNDED'}), {r['n_evictions']} evictions "
                  f"({'as expected' if evicted else 'TOO FEW'}), {r['seconds']} s", flush=True)
    finally:
        llm.close()
    n_right = sum(r["right"] for r in results)
    print(f"{Path(str(model)).name}, heads {Path(str(heads)).name}, b {args.budget}, ub {args.ubatch}: "
          f"{n_right} of {len(results)} prompts answered right")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"settings": {k: (str(v) if isinstance(v, Path) else v)
                                                        for k, v in vars(args).items()},
                                           "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
