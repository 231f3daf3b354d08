#!/usr/bin/env python3
"""SAGE-KV checked against its paper: the paper's selection written again in PyTorch, beside our engine's.

    .venv/bin/python experiments/sage_reference.py --tasks passkey,niah --length 6144 --depths 0.25,0.5,0.75 \\
        --budget 1024 --threads 1

Why: `--locret-policy sage` selects inside llama.cpp (a query store, a scoring graph, compaction), and its own test
(tests/py/test_sage.py) checks it against numpy on the engine's own query and K cache. This script checks it from
outside: the model runs again in PyTorch (transformers, weights dequantized from the same GGUF), and the paper's
selection is computed there from PyTorch's own post-RoPE queries and keys after a full prefill:

- the last prompt token's attention probabilities, per layer and query head (softmax of scale q.k);
- per (layer, KV head): the first b/4 units (sinks), the last b/4 (recent, the last token among them) and the best
  b - 2(b/4) of the rest by the largest probability over the KV head's group of query heads (our split of the
  paper's: the paper takes each query head's own top b/(2G) and their union; that variant's overlap is printed too).

Per prompt (the `locret eval` task generator's, items.task_items, with the settings the docs' 6K SAGE-KV cell used,
runner.plan_runs) it prints the Jaccard overlap of the kept sets over all (layer, KV head), the share of the answer
needles' tokens kept, and greedy answers: PyTorch with full attention; PyTorch with its kept set applied as a
per-(layer, KV head) mask over the prompt for the generated tokens (kept units at their original positions, as the
paper keeps them); the same set with positions compacted to 0..b-1 (as our engine's compaction places them: SAGE-KV
takes no other layout); our engine. Every generated token stays visible in both PyTorch variants, as in our engine
until its cache passes b + ubatch (the paper slides its recent window over them, which for a short answer drops only
the oldest filler units of that window). First it checks that PyTorch and llama.cpp agree without eviction (the same
greedy tokens on a short prompt). Exits 0 after printing the table, 2 on bad arguments, 1 if the agreement check
fails.
"""
from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "py"))

ATTENTION_NAME = "sage_reference"   # the attention implementation this script registers with transformers
CHECK_PROMPT = "Explain in a few sentences why the sky is blue."   # 20 greedy tokens without an end of turn
NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------------------------
# PyTorch: the model, its attention, the paper's selection


class ReferenceAttention:
    """The attention of every layer, as a transformers attention implementation (batch 1, no padding), so that the
    paper's inputs are read where they are made and its kept sets can be applied without another model:

    - a full prefill (as many queries as keys) runs causal SDPA and records the last query's probabilities over
      all units per query head, in float64 (the selection's input: post-RoPE query and keys, exactly);
    - a later step (one new token, or a few) runs eager attention; with `keep` set, each KV head (and its group
      of query heads) sees only its kept prompt units and every generated token.
    """

    def __init__(self):
        self.last_probs: dict[int, "torch.Tensor"] = {}   # layer -> [n_head, n_prompt]
        self.keep: dict[int, "torch.Tensor"] | None = None  # layer -> bool [n_head_kv, n_prompt]

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        import torch
        import torch.nn.functional as F

        n_q, n_k = query.shape[2], key.shape[2]
        group = query.shape[1] // key.shape[1]
        if n_q == n_k:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
            k64 = key[0].repeat_interleave(group, 0).double()
            logits = scaling * torch.einsum("hd,hnd->hn", query[0, :, -1].double(), k64)
            self.last_probs[module.layer_idx] = torch.softmax(logits, dim=-1)
            return out.transpose(1, 2).contiguous(), None
        k = key.repeat_interleave(group, 1)
        v = value.repeat_interleave(group, 1)
        logits = scaling * torch.matmul(query, k.transpose(2, 3))
        causal = torch.arange(n_k)[None, :] > (n_k - n_q + torch.arange(n_q))[:, None]
        logits = logits.masked_fill(causal, NEG_INF)
        if self.keep is not None:
            keep = self.keep[module.layer_idx]
            hidden = torch.zeros(keep.shape[0], n_k, dtype=torch.bool)
            hidden[:, :keep.shape[1]] = ~keep
            logits = logits.masked_fill(hidden.repeat_interleave(group, 0)[None, :, None, :], NEG_INF)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(probs, v).transpose(1, 2).contiguous(), None


