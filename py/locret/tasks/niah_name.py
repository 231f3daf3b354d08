"""Single needle, a person's name ("Marisol Quenby"): niah_single with a fourth needle form.

Why beside niah_single, niah_code and niah_quote: a name is what people most often ask a document for ("who signed
it?", "who is the contact?"), and to a model it is neither digits nor a code nor a sentence: two capitalised words,
each split into a few sub-word tokens that look like any other proper noun. The first and last names come from lists
of their own (FIRST_NAMES, LAST_NAMES: invented but plain), which no haystack family uses (test_haystacks checks it),
so the answer's words occur in the text only in the needle: a model can only say them by having read it.

Score (`score`): the share of the name's two words the prediction says as whole words, without case (0, 0.5 or 1):
a model that keeps the first name and loses the surname has half the answer.
"""
from __future__ import annotations

import re
from typing import Sequence

from . import niah, niah_single
from .haystack import ChatFormat, Sample, Tokenize, rng_for

NAME = "niah_name"
USES_DEPTH = True
MAX_NEW_TOKENS = 64     # as the other single needles': the model restates the question first

FIRST_NAMES = ("Marisol", "Tobiah", "Ilsabet", "Corwin", "Delphine", "Anselm", "Oriana", "Fenwick", "Rosalind",
               "Thaddeus", "Evangeline", "Leopold")
LAST_NAMES = ("Quenby", "Hartsell", "Vantreight", "Ashgrove", "Pellerin", "Dunmore", "Castellane", "Wrexley",
              "Marchbanks", "Oakhurst", "Tremaine", "Blackwood")
NAME_WORDS = FIRST_NAMES + LAST_NAMES

INTRO = ("A name is hidden in the long text below. Read it carefully: at the end you will be asked for the person "
         "who keeps a given archive.")


def make_name(rng) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def needle_text(key: str, name: str) -> str:
    return f"The keeper of {key} is {name}."


def question_text(key: str) -> str:
    return f"Who is the keeper of {key} mentioned in the text? Answer with the full name only."


def generate(seed: int, index: int, *, tokenize: Tokenize, n_tokens: int, depth: float = 0.5,
             chat_format: ChatFormat | None = None, haystack: str = "prose") -> Sample:
    """One sample of at most `n_tokens` prompt tokens: one key's keeper at `depth` in a haystack of the family
    `haystack` (one of haystacks.FAMILIES)."""
    rng = rng_for(NAME, seed, index)
    key = niah.make_key(rng)
    name = make_name(rng)
    return niah_single.one_needle(task=NAME, seed=seed, index=index, rng=rng, tokenize=tokenize, n_tokens=n_tokens,
                                  depth=depth, chat_format=chat_format, haystack=haystack, intro=INTRO,
                                  question=question_text(key), needle=needle_text(key, name), key=key, answer=name)


def score(prediction: str, answers: Sequence[str]) -> float:
    """The best share of a name's words that stand in the prediction as whole words, case ignored."""
    said = set(re.findall(r"[a-z]+", prediction.lower()))
    best = 0.0
    for a in answers:
        words = re.findall(r"[a-z]+", a.lower())
        if words:
            best = max(best, sum(w in said for w in words) / len(words))
    return best
