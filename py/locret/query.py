"""Locret-Q's layout, shared by training and inference: the query goes at the start of the (first)
user turn, then a blank line, then the user's own text (which may end with the same question).

Every eviction then sees the query: its tokens are pinned (never evicted, counted in the budget),
and the heads trained on this layout score the rest of the context against it (paper sec. 5.4).
Training and inference must build the same text, so both call `place_query`, which asks the C
library's llama_locret_query_layout, the one function the llama.cpp tools call too. Which tokens to pin is found by
`locret.eviction.query_tokens`, the C library's rule that the tools use too.
"""
from __future__ import annotations

SEPARATOR = "\n\n"
AUTO = "auto"  # locret_query="auto": the question at the end of the text (find_question)


def place_query(query: str, content: str) -> str:
    """The user turn's text with `query` in front."""
    if not query.strip():
        raise ValueError("the Locret-Q query is empty")
    from .eviction import _api
    # the library builds the layout for every tool
    return _c_string(lambda out, n: _api().llama_locret_query_layout(query.encode(), content.encode(), out, n))



def find_question(text: str) -> str:
    """Locret-Q auto: the question at the end of `text` (a chat's last user message, or a prompt), by the C library's
    written rule (llama_locret_find_question, docs/locret-q.md#the-question-found), or "" when it has none."""
    from .eviction import _api
    return _c_string(lambda out, n: _api().llama_locret_find_question(text.encode(), out, n))


def find_prompt_question(vocab, prompt: str) -> str:
    """Locret-Q auto on a completion prompt, which may hold a chat template written out: the question of its last user
    turn (its turns cut at the model's control tokens; `vocab` a `llama_vocab *`, None for a prompt read as plain
    text), by the C library's rule (llama_locret_find_prompt_question, which llama-server and llama-completion call
    too), or "" when it has none."""
    from .eviction import _api
    return _c_string(lambda out, n: _api().llama_locret_find_prompt_question(vocab, prompt.encode(), out, n))


def place_query_in_prompt(vocab, query: str, prompt: str) -> str:
    """A completion prompt with `query` at the start of its first user turn's text (`place_query` there; a prompt
    without a chat template's markers gets it in front), by llama_locret_prompt_layout, which the tools call too."""
    if not query.strip():
        raise ValueError("the Locret-Q query is empty")
    from .eviction import _api
    return _c_string(lambda out, n: _api().llama_locret_prompt_layout(vocab, query.encode(), prompt.encode(), out, n))


def chat_query_message(user_texts: list[str], requery: bool = True) -> int:
    """Locret-Q auto in a chat: the index of the user message (of `user_texts`, a chat's user messages whose content
    is text, in order) whose closing question is the chat's query, by the C library's rule
    (llama_locret_chat_query_message, which llama-server calls too): with `requery`, the last one; without, the first
    one that ends with a question (a conversation keeps its first question, so a follow-up reads only its new tokens),
    else the last. -1 for no messages."""
    import ctypes
    from .eviction import _api
    encoded = [t.encode() for t in user_texts]
    array = (ctypes.c_char_p * max(1, len(encoded)))(*encoded)
    return int(_api().llama_locret_chat_query_message(array, len(encoded), bool(requery)))


def pin_room() -> int:
    """The tokens a budget schedule keeps free for a pinned question in its smallest layer, beyond the stabilizers
    (the library's LLAMA_LOCRET_PIN_ROOM: a question of the auto rule's longest in Locret-Q's layout)."""
    from .eviction import _api
    return int(_api().llama_locret_pin_room())


def _c_string(write) -> str:
    """The text of a C function that, like snprintf, returns the length it needs when given no buffer."""
    import ctypes

    n = write(None, 0)
    out = ctypes.create_string_buffer(n + 1)
    write(out, n + 1)
    return out.raw[:n].decode(errors="replace")
