"""Single needle, a sentence to quote: one key's motto, seven invented-but-plain words ("seven cobalt otters murmur
beneath the lagoons"), asked back word for word.

Why beside niah_single and niah_code: a number or a code is one contiguous span a cache either keeps or
loses; a sentence is several words whose tokens a score-based eviction may keep in part. A partial keep
then scores as a partial answer instead of a zero. The words come from lists of their own (MOTTO_WORDS),
which no haystack family uses (test_haystacks checks it), so the answer's words occur in the text only in
the needle: a model can only say them by having read it.

Score (`score`): the share of the motto's words the prediction says (SQuAD normalisation, counted with
multiplicity), best over answers. Recall, not F1: the default model restates the question before it quotes
("The motto of amber-heron mentioned in the text is ..."), which F1 would count against a perfect quote.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from .. import metrics
from . import niah, niah_single
from .haystack import ChatFormat, Sample, Tokenize, rng_for

NAME = "niah_quote"
USES_DEPTH = True
MAX_NEW_TOKENS = 64     # the model restates the question before it quotes the seven words

# the motto's words by place: "<number> <colour> <creature> <verb> <preposition> <the> <thing>"
NUMBERS = ("seven", "eleven", "twelve", "nineteen", "forty", "ninety")
COLOURS = ("crimson", "scarlet", "violet", "indigo", "saffron", "cobalt", "maroon", "turquoise")
CREATURES = ("herons", "beetles", "otters", "magpies", "salmon", "moths", "crickets", "tortoises")
VERBS = ("whistle", "wander", "shimmer", "tremble", "gallop", "waltz", "murmur", "dance")
PLACES = ("beneath", "atop", "amid", "alongside")
THINGS = ("lighthouses", "glaciers", "vineyards", "windmills", "chimneys", "lagoons", "meadows", "volcanoes")
MOTTO_WORDS = NUMBERS + COLOURS + CREATURES + VERBS + PLACES + THINGS

INTRO = ("A motto is hidden in the long text below. Read it carefully: at the end you will be asked to quote "
         "the motto that belongs to a given name.")


def make_motto(rng) -> str:
    return " ".join((rng.choice(NUMBERS), rng.choice(COLOURS), rng.choice(CREATURES), rng.choice(VERBS),
                     rng.choice(PLACES), "the", rng.choice(THINGS)))


def needle_text(key: str, motto: str) -> str:
    return f'The motto of {key} is "{motto}".'


def question_text(key: str) -> str:
    return f"What is the motto of {key} mentioned in the text? Quote it exactly."


def generate(seed: int, index: int, *, tokenize: Tokenize, n_tokens: int, depth: float = 0.5,
             chat_format: ChatFormat | None = None, haystack: str = "prose") -> Sample:
    """One sample of at most `n_tokens` prompt tokens: one key's motto at `depth` in a haystack of the family
    `haystack` (one of haystacks.FAMILIES)."""
    rng = rng_for(NAME, seed, index)
    key = niah.make_key(rng)
    motto = make_motto(rng)
    return niah_single.one_needle(task=NAME, seed=seed, index=index, rng=rng, tokenize=tokenize, n_tokens=n_tokens,
                                  depth=depth, chat_format=chat_format, haystack=haystack, intro=INTRO,
                                  question=question_text(key), needle=needle_text(key, motto), key=key, answer=motto)


def score(prediction: str, answers: Sequence[str]) -> float:
    """The best share of a motto's words present in the prediction (SQuAD normalisation, with multiplicity)."""
    said = Counter(metrics.normalize_answer(prediction).split())
    best = 0.0
    for a in answers:
        words = Counter(metrics.normalize_answer(a).split())
        if words:
            best = max(best, sum((words & said).values()) / sum(words.values()))
    return best