def load_torch_model(gguf: Path, threads: int):
    """SmolLM2 (or any llama-architecture GGUF) in float32 PyTorch through transformers' GGUF loader, its attention
    routed through a fresh ReferenceAttention. Returns (model, attention). The first load of a file converts it
    (~25 s: transformers parses the GGUF's vocabulary twice), later ones read locret.hf_gguf's saved copy."""
    import torch
    from transformers import AttentionInterface

    from locret import hf_gguf

    torch.set_num_threads(threads)
    attention = ReferenceAttention()
    AttentionInterface.register(ATTENTION_NAME, attention)
    model = hf_gguf.load_model(gguf, dtype=torch.float32, attn_implementation=ATTENTION_NAME)
    model.eval()
    return model, attention


def torch_prefill(model, attention: ReferenceAttention, tokens) -> tuple[object, "torch.Tensor"]:
    """Full attention over the whole prompt at once (the paper's prefill): (the KV cache, the last logits);
    `attention.last_probs` holds the last token's probabilities per layer afterwards."""
    import torch

    attention.keep, attention.last_probs = None, {}
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(tokens)]), use_cache=True, logits_to_keep=1)
    return out.past_key_values, out.logits[0, -1]


def split(budget: int) -> tuple[int, int, int]:
    """(sinks, recent, chosen by score): the paper's b/4 + b/4 + the rest, as the engine's
    LLAMA_LOCRET_SAGE_SINK_DIV / _RECENT_DIV floor them."""
    sinks = recent = budget // 4
    return sinks, recent, budget - sinks - recent


def select(last_probs: dict, n_head_kv: int, budget: int) -> list[list[list[int]]]:
    """The paper's kept sets with our split: [layer][KV head] -> sorted logical positions. Each KV head's score of a
    unit is the largest probability over its group of query heads; ties go to the earlier position (a stable sort).
    A prompt within the budget is kept whole."""
    import torch

    sinks, recent, n_top = split(budget)
    out = []
    for il in sorted(last_probs):
        probs = last_probs[il]
        n = probs.shape[1]
        if n <= budget:
            out.append([list(range(n)) for _ in range(n_head_kv)])
            continue
        scores = probs.view(n_head_kv, -1, n).amax(dim=1)
        layer = []
        for h in range(n_head_kv):
            middle = scores[h, sinks:n - recent]
            order = torch.sort(-middle, stable=True).indices[:n_top] + sinks
            layer.append(list(range(sinks)) + sorted(order.tolist()) + list(range(n - recent, n)))
        out.append(layer)
    return out


def select_union(last_probs: dict, n_head_kv: int, budget: int) -> list[list[list[int]]]:
    """The paper's own GQA rule (its appendix): each query head's top b/(2G) of the middle units, their union per
    KV head, with the b/4 sinks and b/4 recent units. Fewer units than the budget where the heads agree."""
    import torch

    sinks, recent, _ = split(budget)
    out = []
    for il in sorted(last_probs):
        probs = last_probs[il]
        n_head, n = probs.shape
        group = n_head // n_head_kv
        k = budget // (2 * group)
        layer = []
        for h in range(n_head_kv):
            chosen: set[int] = set()
            for q in range(h * group, (h + 1) * group):
                order = torch.sort(-probs[q, sinks:n - recent], stable=True).indices[:k] + sinks
                chosen.update(order.tolist())
            layer.append(list(range(sinks)) + sorted(chosen) + list(range(n - recent, n)))
        out.append(layer)
    return out


def keep_masks(kept: list[list[list[int]]], n_prompt: int) -> dict:
    """ReferenceAttention.keep from kept sets: layer -> bool [n_head_kv, n_prompt]."""
    import torch

    out = {}
    for il, layer in enumerate(kept):
        mask = torch.zeros(len(layer), n_prompt, dtype=torch.bool)
        for h, positions in enumerate(layer):
            mask[h, positions] = True
        out[il] = mask
    return out


