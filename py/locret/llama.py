"""`locret.Llama`: llama-cpp-python's `Llama` whose KV cache evicts with retaining heads.

Existing code changes one line::

    from locret import Llama                       # was: from llama_cpp import Llama
    llm = Llama(model_path="model.gguf", n_ctx=1_000_000, locret_budget=2048,
                locret_heads="heads.gguf")         # heads embedded in the model need no locret_heads
    llm.create_completion(long_prompt, max_tokens=32)
    llm.locret_stats()                             # physical cells, logical position, evictions, KV bytes

`n_ctx` is the logical limit on positions; the KV cache holds `locret_budget + n_ubatch` cells
(padded to 256) whatever `n_ctx` is. The chunk of Algorithm 1 is `n_ubatch`. `locret_policy`
chooses what scores the units: "heads" (default), "lagkv" (LagKV: each partition of units scored against the
next one's K/V ranges), "sage" (SAGE-KV: each prompt read whole, in a cache of `n_ctx` cells, then one choice by
the attention of its last token), "snapkv" (SnapKV per chunk: the attention of each part's last queries, pooled
over neighbouring units), or the ablations "random" and "streaming" (attention sinks, then recency); all but
"heads" need no heads. A policy's own settings follow its name: `locret_policy="NAME:key=value[,key=value...]"`,
checked by the library (each policy's keys and defaults: `locret.eviction.policy_settings_help(NAME)`,
docs/policies.md); `locret_stats()["policy_settings"]` gives them as resolved. `locret_pool=N` (odd) scores each
unit by the mean of the heads' (or SnapKV's) scores over the N tokens around it, so that whole sentences and numbers
survive eviction rather than scattered tokens of them (15 is what makes the main job's long log answerable).
`locret_budget_schedule` spreads the budget over the layers: "pyramid" (PyramidKV) or a file of per-layer
budgets summing to `locret_budget` times the evicting layers; the cache is sized for the largest layer's.
`locret_budget_mib=N` instead of `locret_budget`: the largest budget whose KV cache (budget and chunk cells, the
window layers' cache, the score store) fits N MiB per sequence for this model and its K/V types
(`eviction.budget_for_mib`, the library's rule); `locret_stats()["budget"]` says what it resolved to.
`locret_positions`: where kept units sit. The default (the heads file's `locret.recommended.positions` where the
policy takes it, else "inplace" for the heads, random and streaming policies) gives
them positions 0..n-1 after every eviction, as the paper does, re-rotating each key in the cell it stays in and
copying the chunk's survivors into the holes; "compact" moves them to cells 0..n-1 as well (the same positions,
nearly every row moved); "keep" (or "keep:N") keeps the positions they were read at, so an eviction re-rotates none
(positions are compacted when they would reach the model's trained context, or N).

Locret-Q (`locret_query="..."`, or per call `create_completion(..., locret_query=...)` and
`create_chat_completion(..., locret_query=...)`): the query goes at the start of the prompt (of the
first user turn in a chat), and the prompt's tokens through the query are pinned: never evicted,
counted in the budget, so every eviction sees the question. Use heads trained that way
(`heads/*.query.gguf`); `locret_query=""` in a call turns a constructor's query off. `locret_query="auto"`:
the question at the end of the prompt (of the last user message in a chat), found by the library's written rule
(`locret.query.find_question`), is the query; without one the call evicts as plain Locret. Heads that recommend it
(`locret.recommended.query = "auto"`, the shipped Locret-Q heads) make "auto" the default; `locret_query="off"` (or
"") turns it off. In a chat, auto's question is the last user message's; `locret_requery=False` keeps the
conversation's first question instead (of the first user message that ends with one, the library's rule that
llama-server's `--locret-requery off` follows too): a follow-up's prompt then opens as the cached one did and only its
new tokens are read, answered from what the first question's eviction kept (docs/locret-q.md). `locret_pool` defaults
to the heads' recommended window (`locret.recommended.pool`); 0 turns pooling off. Heads that recommend it for long
prompts only (`locret.recommended.pool_from`, in budgets) pool a sequence whose first prompt is that long: `eval` tells
the library a prompt's length when it starts the sequence (`locret_seq_prompt` for a prompt fed in parts).
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Sequence

import llama_cpp
import llama_cpp._internals as _internals

from . import eviction, rpc
from .heads import Heads, HeadsError, _last_error
from .threads import threads_from_env
from .query import AUTO, chat_query_message, find_prompt_question, find_question, place_query, place_query_in_prompt

_context_lock = threading.Lock()


class Llama(llama_cpp.Llama):
    """`llama_cpp.Llama` plus Locret settings; every other argument and method is llama-cpp-python's."""

    def __init__(self, model_path: str, *args: Any, locret_heads: str | os.PathLike | None = None,
                 locret_budget: int | None = None, locret_stabilizers: int | None = None,
                 locret_local: int | None = None, locret_policy: str | None = None, n_seq_max: int | None = None,
                 locret_query: str | None = None, locret_requery: bool = True, locret_pool: int | None = None,
                 locret_budget_schedule: str | os.PathLike | None = None, locret_positions: str | None = None,
                 locret_budget_mib: float | None = None, rpc_servers: str | Sequence[str] | None = None,
                 **kwargs: Any):
        self._stack = contextlib.ExitStack()  # what llama_cpp.Llama.__del__ closes, when a refusal below stops here
        unknown = sorted(k for k in kwargs if k.startswith("locret_"))
        if unknown:
            # llama_cpp.Llama takes any keyword and ignores the ones it does not know: a Locret setting misspelt, or
            # one that is now part of another, would otherwise be dropped without a word
            raise HeadsError(f"locret.Llama has no argument {', '.join(unknown)}: a policy's own settings follow its "
                             "name in locret_policy, 'NAME:key=value[,key=value...]' (docs/policies.md)")
        if rpc_servers:
            # llama.cpp's --rpc: the servers' devices are registered for this load (and stay, as in llama.cpp's
            # tools); n_gpu_layers puts layers, and their evicting caches, on them. RpcError when one cannot be reached
            rpc.add_servers(rpc_servers)
        if locret_budget_mib is not None and locret_budget is not None:
            raise HeadsError("give locret_budget (units) or locret_budget_mib (memory), not both")
        if kwargs.get("draft_model") is not None and (locret_budget or locret_budget_mib):
            # llama-cpp-python's speculative loop asks logits for every prompt token (each slice would read as a
            # prompt's end) and drafts past the room before the next eviction (locret_room); llama-server's n-gram
            # kinds serve speculation with a budget
            raise HeadsError("draft_model cannot be used with locret_budget: use llama-server's n-gram speculation "
                             "(--spec-type ngram-simple), or decode drafts of at most Llama.locret_room() tokens")
        if not isinstance(locret_requery, bool):
            raise HeadsError(f"locret_requery must be True or False (got {locret_requery!r})")
        settings = dict(heads=locret_heads, budget=locret_budget, stabilizers=locret_stabilizers,
                        local=locret_local, policy=locret_policy, pool=locret_pool,
                        budget_schedule=locret_budget_schedule, positions=locret_positions)
        self._locret_heads: Heads | None = None
        # the default query of every call (Locret-Q): text, "auto", or none ("" or "off"; None: what the heads recommend)
        self.locret_query = None if locret_query in ("", "off") else locret_query
        # a chat's auto question: the last user message's (True), or the conversation's first one's (False)
        self.locret_requery = locret_requery
        self._locret_active_query: str | None = None  # the query of the call being served
        self._locret_query_is_auto = False  # that query was found in the text (locret_query="auto")
        self._locret_pending_pin: int | None = None   # tokens to pin when that call's prompt starts a sequence
        self._locret_in_chat = False
        holder: dict[str, Heads] = {}
        evicting = bool(locret_budget or locret_budget_mib)

        class _ConfiguredContext(_internals.LlamaContext):
            # llama-cpp-python loads the model and creates its context in one constructor: register the
            # Locret settings for the model in between, so the context is created with them
            def __init__(self, *, model, params, verbose=True):
                if evicting and "flash_attn" not in kwargs:
                    # llama.cpp's own default (its tools'), not llama-cpp-python's "off": flash attention where the
                    # backend has it, so V is stored by rows and an eviction copies V rows as they are instead of
                    # moving a transposed V element by element (docs/results.md: a quarter of the compaction time)
                    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
                if n_seq_max is not None:
                    # several sequences, each in its own KV stream (an evicting cache keeps them apart)
                    params.n_seq_max = n_seq_max
                    params.kv_unified = False
                try:
                    if locret_budget_mib is not None:
                        # the memory size becomes units for this context's own K/V types and ubatch
                        rule = {k: v for k, v in settings.items() if k != "budget"}
                        settings["budget"] = eviction.budget_for_mib(model_path, locret_budget_mib, cparams=params,
                                                                     **rule)["budget"]
                    holder["heads"] = eviction.configure(model.model, model_path, **settings)
                except HeadsError:
                    self._exit_stack = contextlib.ExitStack()  # what LlamaContext.__del__ closes
                    raise
                super().__init__(model=model, params=params, verbose=verbose)
                err = _last_error()
                if self.ctx is None and err:
                    raise HeadsError(err)

        env_threads = threads_from_env()
        if env_threads is not None:
            # a run that names no thread count takes LLAMA_ARG_THREADS, as llama.cpp's tools do (locret/threads.py)
            kwargs.setdefault("n_threads", env_threads)
            kwargs.setdefault("n_threads_batch", env_threads)

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
        if locret_query is None and self._locret_heads is not None and self._locret_heads.recommended["query_auto"] \
                and self.locret_enabled and eviction.policy_traits(self.locret_stats()["policy"]).needs_heads:
            self.locret_query = AUTO  # Locret-Q heads: the question at the end of each prompt (locret_query="" turns it off)

    def close(self) -> None:
        """llama-cpp-python's close (the context, then the model), then the heads: their weights sit where their
        layers do (a GPU, an RPC server) and must go while that device still answers, not at interpreter exit."""
        super().close()
        heads = getattr(self, "_locret_heads", None)
        if heads is not None:
            heads.free()

    @property
    def locret_enabled(self) -> bool:
        return self.locret_stats()["enabled"]

    def locret_stats(self, seq_id: int = 0) -> dict[str, int | bool | str]:
        """Eviction figures of this context (of sequence `seq_id`): see `locret.eviction.stats`."""
        return eviction.stats(self._ctx.ctx, seq_id)

    def locret_pin_query(self, n_tokens: int, seq_id: int = 0) -> None:
        """Locret-Q by hand: positions [0, n_tokens) of sequence `seq_id` are never evicted (before its first
        eviction; lasts until the sequence is emptied). HeadsError with the reason when that cannot be."""
        eviction.pin_query(self._ctx.ctx, n_tokens, seq_id)

    def locret_seq_prompt(self, n_tokens: int, seq_id: int = 0) -> bool:
        """Sequence `seq_id` starts with a prompt of `n_tokens` tokens (`eval` tells it for a prompt given whole):
        decides pooling for heads that pool long prompts only. Returns whether its scores are pooled."""
        return eviction.seq_prompt(self._ctx.ctx, n_tokens, seq_id)

    def locret_pin_next_prompt(self, n_tokens: int | None) -> None:
        """Locret-Q for token-level callers (`eval`): pin positions [0, n_tokens) when the next `eval` starts the
        sequence (n_tokens == 0: it empties the sequence first, which would drop a pin set before). None: no pin."""
        self._locret_pending_pin = n_tokens

    def locret_layer_budget(self, layer: int) -> int:
        """The units `layer` keeps (its budget schedule's entry, or the budget); -1 for a layer not evicted."""
        return eviction.layer_budget(self._ctx.ctx, layer)

    def locret_layer_cells(self, layer: int) -> int:
        """The KV cells per sequence `layer`'s cache allocates (a budget schedule's layers sit in a cache per budget:
        its budget plus the ubatch; the largest budget's, and every layer without a schedule, n_cells); -1 for a layer
        not evicted."""
        return eviction.layer_cells(self._ctx.ctx, layer)

    def locret_room(self, seq_id: int = 0) -> int:
        """Speculative decoding: the most tokens (the sampled one and its draft) the next batch of sequence `seq_id` may
        hold so that no eviction falls inside it (`locret.eviction.seq_room`); -1 without eviction."""
        return eviction.seq_room(self._ctx.ctx, seq_id)

    def locret_retained(self, layer: int, head: int, seq_id: int = 0):
        """Logical positions of the units that (layer, KV head) holds in sequence `seq_id`, in cell order."""
        return eviction.retained(self._ctx.ctx, layer, head, seq_id)

    # Locret-Q

    def _call_query(self, locret_query: str | None, text, find=find_question) -> str | None:
        """This call's query (else the constructor's); "auto": the question `find` finds in `text` (the prompt, or the
        last user message), None when it has none or the context does not evict."""
        query = self.locret_query if locret_query is None else (locret_query or None)
        if query is not None and not isinstance(query, str):
            raise HeadsError(f"locret_query must be text (got {type(query).__name__})")
        if query is not None and not query.strip():
            query = None
        self._locret_query_is_auto = query == AUTO
        if query == AUTO:
            query = find(text) if self.locret_enabled and isinstance(text, str) else ""
            query = query or None  # no question: plain Locret
        if query is not None and not self.locret_enabled:
            raise HeadsError("locret_query needs an evicting context (locret_budget)")
        self._locret_active_query = query
        return query

    def create_completion(self, prompt, *args: Any, locret_query: str | None = None, **kwargs: Any):
        """llama-cpp-python's, with the Locret-Q query (this call's, else the constructor's) in front."""
        if self._locret_in_chat:
            # the chat handler's own call: the query was placed in the messages
            return super().create_completion(prompt, *args, **kwargs)
        # a prompt may hold a chat template written out: the question is its last user turn's, and the query opens
        # its first user turn's text, as in a chat (the library's rule, the tools' too)
        vocab = eviction.model_vocab(self)
        query = self._call_query(locret_query, prompt, lambda text: find_prompt_question(vocab, text))
        if query is not None:
            if not isinstance(prompt, str):
                raise HeadsError("locret_query needs a text prompt (the query is placed in front of its text)")
            prompt = place_query_in_prompt(vocab, query, prompt)
        return super().create_completion(prompt, *args, **kwargs)

    def __call__(self, prompt, *args: Any, locret_query: str | None = None, **kwargs: Any):
        return self.create_completion(prompt, *args, locret_query=locret_query, **kwargs)

    def create_chat_completion(self, messages, *args: Any, locret_query: str | None = None, **kwargs: Any):
        """llama-cpp-python's, with the Locret-Q query at the start of the first user turn."""
        user_texts = [m["content"] for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]
        asked = chat_query_message(user_texts, self.locret_requery)  # whose question auto takes
        query = self._call_query(locret_query, user_texts[asked] if asked >= 0 else None)
        if query is not None:
            messages = [dict(m) for m in messages]
            first_user = next((m for m in messages if m.get("role") == "user"), None)
            if first_user is None or not isinstance(first_user.get("content"), str):
                raise HeadsError("locret_query needs a chat with a user turn whose content is text")
            first_user["content"] = place_query(query, first_user["content"])
        self._locret_in_chat = True
        try:
            return super().create_chat_completion(messages, *args, **kwargs)
        finally:
            self._locret_in_chat = False

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any):
        """llama-cpp-python's; with a Locret-Q query, finds the tokens to pin (through the query) first. A
        cached sequence pinned otherwise is not continued: the prompt is processed again from the start."""
        query, self._locret_active_query = self._locret_active_query, None
        self._locret_pending_pin = None
        if query is not None:
            st = self.locret_stats()
            try:
                n_pin = eviction.model_query_tokens(self, list(tokens), query, st["budget"])
            except HeadsError:
                if not self._locret_query_is_auto:
                    raise
                n_pin = 0  # a question found, not asked for, that the budget cannot hold: plain Locret
            if self.n_tokens > 0 and st["n_pinned"] != n_pin:
                self.n_tokens = 0  # no prefix reuse: the sequence is emptied and pinned anew
            self._locret_pending_pin = n_pin
        return super().generate(tokens, *args, **kwargs)

    def eval(self, tokens: Sequence[int], prompt_continues: bool = False):
        """As llama-cpp-python's, except that only the last token of the whole call asks for logits.

        llama-cpp-python marks the last token of every n_batch slice; the evicting cache reads a token
        that asks for logits as the end of a prompt (its local tail is split off and the chunk before
        it is evicted without stabilizers, when the prompt does not fit in the budget), so the slices
        in between must not ask.

        `prompt_continues=True` feeds part of a prompt whose rest comes in a later call: no token asks
        for logits, so these tokens are compressed as ordinary prefill chunks (there are no logits to
        sample from afterwards). Without eviction it is ignored."""
        if not self.locret_enabled or self._logits_all:
            return super().eval(tokens)
        self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
        if self.n_tokens == 0 and not prompt_continues:
            # the prompt starts the sequence: its length decides the heads' pooling for long prompts (the library's
            # rule; a prompt fed in parts tells its length with locret_seq_prompt first)
            eviction.seq_prompt(self._ctx.ctx, len(tokens))
        if self._locret_pending_pin is not None and self.n_tokens == 0:
            # the prompt starts the sequence: pin its query before anything can be evicted
            try:
                eviction.pin_query(self._ctx.ctx, self._locret_pending_pin)
            except HeadsError:
                if not self._locret_query_is_auto:
                    raise
                # a question found, not asked for, that the budget cannot hold (the library's rule): plain Locret
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
