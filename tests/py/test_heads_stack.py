"""The heads' graph over stacked layers (ggml_ext/src/locret-graph.cpp, locret_build_stacked).

A small ubatch (generation: one token per sequence; speculative batches) is scored for every layer at once: each layer
copies its Q, K, V into a stacked input (three ops), then one MLP over the stacked heads and one store write score all
layers, instead of ~10 ops per layer. On a GPU a generated token of a small model is mostly kernel launches, which is
why (docs/results.md). The stacked graph must score exactly as the per-layer one: checked here bit for bit on the CPU
(the PyTorch parity of the stacked scores is in test_cis_parity.py), with evictions, pooling and kept sets; and the
node count of the generation graph is checked, so that losing the stacking fails a test.
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
from conftest import THREADS, natural_text, run, tool
from test_heads_runtime import SMOLLM, write_heads

import locret  # noqa: F401  (points llama_cpp at our library)
from locret import heads as heads_api
from locret.llama import Llama

N_LAYER = 30
SHIPPED = "heads/smollm2-135m-instruct.gguf"


def reserve_log(model_path, heads, env):
    """llama-completion's log of the context's graph reservation: (prompt graph nodes, generation graph nodes, the
    heads' load line)."""
    out = run([tool("llama-completion"), "-m", model_path, "--locret-heads", heads, "--locret-budget", "256", "-p",
               "Hello there", "-n", "2", "-no-cnv", "-t", str(THREADS), "-v"],
              env={**{k: v for k, v in os.environ.items() if k != "LOCRET_DEBUG_HEADS"}, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stderr
    m = re.findall(r"sched_reserve: graph(?: \(pp bs=\d+, tg bs=\d+\))?: nodes = (\d+)(?: / (\d+))?", log)
    assert m, log[-3000:]
    pp, tg = m[-1]  # the last reservation: with the heads attached
    loaded = re.search(r"load_heads: loaded retaining heads .*", log)
    assert loaded, log[-3000:]
    return int(pp), int(tg or pp), loaded.group(0)


def test_a_generated_token_scores_every_layer_at_once(model_path, repo):
    heads = str(repo / SHIPPED)
    pp_layer, tg_layer, _ = reserve_log(model_path, heads, {"LOCRET_DEBUG_HEADS": "layer"})
    pp, tg, loaded = reserve_log(model_path, heads, {})
    print(f"\ngraph nodes, prompt / generation: per layer {pp_layer} / {tg_layer}, stacked {pp} / {tg}")
    assert "30 layers (stacked)" in loaded
    # the prompt's ubatch (512 tokens) is scored layer by layer either way; a generated token saves at least four
    # nodes a layer (three copies and a view a layer, and seven ops once, against concats, matmuls, adds, the
    # activation and the store write in every layer)
    assert pp == pp_layer and tg_layer == pp_layer
    assert tg <= tg_layer - 4 * N_LAYER


def run_scored(model_path, heads, mode, monkeypatch, pool):
    """Prompt in ubatches of 64, then 60 tokens one at a time, budget 128: the recorded scores, the kept units of every
    (layer, KV head) and the eviction count."""
    if mode is None:
        monkeypatch.delenv("LOCRET_DEBUG_HEADS", raising=False)
    else:
        monkeypatch.setenv("LOCRET_DEBUG_HEADS", mode)
    llm = Llama(model_path=str(model_path), n_ctx=2048, n_batch=64, n_ubatch=64, locret_budget=128,
                locret_heads=str(heads), locret_pool=pool, verbose=False, n_threads=THREADS, n_threads_batch=THREADS)
    heads_api.record_scores(llm)
    tokens = llm.tokenize(natural_text().encode())[:460]
    llm.eval(tokens[:400])
    for t in tokens[400:]:
        llm.eval([t])
    scores, positions = heads_api.recorded_scores(llm)
    kept = [llm.locret_retained(il, h).tolist() for il in range(N_LAYER) for h in range(3)]
    n_evictions = llm.locret_stats()["n_evictions"]
    llm.close()
    assert positions.tolist() == list(range(460))
    return scores, kept, n_evictions


@pytest.mark.parametrize("pool", [0, 5])
def test_stacked_and_per_layer_scores_are_the_same_bit_for_bit(pool, model_path, repo, monkeypatch):
    heads = repo / SHIPPED
    layer = run_scored(model_path, heads, "layer", monkeypatch, pool)
    modes = [None] + (["stack"] if pool == 0 else [])  # "stack": the prompt's ubatches too (unpooled only)
    for mode in modes:
        got = run_scored(model_path, heads, mode, monkeypatch, pool)
        assert np.array_equal(got[0], layer[0]), (mode, float(np.abs(got[0] - layer[0]).max()))
        assert got[1] == layer[1], mode
        assert got[2] == layer[2] >= 5, mode


def test_heads_whose_layers_differ_in_type_load_per_layer_and_score_alike(model_path, tmp_path, monkeypatch):
    # one layer's fc1 stored as F32, the rest F16: the layers cannot be one stacked tensor, so they load one by one
    # and every ubatch is scored layer by layer; the scores are those of the all-F16 heads (the same values: layer 0
    # exactly in value, rounded differently in its product)
    uniform = write_heads(tmp_path / "f16.gguf", **SMOLLM)
    mixed = write_heads(tmp_path / "mixed.gguf", **SMOLLM, f32_tensors=("locret.blk.0.fc1.weight",))
    _, _, loaded = reserve_log(model_path, str(mixed), {})
    assert "30 layers," in loaded and "(stacked)" not in loaded
    a = run_scored(model_path, uniform, None, monkeypatch, 0)
    b = run_scored(model_path, mixed, None, monkeypatch, 0)
    assert np.array_equal(a[0][1:], b[0][1:])
    assert np.abs(a[0][0] - b[0][0]).max() < 1e-2 * np.abs(a[0][0]).max()
