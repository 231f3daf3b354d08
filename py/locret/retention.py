"""`locret inspect`: what the cache kept of a prompt, and whether a given fact (the needle) survived.

    locret inspect --prompt-file doc.txt --needle "4-7-2-9" [--question Q] [--query Q] [--budget 2048]
                   [--ubatch 512] [--pool 15] [--heads H.gguf] [--layers 0,10,29] [--json out.json]

Runs the prompt (the document, then the question) through `locret.Llama` with the heads' scores recorded, then reads
every (layer, KV head)'s retained positions after the prompt. For each it reports how many of the needle's tokens are
held, the best rank of a needle token by the heads' own score among all prompt tokens (1 = the top-scored token),
and the longest runs of retained positions as text with their mean score: what the cache holds instead. With
`--query` the question is also placed at the start and pinned (Locret-Q); the report says how many tokens are pinned.

    locret inspect --task niah --length 8192 [--haystacks prose,code] [--depth 0.25,0.75] [--samples 2] [--seed 11]
                   [--method locret-q] [--budget 768] [--pool 15] [--heads H.gguf] [--json out.json]

The second form runs the evaluation's own prompts (`locret eval`'s items, the same seeds) and follows every needle
they place by its token span, labelled as the task labels it (niah: the asked "answer" needles and the look-alike
"distractor" needles): for each needle, the share of its tokens held over the evicting (layer, KV head) pairs and
the pairs that hold it whole, each layer's share (which layers lost it) and the share of the answer's own tokens
inside it (a number's digits); then the same per label, averaged over the prompts. `--method locret-q-auto` finds
the question as the tools' defaults do; `--budget-schedule pyramid|FILE` spreads the budget over the layers as
`locret eval`'s METHOD@schedule does (the report lists each layer's budget). That is how Locret-Q heads are
told from plain ones: they should hold the asked needle more than its look-alikes (heads/README.md).

Why: eviction failures on long inputs are about which spans survive. The diagnostic that found score pooling
(README, "Score pooling") was this: the needle's tokens were scattered over a few heads, never whole in most.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .threads import threads_or_default


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
                   local: int | None = None, chat: bool = False, schedule: str | None = None) -> dict:
    """The report as a dict (see the module's docstring). `chat`: the prompt is the user turn of the model's chat
    template; `query`: placed at the start of the prompt (of the user turn) and pinned; `schedule`: the budget
    schedule ("pyramid" or a file of per-layer budgets; None: uniform)."""
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
                locret_budget_schedule=schedule, n_threads=threads, n_threads_batch=threads, verbose=False)
    try:
        text = place_query(query, prompt) if query else prompt
        template = decoding.chat_format(llm) if chat else None
        if chat and template is None:
            raise ValueError("--chat: the model has no chat template")
        text = template(text) if template else text
        ids = llm.tokenize(text.encode(), add_bos=True, special=bool(template))
        if query:
            llm.locret_pin_next_prompt(eviction.model_query_tokens(llm, ids, query, budget))
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
            "schedule": schedule_name(schedule), "layer_budgets": layer_budgets(llm), "pool": int(stats["pool"]),
            "evictions": int(stats["n_evictions"]),
            "needle_held_share": round(float(held.mean() / len(needle_pos)), 4),
            "pairs_holding_all": int((held == len(needle_pos)).sum()), "pairs": len(pairs),
            "by_pair": [asdict(p) for p in pairs], "layers_shown": chosen,
        }
    finally:
        llm.close()


def needle_shares(llm, spans: list[tuple[str, int, int]], layers: list[int], n_head_kv: int,
                  values: list[tuple[int, int]] | None = None) -> list[dict]:
    """For each needle (label, first position, end): the mean share of its tokens held over the (layer, KV head)
    pairs of `layers`, how many of those pairs hold all of its tokens, each token's share of the pairs holding it
    ("token_shares", in order) and each layer's share of the needle's tokens held, over its KV heads
    ("layer_shares", in the order of `layers`). values[i], where given, is the (first, end) of the needle's answer
    value inside it (the digits of a number): its share held as "value_held_share" (None where the needle carries
    no value)."""
    kept = [llm.locret_retained(il, ih) for il in layers for ih in range(n_head_kv)]
    out = []
    for i, (label, a, b) in enumerate(spans):
        positions = np.arange(a, b)
        held = np.array([np.isin(positions, k) for k in kept])  # [pairs, tokens]
        shares = held.mean(axis=1)
        entry = {"label": label, "positions": [int(a), int(b)], "held_share": round(float(shares.mean()), 4),
                 "pairs_whole": int((shares == 1.0).sum()),
                 "token_shares": [round(float(x), 4) for x in held.mean(axis=0)],
                 "layer_shares": [round(float(x), 4) for x in shares.reshape(len(layers), n_head_kv).mean(axis=1)]}
        value = values[i] if values is not None else None
        entry["value_held_share"] = (round(float(held[:, value[0] - a:value[1] - a].mean()), 4)
                                     if value is not None else None)
        out.append(entry)
    return out


def layer_map(layer_shares: list[float]) -> str:
    """One character a layer: '.' none of the needle held in any of its KV heads, '#' all of it in every head, else
    the tenths held (0-9)."""
    return "".join("." if s == 0 else "#" if s == 1 else str(min(int(s * 10), 9)) for s in layer_shares)


def value_within(pieces: list[bytes], first: int, answers) -> tuple[int, int] | None:
    """The prompt's token span of the first answer string written inside a needle whose tokens, from prompt position
    `first` on, detokenize to `pieces` (None when no answer is written there: a look-alike, or a needle of another
    form)."""
    for _, a, b in answer_spans(pieces, answers, limit=1):
        return first + a, first + b
    return None


def _mean_by_label(entries: list[dict]) -> dict:
    """{label: {"held_share": mean, "pairs_whole": mean}} over entries carrying a label and those two values
    (needles of one prompt, or per-prompt means); not rounded, so that means of means stay exact."""
    labels = sorted({e["label"] for e in entries})
    return {lab: {k: float(np.mean([e[k] for e in entries if e["label"] == lab])) for k in ("held_share", "pairs_whole")}
            for lab in labels}


def _rounded(by_label: dict) -> dict:
    return {lab: {"held_share": round(v["held_share"], 4), "pairs_whole": round(v["pairs_whole"], 2)}
            for lab, v in by_label.items()}


def answer_spans(pieces: list[bytes], answers, limit: int = 8) -> list[tuple[str, int, int]]:
    """("answer", first, end) token spans of every occurrence of each answer string in the prompt whose tokens
    detokenize to `pieces` (at most `limit` occurrences each: a RULER common-words answer is everywhere). An answer
    listed twice (RULER's qa gives SQuAD's several annotators' answers, often the same words) is followed once."""
    text = b"".join(pieces)
    starts = np.concatenate(([0], np.cumsum([len(p) for p in pieces])))
    out = []
    for answer in dict.fromkeys(str(a) for a in answers):
        needle, at, seen = str(answer).encode(), 0, 0
        while seen < limit and (at := text.find(needle, at)) >= 0:
            first = int(np.searchsorted(starts, at, side="right") - 1)
            end = int(np.searchsorted(starts, at + len(needle), side="left"))
            out.append(("answer", first, max(end, first + 1)))
            at, seen = at + len(needle), seen + 1
    return out


def inspect_task(*, model: str, task: str, length: int, method: str, budget: int, ubatch: int, heads: str | None,
                 haystacks: list[str], depths: list[float], samples: int, seed: int, pool: int | None = None,
                 stabilizers: int | None = None, local: int | None = None, threads: int = 2,
                 suite: str | None = None, schedule: str | None = None, ruler_mode: str = "chat") -> dict:
    """The task-mode report (see the module's docstring): the evaluation's prompts of `task`, prefilled with the
    method's eviction (Locret-Q: the question in front and pinned, as `locret eval` does), then every needle's
    retention read from the cache."""
    from tqdm import tqdm

    from .evaluation import items as items_module
    from .evaluation.worker import RunSpec, _prefill, evicting_layers, kv_heads, make_llm, prompt_of

    allowed = ("locret", "locret-q-auto") if suite else ("locret", "locret-q", "locret-q-auto")
    if method not in allowed:
        raise ValueError(f"--method must be {' or '.join(allowed)}, got {method!r}")
    vocab = items_module.vocab_model(model)
    try:
        if suite:
            from . import models

            items = items_module.ruler_items(vocab, [task], [length], samples, seed, mode=ruler_mode, random_start=True,
                                             cache=models.cache_dir() / "ruler-samples")
            for it in items:  # RULER names its answers, not its needles: follow every place an answer is written
                pieces = [vocab.detokenize([t]) for t in it.tokens]
                it.extra["needles"] = answer_spans(pieces, it.answers)
        else:
            items = items_module.task_items(vocab, [task], [length], depths, samples, seed, haystacks=tuple(haystacks))
    except items_module.ItemError as e:
        raise ValueError(str(e)) from None
    finally:
        vocab.close()
    if not items[0].extra.get("needles"):
        raise ValueError(f"task {task} places no needles to follow")
    spec = RunSpec(model_path=model, method=method, budget=budget, heads=heads, stabilizers=stabilizers, local=local,
                   n_ctx=-(-(max(len(it.query_tokens or it.tokens) for it in items) + 256) // 256) * 256,
                   ubatch=ubatch, threads=threads, pool=pool, schedule=schedule)
    llm = make_llm(spec)
    rows, prompt_means = [], []
    try:
        layers = evicting_layers(llm)
        _, n_head_kv = kv_heads(llm)
        budgets = layer_budgets(llm)
        for it in tqdm(items, desc="prompts", unit="prompt"):
            llm.reset()  # the next eval empties the sequence and its eviction count
            _prefill(llm, spec, it, True, None)
            tokens = prompt_of(spec, it)
            shift = len(tokens) - len(it.tokens)  # Locret-Q's head grew by the question; the rest is unchanged
            spans = [(label, a + shift, b + shift) for label, a, b in it.extra["needles"]]
            values = [value_within([llm.detokenize([t]) for t in tokens[a:b]], a, it.answers) for _, a, b in spans]
            stats = llm.locret_stats()
            needles = needle_shares(llm, spans, layers, n_head_kv, values)
            means = _mean_by_label(needles)
            prompt_means.append(means)
            for n, (_, a, b), value in zip(needles, spans, values):
                n["text"] = llm.detokenize(tokens[a:b]).decode(errors="replace").strip()
                n["value"] = llm.detokenize(tokens[value[0]:value[1]]).decode(errors="replace") if value else None
            rows.append({"item": it.id, "prompt_tokens": len(tokens), "evictions": int(stats["n_evictions"]),
                         "pinned": int(stats["n_pinned"]), "needles": needles, "by_label": _rounded(means)})
    finally:
        llm.close()
    # each prompt weighs the same in the overall means, whatever its count of needles
    mean = _rounded(_mean_by_label([dict(v, label=lab) for m in prompt_means for lab, v in m.items()]))
    return {"task": task, "length": length, "method": method, "heads": Path(heads).name if heads else None,
            "budget": budget, "schedule": schedule_name(schedule), "layer_budgets": budgets, "pool": pool or 0,
            "pairs": len(layers) * n_head_kv, "layers": layers, "items": rows, "by_label": mean}


def schedule_name(schedule: str | None) -> str:
    """How a report names a budget schedule: uniform, pyramid, or the file's name."""
    return "uniform" if schedule is None else schedule if schedule == "pyramid" else Path(schedule).name


def layer_budgets(llm) -> list[int]:
    """What each evicting layer keeps in `llm`'s context (its schedule's budget, or b), in layer order."""
    from .evaluation.worker import kv_heads

    return [b for b in (llm.locret_layer_budget(il) for il in range(kv_heads(llm)[0])) if b >= 0]


def print_task_report(report: dict) -> None:
    print(f"{report['task']} at {report['length']} tokens, {report['method']} b = {report['budget']}"
          f"{'' if report['schedule'] == 'uniform' else ' (schedule ' + report['schedule'] + ')'}, pooling "
          f"{report['pool'] or 'none'}, heads {report['heads'] or '(embedded)'}: share of each needle's tokens held "
          f"over {report['pairs']} (layer, KV head) pairs, and the pairs holding it whole; by layer, one character "
          f"a layer ({report['layers'][0]}-{report['layers'][-1]}): '.' none of it held, '#' all of it in every "
          f"KV head, else the tenths held; value: the answer's own tokens")
    for r in report["items"]:
        print(f"\n{r['item']}: {r['prompt_tokens']} tokens, {r['evictions']} evictions, pinned {r['pinned']}")
        for n in r["needles"]:
            shown = n["text"] if len(n["text"]) <= 70 else n["text"][:67] + "..."
            print(f"  {n['label']:<10} @{n['positions'][0]:>7}  held {n['held_share']:.3f}  whole in "
                  f"{n['pairs_whole']:>3}  {shown}")
            value = (f"  value {n['value'].strip()!r} held {n['value_held_share']:.3f}"
                     if n.get("value_held_share") is not None else "")
            print(f"  {'':<10} by layer {layer_map(n['layer_shares'])}{value}")
    print(f"\nmean over {len(report['items'])} prompts:")
    for lab, v in report["by_label"].items():
        print(f"  {lab:<10} held {v['held_share']:.3f}  whole in {v['pairs_whole']:.1f} pairs")
    by = report["by_label"]
    if "answer" in by and "distractor" in by:
        print(f"  answer / distractor held: {by['answer']['held_share'] / max(by['distractor']['held_share'], 1e-9):.2f}")


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

    p.add_argument("--prompt-file", type=Path, help="the document (text); or --task")
    p.add_argument("--needle", help="with --prompt-file: text whose tokens to follow (its first occurrence)")
    task = p.add_argument_group("the evaluation's prompts (instead of --prompt-file)")
    task.add_argument("--task", help="a `locret eval` task whose needles to follow (e.g. niah, niah_single); with "
                      "--suite ruler a RULER task, whose answers are followed wherever the prompt writes them")
    task.add_argument("--suite", choices=("ruler",), help="ruler: --task is one of RULER's (its samples, as `locret "
                      "eval --suite ruler` sends them); --method locret or locret-q-auto")
    task.add_argument("--ruler-mode", choices=("chat", "completion"), default="chat",
                      help="with --suite ruler, how the samples are sent, as locret eval's --ruler-mode: chat (default) "
                      "or completion (a model without a chat template, Gemma-3-270M)")
    task.add_argument("--length", type=int, help="prompt length in tokens")
    task.add_argument("--haystacks", default="prose", help="haystack families, comma-separated (default prose)")
    task.add_argument("--depth", default="0.5", help="needle depths in [0, 1], comma-separated (default 0.5); "
                      "the list locret eval's --depths was given gives its very prompts")
    task.add_argument("--samples", type=int, default=1, help="prompts per haystack family (default 1)")
    task.add_argument("--seed", type=int, default=0)
    task.add_argument("--method", default="locret", choices=("locret", "locret-q", "locret-q-auto"),
                      help="locret-q: the task's question in front and pinned, and the Locret-Q heads without "
                      "--heads; locret-q-auto: the question the auto rule finds, as the tools' defaults do")
    p.add_argument("--question", help="appended after the document (\"\\n\\nQuestion: ...\")")
    p.add_argument("--query", help="Locret-Q: placed at the start and pinned (give the question again); without "
                   "--heads, the model's shipped Locret-Q heads where there are some")
    p.add_argument("--chat", action="store_true", help="the prompt is the user turn of the model's chat template")
    p.add_argument("--model", default=models.DEFAULT_MODEL, help=f"model name or .gguf path (default {models.DEFAULT_MODEL})")
    p.add_argument("--heads", help="retaining heads (default: embedded in the model, or shipped in heads/)")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--budget-schedule", help="uniform (default), pyramid (PyramidKV) or a file of per-layer budgets "
                   "(as locret eval's METHOD@schedule --schedule FILE): the budget each layer keeps")
    p.add_argument("--ubatch", type=int, default=512)
    p.add_argument("--stabilizers", type=int)
    p.add_argument("--local", type=int)
    p.add_argument("--pool", type=int, help="score pooling window, 0: none (default: the heads' recommended window "
                   "for a text; none for --task, as in locret eval)")
    p.add_argument("--layers", help="layers to show runs for, comma-separated (default: all)")
    p.add_argument("--runs", type=int, default=5, help="longest retained runs shown per (layer, KV head)")
    p.add_argument("--threads", type=int, help="CPU threads (default: LLAMA_ARG_THREADS, else every core)")
    p.add_argument("--json", type=Path, help="also write the whole report as JSON")


def run_cli(args: argparse.Namespace) -> int:
    from . import models, planner

    if (args.prompt_file is None) == (args.task is None):
        raise ValueError("give either --prompt-file (with --needle) or --task (with --length)")
    if args.task is not None:
        if args.length is None or args.length < 1:
            raise ValueError("--task needs --length (tokens)")
        if args.needle or args.query or args.question or args.chat:
            raise ValueError("--task brings its own needles, question and template: --needle, --query, --question "
                             "and --chat apply to --prompt-file")
        if args.samples < 1:
            raise ValueError(f"--samples must be at least 1, got {args.samples}")
        if args.ruler_mode != "chat" and args.suite != "ruler":
            raise ValueError("--ruler-mode applies to --suite ruler")
        # numbers here; their range is the task items' rule (items.task_samples), as for locret eval --depths
        try:
            depths = [float(d) for d in args.depth.split(",") if d.strip()]
        except ValueError:
            depths = []
        if not depths:
            raise ValueError(f"--depth takes numbers in [0, 1], comma-separated, got {args.depth!r}")
    elif not args.needle:
        raise ValueError("--prompt-file needs --needle (the text to follow)")
    elif args.method != "locret":
        raise ValueError("--method applies to --task; with --prompt-file, --query QUESTION is Locret-Q")
    # the library reads the schedule and refuses a bad one (eviction.set_budget_schedule), with its reason
    schedule = None if args.budget_schedule in (None, "uniform") else args.budget_schedule
    model = models.resolve(args.model)
    heads = args.heads
    if heads is None:
        query = bool(args.query) or args.method in ("locret-q", "locret-q-auto")
        found, _ = planner.resolve_heads(args.model, model, planner.read_model(model), None, query=query)
        heads = str(found) if found is not None else None
    threads = threads_or_default(args.threads)
    if args.task is not None:
        report = inspect_task(model=str(model), task=args.task, length=args.length, method=args.method,
                              budget=args.budget, ubatch=args.ubatch, heads=heads,
                              haystacks=[h for h in args.haystacks.split(",") if h], depths=depths,
                              samples=args.samples, seed=args.seed, pool=args.pool, stabilizers=args.stabilizers,
                              local=args.local, threads=threads, suite=args.suite, schedule=schedule,
                              ruler_mode=args.ruler_mode)
        print_task_report(report)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        return 0
    if not args.prompt_file.is_file():
        raise ValueError(f"cannot read the prompt file {args.prompt_file}")
    prompt = args.prompt_file.read_text()
    if args.question:
        prompt += "\n\nQuestion: " + args.question + "\n"
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    report = inspect_prompt(model=str(model), prompt=prompt, needle=args.needle, budget=args.budget,
                            ubatch=args.ubatch, heads=heads, pool=args.pool, query=args.query, layers=layers,
                            n_runs=args.runs, threads=threads, stabilizers=args.stabilizers, local=args.local,
                            chat=args.chat, schedule=schedule)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0