def compacted_cache(model, cache, kept: list[list[list[int]]]):
    """A new KV cache holding per (layer, KV head) only the kept units, in position order at positions 0..b-1, their
    keys rotated from their old RoPE position to the new one (what our engine's compaction does). Every head keeps
    the same count, so later tokens continue at position b."""
    import torch
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    new = DynamicCache()
    for il, layer in enumerate(kept):
        keys, values = cache.layers[il].keys, cache.layers[il].values   # [1, n_head_kv, n, d]
        ks, vs = [], []
        for h, positions in enumerate(layer):
            idx = torch.tensor(positions)
            shift = (torch.arange(len(positions)) - idx)[None, :]
            cos, sin = model.model.rotary_emb(values, position_ids=shift)
            k = keys[:, h:h + 1, idx]
            ks.append(apply_rotary_pos_emb(k, k, cos, sin)[0])
            vs.append(values[:, h:h + 1, idx])
        new.update(torch.cat(ks, 1), torch.cat(vs, 1), il)
    return new


def greedy_torch(model, cache, logits, n_new: int, is_eog) -> list[int]:
    """Greedy tokens after a prefill whose last logits are `logits`, extending `cache`; stops at end of generation
    like decoding.greedy does."""
    import torch

    out: list[int] = []
    with torch.inference_mode():
        for i in range(n_new):
            token = int(torch.argmax(logits))
            if is_eog(token):
                break
            out.append(token)
            if i + 1 < n_new:
                logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]
    return out


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp: agreement without eviction, and the engine's SAGE-KV


def vocab_tools(vocab):
    """(tokenize(text, add_bos), detokenize(tokens) -> str, is_eog(token)) of the evaluation's vocabulary."""
    import llama_cpp

    from locret.evaluation import decoding

    eog = vocab._model.vocab
    return (decoding.tokenizer(vocab), lambda toks: vocab.detokenize(list(toks)).decode(errors="replace"),
            lambda t: bool(llama_cpp.llama_vocab_is_eog(eog, t)))


@dataclass
class Agreement:
    """PyTorch against llama.cpp without eviction: if they disagree here, no kept-set comparison means anything."""
    tokens_llama: list[int]
    tokens_torch: list[int]           # PyTorch's own greedy tokens
    argmax_agree: int                 # steps where PyTorch's top token is llama.cpp's, on llama.cpp's path
    max_abs_diff: float               # largest |logit difference| over those steps
    logit_spread: float               # the logits' range at the first step, for scale

    @property
    def same_tokens(self) -> bool:
        return self.tokens_llama == self.tokens_torch

    def line(self) -> str:
        return (f"PyTorch against llama.cpp, full attention, {len(self.tokens_llama)} greedy tokens: "
                f"{'same tokens' if self.same_tokens else 'DIFFERENT tokens'}; top token agrees at "
                f"{self.argmax_agree}/{len(self.tokens_llama)} steps; max |logit difference| {self.max_abs_diff:.3f} "
                f"(first step's logits span {self.logit_spread:.1f})")


def check_agreement(model, attention, gguf: Path, vocab, threads: int, n_new: int = 20) -> Agreement:
    """llama.cpp (full attention, no eviction) and PyTorch on one short chat prompt: llama.cpp's greedy tokens with
    their logits, PyTorch's logits on the same tokens (teacher forced) and PyTorch's own greedy tokens. Quantized
    weights and activations in llama.cpp make the logits differ by a little; the tokens must not."""
    import numpy as np
    import torch

    from locret.evaluation import decoding
    from locret.llama import Llama

    tokenize, _, is_eog = vocab_tools(vocab)
    prompt = tokenize(decoding.chat_format(vocab)(CHECK_PROMPT), True)
    llm = Llama(str(gguf), n_ctx=512, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                flash_attn=True, verbose=False)
    try:
        llm.eval(prompt)
        ours, logits_llama = [], []
        for _ in range(n_new):
            logits = decoding.last_logits(llm)
            token = int(np.argmax(logits))
            if is_eog(token):
                break
            ours.append(token)
            logits_llama.append(logits)
            llm.eval([token])
    finally:
        llm.close()
    attention.keep = None
    with torch.inference_mode():
        forced = model(input_ids=torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(ours)]
    forced = forced.double().numpy()
    cache, first = torch_prefill(model, attention, prompt)
    own = greedy_torch(model, cache, first, n_new, is_eog)
    diffs = np.abs(forced - np.stack(logits_llama)) if ours else np.zeros((1, 1))
    return Agreement(ours, own, int(sum(int(np.argmax(f)) == t for f, t in zip(forced, ours))), float(diffs.max()),
                     float(np.ptp(logits_llama[0])) if ours else 0.0)


