"""Locret-Q's layout, shared by training and inference: the query goes at the start of the (first)
user turn, then a blank line, then the user's own text (which may end with the same question).

Every eviction then sees the query: its tokens are pinned (never evicted, counted in the budget),
and the heads trained on this layout score the rest of the context against it (paper sec. 5.4).
Training and inference must build the same text, so both call `place_query` (the tools follow the
same layout: LLAMA_LOCRET_QUERY_SEPARATOR in llama-locret.h). Which tokens to pin is found by
`locret.eviction.query_tokens`, the C library's rule that the tools use too.
"""
from __future__ import annotations

SEPARATOR = "\n\n"


def place_query(query: str, content: str) -> str:
    """The user turn's text with `query` in front."""
    query = query.strip()
    if not query:
        raise ValueError("the Locret-Q query is empty")
    return query + SEPARATOR + content

