"""How far a budget may compress a document and still answer as full attention does: `locret plan --doc-tokens N
--accuracy F` picks the budget from what was measured, not from a model of it.

Compression is a document's tokens over the budget (b units per layer and KV head). Each measured point sets
Locret's answers beside full attention's on the same kind of prompts (relative accuracy: Locret's score over full
attention's; full attention cut to the model's window where the document is longer). The rule: the largest
compression c such that every point at c or below held at least F; the budget is the document over c, rounded up to
a whole chunk of 64 units. Where no point holds F, the whole document stays (no eviction: the answers are plain
llama.cpp's). Beyond the largest measured compression nothing is claimed.

The points are per model, each measured with that model's shipped heads on the CPU (docs/results.md has each run
and its command). SmolLM2-135M-Instruct: plain heads and Locret-Q alike; the rule takes the worst of them, so the plain
heads' loss on look-alike needles at 2.7x (the 16-user serving run) holds the advice at 2.5x for any target above
0.64. Gemma-3-270M: RULER holds 0.81-1.26x at 4-8x, but real documents served to 16 users lost every needle at 3.4x
(0 of 32 where plain llama-server found 8), so no compression is advised for it. A model with no points of its own
gets no advice: its budget is the user's to give. Small samples: a point of 27 prompts moves by 0.04 with one
answer. When a larger run lands in docs/results.md, its point goes here, and the planner's advice follows it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .inputs import PlanError

BUDGET_STEP = 64   # budgets are rounded up to this many units: finer steps than this are below what was measured


@dataclass(frozen=True)
class Point:
    compression: float   # document tokens / budget
    relative: float      # Locret's score / full attention's on the same prompts
    prompts: int
    source: str


SMOLLM2: tuple[Point, ...] = (
    Point(2.0, 34.0 / 32.4, 26, "RULER 4K (13 tasks), plain heads, b 2048: 34.0 against 32.4"),
    Point(2.5, 1.0, 16, "real text with digits of its own through llama-server, 8 users of 2-3K tokens, plain "
                        "heads, b 1024 (mean compression 2.5): 6 of 16 turns against plain llama-server unbounded "
                        "6 of 16"),
    Point(2.7, 9 / 14, 32, "real text with digits of its own through llama-server, 16 users of 4-7K tokens, plain "
                           "heads with no question pinned, b 2048 (mean compression 2.7, 2.1-3.4): 9 of 32 turns "
                           "against plain llama-server unbounded 14 of 32; the misses are look-alike needles"),
    Point(4.0, 31.2 / 32.4, 130, "RULER 4K (13 tasks, 10 prompts a task), plain heads, b 1024: 31.2 against 32.4"),
    Point(8.0, 1.0, 18, "real text with digits of its own (code, number, look-alike needles), 8-16K, b 2048, "
                        "Locret-Q auto: 10 of 18 against full attention in the window 10 of 18"),
    Point(8.0, 1.0, 8, "held-out generated families, niah_single 16K, b 2048, Locret-Q auto: 8 of 8 against 8 of 8"),
    Point(8.0, 11 / 8, 27, "real text with digits of its own (info, man, pysource), 16K, b 2048, Locret-Q auto: 11 of "
                           "27 against full attention in its 8K window 8 of 27"),
    Point(16.0, 0.0, 8, "real text with digits of its own, 28-32K, b 2048, Locret-Q auto: 0 of 8 against full "
                        "attention in the window 6 of 10"),
    Point(16.0, 6 / 8, 27, "real text with digits of its own (info, man, pysource), 32K, b 2048, Locret-Q auto: 6 of "
                           "27 against full attention in its 8K window 8 of 27"),
    Point(16.0, 0.88, 8, "held-out generated families, niah_code 32K, b 2048, Locret-Q auto: 7 of 8 (full "
                         "attention in the window: 0 of 8; niah_single 8 of 8 against 8 of 8)"),
)

GEMMA3: tuple[Point, ...] = (
    Point(3.4, 0.0, 32, "real text with digits of its own through llama-server, 16 users of 16-30K tokens, plain "
                        "heads pooled, 6 slots of b 6912 (mean compression 3.4, 2.4-4.4): 0 of 32 turns against plain "
                        "llama-server with every document whole 8 of 32"),
    Point(4.0, 25.6 / 31.5, 26, "RULER 4K in completion mode, plain heads, b 1024: 25.6 (26 prompts) against full "
                                "attention's 31.5 (13)"),
    Point(6.0, 21.8 / 17.3, 26, "RULER 12K in completion mode, plain heads, b 2048: 21.8 (26 prompts) against full "
                                "attention's 17.3 (13)"),
    Point(8.0, 23.1 / 27.6, 26, "RULER 16K in completion mode, plain heads pooled, b 2048: 23.1 against full "
                                "attention's 27.6 (26 prompts each)"),
    Point(9.2, 0.0, 32, "real text with digits of its own through llama-server, 16 users of 16-30K tokens, plain "
                        "heads pooled, 9 slots of b 2560 (mean compression 9.2, 6.4-12.0): 0 of 32 turns against "
                        "plain llama-server with every document whole 8 of 32"),
    Point(16.0, 15.4 / 19.2, 26, "RULER 32K in completion mode, plain heads pooled, b 2048: 15.4 (26 prompts) "
                                 "against full attention's 19.2 (13)"),
)

# what was measured, per registered model (locret.models); a model not here has no advice
MEASURED: dict[str, tuple[Point, ...]] = {"smollm2-135m": SMOLLM2, "gemma3-270m": GEMMA3}


def points_for(model: str) -> tuple[Point, ...]:
    """The measured points of a model given by name or GGUF path; refused for a model that has none."""
    from .. import models

    name = models.registered_name(model)
    if name not in MEASURED:
        measured = ", ".join(MEASURED)
        raise PlanError(f"no accuracy was measured for {model} (planner/accuracy.py has points for {measured}): "
                        f"--doc-tokens cannot pick its budget; give --budget or --budget-mib")
    return MEASURED[name]


@dataclass(frozen=True)
class Choice:
    budget: int              # units per layer and KV head; the document's length when nothing may be evicted
    compression: float       # the measured compression the budget stands on (1.0: no eviction)
    evicts: bool             # False: the document fits budget + chunk, as in plain llama.cpp
    basis: tuple[Point, ...]  # the points at or below that compression
    attainable: bool = True  # False: no measured compression holds the target

    def describe(self, doc_tokens: int, target: float) -> str:
        if not self.evicts:
            why = ("" if self.attainable else
                   f": no measured compression keeps {target:g}x of full attention's right answers")
            return (f"budget {self.budget}: {doc_tokens}-token documents fit budget + chunk whole, nothing is "
                    f"evicted (answers as plain llama.cpp's){why}")
        n = sum(p.prompts for p in self.basis)
        worst = min(p.relative for p in self.basis)
        return (f"budget {self.budget}: {doc_tokens}-token documents at most {self.compression:g}x compressed, where "
                f"every measured point kept at least {worst:.2f}x of full attention's right answers ({len(self.basis)} "
                f"points, {n} prompts; planner/accuracy.py lists them) for a target of {target:g}x")


def parse_accuracy(text) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise PlanError(f"accuracy must be a fraction of full attention's right answers such as 0.9 (got '{text}')") \
            from None
    if not 0.0 < value <= 2.0 or math.isnan(value):
        raise PlanError(f"accuracy must be above 0 and at most 2 (a fraction of full attention's right answers; got "
                        f"{value:g})")
    return value


def largest_compression(target: float, points: tuple[Point, ...]) -> float | None:
    """The largest measured compression c where every point at c or below held `target`; None where the smallest
    measured compression already misses it."""
    best = None
    for c in sorted({p.compression for p in points}):
        if any(p.relative < target for p in points if p.compression <= c):
            break
        best = c
    return best


def budget_for(doc_tokens: int, target: float, ubatch: int, points: tuple[Point, ...]) -> Choice:
    """The budget for documents of `doc_tokens` tokens (prompt and answer) that keeps `target` of full attention's
    right answers by the measured points, in a cache of budget + `ubatch` cells."""
    if doc_tokens < 1:
        raise PlanError(f"document length must be at least 1 token (got {doc_tokens})")
    # the whole document in budget + chunk, and never a budget below one chunk (the rule book's floor)
    whole = max(ubatch, _round_up(max(doc_tokens - ubatch, 1)))
    c = largest_compression(target, points)
    if c is None:
        return Choice(budget=whole, compression=1.0, evicts=False, basis=(), attainable=False)
    budget = max(ubatch, _round_up(math.ceil(doc_tokens / c)))
    if budget >= whole:
        return Choice(budget=whole, compression=1.0, evicts=False, basis=())
    return Choice(budget=budget, compression=c, evicts=True,
                  basis=tuple(p for p in points if p.compression <= c))


def _round_up(n: int) -> int:
    return -(-n // BUDGET_STEP) * BUDGET_STEP