def eval_run(args, vocab, gguf: Path):
    """The items and the `locret eval` run spec of method sage at the budget: the generator and the settings the
    docs' SAGE-KV cells used (ubatch 512, flash attention, the context sized for the longest prompt)."""
    from locret.evaluation import items as items_module, runner

    cfg = runner.EvalConfig(model=str(gguf), output=Path("."), tasks=args.tasks, lengths=[args.length],
                            depths=args.depths, samples=1, seed=args.seed, methods=["sage"], budgets=[args.budget],
                            threads=args.threads, max_new_tokens=args.max_new_tokens, heatmaps=0, plots=False)
    runner.apply_device(cfg, None)
    items = items_module.task_items(vocab, cfg.tasks, cfg.lengths, cfg.depths, cfg.samples, cfg.seed,
                                    cfg.max_new_tokens)
    (spec, _), = runner.plan_runs(cfg, items, gguf, None, {}, None, Path("."))[0]
    return items, spec


def engine_answer(llm, spec, item) -> tuple[str, list[list[list[int]]]]:
    """Our engine on one item, as `locret eval`'s worker runs it (chunked prefill, greedy answer): (answer, its kept
    prompt positions per [layer][KV head]). The selection happens at the first token after the prompt; an answer
    that ends at once decodes that token so that the kept sets exist."""
    import numpy as np

    from locret.evaluation import decoding, worker

    record = worker.run_item(llm, spec, item, True)
    if llm.locret_stats()["n_evictions"] == 0:
        llm.eval([int(np.argmax(decoding.last_logits(llm)))])
    n_prompt = len(item.tokens)
    n_layer, n_head_kv = worker.kv_heads(llm)
    kept = [[[int(p) for p in llm.locret_retained(il, h) if p < n_prompt] for h in range(n_head_kv)]
            for il in range(n_layer)]
    return record["answer"], kept


# ---------------------------------------------------------------------------------------------------------------
# comparison


def jaccard(a: list[list[list[int]]], b: list[list[list[int]]]) -> list[float]:
    """|A and B| / |A or B| per (layer, KV head), layer-major."""
    out = []
    for la, lb in zip(a, b, strict=True):
        for ha, hb in zip(la, lb, strict=True):
            sa, sb = set(ha), set(hb)
            out.append(len(sa & sb) / max(len(sa | sb), 1))
    return out


def needle_held(kept: list[list[list[int]]], spans) -> float:
    """The share of (layer, KV head, answer-needle token) that is kept: 1.0 when every pair holds every token of
    every answer needle."""
    needle = [t for label, start, end in spans if label == "answer" for t in range(start, end)]
    if not needle:
        return float("nan")
    held = [sum(t in s for t in needle) / len(needle) for layer in kept for s in map(set, layer)]
    return sum(held) / len(held)


def cut_ratio(last_probs: dict, n_head_kv: int, budget: int, ours: list[list[list[int]]]) -> float:
    """The least, over (layer, KV head), of PyTorch's score of the worst unit our engine chose among the middle units
    over PyTorch's score at its own cut (its b - 2(b/4)-th best): 1.0 or more where the engine chose PyTorch's top
    units, a little under 1 where it differs only by near-ties at the cut (llama.cpp's rounding moves them), near 0
    where it ranks by something else."""
    import torch

    sinks, recent, n_top = split(budget)
    worst = float("inf")
    for il in sorted(last_probs):
        probs = last_probs[il]
        n = probs.shape[1]
        scores = probs.view(n_head_kv, -1, n).amax(dim=1)
        for h in range(n_head_kv):
            cut = torch.sort(scores[h, sinks:n - recent], descending=True).values[n_top - 1]
            chosen = [p for p in ours[il][h] if sinks <= p < n - recent]
            worst = min(worst, float(scores[h, chosen].min() / cut))
    return worst


@dataclass
class Row:
    item: str
    needle: str
    overlap_mean: float
    overlap_min: float
    overlap_union: float              # our kept sets against the paper's per-head union
    cut_ratio: float                  # cut_ratio of our chosen units
    held_torch: float
    held_ours: float
    answers: dict = field(default_factory=dict)   # variant -> (text, score)
    kept_torch: list = field(default_factory=list, repr=False)   # [layer][KV head] -> positions
    kept_ours: list = field(default_factory=list, repr=False)


