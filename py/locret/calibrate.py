"""`locret calibrate`: per-layer budgets fitted to a model from how concentrated its retaining heads' scores are.

The rule (method "score-mass"). The heads score every unit with a pre-softmax attention score (the largest score an
answer token gives it, train/labels.py), so softmax over a layer's units, per KV head, is the attention the heads
predict the unit will get. A layer whose predicted attention sits on few units loses little when its cache is cut;
one whose attention is spread needs more of its units. So, over sample text read without eviction:

    need(l) = mean over KV heads h and texts of  k_{l,h}(mass) / n      the share of units that carries `mass`
                                                                         (0.9) of the layer's predicted attention
    b_l     = n_layers * b * need(l) / sum(need), clamped to [floor, cap], rounded so that the sum is n_layers * b

Clamping and rounding are done by water-filling (the layers at a bound keep it, the others share what is left in
proportion to their need; the units rounding leaves go to the largest remainders, ties to the lower layer), so the
result is a deterministic function of the scores. The floor (default: the stabilizers, the library's room for a pinned
Locret-Q question, query.pin_room(), and one unit more) keeps every layer able to evict; the cap (default 2b,
PyramidKV's first layer) keeps one layer from holding most of the memory.

The file it writes is a budget schedule (--locret-budget-schedule FILE, locret.Llama(locret_budget_schedule=...)):
one budget per evicting layer, and comment lines saying what made it. Its "# model: NAME" line is the model's
general.name: the library refuses the file for another model.
"""
from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from .threads import threads_or_default

DEFAULT_MASS = 0.9
DEFAULT_TEXTS = ("prose", "code", "legal", "logs")
DEFAULT_TOKENS = 2048


class CalibrationError(ValueError):
    """Settings a calibration cannot meet (a total outside the floor and cap, an unknown text family, ...)."""


def mass_share(scores: np.ndarray, mass: float) -> float:
    """The share of units that carries `mass` of softmax(scores): scores [n_units, n_head_kv], mean over heads."""
    x = scores.astype(np.float64)
    p = np.exp(x - x.max(axis=0, keepdims=True))
    p /= p.sum(axis=0, keepdims=True)
    shares = []
    for h in range(p.shape[1]):
        cum = np.cumsum(np.sort(p[:, h])[::-1])
        shares.append((int(np.searchsorted(cum, mass * cum[-1])) + 1) / p.shape[0])
    return float(np.mean(shares))


def fit_budgets(needs: list[float], total: int, floor: int, cap: int) -> list[int]:
    """Whole budgets in [floor, cap] summing to `total`, proportional to `needs` where no bound holds (water-filling;
    see the module's docstring). CalibrationError when the bounds cannot meet the total."""
    n = len(needs)
    if n == 0:
        raise CalibrationError("no layer to budget")
    if not 1 <= floor <= cap:
        raise CalibrationError(f"the floor ({floor}) must be at least 1 and at most the cap ({cap})")
    if not n * floor <= total <= n * cap:
        raise CalibrationError(f"{n} layers cannot share {total} units with budgets between {floor} and {cap} "
                               f"(possible totals: {n * floor} to {n * cap})")
    w = np.maximum(np.asarray(needs, dtype=np.float64), 1e-12)
    # the water level: the scale s at which sum(clamp(s * need, floor, cap)) == total (the sum grows with s, from
    # n * floor to n * cap); bisection to the precision of a float64
    lo, hi = 0.0, cap / w.min()
    for _ in range(200):
        mid = (lo + hi) / 2
        if np.clip(mid * w, floor, cap).sum() < total:
            lo = mid
        else:
            hi = mid
    exact = np.clip(hi * w, floor, cap)
    out = [min(cap, max(floor, int(np.floor(v + 1e-9)))) for v in exact]
    # whole units: what rounding down leaves goes to the largest remainders (ties to the lower layer), never past cap
    frac = [float(exact[i] - out[i]) for i in range(n)]
    while sum(out) < total:
        i = min((i for i in range(n) if out[i] < cap), key=lambda i: (-round(frac[i], 9), i))  # ties within float noise
        out[i] += 1
        frac[i] -= 1.0
    while sum(out) > total:  # only float rounding at the bounds could get here
        i = min((i for i in range(n) if out[i] > floor), key=lambda i: (round(frac[i], 9), i))
        out[i] -= 1
        frac[i] += 1.0
    assert sum(out) == total and all(floor <= v <= cap for v in out), (out, total, floor, cap)
    return out


def sample_tokens(llm, family: str, n_tokens: int, seed: int) -> list[int]:
    """n_tokens of a haystack family's text (seeded), tokenized by the model."""
    from .tasks import haystacks

    units = haystacks.units(family, random.Random(f"calibrate:{family}:{seed}"))
    text, tokens = "", []
    while len(tokens) < n_tokens:
        text += " " + " ".join(islice(units, 200))
        tokens = llm.tokenize(text.encode(), add_bos=True)
    return tokens[:n_tokens]


@dataclass
class Calibration:
    model_name: str
    budgets: list[int]
    needs: list[float]
    header: list[str]

    def text(self) -> str:
        return "".join(f"# {h}\n" for h in self.header) + "".join(f"{b}\n" for b in self.budgets)


