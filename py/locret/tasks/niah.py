"""Needle in a haystack with several keys and values (RULER's multi-key / multi-value variants).

Several names (keys such as "amber-heron") each get `n_values` seven-digit numbers, one needle
sentence per number, hidden in filler. The question asks for every number of `n_queries` of the keys;
the other keys' needles are distractors that look exactly like the answers. This tests what a
single passkey cannot: whether eviction keeps *all* the relevant needles, and keeps them apart from
similar ones.

Placement: the answer needles go at `depth` (one depth for all, or one depth per answer needle, in
order); the distractors at seeded random depths. Each number occurs once in the text, only in its
needle; each key occurs only in its needles (and, for the asked keys, in the question).

Score (`score`): the share of the expected numbers that the answer contains as whole numbers, as
RULER's string_match_all (mean over references of "reference occurs in the prediction"), except that a
number must stand alone ("1234567" does not count inside "12345678").
"""
from __future__ import annotations

import re
from typing import Sequence

from . import haystacks
from .haystack import ChatFormat, Needle, Sample, Tokenize, assemble, rng_for

NAME = "niah"
USES_DEPTH = True
MAX_NEW_TOKENS = 64

ADJECTIVES = ("amber", "brisk", "copper", "dusky", "ember", "frosty", "gilded", "hollow", "ivory", "jade",
              "kindly", "lunar", "mossy", "nimble", "opal", "pewter", "quaint", "russet", "silver", "tawny",
              "umber", "velvet", "wistful", "zesty")
NOUNS = ("heron", "badger", "comet", "dormouse", "falcon", "glacier", "harbinger", "ibis", "jackal", "kestrel",
         "lynx", "marmot", "narwhal", "osprey", "pelican", "quokka", "raven", "starling", "tapir", "urchin",
         "vole", "walrus", "yak", "zebu")

INTRO = ("Archive numbers for several names are hidden in the long text below. Read it carefully: "
         "at the end you will be asked for all the numbers that belong to a given name.")


def make_key(rng) -> str:
    """A key name such as "amber-heron": one adjective, then one noun (the single-needle tasks draw it first)."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def needle_text(key: str, value: str) -> str:
    return f"One of the archive numbers for {key} is {value}."


def question_text(keys: Sequence[str]) -> str:
    names = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]
    return (f"What are all the archive numbers for {names} mentioned in the text? "
            "Answer with the numbers only, separated by commas.")


def generate(seed: int, index: int, *, tokenize: Tokenize, n_tokens: int, depth: float | Sequence[float] = 0.5,
             chat_format: ChatFormat | None = None, n_keys: int = 4, n_values: int = 2,
             n_queries: int = 1, haystack: str = "prose") -> Sample:
    """One sample of at most `n_tokens` prompt tokens: `n_keys` keys with `n_values` numbers each, the
    numbers of `n_queries` keys asked for. `depth`: where the answer needles go (a float for all of them,
    or one per answer needle, n_queries * n_values in all). `haystack`: the kind of filler, one of
    haystacks.FAMILIES (recorded in the metadata unless it is the default "prose")."""
    if not 1 <= n_queries <= n_keys:
        raise ValueError(f"n_queries must be between 1 and n_keys ({n_keys}), got {n_queries}")
    if n_values < 1 or n_keys > len(ADJECTIVES) * len(NOUNS):
        raise ValueError("n_values must be at least 1 and n_keys at most "
                         f"{len(ADJECTIVES) * len(NOUNS)}")
    n_answers = n_queries * n_values
    depths = [float(depth)] * n_answers if isinstance(depth, (int, float)) else [float(d) for d in depth]
    if len(depths) != n_answers:
        raise ValueError(f"depth needs one value per answer needle ({n_answers}), got {len(depths)}")

    rng = rng_for(NAME, seed, index)
    pairs = rng.sample([(a, n) for a in ADJECTIVES for n in NOUNS], n_keys)
    keys = [f"{a}-{n}" for a, n in pairs]
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), n_keys * n_values)]
    by_key = {k: values[i * n_values:(i + 1) * n_values] for i, k in enumerate(keys)}
    asked = keys[:n_queries]

    answers = [v for k in asked for v in by_key[k]]
    needles = [Needle(needle_text(k, v), d, "answer") for (k, v), d in
               zip(((k, v) for k in asked for v in by_key[k]), depths)]
    needles += [Needle(needle_text(k, v), rng.random(), "distractor") for k in keys[n_queries:] for v in by_key[k]]
    return assemble(task=NAME, seed=seed, index=index, tokenize=tokenize, chat_format=chat_format,
                    n_tokens=n_tokens, intro=INTRO, question=question_text(asked),
                    filler=haystacks.units(haystack, rng), needles=needles, answers=answers,
                    metadata={"depth": depths[0] if len(set(depths)) == 1 else depths, "keys": asked,
                              "n_keys": n_keys, "n_values": n_values, "n_queries": n_queries,
                              **haystacks.metadata(haystack)})


def score(prediction: str, answers: Sequence[str]) -> float:
    """Share of the expected numbers present in the prediction as whole numbers."""
    found = set(re.findall(r"\d+", prediction))
    return sum(a in found for a in answers) / len(answers) if answers else 0.0