def compare_item(model, attention, item, llm, spec, budget: int, n_new: int, vocab) -> Row:
    """One prompt through PyTorch (full prefill, selection, three greedy answers) and our engine."""
    from locret import tasks

    _, detok, is_eog = vocab_tools(vocab)
    n_head_kv = model.config.num_key_value_heads
    cache, first = torch_prefill(model, attention, item.tokens)
    kept = select(attention.last_probs, n_head_kv, budget)
    union = select_union(attention.last_probs, n_head_kv, budget)
    prompt_cache = copy.deepcopy(cache)
    full = greedy_torch(model, cache, first, n_new, is_eog)
    compact = greedy_torch(model, compacted_cache(model, prompt_cache, kept), first, n_new, is_eog)
    attention.keep = keep_masks(kept, len(item.tokens))
    masked = greedy_torch(model, prompt_cache, first, n_new, is_eog)
    attention.keep = None
    ours, ours_kept = engine_answer(llm, spec, item)

    score = tasks.get(item.source.split("@")[0]).score
    texts = {"full": detok(full), "torch-SAGE": detok(masked), "torch-SAGE compact": detok(compact), "ours": ours}
    overlaps = jaccard(kept, ours_kept)
    spans = item.extra["needles"]
    needle = " ".join(str(a) for a in item.answers)
    return Row(item.id, needle, sum(overlaps) / len(overlaps), min(overlaps),
               sum(jaccard(union, ours_kept)) / len(overlaps),
               cut_ratio(attention.last_probs, n_head_kv, budget, ours_kept),
               needle_held(kept, spans), needle_held(ours_kept, spans),
               {k: (v, score(v, item.answers)) for k, v in texts.items()}, kept, ours_kept)


def verdict(score: float) -> str:
    """The task's score in words for the table (niah scores a share of its numbers)."""
    return "right" if score >= 1.0 else "wrong" if score <= 0.0 else f"{score:.2f}"


def cell(text: str, score: float, width: int = 64) -> str:
    """An answer for a table cell: one line, at most `width` characters, with its verdict."""
    line = " ".join(text.split()).replace("|", "/")
    line = line if len(line) <= width else line[:width - 1] + "…"
    return f"`{line}` {verdict(score)}" if line else f"(empty) {verdict(score)}"


VARIANTS = ("full", "torch-SAGE", "torch-SAGE compact", "ours")


def markdown_table(rows: list[Row]) -> str:
    """The rows as the table of docs/experiments/results-history.md shows (answers shortened; the whole answers are
    printed above it)."""
    head = ("| prompt | needle | overlap mean / min | needle held torch / ours | " +
            " | ".join(f"answer {v}" for v in VARIANTS) + " |")
    lines = [head, "|" + "---|" * (4 + len(VARIANTS))]
    for r in rows:
        lines.append(f"| {r.item} | {r.needle} | {r.overlap_mean:.3f} / {r.overlap_min:.3f} | "
                     f"{r.held_torch:.2f} / {r.held_ours:.2f} | " +
                     " | ".join(cell(*r.answers[v]) for v in VARIANTS) + " |")
    return "\n".join(lines)


def agreement_counts(rows: list[Row]) -> str:
    """Which answers are the same text (whole answers, not the table's shortened cells): whether the paper's layout
    answers as full attention does, and whether our answer is the one of the layout our engine uses."""
    def same(a: str, b: str) -> int:
        return sum(r.answers[a][0].strip() == r.answers[b][0].strip() for r in rows)

    n = len(rows)
    return (f"same answer as PyTorch with full attention: torch-SAGE {same('torch-SAGE', 'full')}/{n}, torch-SAGE "
            f"compact {same('torch-SAGE compact', 'full')}/{n}, ours {same('ours', 'full')}/{n}; ours the same as "
            f"torch-SAGE {same('ours', 'torch-SAGE')}/{n}, as torch-SAGE compact "
            f"{same('ours', 'torch-SAGE compact')}/{n}")