def calibrate(model_path: str, *, heads: str | None, budget: int, stabilizers: int | None = None,
              texts: tuple[str, ...] = DEFAULT_TEXTS, n_tokens: int = DEFAULT_TOKENS, mass: float = DEFAULT_MASS,
              floor: int | None = None, cap: int | None = None, seed: int = 0, threads: int = 2,
              progress=None) -> Calibration:
    from . import eviction
    from .llama import Llama
    from .query import pin_room
    from .tasks import haystacks

    if not 0.0 < mass < 1.0:
        raise CalibrationError(f"--mass must be between 0 and 1 (a share of the predicted attention), got {mass}")
    if n_tokens < 256:
        raise CalibrationError(f"--tokens must be at least 256 (a sample too short to rank units), got {n_tokens}")
    unknown = [t for t in texts if t not in haystacks.FAMILIES]
    if unknown or not texts:
        raise CalibrationError(f"unknown text family {', '.join(unknown) or '(none given)'}; "
                               f"valid: {', '.join(haystacks.FAMILIES)}")
    if budget < 1:
        raise CalibrationError(f"--budget must be a positive number of units, got {budget}")
    ubatch = 512
    # a cache that holds the whole sample: the heads score every unit and nothing is evicted
    llm = Llama(model_path=str(model_path), locret_heads=heads, locret_budget=n_tokens, locret_pool=0,
                locret_query="off", n_ctx=n_tokens + ubatch, n_batch=ubatch, n_ubatch=ubatch, n_threads=threads,
                verbose=False)
    try:
        stats = llm.locret_stats()
        n_s = stats["stabilizers"] if stabilizers is None else stabilizers
        floor = n_s + pin_room() + 1 if floor is None else floor
        cap = 2 * budget if cap is None else cap
        import llama_cpp

        n_head_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
        layers = [il for il in range(llama_cpp.llama_model_n_layer(llm._model.model)) if llm.locret_layer_budget(il) > 0]
        fit_budgets([1.0] * len(layers), budget * len(layers), floor, cap)  # a total it cannot meet: before reading
        per_text = []
        for family in texts:
            tokens = sample_tokens(llm, family, n_tokens, seed)
            llm.reset()
            llm.eval(tokens)
            if llm.locret_stats()["n_evictions"] != 0:
                raise CalibrationError("the calibration context evicted: its scores would not cover the whole sample")
            ctx = llm._ctx.ctx
            per_text.append([mass_share(eviction.read_scores(ctx, il, len(tokens), n_head_kv=n_head_kv), mass)
                             for il in layers])
            if progress is not None:
                progress.update(1)
        needs = [float(v) for v in np.mean(np.asarray(per_text), axis=0)]
        name = llm.metadata.get("general.name", "")
    finally:
        llm.close()
    total = budget * len(needs)
    budgets = fit_budgets(needs, total, floor, cap)
    header = ["Locret budget schedule (locret calibrate)",
              f"model: {name}",
              f"method: score-mass {mass}: each layer's share of units carrying {mass:.0%} of the attention its "
              f"heads predict, over {len(texts)} x {n_tokens} tokens of {', '.join(texts)} (seed {seed})",
              f"heads: {Path(heads).name if heads else 'embedded in the model'}",
              f"mean budget {budget} over {len(needs)} layers (sum {total}), floor {floor}, cap {cap}",
              "needs (share of units per layer): " + " ".join(f"{v:.3f}" for v in needs)]
    return Calibration(name, budgets, needs, header)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from . import models

    p.add_argument("--model", default=models.DEFAULT_MODEL, help=f"model name or .gguf path (default {models.DEFAULT_MODEL})")
    p.add_argument("--heads", help="retaining heads .gguf (default: embedded in the model, or shipped in heads/)")
    p.add_argument("--budget", type=int, required=True, help="the mean budget b: the schedule sums to layers x b, "
                   "the memory of a uniform budget b")
    p.add_argument("--texts", default=",".join(DEFAULT_TEXTS), help="sample text: haystack families, comma-separated "
                   f"(default {','.join(DEFAULT_TEXTS)})")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"tokens per text (default {DEFAULT_TOKENS})")
    p.add_argument("--mass", type=float, default=DEFAULT_MASS, help=f"the share of predicted attention a layer's "
                   f"units must carry (default {DEFAULT_MASS})")
    p.add_argument("--floor", type=int, help="the smallest layer budget (default: stabilizers + the room for a pinned "
                   "question + 1)")
    p.add_argument("--cap", type=int, help="the largest layer budget (default 2 x --budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="CPU threads (default: LLAMA_ARG_THREADS, else 2)")
    p.add_argument("-o", "--output", required=True, help="the schedule file to write")


def run_cli(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from . import models, planner
    from ._library import LibraryError
    from .heads import HeadsError

    try:
        model_path = models.resolve(args.model)
        facts = planner.read_model(model_path)
        heads, _ = planner.resolve_heads(args.model, model_path, facts, args.heads)
        texts = tuple(t for t in args.texts.split(",") if t)
        with tqdm(total=len(texts), unit="text", desc="calibrating") as bar:
            cal = calibrate(str(model_path), heads=str(heads) if heads else None, budget=args.budget, texts=texts,
                            n_tokens=args.tokens, mass=args.mass, floor=args.floor, cap=args.cap, seed=args.seed,
                            threads=threads_or_default(args.threads, 2), progress=bar)
    except (CalibrationError, HeadsError, LibraryError, planner.PlanError, models.ModelError) as e:
        print(f"locret calibrate: {e}", file=sys.stderr)
        return 1
    Path(args.output).write_text(cal.text())
    print(f"{args.output}: {len(cal.budgets)} layer budgets from {min(cal.budgets)} to {max(cal.budgets)}, "
          f"sum {sum(cal.budgets)} (mean {args.budget})")
    print("layer:budget " + " ".join(f"{i}:{b}" for i, b in enumerate(cal.budgets)))
    return 0
