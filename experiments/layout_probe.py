"""One prompt of `locret eval`'s generated tasks under one cache layout: the greedy answer, how much of the needle
the cache holds at the end of the prompt (mean share over every (layer, KV head), and the pairs holding all of it),
and what the layout did (evictions, compactions of positions, the RoPE position the answer starts at).

For looking at a single prompt closely (e.g. why kept positions lose a passkey that compact positions find); the
accuracy tables come from `locret eval`. The settings are the evaluation's for `--methods locret`: flash attention,
the shipped plain heads, no query.

    .venv/bin/python experiments/layout_probe.py --length 32768 --positions keep --which 0
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "py"))

import llama_cpp  # noqa: E402

import locret  # noqa: E402,F401  (points llama_cpp at our library)
from locret import models, retention  # noqa: E402
from locret.evaluation import decoding, items as items_mod, worker  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="passkey", help="a generated task of `locret eval` (default passkey)")
    p.add_argument("--length", type=int, default=32768, help="prompt length in tokens")
    p.add_argument("--depths", default="0.2,0.4,0.6,0.8", help="the eval's --depths (they number the prompts)")
    p.add_argument("--which", type=int, default=0, help="which prompt of those depths (0 = the first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--positions", default="compact", help="compact, inplace, keep or keep:N")
    p.add_argument("--pool", type=int, default=15)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--ubatch", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new", type=int, default=24)
    a = p.parse_args(argv)

    model = str(models.resolve("smollm2-135m"))
    depths = [float(d) for d in a.depths.split(",")]
    vocab = items_mod.vocab_model(model)
    try:
        prompts = items_mod.task_items(vocab, [a.task], [a.length], depths, 1, seed=a.seed)
    except items_mod.ItemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        vocab.close()
    if not 0 <= a.which < len(prompts):
        print(f"error: --which {a.which} is outside 0..{len(prompts) - 1}", file=sys.stderr)
        return 1
    item = prompts[a.which]
    n_ctx = -(-(len(item.tokens) + a.max_new + 64) // 256) * 256
    # the context `locret eval --methods locret` makes for these settings
    llm = worker.make_llm(worker.RunSpec(model_path=model, method="locret", budget=a.budget,
                                         heads=str(models.shipped_heads("smollm2-135m")), stabilizers=None,
                                         local=None, n_ctx=n_ctx, ubatch=a.ubatch, threads=a.threads, pool=a.pool,
                                         positions=a.positions))
    try:
        t0 = time.time()
        llm.eval(list(item.tokens))
        after_prompt = llm.locret_stats()
        n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
        n_head_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
        held = retention.needle_shares(llm, item.extra["needles"], list(range(n_layer)), n_head_kv)
        answer, _ = decoding.greedy(llm, a.max_new)
        after_answer = llm.locret_stats()
    finally:
        llm.close()
    score = items_mod.score(item, answer, {})
    print(f"| {item.id} | {a.positions} | {len(item.tokens)} | {after_prompt['n_evictions']} | "
          f"{after_prompt['n_repositions']} -> {after_answer['n_repositions']} | {after_prompt['pos_rope_next']} | "
          + ", ".join(f"{h['label']} {h['held_share']:.3f} ({h['pairs_whole']} of {n_layer * n_head_kv} whole)"
                      for h in held)
          + f" | {answer.strip()!r} | {score:.0f} | {time.time() - t0:.0f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
