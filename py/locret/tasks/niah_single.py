"""Single needle in a haystack: one key, one seven-digit number, no distractors (RULER's S-NIAH with a
numeric value).

Why beside niah: the multi-key niah (4 keys x 2 numbers, 6 distractor needles) is too hard for the default
135M model even inside its window with full attention (0 of 3 at 6K), so "Locret-Q reaches 0.8x the
in-window full-attention accuracy" has no reference worth the name there. With one needle and nothing like
it in the text, the question is whether the cache kept the needle, which is what eviction decides. Same
needle sentence, keys and score as niah; the haystack families of haystacks.py.
"""
from __future__ import annotations

from typing import Sequence

from . import haystacks, niah
from .haystack import ChatFormat, Needle, Sample, Tokenize, assemble, rng_for

NAME = "niah_single"
USES_DEPTH = True
MAX_NEW_TOKENS = niah.MAX_NEW_TOKENS

INTRO = ("An archive number is hidden in the long text below. Read it carefully: at the end you will be asked "
         "for the number that belongs to a given name.")


def question_text(key: str) -> str:
    return f"What is the archive number for {key} mentioned in the text? Answer with the number only."


def one_needle(*, task: str, seed: int, index: int, rng, tokenize: Tokenize, n_tokens: int, depth: float,
               chat_format: ChatFormat | None, haystack: str, intro: str, question: str, needle: str, key: str,
               answer: str) -> Sample:
    """A sample with one answer needle at `depth` and nothing like it in the filler: what niah_single, niah_code,
    niah_quote and niah_name share (each draws its key and answer from `rng` first; the filler continues the same stream)."""
    return assemble(task=task, seed=seed, index=index, tokenize=tokenize, chat_format=chat_format,
                    n_tokens=n_tokens, intro=intro, question=question,
                    filler=haystacks.units(haystack, rng), needles=[Needle(needle, depth, "answer")],
                    answers=[answer], metadata={"depth": float(depth), "keys": [key], **haystacks.metadata(haystack)})


def generate(seed: int, index: int, *, tokenize: Tokenize, n_tokens: int, depth: float = 0.5,
             chat_format: ChatFormat | None = None, haystack: str = "prose") -> Sample:
    """One sample of at most `n_tokens` prompt tokens: one key's number at `depth` in a haystack of the
    family `haystack` (one of haystacks.FAMILIES)."""
    rng = rng_for(NAME, seed, index)
    key = niah.make_key(rng)
    value = str(rng.randrange(1_000_000, 10_000_000))
    return one_needle(task=NAME, seed=seed, index=index, rng=rng, tokenize=tokenize, n_tokens=n_tokens, depth=depth,
                      chat_format=chat_format, haystack=haystack, intro=INTRO, question=question_text(key),
                      needle=niah.needle_text(key, value), key=key, answer=value)


def score(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the number stands in the prediction as a whole number (niah's rule), else 0.0."""
    return niah.score(prediction, answers)
