"""Single needle, an access code mixing capitals and digits ("KX7R-42M9"): niah_single with another
needle form.

Why beside niah_single: a seven-digit number is a handful of digit tokens the model reads as one
thing; a code such as "KX7R-42M9" splits into many short tokens, letters and digits mixed, none of which
means anything alone. A cache that keeps half of those tokens loses the answer, so this form asks more
of eviction than a number does (and it is the form a user's serial numbers, ticket ids and keys take).
Same keys as niah ("amber-heron"), same placement (haystack.assemble), the haystack families of
haystacks.py.

Score (`score`): 1.0 when the code stands in the prediction, compared without case and without the
separators a model may add or drop ("kx7r 42m9" counts), else 0.0.
"""
from __future__ import annotations

import re
from typing import Sequence

from . import niah, niah_single
from .haystack import ChatFormat, Sample, Tokenize, rng_for

NAME = "niah_code"
USES_DEPTH = True
MAX_NEW_TOKENS = 64     # as niah_single's: the model restates the question first ("The access code for zesty-walrus ... is ...")

LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"     # no I or O: nothing to read as 1 or 0
DIGITS = "23456789"                      # no 0 or 1, for the same reason
PATTERN = "LLDL-DDLD"                    # L a capital, D a digit

INTRO = ("An access code is hidden in the long text below. Read it carefully: at the end you will be asked "
         "for the code that belongs to a given name.")


def make_code(rng) -> str:
    return "".join(rng.choice(LETTERS) if c == "L" else rng.choice(DIGITS) if c == "D" else c for c in PATTERN)


def needle_text(key: str, code: str) -> str:
    return f"The access code for {key} is {code}."


def question_text(key: str) -> str:
    return f"What is the access code for {key} mentioned in the text? Answer with the code only."


def generate(seed: int, index: int, *, tokenize: Tokenize, n_tokens: int, depth: float = 0.5,
             chat_format: ChatFormat | None = None, haystack: str = "prose") -> Sample:
    """One sample of at most `n_tokens` prompt tokens: one key's code at `depth` in a haystack of the family
    `haystack` (one of haystacks.FAMILIES)."""
    rng = rng_for(NAME, seed, index)
    key = niah.make_key(rng)
    code = make_code(rng)
    return niah_single.one_needle(task=NAME, seed=seed, index=index, rng=rng, tokenize=tokenize, n_tokens=n_tokens,
                                  depth=depth, chat_format=chat_format, haystack=haystack, intro=INTRO,
                                  question=question_text(key), needle=needle_text(key, code), key=key, answer=code)


def _letters_and_digits(text: str) -> str:
    return re.sub(r"[^0-9A-Z]", "", text.upper())


def score(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when a code stands in the prediction (case and separators ignored), else 0.0."""
    got = _letters_and_digits(prediction)
    return float(any(_letters_and_digits(a) in got for a in answers if a))
