"""One number in real text, shaped like the document's own numbers.

Real-text families: info, man, pysource (held out), and pypackages to tune settings on.

The needle states one fact about a made-up subject ("Support for the quenmoor option first appeared in version
2.6.31."), its value of the shape the haystack's numbers have near the insertion point: a version among versions,
a file mode among modes, a date among dates (realneedle.py). The document's own numbers are the look-alikes a
generated haystack never had: an answer that names one of them is a confusion, not a miss (confusion.py).

Score (`score`): 1.0 when the asked value stands in the answer as a whole token, else 0.0; `classify` tells
"right", "confusion" and "miss" apart.
"""
from __future__ import annotations


from . import realneedle, realtext
from .haystack import ChatFormat, Sample, Tokenize
from .realneedle import classify, judge, score  # noqa: F401  (the real-text needles' common rules)

NAME = "real_number"
USES_DEPTH = True
MAX_NEW_TOKENS = realneedle.MAX_NEW_TOKENS
HAYSTACKS = realtext.NEEDLE_FAMILIES        # the families it takes (only real text)


def generate(seed: int, index: int, *, tokenize: Tokenize, n_tokens: int, depth: float = 0.5,
             chat_format: ChatFormat | None = None, haystack: str = "man") -> Sample:
    """One sample of at most `n_tokens` prompt tokens: one needle at `depth` in a stretch of the real-text family
    `haystack`."""
    return realneedle.generate(task=NAME, seed=seed, index=index, tokenize=tokenize, n_tokens=n_tokens, depth=depth,
                               chat_format=chat_format, family=haystack, n_needles=1, uses_shape=True,
                               fact_for=realneedle.number_fact, values_for=realneedle.number_values)

