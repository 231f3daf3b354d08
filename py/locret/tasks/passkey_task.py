"""The passkey task (passkey.py) in the common task interface (see tasks/__init__.py), so a runner can
treat it like the other tasks: same wording, key and filler as passkey.py, assembled by haystack.py.

passkey.py itself stays as it is for passkey_eval.py, which needs exact filler lengths and chunk-aligned
needle offsets to reuse cache state across trials; here the needle goes between whole filler sentences.
"""
from __future__ import annotations

import re
from typing import Sequence

from . import haystacks, passkey
from .haystack import ChatFormat, Needle, Sample, Tokenize, assemble, rng_for

NAME = "passkey"
USES_DEPTH = True
MAX_NEW_TOKENS = 32  # room for a chatty answer, as passkey_eval gives

SENTENCES = tuple(s for s in re.split(r"(?<=\.)\s+", passkey.FILLER.strip()) if s)


def generate(seed: int, index: int, *, tokenize: Tokenize, n_tokens: int, depth: float = 0.5,
             chat_format: ChatFormat | None = None, haystack: str = "prose") -> Sample:
    """One passkey prompt of at most `n_tokens` tokens; the key is passkey.make_keys(seed, ...)[index].
    `haystack`: the kind of filler, one of haystacks.FAMILIES; "prose" is passkey's own sentences."""
    key = passkey.make_keys(seed, index + 1)[index]
    return assemble(task=NAME, seed=seed, index=index, tokenize=tokenize, chat_format=chat_format,
                    n_tokens=n_tokens, intro=passkey.INTRO, question=passkey.QUESTION,
                    filler=haystacks.units(haystack, rng_for(NAME, seed, index), prose=SENTENCES),
                    needles=[Needle(passkey.needle_text(key).strip(), depth)], answers=[key],
                    metadata={"depth": depth, **haystacks.metadata(haystack)})


def score(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the key appears as a whole number in the prediction (passkey.score)."""
    return float(any(passkey.score(prediction, a) for a in answers))
