"""An access code of capitals and digits ("KX7R-42M9") in real text.

Real-text families: info, man, pysource (held out), and pypackages to tune settings on.

niah_code's needle form in a sentence of the document's register (a paragraph of the manual, a comment of the
source; realneedle.py): a code no document holds, among numbers that are the document's own. An answer that gives
one of those numbers instead is a confusion (confusion.py).

Score (`score`): 1.0 when the code stands in the answer as a whole token (without case), else 0.0; `classify`
tells "right", "confusion" and "miss" apart.
"""
from __future__ import annotations


from . import niah_code, realneedle, realtext
from .haystack import ChatFormat, Sample, Tokenize
from .realneedle import classify, judge, score  # noqa: F401  (the real-text needles' common rules)

NAME = "real_code"
USES_DEPTH = True
MAX_NEW_TOKENS = realneedle.MAX_NEW_TOKENS
HAYSTACKS = realtext.NEEDLE_FAMILIES

FACTS = (realneedle.Fact("The registration key for the {subject} package is {value}.",
                         "What is the registration key for the {subject} package?", "key"),
         realneedle.Fact("The {subject} account is unlocked with the code {value}.",
                         "Which code unlocks the {subject} account?", "code"))


def _fact(shape, rng) -> realneedle.Fact:
    return rng.choice(FACTS)


def _values(shape, rng, n, taken) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        code = niah_code.make_code(rng)
        if code not in out and not taken(code):
            out.append(code)
    return out


def generate(seed: int, index: int, *, tokenize: Tokenize, n_tokens: int, depth: float = 0.5,
             chat_format: ChatFormat | None = None, haystack: str = "man") -> Sample:
    """One sample of at most `n_tokens` prompt tokens: one code at `depth` in a stretch of the real-text family
    `haystack`."""
    return realneedle.generate(task=NAME, seed=seed, index=index, tokenize=tokenize, n_tokens=n_tokens, depth=depth,
                               chat_format=chat_format, family=haystack, n_needles=1, uses_shape=False,
                               fact_for=_fact, values_for=_values)