# ---------------------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, checked before anything slow loads (argparse exits 2 with the reason)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="passkey,niah",
                    help="comma-separated `locret eval` tasks (default passkey,niah)")
    ap.add_argument("--length", type=int, default=6144, help="prompt tokens asked (default 6144)")
    ap.add_argument("--depths", default="0.25,0.5,0.75", help="needle depths, comma separated, 0-1")
    ap.add_argument("--budget", type=int, default=1024, help="units per layer and KV head (default 1024)")
    ap.add_argument("--threads", type=int, default=2, help="threads for PyTorch and llama.cpp (default 2)")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="greedy answer length (default 24)")
    ap.add_argument("--seed", type=int, default=0, help="task seed (default 0, the eval's)")
    ap.add_argument("--model", default="smollm2-135m", help="model name or GGUF path (default smollm2-135m)")
    args = ap.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        args.depths = [float(x) for x in args.depths.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--depths takes comma-separated numbers, got {args.depths!r}")
    from locret import tasks

    unknown = [t for t in args.tasks if t not in tasks.TASKS]
    if not args.tasks or unknown:
        ap.error(f"unknown task(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(tasks.TASKS)}")
    if not args.depths or not all(0.0 <= d <= 1.0 for d in args.depths):
        ap.error("--depths must be numbers within 0-1")
    if args.budget < 8:
        ap.error(f"--budget must be at least 8 (b/4 sinks, b/4 recent, the rest chosen), got {args.budget}")
    if args.length <= args.budget:
        ap.error(f"--length ({args.length}) must exceed --budget ({args.budget}): a shorter prompt is kept whole")
    if args.threads < 1 or args.max_new_tokens < 1:
        ap.error("--threads and --max-new-tokens must be positive")
    return args


def main(argv: list[str]) -> int:
    """Prompts and the engine's run spec first (cheap, and they can be refused), then the models, the agreement
    check, and one row per prompt."""
    args = parse_args(argv)
    import locret  # noqa: F401  (points llama_cpp at our library)
    from tqdm import tqdm

    from locret import models
    from locret.evaluation import items as items_module, worker

    try:
        gguf = models.resolve(args.model)
        vocab = items_module.vocab_model(str(gguf))
        items, spec = eval_run(args, vocab, gguf)
    except (models.ModelError, models.ModelFileError, items_module.ItemError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(items)} prompts of {args.length} tokens; engine: {spec.name}, ubatch {spec.ubatch}, "
          f"n_ctx {spec.n_ctx}")
    model, attention = load_torch_model(gguf, args.threads)
    check_tokenizer(gguf, vocab)
    agreement = check_agreement(model, attention, gguf, vocab, args.threads)
    print(agreement.line())
    if not agreement.same_tokens:
        return 1
    llm = worker.make_llm(spec)
    rows = []
    try:
        for item in tqdm(items, desc="prompts", unit="prompt"):
            row = compare_item(model, attention, item, llm, spec, args.budget, args.max_new_tokens, vocab)
            tqdm.write(f"{row.item}: overlap mean {row.overlap_mean:.3f}, min {row.overlap_min:.3f} "
                       f"(the paper's per-head union against ours: {row.overlap_union:.3f}); the worst unit we "
                       f"chose scores {row.cut_ratio:.2f} of PyTorch's cut; needle held "
                       f"torch {row.held_torch:.2f}, ours {row.held_ours:.2f}")
            for variant, (text, score) in row.answers.items():
                tqdm.write(f"    {variant}: {text.strip()!r} ({verdict(score)})")
            rows.append(row)
    finally:
        llm.close()
    print(markdown_table(rows))
    print(agreement_counts(rows))
    return 0


def check_tokenizer(gguf: Path, vocab) -> None:
    """transformers' tokenizer from the same GGUF gives llama.cpp's ids on the check prompt (the prompts themselves
    are tokenized by llama.cpp, as `locret eval` does, and fed to PyTorch as ids)."""
    from locret import hf_gguf

    tokenize, _, _ = vocab_tools(vocab)
    hf = hf_gguf.load_tokenizer(gguf)
    same = hf(CHECK_PROMPT, add_special_tokens=False)["input_ids"] == tokenize(CHECK_PROMPT, False)
    print(f"tokenizer: transformers and llama.cpp give {'the same' if same else 'DIFFERENT'} ids on the check prompt")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
