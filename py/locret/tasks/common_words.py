"""Common words extraction (RULER's CWE): find the most frequent words in a long numbered word list.

The list holds `n_common` words `common_freq` times each and as many other words as fit `rare_freq` times
each, in seeded random order. The question asks for the `n_common` most frequent words. There is no
needle: the answer is spread over the whole context, so the task measures whether eviction keeps a
fair sample of everything rather than a few important spots. `USES_DEPTH` is False and `generate`
takes no depth.

Words are invented (two or three consonant-vowel syllables such as "kamero"), so no word is favoured
by a model's prior; all words of a sample are distinct.

Score (`score`): the share of the expected words present as whole words (case-insensitive) in the
answer, as RULER's string_match_all.
"""
from __future__ import annotations

import re
from typing import Sequence

from .haystack import ChatFormat, Piece, Sample, Tokenize, rng_for, template

NAME = "common_words"
USES_DEPTH = False
MAX_NEW_TOKENS = 96

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"

INTRO = "Below is a numbered list of words. Some words appear many more times than others."


def question_text(n: int) -> str:
    return (f"What are the {n} most common words in the list above? "
            "Answer with the words only, separated by commas.")


def _words(rng, n: int) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.choice((2, 3))))
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out


def _word_list(seed: int, index: int, n_items: int, n_common: int, common_freq: int, rare_freq: int):
    rng = rng_for(NAME, seed, index)
    n_rare = (n_items - n_common * common_freq) // rare_freq
    words = _words(rng, n_common + n_rare)
    common, rare = words[:n_common], words[n_common:]
    occurrences = [w for w in common for _ in range(common_freq)] + [w for w in rare for _ in range(rare_freq)]
    rng.shuffle(occurrences)
    text = " " + " ".join(f"{i}. {w}" for i, w in enumerate(occurrences, 1))
    return text, common, n_rare


def generate(seed: int, index: int, *, tokenize: Tokenize, n_tokens: int, depth: None = None,
             chat_format: ChatFormat | None = None, n_common: int = 10, common_freq: int = 30,
             rare_freq: int = 3) -> Sample:
    """One sample of at most `n_tokens` prompt tokens (a little less: the list is sized to fit)."""
    if depth is not None:
        raise ValueError("common_words has no needle depth (the answer is spread over the whole list)")
    if not 1 <= rare_freq < common_freq or n_common < 1:
        raise ValueError("need n_common >= 1 and 1 <= rare_freq < common_freq")
    head, tail = template(INTRO, question_text(n_common), tokenize, chat_format)
    budget = n_tokens - len(head.tokens) - len(tail.tokens)
    smallest = n_common * common_freq + rare_freq       # at least one rare word

    def make(n_items: int):
        text, common, n_rare = _word_list(seed, index, n_items, n_common, common_freq, rare_freq)
        return text, tuple(tokenize(text, False)), common, n_rare

    n_items = max(smallest, budget // 4)
    text, toks, common, n_rare = make(n_items)
    for _ in range(8):                  # scale the item count by the observed tokens per item
        guess = max(smallest, int(n_items * budget / max(len(toks), 1)))
        if guess == n_items:
            break
        n_items = guess
        text, toks, common, n_rare = make(n_items)
    while len(toks) > budget:           # then trim a rare word at a time until it fits
        n_items -= rare_freq
        if n_items < smallest:
            raise ValueError(f"n_tokens={n_tokens} is too small for {n_common} words x {common_freq} "
                             f"plus rare words x {rare_freq}")
        text, toks, common, n_rare = make(n_items)

    pieces = (head, Piece("filler", text, toks), tail)
    total = sum(len(p.tokens) for p in pieces)
    return Sample(NAME, seed, index, pieces, question_text(n_common), tuple(common),
                  {"n_tokens": total, "n_tokens_asked": n_tokens, "n_filler": len(toks), "depth": None,
                   "n_common": n_common, "common_freq": common_freq, "rare_freq": rare_freq,
                   "n_rare_words": n_rare})


def score(prediction: str, answers: Sequence[str]) -> float:
    """Share of the expected words present as whole words in the prediction (case-insensitive)."""
    found = set(re.findall(r"[a-z]+", prediction.lower()))
    return sum(a.lower() in found for a in answers) / len(answers) if answers else 0.0
