"""Passkey quality of Locret's scoring policies against full attention, in one engine.

Methods (each one llama.cpp context, greedy decoding):

- ``full``          plain llama.cpp, no eviction (only where the prompt fits the model's window)
- ``locret``        retaining heads (the trained ones by default), budget b
- ``random-heads``  the same eviction with randomly initialised heads (the paper's appendix ablation)
- ``random``        random scores per unit (the paper's random-eviction ablation), no heads
- ``streaming``     attention sinks plus the most recent units (StreamingLLM-style), no heads

Trials at one length share one filler and differ in the needle's depth (spread over 0-100 %) and
key. To save work, the trials are run in depth order and the cache state after the shared prefix
(template head + filler up to the needle) is saved and reloaded, instead of recomputed. Needles sit
at chunk-aligned offsets, so the prompt is split into the same chunks as in a single pass and the
eviction decisions are exactly a single pass's (`--check-prefix-reuse` runs one trial both ways).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import heads as heads_module
from . import evaluation
from .evaluation import decoding, worker
from .tasks import passkey

# the methods of `locret eval` but the auto-question ones (locret-q-auto, snapkv-q-auto): this script assembles its prompts from cached pieces and places no
# query (its locret-q runs the Locret-Q heads on the plain prompt), so the auto rule would change nothing here
METHODS = tuple(m for m in evaluation.METHODS if m not in evaluation.AUTO_QUERY_METHODS)
MAX_NEW_TOKENS = 32  # room for a chatty answer ("The five-digit passkey hidden in the text is 12345.")


@dataclass
class Trial:
    method: str
    length: int       # prompt tokens
    budget: int | None
    depth: float      # asked depth
    needle_at: int    # filler token offset of the needle
    key: str
    answer: str
    correct: bool
    seconds: float
    # evicting methods only, read after the prompt: per layer, the share of the key's digit tokens (both
    # statements) that its KV heads still hold, averaged over the heads; and how many (layer, KV head)
    # pairs hold every digit. They tell a key that was evicted from one that was kept and not read back.
    key_held_by_layer: list[float] | None = None
    pairs_holding_key: int | None = None


@dataclass
class Setup:
    model_path: str
    heads: str | None         # trained heads for `locret`
    random_heads: str | None  # heads for `random-heads`
    n_ubatch: int = 512
    threads: int = 2
    stabilizers: int | None = None  # n_s for every evicting method alike; None: the heads file's (or engine's) default
    kv_type: str | None = None      # K and V cache type ("f16", "q8_0", "q4_0", ...); None: llama.cpp's f16
    pool: int = 0                   # score pooling window of the heads methods (0: none, as locret eval without --pool)


def _spec(setup: Setup, method: str, budget: int | None, n_ctx: int) -> worker.RunSpec:
    heads = setup.heads if method == "locret" else setup.random_heads if method == "random-heads" else None
    return worker.RunSpec(model_path=setup.model_path, method=method, budget=budget, heads=heads,
                          stabilizers=setup.stabilizers, local=None, n_ctx=n_ctx, ubatch=setup.n_ubatch,
                          threads=setup.threads, kv_type=setup.kv_type, pool=setup.pool or None,
                          labels={"run": f"{method} b={budget}"})


def _n_ctx(method: str, length: int) -> int:
    return length + 1024 if method == "full" else max(length + 1024, 4096)


def check_settings(setup: Setup, runs: list[tuple[str, int, int | None]]) -> None:
    """Every (method, length, budget) run's settings, checked by the library's rule book before any trial starts:
    raises evaluation.EvalError with the refusal (a pooling window that is even or wider than the ubatch, ...)."""
    from .evaluation.runner import check_runs

    check_runs([(_spec(setup, method, budget, _n_ctx(method, length)), []) for method, length, budget in runs])


def _make_llm(setup: Setup, method: str, budget: int | None, n_ctx: int):
    """The same context `locret eval` makes for a method (flash attention for every method alike)."""
    return worker.make_llm(_spec(setup, method, budget, n_ctx))


def _feed_prefix(llm, tokens: list[int]) -> None:
    """Tokens that do not end the prompt: no logits, so an evicting cache treats them as prefill chunks."""
    if getattr(llm, "locret_enabled", False):
        llm.eval(tokens, prompt_continues=True)
    else:
        llm.eval(tokens)


def run_length(setup: Setup, method: str, length: int, budget: int | None, trials: int, seed: int,
               progress=None, deadline: float | None = None, done: set | None = None,
               on_trial=None) -> list[Trial]:
    """`trials` passkey trials of about `length` prompt tokens with one method.

    `done`: (method, budget, key, needle_at) of trials already recorded, skipped; `on_trial(trial)` is
    called as each trial ends (the script appends it to a JSONL file, so an interrupted run resumes)."""
    n_ctx = _n_ctx(method, length)
    llm = _make_llm(setup, method, budget, n_ctx)
    try:
        tokenize = decoding.tokenizer(llm)
        pieces = passkey.prompt_pieces(tokenize, decoding.chat_format(llm), n_filler=length)
        overhead = len(pieces.head) + len(pieces.tail) + len(tokenize(passkey.needle_text("00000"), False))
        n_filler = length - overhead
        keys = passkey.make_keys(seed + length, trials)
        depths = passkey.spread_depths(trials)
        points = passkey.aligned_insert_points(len(pieces.head), n_filler, setup.n_ubatch, depths)
        order = [i for i in sorted(range(trials), key=lambda i: points[i])
                 if done is None or (method, budget, keys[i], points[i]) not in done]
        if not order:
            return []
        results: list[Trial] = []
        snapshot, snapshot_at = None, None
        for i in order:
            if deadline is not None and time.monotonic() > deadline:
                break
            t0 = time.monotonic()
            at = points[i]
            needle = tokenize(passkey.needle_text(keys[i]), False)
            if at == 0:
                llm.reset()
                rest = pieces.build(n_filler, 0, needle)
            else:
                if snapshot_at != at:
                    if snapshot is None:
                        llm.reset()
                        _feed_prefix(llm, pieces.head + pieces.filler[:at])
                    else:
                        llm.load_state(snapshot)
                        _feed_prefix(llm, pieces.filler[snapshot_at:at])
                    snapshot, snapshot_at = llm.save_state(), at
                else:
                    llm.load_state(snapshot)
                rest = needle + pieces.filler[at:n_filler] + pieces.tail
            llm.eval(rest)
            held, pairs = None, None
            if getattr(llm, "locret_enabled", False):
                first = len(pieces.head) + at  # logical position of the needle's first token
                held, pairs = key_held(llm, [first + k for k in passkey.key_token_offsets(needle, llm.detokenize)])
            answer = decoding.greedy(llm, MAX_NEW_TOKENS)[0]
            prompt_tokens = len(pieces.head) + n_filler + len(needle) + len(pieces.tail)
            results.append(Trial(method, prompt_tokens, budget, depths[i], at, keys[i], answer.strip(), passkey.score(answer, keys[i]),
                                 round(time.monotonic() - t0, 2), held, pairs))
            if on_trial is not None:
                on_trial(results[-1])
            if progress is not None:
                progress.update(1)
                progress.set_postfix(method=method, length=length, acc=f"{np.mean([r.correct for r in results]):.2f}")
        return sorted(results, key=lambda r: r.depth)
    finally:
        llm.close()


def key_held(llm, positions: list[int]) -> tuple[list[float], int]:
    """Per evicting layer (every layer but a sliding-window model's window layers), the share of `positions`
    (logical) its KV heads hold, mean over heads; and the number of (layer, KV head) pairs that hold all of them."""
    _, n_head_kv = worker.kv_heads(llm)
    wanted = np.asarray(positions)
    by_layer, pairs = [], 0
    for il in worker.evicting_layers(llm):
        shares = [float(np.isin(wanted, llm.locret_retained(il, ih)).mean()) for ih in range(n_head_kv)]
        by_layer.append(round(float(np.mean(shares)), 3))
        pairs += sum(share == 1.0 for share in shares)
    return by_layer, pairs


def check_prefix_reuse(setup: Setup, method: str, length: int, budget: int | None, seed: int,
                       return_logits: bool = False):
    """One trial at a mid depth run twice: with the saved-prefix shortcut and in a single pass. Returns both
    answers (equal when the shortcut is exact), or with `return_logits` both next-token logits."""
    llm = _make_llm(setup, method, budget, max(length + 1024, 4096))
    try:
        pieces = passkey.prompt_pieces(decoding.tokenizer(llm), decoding.chat_format(llm), n_filler=length)
        needle = decoding.tokenizer(llm)(passkey.needle_text(passkey.make_keys(seed, 1)[0]), False)
        n_filler = length - len(pieces.head) - len(pieces.tail) - len(needle)
        at = passkey.aligned_insert_points(len(pieces.head), n_filler, setup.n_ubatch, [0.5])[0]
        llm.reset()
        llm.eval(pieces.build(n_filler, at, needle))
        single = decoding.last_logits(llm) if return_logits else decoding.greedy(llm, MAX_NEW_TOKENS)[0]
        llm.reset()
        _feed_prefix(llm, pieces.head + pieces.filler[:at])
        state = llm.save_state()
        llm.reset()
        llm.load_state(state)
        llm.eval(needle + pieces.filler[at:n_filler] + pieces.tail)
        reused = decoding.last_logits(llm) if return_logits else decoding.greedy(llm, MAX_NEW_TOKENS)[0]
        return single, reused
    finally:
        llm.close()


def summarize(trials: list[Trial]) -> list[dict]:
    """Accuracy per (length, method, budget), with accuracy by depth fifth."""
    groups: dict[tuple, list[Trial]] = {}
    for t in trials:
        groups.setdefault((t.length // 1000, t.method, t.budget), []).append(t)
    rows = []
    for (_, method, budget), group in groups.items():
        fifths = []
        for k in range(5):
            sel = [t.correct for t in group if min(4, int(t.depth * 5)) == k]
            fifths.append(round(float(np.mean(sel)), 3) if sel else None)
        measured = [t for t in group if t.key_held_by_layer is not None]
        rows.append({"length": int(np.mean([t.length for t in group])), "method": method, "budget": budget,
                     "trials": len(group), "accuracy": round(float(np.mean([t.correct for t in group])), 3),
                     "accuracy_by_depth_fifth": fifths,
                     "key_held": round(float(np.mean([np.mean(t.key_held_by_layer) for t in measured])), 3)
                     if measured else None,
                     "pairs_holding_key": round(float(np.mean([t.pairs_holding_key for t in measured])), 1)
                     if measured else None,
                     "seconds_per_trial": round(float(np.mean([t.seconds for t in group])), 1)})
    return rows


def markdown_table(rows: list[dict]) -> str:
    """One row per (length, method, budget). "key held": the share of the key's digit tokens the cache
    still holds after the prompt, over layers and KV heads, and the (layer, KV head) pairs holding all
    of them, both averaged over trials (evicting methods only)."""
    lines = ["| prompt tokens | method | budget | trials | accuracy | by depth 0-20/20-40/40-60/60-80/80-100 % "
             "| key held: share / pairs |",
             "|---:|---|---:|---:|---:|---|---|"]
    for r in rows:
        fifths = " / ".join("-" if f is None else f"{f:.2f}" for f in r["accuracy_by_depth_fifth"])
        held = "-" if r.get("key_held") is None else f"{r['key_held']:.2f} / {r['pairs_holding_key']:.1f}"
        lines.append(f"| {r['length']} | {r['method']} | {r['budget'] or '-'} | {r['trials']} | "
                     f"{r['accuracy']:.2f} | {fifths} | {held} |")
    return "\n".join(lines)


def write_results(path: Path, trials: list[Trial], rows: list[dict], settings: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, "summary": rows, "trials": [asdict(t) for t in trials]},
                               indent=1))
    path.with_suffix(".md").write_text(markdown_table(rows) + "\n")


default_random_heads = heads_module.cached_random_heads  # the name scripts/eval_passkey.py uses
