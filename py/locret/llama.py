"""`locret.Llama`: llama-cpp-python's `Llama` whose KV cache evicts with retaining heads.

Existing code changes one line::

    from locret import Llama                       # was: from llama_cpp import Llama
    llm = Llama(model_path="model.gguf", n_ctx=1_000_000, locret_budget=2048,
                locret_heads="heads.gguf")         # heads embedded in the model need no locret_heads
    llm.create_completion(long_prompt, max_tokens=32)
    llm.locret_stats()                             # physical cells, logical position, evictions, KV bytes

`n_ctx` is the logical limit on positions; the KV cache holds `locret_budget + n_ubatch` cells
(padded to 256) whatever `n_ctx` is. The chunk of Algorithm 1 is `n_ubatch`. `locret_policy`
chooses what scores the units: "heads" (default), or the ablations "random" and "streaming"
(attention sinks, then recency), which need no heads.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Sequence

import llama_cpp
import llama_cpp._internals as _internals

from . import eviction
from .heads import Heads, HeadsError, _last_error

_context_lock = threading.Lock()


class Llama(llama_cpp.Llama):
    """`llama_cpp.Llama` plus Locret settings; every other argument and method is llama-cpp-python's."""

    def __init__(self, model_path: str, *args: Any, locret_heads: str | os.PathLike | None = None,
                 locret_budget: int | None = None, locret_stabilizers: int | None = None,
                 locret_local: int | None = None, locret_policy: str | None = None, n_seq_max: int | None = None,
                 **kwargs: Any):
        settings = dict(heads=locret_heads, budget=locret_budget, stabilizers=locret_stabilizers,
                        local=locret_local, policy=locret_policy)
        self._locret_heads: Heads | None = None
        holder: dict[str, Heads] = {}

        class _ConfiguredContext(_internals.LlamaContext):
            # llama-cpp-python loads the model and creates its context in one constructor: register the
            # Locret settings for the model in between, so the context is created with them
            def __init__(self, *, model, params, verbose=True):
                if n_seq_max is not None:
                    # several sequences, each in its own KV stream (an evicting cache keeps them apart)
                    params.n_seq_max = n_seq_max
                    params.kv_unified = False
                try:
                    holder["heads"] = eviction.configure(model.model, model_path, **settings)
                except HeadsError:
                    self._exit_stack = contextlib.ExitStack()  # what LlamaContext.__del__ closes
                    raise
                super().__init__(model=model, params=params, verbose=verbose)
                err = _last_error()
                if self.ctx is None and err:
                    raise HeadsError(err)

        with _context_lock:
            original = _internals.LlamaContext
            _internals.LlamaContext = _ConfiguredContext
            try:
                super().__init__(model_path, *args, **kwargs)
            except ValueError as e:
                err = _last_error()
                raise HeadsError(err or str(e)) from e
            finally:
                _internals.LlamaContext = original
        self._locret_heads = holder.get("heads")

    @property
    def locret_enabled(self) -> bool:
        return self.locret_stats()["enabled"]

    def locret_stats(self, seq_id: int = 0) -> dict[str, int | bool | str]:
        """Eviction figures of this context (of sequence `seq_id`): see `locret.eviction.stats`."""
        return eviction.stats(self._ctx.ctx, seq_id)

    def locret_retained(self, layer: int, head: int, seq_id: int = 0):
        """Logical positions of the units that (layer, KV head) holds in sequence `seq_id`, in cell order."""
        return eviction.retained(self._ctx.ctx, layer, head, seq_id)

    def eval(self, tokens: Sequence[int], prompt_continues: bool = False):
        """As llama-cpp-python's, except that only the last token of the whole call asks for logits.

        llama-cpp-python marks the last token of every n_batch slice; the evicting cache reads a token
        that asks for logits as the end of a prompt (its local tail is split off and the chunk before
        it is evicted without stabilizers), so the slices in between must not ask.

        `prompt_continues=True` feeds part of a prompt whose rest comes in a later call: no token asks
        for logits, so these tokens are compressed as ordinary prefill chunks (there are no logits to
        sample from afterwards). Without eviction it is ignored."""
        if not self.locret_enabled or self._logits_all:
            return super().eval(tokens)
        self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
        for i in range(0, len(tokens), self.n_batch):
            batch = tokens[i: min(len(tokens), i + self.n_batch)]
            n_past = self.n_tokens
            n_tokens = len(batch)
            self._batch.set_batch(batch=batch, n_past=n_past, logits_all=False)
            if prompt_continues or i + n_tokens < len(tokens):
                self._batch.batch.logits[n_tokens - 1] = False
            self._ctx.decode(self._batch)
            self.input_ids[n_past: n_past + n_tokens] = batch
            self.n_tokens += n_tokens
            self._requires_eval = False


__all__ = ["Llama"]
