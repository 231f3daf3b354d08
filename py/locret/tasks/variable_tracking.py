"""Variable tracking (RULER's multi-hop tracing): follow chains of assignments through a long text.

A chain starts with "Set QXJZT to 48213." and continues with "Set BRWKM to the value of QXJZT." and so
on, `n_hops` times; `n_chains - 1` other chains with other values are distractors. The question gives the
answer chain's value and asks which variables hold it. Unlike a single needle, every link must survive
eviction: losing one hop cuts the chain.

Placement: the answer chain's statements go in order at evenly spaced depths from `depth` (the first
statement, where the value enters) to `depth_end` (the last hop; default: `depth`, a compact chain).
Distractor chains span seeded random intervals. The value occurs in the text only in the chain's first
statement; variable names are five random capital letters, never reused.

Score (`score`): set overlap of the variable names in the answer (words of exactly five capital letters)
with the expected ones, as the Jaccard index |found & expected| / |found | expected|, so naming extra
variables costs as much as missing one. (RULER scores the share of expected names found; listing every
variable of the text would get full marks there.)
"""
from __future__ import annotations

import re
import string
from typing import Sequence

from . import haystacks
from .haystack import ChatFormat, Needle, Sample, Tokenize, assemble, rng_for

NAME = "variable_tracking"
USES_DEPTH = True
MAX_NEW_TOKENS = 48

INTRO = ("The long text below contains statements that set variables. Follow them carefully: at the end "
         "you will be asked which variables hold a given value.")
_VARIABLE = re.compile(r"\b[A-Z]{5}\b")


def chain_statements(names: Sequence[str], value: str) -> list[str]:
    return [f"Set {names[0]} to {value}."] + [f"Set {b} to the value of {a}." for a, b in zip(names, names[1:])]


def question_text(value: str) -> str:
    return (f"Which variables hold the value {value} after all the statements in the text? "
            "Answer with the variable names only, separated by commas.")


def _spread(start: float, end: float, n: int) -> list[float]:
    return [start] * n if n == 1 else [start + (end - start) * i / (n - 1) for i in range(n)]


def generate(seed: int, index: int, *, tokenize: Tokenize, n_tokens: int, depth: float = 0.5,
             depth_end: float | None = None, chat_format: ChatFormat | None = None, n_hops: int = 4,
             n_chains: int = 2, haystack: str = "prose") -> Sample:
    """One sample of at most `n_tokens` prompt tokens; the answer is the n_hops + 1 variables of the first
    chain. `haystack`: the kind of filler, one of haystacks.FAMILIES."""
    if n_hops < 0 or n_chains < 1:
        raise ValueError("n_hops must be at least 0 and n_chains at least 1")
    depth_end = depth if depth_end is None else depth_end
    if not 0.0 <= depth <= depth_end <= 1.0:
        raise ValueError(f"need 0 <= depth <= depth_end <= 1, got depth={depth}, depth_end={depth_end}")

    rng = rng_for(NAME, seed, index)
    per_chain = n_hops + 1
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < per_chain * n_chains:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in seen:
            seen.add(name)
            names.append(name)
    values = [str(v) for v in rng.sample(range(10_000, 100_000), n_chains)]
    chains = [names[i * per_chain:(i + 1) * per_chain] for i in range(n_chains)]

    needles = [Needle(text, d, f"hop {i}") for i, (text, d) in
               enumerate(zip(chain_statements(chains[0], values[0]), _spread(depth, depth_end, per_chain)))]
    for c in range(1, n_chains):
        a, b = sorted((rng.random(), rng.random()))
        needles += [Needle(text, d, f"distractor {c} hop {i}") for i, (text, d) in
                    enumerate(zip(chain_statements(chains[c], values[c]), _spread(a, b, per_chain)))]
    return assemble(task=NAME, seed=seed, index=index, tokenize=tokenize, chat_format=chat_format,
                    n_tokens=n_tokens, intro=INTRO, question=question_text(values[0]),
                    filler=haystacks.units(haystack, rng), needles=needles, answers=chains[0],
                    metadata={"depth": depth, "depth_end": depth_end, "value": values[0], "n_hops": n_hops,
                              "n_chains": n_chains, **haystacks.metadata(haystack)})


def score(prediction: str, answers: Sequence[str]) -> float:
    """Jaccard index of the five-capital-letter names in the prediction and the expected names."""
    found, expected = set(_VARIABLE.findall(prediction)), set(answers)
    return len(found & expected) / len(found | expected) if found | expected else 0.0
