"""`locret inspect`: what the cache kept of a prompt, and whether a given fact (the needle) survived.

    locret inspect --prompt-file doc.txt --needle "4-7-2-9" [--question Q] [--query Q] [--budget 2048]
                   [--ubatch 512] [--pool 15] [--heads H.gguf] [--layers 0,10,29] [--json out.json]

Runs the prompt (the document, then the question) through `locret.Llama` with the heads' scores recorded, then reads
every (layer, KV head)'s retained positions after the prompt. For each it reports how many of the needle's tokens are
held, the best rank of a needle token by the heads' own score among all prompt tokens (1 = the top-scored token),
and the longest runs of retained positions as text with their mean score: what the cache holds instead. With
`--query` the question is also placed at the start and pinned (Locret-Q); the report says how many tokens are pinned.

Why: eviction failures on long inputs are about which spans survive. The diagnostic that found score pooling
(README, "Score pooling") was this: the needle's tokens were scattered over a few heads, never whole in most.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass
class PairReport:
    layer: int
    head: int
    needle_held: int          # needle tokens retained
    needle_best_rank: int     # best rank (1-based) of a needle token by the heads' own score over the prompt
    runs: list                # [(first position, length, mean score, text)] of the longest retained runs


def _runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """(first, length) of each run of consecutive positions."""
    if positions.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks + 1, [positions.size]))
    return [(int(positions[a]), int(b - a)) for a, b in zip(starts, ends)]


def needle_positions(pieces: list[bytes], needle: str, n_prompt: int) -> list[int]:
    """Prompt positions of the tokens that overlap the needle's first occurrence in the detokenized prompt."""
    text = b"".join(pieces[:n_prompt])
    at = text.find(needle.encode())
    if at < 0:
        raise ValueError(f"the needle {needle!r} is not in the prompt")
    ends = np.cumsum([len(p) for p in pieces[:n_prompt]])
    stop = at + len(needle.encode())
    return [i for i in range(n_prompt) if ends[i] > at and ends[i] - len(pieces[i]) < stop]


