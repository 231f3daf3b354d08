"""The model's own tokenizer and chat template, and greedy decoding one token at a time (so the evicting
cache sees decode steps exactly as llama.cpp's tools feed them)."""
from __future__ import annotations

from typing import Callable

import numpy as np


def tokenizer(llm) -> Callable[[str, bool], list[int]]:
    def tokenize(text: str, add_bos: bool) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=add_bos, special=True)
    return tokenize


def chat_format(llm) -> Callable[[str], str] | None:
    """The model's chat template applied to one user message; None when the GGUF has no template."""
    from llama_cpp import llama_chat_format

    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        return None
    formatter = llama_chat_format.Jinja2ChatFormatter(template=template, eos_token=llm.detokenize([llm.token_eos()]).decode(),
                                                      bos_token=llm.detokenize([llm.token_bos()]).decode())
    return lambda user: formatter(messages=[{"role": "user", "content": user}]).prompt


def last_logits(llm) -> np.ndarray:
    """The next-token logits of the last evaluated token, copied: llama.cpp reuses (and frees on close) the buffer
    they live in, so a view would silently change under the next eval."""
    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).copy()


def greedy(llm, max_new: int) -> tuple[str, int]:
    """Greedy answer after the prompt already evaluated: (text, tokens generated). Stops at end of turn."""
    import llama_cpp

    out: list[int] = []
    vocab = llm._model.vocab
    for _ in range(max_new):
        token = int(np.argmax(last_logits(llm)))
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            break
        out.append(token)
        llm.eval([token])
    return llm.detokenize(out).decode(errors="replace"), len(out)
