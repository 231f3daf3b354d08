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
from test_eviction import GGML_TYPE_F16, GGML_TYPE_Q8_0, B, UB, decode, last_logits, make, prompt_tokens  # noqa: F401

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
    # runs of layers (at b 2048 SmolLM2's 30 layers take 4-6 runs, so that the compute buffer stays bounded): here
    # runs of at most 4 layers' full tables (B x 3 KV heads rows of 64 F32 keys), and of single layers
    dict(locret_positions="compact", run_bytes=4 * B * 3 * 64 * 4),
    dict(locret_positions="keep", run_bytes=1),
], ids=["compact", "keep", "compact-pyramid", "keep-q8_0", "compact-pyramid-staged", "compact-runs", "keep-runs"])
def test_stacked_compaction_keeps_the_cache_of_the_per_layer_one(model_path, heads_file, prompt_tokens, monkeypatch,
                                                                  capfd, kw):
    kw = dict(kw)
    monkeypatch.setenv("LOCRET_DEBUG_STAGED_MOVES", "1" if kw.pop("staged", False) else "0")
    run_bytes = kw.pop("run_bytes", None)
    if run_bytes:
        monkeypatch.setenv("LOCRET_DEBUG_COMPACT_RUN_BYTES", str(run_bytes))
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
    # one op per kind over all layers (or over each run of layers), against a few per layer
    if run_bytes:
        assert max(nodes_s) > 16, (nodes_s, nodes_l)  # several runs
    else:
        assert max(nodes_s) <= 16 < n_layer <= min(nodes_l)
    for il in range(n_layer):
        for a, b, what in zip(stacked[il], per_layer[il], ("K", "V", "scores", "kept units")):
            assert np.array_equal(np.asarray(a), np.asarray(b)), f"layer {il}: {what} differ"
    assert np.array_equal(logits_s, logits_l)


def test_the_compaction_buffers_stay_bounded_at_the_main_jobs_budget(model_path, heads_file, monkeypatch):
    # The gathered rows live in the compaction's compute buffer. One op over all 30 layers held every moved key twice in
    # F32 (gathered, then re-rotated): 90.7 MiB at b 2048 (113 MiB with the copying compaction's), above the 56 MiB
    # cache they serve. Runs of layers whose gathered rows fit 8 MiB bound them: at most 2 x 8 MiB for the keys, 8 MiB
    # for the copies, and the selection's and scoring's few.
    def eviction_buffers(run_bytes):
        if run_bytes:
            monkeypatch.setenv("LOCRET_DEBUG_COMPACT_RUN_BYTES", str(run_bytes))
        else:
            monkeypatch.delenv("LOCRET_DEBUG_COMPACT_RUN_BYTES", raising=False)
        llm = make(model_path, heads_file, n_ctx=65536, n_batch=512, n_ubatch=512, locret_budget=2048,
                   locret_stabilizers=128, locret_local=100, type_k=GGML_TYPE_F16, type_v=GGML_TYPE_F16)
        return eviction.locret_buffers(llm._ctx.ctx)["evict_compute"] / 2**20

    MiB = eviction_buffers(None)
    one_run = eviction_buffers(1 << 40)
    assert MiB <= 3 * 8 + 2, MiB
    # the bound is what keeps them down: one run over every layer is the old size (the keys alone: 90.7 MiB)
    assert one_run > 85 and one_run > 3 * MiB, (one_run, MiB)
