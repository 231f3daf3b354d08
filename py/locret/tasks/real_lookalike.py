"""Four look-alike needles in real text, one asked.

Real-text families: info, man, pysource (held out), and pypackages to tune settings on.

The four needles state the same fact (one sentence of realneedle.FACTS) about four made-up subjects, with values
of one shape (the shape of the document's numbers near the asked needle): "Support for the quenmoor option first
appeared in version 2.6.31.", "... the draixel option ... 3.1.17.", ... The question names one subject; the asked
needle goes at `depth`, the three others at seeded depths at least a tenth of the haystack away from it and from
each other. What a cache that keeps the wrong one of four alike sentences answers is a confusion with another
needle's value, which `classify` reports as such (confusion.py), apart from a miss.

Score (`score`): 1.0 when the asked value stands in the answer as a whole token, else 0.0.
"""
from __future__ import annotations


from . import realneedle, realtext
from .haystack import ChatFormat, Sample, Tokenize
from .realneedle import classify, judge, score  # noqa: F401  (the real-text needles' common rules)

NAME = "real_lookalike"
USES_DEPTH = True
MAX_NEW_TOKENS = realneedle.MAX_NEW_TOKENS
HAYSTACKS = realtext.NEEDLE_FAMILIES
N_NEEDLES = 4


def generate(seed: int, index: int, *, tokenize: Tokenize, n_tokens: int, depth: float = 0.5,
             chat_format: ChatFormat | None = None, haystack: str = "man") -> Sample:
    """One sample of at most `n_tokens` prompt tokens: four alike needles in a stretch of the real-text family
    `haystack`, the asked one at `depth`."""
    return realneedle.generate(task=NAME, seed=seed, index=index, tokenize=tokenize, n_tokens=n_tokens, depth=depth,
                               chat_format=chat_format, family=haystack, n_needles=N_NEEDLES, uses_shape=True,
                               fact_for=realneedle.number_fact, values_for=realneedle.number_values)

