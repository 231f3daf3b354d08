"""The models users bring, on tiny stand-ins built here (locret.standins): Phi-3-128K's LongRoPE and attention factor
(both factor sets), Llama-3.1's llama3 frequencies, Qwen2's YaRN with q/k/v biases, StableLM's partial NEOX rotary.

For each stand-in, against independent PyTorch references (tests/py/standin_reference.py):
  - the scores llama.cpp computes match the heads applied to the Hugging Face model's pre-RoPE Q, K, V;
  - after >= 30 evictions every retained key is the model's RoPE of its pre-RoPE key at its new position (layer 0,
    whose keys do not depend on the context), and in every layer the stored key rotated from where it was first
    stored to where it is now; keys that did not move are bit-identical to before the eviction;
  - the naive re-rotation (the model's own RoPE parameters, LOCRET_DEBUG_NAIVE_ROPE=1) fails the same check where the
    model has an attention factor, which proves the check can tell;
  - a budget above the input gives plain llama.cpp's logits.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
import llama_cpp
from locret import eviction, heads as heads_api, standins
from locret.llama import Llama

import standin_reference as ref
from conftest import THREADS, natural_text
from reference_cis import spearman
from test_eviction import decode, last_logits

NAMES = sorted(standins.SPECS)
B, UB, NS, NLOC = 48, 16, 4, 4
N_CHUNKS = 40  # 640 tokens in chunks of one ubatch: more than 30 evictions
GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0 = 0, 1, 8
# Largest error of a retained key, relative to the largest key value, per K cache type (measured: 2.7e-4 / 2.1e-3 /
# 3.8e-2 against Hugging Face, 1.5e-6 / 2.9e-3 / 4.8e-2 against the first stored keys, over the five stand-ins).
# Against Hugging Face, llama.cpp's own float16 rounding of the activations that multiply float16 weights comes on top.
# F16 rounds a stored row to 11 bits, and a moved key is rounded again at every move; q8_0 to 8 bits per 32 values.
TOLERANCE_VS_HF = {GGML_TYPE_F32: 1e-3, GGML_TYPE_F16: 5e-3, GGML_TYPE_Q8_0: 6e-2}
TOLERANCE_ROTATION = {GGML_TYPE_F32: 1e-5, GGML_TYPE_F16: 6e-3, GGML_TYPE_Q8_0: 8e-2}
TYPE_IDS = {GGML_TYPE_F32: "f32", GGML_TYPE_F16: "f16", GGML_TYPE_Q8_0: "q8_0"}


@pytest.fixture(scope="module", params=NAMES)
def standin(request):
    return standins.build(request.param)


@pytest.fixture(scope="module")
def hf_model(standin):
    return ref.load(standin.hf_dir)


@pytest.fixture(scope="module")
def tokens(standin):
    llm = llama_cpp.Llama(model_path=str(standin.gguf), vocab_only=True, verbose=False)
    out = llm.tokenize(natural_text().encode(), add_bos=False)[: UB * N_CHUNKS]
    assert len(out) == UB * N_CHUNKS
    return out


def _geometry(hf_model):
    cfg = hf_model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    return d, cfg.num_key_value_heads, cfg.num_hidden_layers


def _to_hf(x, arch, n_rot):
    """One head's rows from llama.cpp's order back to Hugging Face's (inverse of to_llama_order)."""
    if arch != "llama":
        return x
    out = x.copy()
    out[:, : n_rot // 2], out[:, n_rot // 2: n_rot] = x[:, 0:n_rot:2], x[:, 1:n_rot:2]
    return out


def _from_hf(x, arch, n_rot):
    return ref.to_llama_order(x, n_rot) if arch == "llama" else x


def test_scores_match_the_pytorch_reference(standin, hf_model, tokens):
    from safetensors.torch import load_file

    weights = {k: v.float().numpy() for k, v in load_file(str(standin.heads_checkpoint)).items()}
    toks = tokens[:300]
    want = ref.heads_scores(ref.pre_rope_qkv(hf_model, toks), weights)

    llm = llama_cpp.Llama(model_path=str(standin.gguf), n_ctx=1024, n_batch=512, n_ubatch=128, n_threads=THREADS, n_threads_batch=THREADS,
                          verbose=False)
    heads_api.attach(llm, standin.heads)
    heads_api.record_scores(llm)
    llm.eval(toks)
    got, positions = heads_api.recorded_scores(llm)
    llm.close()
    assert positions.tolist() == list(range(len(toks)))
    assert got.shape == want.shape
    corr = np.array([[spearman(got[il, h], want[il, h]) for h in range(want.shape[1])] for il in range(want.shape[0])])
    print(f"\n{standin.name}: CIS rank correlation min {corr.min():.5f}, max |diff| {np.abs(got - want).max():.3g} "
          f"of {np.abs(want).max():.3g}")
    assert corr.min() >= 0.99


def _run_evicting(standin, tokens, type_k, flash, track_first=False):
    """Prefill `tokens` chunk by chunk through an evicting context; returns the context and, with track_first, each
    layer's key rows as first stored: {layer: {logical position: (row [n_embd_k_gqa], cell)}}."""
    llm = Llama(model_path=str(standin.gguf), n_ctx=8192, n_batch=UB, n_ubatch=UB, locret_heads=str(standin.heads),
                locret_budget=B, locret_stabilizers=NS, locret_local=NLOC, type_k=type_k, type_v=GGML_TYPE_F16,
                flash_attn=flash, n_threads=THREADS, n_threads_batch=THREADS, verbose=False, seed=1)
    n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
    width = llama_cpp.llama_model_n_head_kv(llm._model.model) * (
        llama_cpp.llama_model_n_embd(llm._model.model) // llama_cpp.llama_model_n_head(llm._model.model))
    first = {il: {} for il in range(n_layer)}
    n_past = 0
    for i in range(0, len(tokens), UB):
        n_past = decode(llm, tokens[i:i + UB], n_past, False)
        if track_first:
            n_used = llm.locret_stats()["n_cells_used"]
            for il in range(n_layer):
                rows = eviction.read_kv(llm._ctx.ctx, il, n_used, width=width)
                logical = llm.locret_retained(il, 0)
                for c in range(n_used - UB, n_used):  # this chunk's tokens: the last cells, the same in every head
                    first[il][int(logical[c])] = (rows[c].copy(), c)
    return llm, first, width


def _layer0_error(llm, standin, hf_model, tokens, width):
    """Largest error of layer 0's retained keys against Hugging Face's RoPE of their pre-RoPE keys at the positions the
    layout reports (the default, in place: each kept unit at its rank, in the cell it stayed in)."""
    d, n_kv, _ = _geometry(hf_model)
    k_pre = ref.pre_rope_qkv(hf_model, tokens)[0][1]  # layer 0's keys depend on the token alone
    st = llm.locret_stats()
    inv_freq, scaling = ref.rope_parameters(hf_model, st["n_cells"])
    n_rot = 2 * len(inv_freq)
    stored = eviction.read_kv(llm._ctx.ctx, 0, st["n_cells_used"], width=width)
    worst, scale = 0.0, 0.0
    for h in range(n_kv):
        logical = llm.locret_retained(0, h)
        rope = eviction.rope_positions(llm._ctx.ctx, 0, h)
        assert sorted(rope.tolist()) == list(range(len(logical)))  # positions 0..n-1, whatever cells hold them
        want = ref.rope(k_pre[logical, h * d:(h + 1) * d], rope, inv_freq, scaling)
        want = _from_hf(want, standin.spec.gguf_arch, n_rot)
        got = stored[: len(logical), h * d:(h + 1) * d]
        worst = max(worst, float(np.abs(got - want).max()))
        scale = max(scale, float(np.abs(want).max()))
    return worst / scale


@pytest.mark.parametrize("type_k,flash", [(GGML_TYPE_F32, True), (GGML_TYPE_F16, False), (GGML_TYPE_Q8_0, True)],
                         ids=["f32", "f16-no-flash-attn", "q8_0"])
def test_retained_keys_are_exact_rotations_after_many_evictions(standin, hf_model, tokens, type_k, flash):
    llm, first, width = _run_evicting(standin, tokens, type_k, flash, track_first=True)
    st = llm.locret_stats()
    assert st["n_evictions"] >= 30, st
    tol = TOLERANCE_VS_HF[type_k]

    err0 = _layer0_error(llm, standin, hf_model, tokens, width)
    print(f"\n{standin.name} {TYPE_IDS[type_k]}: {st['n_evictions']} evictions; layer 0 vs Hugging Face RoPE: "
          f"{err0:.2e} of the key scale", end="")
    assert err0 < tol, f"layer 0 keys off by {err0:.2e} of their scale (tolerance {tol})"

    # every layer: the key as first stored, rotated by its position change, is the key stored now
    d, n_kv, n_layer = _geometry(hf_model)
    inv_freq, _ = ref.rope_parameters(hf_model, st["n_cells"])
    n_rot = 2 * len(inv_freq)
    worst = 0.0
    for il in range(n_layer):
        stored = eviction.read_kv(llm._ctx.ctx, il, st["n_cells_used"], width=width)
        for h in range(n_kv):
            logical = llm.locret_retained(il, h)
            orig = np.stack([first[il][int(p)][0][h * d:(h + 1) * d] for p in logical])
            # a unit was placed at its cell's position; it now sits at the position the layout reports
            delta = eviction.rope_positions(llm._ctx.ctx, il, h) - np.array([first[il][int(p)][1] for p in logical])
            assert (delta != 0).any()
            want = _from_hf(ref.rope(_to_hf(orig, standin.spec.gguf_arch, n_rot), delta, inv_freq, 1.0),
                            standin.spec.gguf_arch, n_rot)
            got = stored[: len(logical), h * d:(h + 1) * d]
            worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    print(f"; all layers vs first-stored keys rotated: {worst:.2e}")
    assert worst < TOLERANCE_ROTATION[type_k]
    llm.close()


def test_keys_that_do_not_move_are_not_rewritten(standin, tokens):
    llm, _, width = _run_evicting(standin, tokens[: UB * 8], GGML_TYPE_Q8_0, True)
    n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
    n_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
    d = width // n_kv
    n_used = llm.locret_stats()["n_cells_used"]
    before = {il: (eviction.read_kv(llm._ctx.ctx, il, n_used, width=width),
                   [(llm.locret_retained(il, h), eviction.rope_positions(llm._ctx.ctx, il, h)) for h in range(n_kv)])
              for il in range(n_layer)}
    evictions = llm.locret_stats()["n_evictions"]
    decode(llm, tokens[UB * 8: UB * 9], UB * 8, False)
    assert llm.locret_stats()["n_evictions"] == evictions + 1
    unmoved = moved = 0
    for il in range(n_layer):
        after = eviction.read_kv(llm._ctx.ctx, il, B, width=width)
        for h in range(n_kv):
            kept_before, rope_before = before[il][1][h]
            kept_after = llm.locret_retained(il, h)[:B]
            rope_after = eviction.rope_positions(llm._ctx.ctx, il, h)[:B]
            for c in range(B):
                if kept_after[c] == kept_before[c] and rope_after[c] == rope_before[c]:  # same cell, same position
                    assert np.array_equal(after[c, h * d:(h + 1) * d], before[il][0][c, h * d:(h + 1) * d]), (il, h, c)
                    unmoved += 1
                else:
                    moved += 1
    assert unmoved > 0 and moved > 0
    llm.close()


def test_the_naive_rerotation_fails_where_the_model_has_an_attention_factor(standin, hf_model, tokens, monkeypatch):
    monkeypatch.setenv("LOCRET_DEBUG_NAIVE_ROPE", "1")
    llm, _, width = _run_evicting(standin, tokens, GGML_TYPE_F32, True)
    err = _layer0_error(llm, standin, hf_model, tokens, width)
    _, scaling = ref.rope_parameters(hf_model, llm.locret_stats()["n_cells"])
    llm.close()
    print(f"\n{standin.name}: naive re-rotation (attention scaling {scaling:.3f}): layer 0 keys off by {err:.2e}")
    if abs(scaling - 1.0) > 1e-3:
        assert err > 100 * TOLERANCE_VS_HF[GGML_TYPE_F32], "the check cannot tell the naive re-rotation from the exact one"
    else:
        assert err < TOLERANCE_VS_HF[GGML_TYPE_F32]  # without a magnitude factor both are pure rotations


def test_a_budget_above_the_input_gives_plain_logits(standin, tokens):
    toks = tokens[:200]
    # flash attention as the evicting context has it by default (llama.cpp's auto)
    plain = llama_cpp.Llama(model_path=str(standin.gguf), n_ctx=1024, n_batch=256, n_ubatch=64, n_threads=THREADS, n_threads_batch=THREADS,
                            verbose=False, flash_attn=True)
    plain.eval(toks)
    want = last_logits(plain)
    plain.close()
    llm = Llama(model_path=str(standin.gguf), n_ctx=1024, n_batch=256, n_ubatch=64, locret_heads=str(standin.heads),
                locret_budget=512, locret_stabilizers=16, locret_local=8, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    llm.eval(toks)
    got = last_logits(llm)
    assert llm.locret_stats()["n_evictions"] == 0
    llm.close()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