def inspect_prompt(*, model: str, prompt: str, needle: str, budget: int, ubatch: int, heads: str | None = None,
                   pool: int | None = None, query: str | None = None, layers: list[int] | None = None,
                   n_runs: int = 5, threads: int = 2, stabilizers: int | None = None,
                   local: int | None = None, chat: bool = False) -> dict:
    """The report as a dict (see the module's docstring). `chat`: the prompt is the user turn of the model's chat
    template; `query`: placed at the start of the prompt (of the user turn) and pinned."""
    import llama_cpp

    from . import eviction, heads as heads_api
    from .evaluation import decoding
    from .llama import Llama
    from .query import place_query

    vocab = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    n_est = len(vocab.tokenize(prompt.encode(), add_bos=True, special=True)) + 256
    vocab.close()
    n_ctx = -(-n_est // 256) * 256
    llm = Llama(model, n_ctx=max(n_ctx, 512), n_batch=max(n_ctx, 512), n_ubatch=ubatch, locret_heads=heads,
                locret_budget=budget, locret_pool=pool, locret_stabilizers=stabilizers, locret_local=local,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    try:
        text = place_query(query, prompt) if query else prompt
        template = decoding.chat_format(llm) if chat else None
        if chat and template is None:
            raise ValueError("--chat: the model has no chat template")
        text = template(text) if template else text
        ids = llm.tokenize(text.encode(), add_bos=True, special=bool(template))
        if query:
            vocab_ptr = llama_cpp.llama_model_get_vocab(llm._model.model)
            llm.locret_pin_next_prompt(eviction.query_tokens(vocab_ptr, ids, query, budget))
        heads_api.record_scores(llm)
        llm.eval(ids)
        scores, recorded = heads_api.recorded_scores(llm)     # [n_layer, n_head_kv, n_tokens], decode order
        stats = llm.locret_stats()
        n_prompt = len(ids)
        pieces = [llm.detokenize([t], special=True) for t in ids]
        needle_pos = needle_positions(pieces, needle, n_prompt)
        first = {}
        for i, p in enumerate(recorded.tolist()):
            if p < n_prompt and p not in first:
                first[p] = i
        own = scores[:, :, [first[q] for q in range(n_prompt)]]  # [n_layer, n_head_kv, n_prompt] heads' own scores
        n_layer, n_head_kv, _ = own.shape
        chosen = layers if layers else list(range(n_layer))
        bad = [il for il in chosen if not 0 <= il < n_layer]
        if bad:
            raise ValueError(f"layers {bad} are outside 0..{n_layer - 1}")
        pairs = []
        for il in range(n_layer):
            for ih in range(n_head_kv):
                kept = llm.locret_retained(il, ih)
                kept = kept[kept < n_prompt]
                held = int(np.isin(needle_pos, kept).sum())
                order = np.argsort(-own[il, ih], kind="stable")
                rank = np.empty(n_prompt, dtype=np.int64)
                rank[order] = np.arange(1, n_prompt + 1)
                runs = sorted(_runs(np.sort(kept)), key=lambda r: -r[1])[:n_runs] if il in chosen else []
                pairs.append(PairReport(
                    layer=il, head=ih, needle_held=held, needle_best_rank=int(rank[needle_pos].min()),
                    runs=[(a, n, round(float(own[il, ih, a:a + n].mean()), 4),
                           b"".join(pieces[a:a + n]).decode(errors="replace")) for a, n in runs]))
        held = np.array([p.needle_held for p in pairs])
        return {
            "prompt_tokens": n_prompt, "needle": needle, "needle_tokens": len(needle_pos),
            "needle_positions": needle_pos, "pinned": int(stats["n_pinned"]), "budget": int(stats["budget"]),
            "pool": int(stats["pool"]), "evictions": int(stats["n_evictions"]),
            "needle_held_share": round(float(held.mean() / len(needle_pos)), 4),
            "pairs_holding_all": int((held == len(needle_pos)).sum()), "pairs": len(pairs),
            "by_pair": [asdict(p) for p in pairs], "layers_shown": chosen,
        }
    finally:
        llm.close()


def print_report(report: dict) -> None:
    print(f"prompt: {report['prompt_tokens']} tokens, budget {report['budget']}, pooling {report['pool'] or 'none'}, "
          f"{report['evictions']} evictions, pinned {report['pinned']} (Locret-Q)")
    print(f"needle {report['needle']!r}: {report['needle_tokens']} tokens at positions "
          f"{report['needle_positions'][0]}..{report['needle_positions'][-1]}")
    print(f"held: {report['needle_held_share']:.2f} of its tokens on average over {report['pairs']} (layer, KV head) "
          f"pairs; all of them in {report['pairs_holding_all']}")
    for p in report["by_pair"]:
        if p["layer"] not in report["layers_shown"]:
            continue
        print(f"\nlayer {p['layer']} head {p['head']}: needle {p['needle_held']}/{report['needle_tokens']} held, "
              f"best rank {p['needle_best_rank']} of {report['prompt_tokens']}; longest retained runs:")
        for first, n, mean, text in p["runs"]:
            shown = text.replace("\n", " ")
            shown = shown if len(shown) <= 100 else shown[:97] + "..."
            print(f"  @{first:>7} x{n:<4} score {mean:+.3f}  {shown}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from . import models

    p.add_argument("--prompt-file", required=True, type=Path, help="the document (text)")
    p.add_argument("--needle", required=True, help="text whose tokens to follow (its first occurrence)")
    p.add_argument("--question", help="appended after the document (\"\\n\\nQuestion: ...\")")
    p.add_argument("--query", help="Locret-Q: placed at the start and pinned (give the question again); without "
                   "--heads, the model's shipped Locret-Q heads where there are some")
    p.add_argument("--chat", action="store_true", help="the prompt is the user turn of the model's chat template")
    p.add_argument("--model", default=models.DEFAULT_MODEL, help=f"model name or .gguf path (default {models.DEFAULT_MODEL})")
    p.add_argument("--heads", help="retaining heads (default: embedded in the model, or shipped in heads/)")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--ubatch", type=int, default=512)
    p.add_argument("--stabilizers", type=int)
    p.add_argument("--local", type=int)
    p.add_argument("--pool", type=int, help="score pooling window (default: none)")
    p.add_argument("--layers", help="layers to show runs for, comma-separated (default: all)")
    p.add_argument("--runs", type=int, default=5, help="longest retained runs shown per (layer, KV head)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--json", type=Path, help="also write the whole report as JSON")


def run_cli(args: argparse.Namespace) -> int:
    from . import models, planner

    model = models.resolve(args.model)
    heads = args.heads
    if heads is None:
        found, _ = planner.resolve_heads(args.model, model, planner.read_model(model), None,
                                         query=bool(args.query))
        heads = str(found) if found is not None else None
    if not args.prompt_file.is_file():
        raise ValueError(f"cannot read the prompt file {args.prompt_file}")
    prompt = args.prompt_file.read_text()
    if args.question:
        prompt += "\n\nQuestion: " + args.question + "\n"
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    report = inspect_prompt(model=str(model), prompt=prompt, needle=args.needle, budget=args.budget,
                            ubatch=args.ubatch, heads=heads, pool=args.pool, query=args.query, layers=layers,
                            n_runs=args.runs, threads=args.threads, stabilizers=args.stabilizers, local=args.local,
                            chat=args.chat)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0
