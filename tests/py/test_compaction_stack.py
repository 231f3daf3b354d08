"""The compaction graph's two forms keep the same cache, bit for bit.

Where llama.cpp placed the layers' K and V evenly in one buffer (every model here), the compaction moves the rows of all
layers with one get_rows and one set_rows per kind over a layer-stacked alias of the cache (locret_layer_stack): each
layer's part of the move tables is padded to the same count with rows copied onto themselves. Otherwise, and with
LOCRET_DEBUG_COMPACT_PER_LAYER=1, it builds a few nodes per layer. Both must leave the same K, V, scores and kept units
after prompt- and generation-time evictions, and give the same logits; the stacked graph must have a node count that
does not grow with the layers (LOCRET_PROFILE's compaction lines).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from locret import eviction  # (points llama_cpp at our library first)
import llama_cpp
from test_eviction import GGML_TYPE_F16, GGML_TYPE_Q8_0, UB, decode, last_logits, make, prompt_tokens  # noqa: F401

N_PROMPT = 480
N_GEN = 24


def run_once(model_path, heads_file, prompt_tokens, monkeypatch, capfd, *, per_layer, **kw):
    monkeypatch.setenv("LOCRET_DEBUG_COMPACT_PER_LAYER", "1" if per_layer else "0")
    monkeypatch.setenv("LOCRET_PROFILE", "1")
    capfd.readouterr()
    llm = make(model_path, heads_file, flash_attn=True, **kw)
    n_past = 0
    for i in range(0, N_PROMPT, UB):
        n_past = decode(llm, prompt_tokens[i:i + UB], n_past, i + UB >= N_PROMPT)
    logits = [last_logits(llm)]
    for _ in range(N_GEN):  # generation-time evictions: the cache is full after the prompt
        n_past = decode(llm, [int(np.argmax(logits[-1]))], n_past, True)
        logits.append(last_logits(llm))
    st = llm.locret_stats()
    model = llm._model.model
    n_layer = llama_cpp.llama_model_n_layer(model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(model)
    width = n_head_kv * (llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model))
    n = st["n_cells_used"]
    cache = {il: (eviction.read_kv(llm._ctx.ctx, il, n, width=width),
                  eviction.read_kv(llm._ctx.ctx, il, n, values=True, width=width),
                  eviction.read_scores(llm._ctx.ctx, il, n, n_head_kv=n_head_kv),
                  [llm.locret_retained(il, h).tolist() for h in range(n_head_kv)])
             for il in range(n_layer)}
    nodes = [int(x) for x in re.findall(r"locret-profile: compaction build .* \(nodes (\d+),", capfd.readouterr().err)]
    monkeypatch.delenv("LOCRET_PROFILE")
    return st, cache, np.array(logits), nodes, n_layer


@pytest.mark.parametrize("kw", [
    dict(locret_positions="compact"),                                  # every compaction re-rotates keys
    dict(locret_positions="keep"),                                     # copies as words
    dict(locret_positions="compact", locret_budget_schedule="pyramid"),  # layers keep different counts: padding
    dict(locret_positions="keep", type_k=GGML_TYPE_Q8_0, type_v=GGML_TYPE_Q8_0),  # quantized rows copied as words
    # the move tables filled apart and uploaded per eviction, as for a cache on a device: the padding goes up too
    dict(locret_positions="compact", locret_budget_schedule="pyramid", staged=True),
], ids=["compact", "keep", "compact-pyramid", "keep-q8_0", "compact-pyramid-staged"])
def test_stacked_compaction_keeps_the_cache_of_the_per_layer_one(model_path, heads_file, prompt_tokens, monkeypatch,
                                                                  capfd, kw):
    kw = dict(kw)
    monkeypatch.setenv("LOCRET_DEBUG_STAGED_MOVES", "1" if kw.pop("staged", False) else "0")
    if "locret_budget_schedule" in kw:
        # a schedule in one cache, as an iSWA model holds it (in a cache per budget the layers' tensors differ in size,
        # and the compaction runs layer by layer: tests/py/test_schedule.py compares that form with this one)
        monkeypatch.setenv("LOCRET_DEBUG_ALLOC", "masked")
    kw.setdefault("type_k", GGML_TYPE_F16)
    kw.setdefault("type_v", GGML_TYPE_F16)
    st_s, stacked, logits_s, nodes_s, n_layer = run_once(model_path, heads_file, prompt_tokens, monkeypatch, capfd,
                                                         per_layer=False, **kw)
    st_l, per_layer, logits_l, nodes_l, _ = run_once(model_path, heads_file, prompt_tokens, monkeypatch, capfd,
                                                     per_layer=True, **kw)
    # the same evictions, some of them while generating, and rows that really moved
    assert st_s["n_evictions"] == st_l["n_evictions"] >= 6
    assert st_s["n_rows_moved"] == st_l["n_rows_moved"] > 0
    assert len(nodes_s) == len(nodes_l) == st_s["n_compactions"] > 0
    # one op per kind over all layers, against a few per layer
    assert max(nodes_s) <= 16 < n_layer <= min(nodes_l)
    for il in range(n_layer):
        for a, b, what in zip(stacked[il], per_layer[il], ("K", "V", "scores", "kept units")):
            assert np.array_equal(np.asarray(a), np.asarray(b)), f"layer {il}: {what} differ"
    assert np.array_equal(logits_s, logits_l)
