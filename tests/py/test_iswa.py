"""Sliding-window (iSWA) models: Gemma-3-270M, whose window layers (5 of every 6, window 512) keep llama.cpp's own
window cache while its full-attention layers evict (b = 512, ubatch 64, n_s = 16, n_loc = 8, the shipped heads: the
parity tests compare with the scores the heads gave, so any heads do, and these need no conversion).

  - a budget above the input gives plain llama.cpp's logits;
  - the full-attention layers retain exactly what the numpy model of Algorithm 1 predicts;
  - the window cache follows every compaction: each of its cells holds the token at the client's position the cache
    reports for it (the cells record their token), and it always holds the last 512 positions;
  - state save/load carries both caches;
  - with the shipped trained heads (heads/gemma3-270m.gguf) and flash attention, a passkey prompt of a few thousand
    tokens goes through the evictions a long prompt does, in a cache of b + ubatch cells, and is answered.
The accuracy past the model's 32,768-token training context is an evaluation, not a test: experiments/eval_gemma_passkey.py
(docs/results.md has its command and result).
"""
from __future__ import annotations


import numpy as np
import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
import llama_cpp
from locret import eviction, heads as heads_api, models, tasks
from locret.evaluation import decoding
from locret.llama import Llama

from conftest import THREADS, natural_text
from test_eviction import Algorithm1, compact_unless_asked, decode, last_logits

B, UB, NS, NLOC, WINDOW = 512, 64, 16, 8, 512

pytestmark = pytest.mark.skipif(not models.is_installed("gemma3-270m"), reason="gemma3-270m is not installed")


@pytest.fixture(scope="module")
def gemma():
    return models.resolve("gemma3-270m", fetch=False)


@pytest.fixture(scope="module")
def gemma_heads():
    # the shipped heads: converting random ones for Gemma cost this module up to ~45 s (test_convert.py converts Gemma)
    heads = models.shipped_heads("gemma3-270m")
    assert heads is not None, "heads/ has no trained heads for gemma3-270m"
    return heads


@pytest.fixture(scope="module")
def tokens(gemma):
    llm = llama_cpp.Llama(model_path=str(gemma), vocab_only=True, verbose=False)
    out = llm.tokenize(natural_text().encode(), add_bos=True)
    assert len(out) >= 1600
    return out[:1600]


def make(gemma, heads, **kw):
    args = dict(n_ctx=16384, n_batch=UB, n_ubatch=UB, locret_heads=str(heads), locret_budget=B, locret_stabilizers=NS,
                locret_local=NLOC, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    args.update(kw)
    return Llama(model_path=str(gemma), **compact_unless_asked(args))


def evicting_layers(llm, n_layer):
    out = []
    for il in range(n_layer):
        try:
            llm.locret_retained(il, 0)
            out.append(il)
        except heads_api.HeadsError:
            pass
    return out


def run_and_compare(llm, ref, calls, layers, n_head_kv):
    """Decode `calls` ((tokens, output_last) each), placing the same ubatches with the recorded heads' scores in the
    numpy model `ref`; after every call, every evicting layer's and KV head's kept set must equal the model's, and the
    window cache must hold, in every cell, the token at the position it reports, and all of the last WINDOW positions.
    Returns the next position."""
    n_past, token_at = 0, {}
    for toks, out in calls:
        token_at.update((n_past + j, t) for j, t in enumerate(toks))
        n_past = decode(llm, toks, n_past, out)
        scores, positions = heads_api.recorded_scores(llm)
        scores_of = {int(p): scores[:, :, i] for i, p in enumerate(positions)}
        first, offset = n_past - len(toks), 0
        for size in ref.split(len(toks), out):
            ref.place(list(range(first + offset, first + offset + size)), scores_of, out and offset + size == len(toks))
            offset += size
        for il in layers:
            for h in range(n_head_kv):
                assert llm.locret_retained(il, h).tolist() == [u[0] for u in ref.units[il][h]], (il, h, n_past)
        pos, tok = eviction.window(llm._ctx.ctx)
        assert all(token_at[int(p)] == int(t) for p, t in zip(pos, tok)), n_past
        assert set(range(max(0, n_past - WINDOW), n_past)) <= set(pos.tolist()), n_past
    return n_past


def test_gemma_budget_above_the_input_gives_plain_logits(gemma, gemma_heads, tokens):
    toks = tokens[:600]
    # flash attention as the evicting context has it by default (llama.cpp's auto)
    plain = llama_cpp.Llama(model_path=str(gemma), n_ctx=2048, n_batch=256, n_ubatch=64, n_threads=THREADS, n_threads_batch=THREADS, verbose=False,
                            flash_attn=True)
    plain.eval(toks)
    want = last_logits(plain)
    plain.close()
    llm = make(gemma, gemma_heads, n_ctx=2048, n_batch=256, locret_budget=1024)
    llm.eval(toks)
    got = last_logits(llm)
    assert llm.locret_stats()["n_evictions"] == 0
    llm.close()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())


# positions "keep:800": kept positions (test_kept_positions.py); the window cache shifts only when positions are
# compacted (the limit, every few hundred tokens here)
@pytest.mark.parametrize("positions", [None, "keep:800", "inplace"])
def test_gemma_full_attention_layers_evict_as_algorithm_1_and_the_window_follows(gemma, gemma_heads, tokens, positions):
    llm = make(gemma, gemma_heads, locret_positions=positions)
    heads_api.record_scores(llm)
    n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
    layers = evicting_layers(llm, n_layer)
    assert layers == [5, 11, 17], layers  # Gemma 3: every 6th layer attends to everything
    if positions is None:
        ref = Algorithm1(n_layer, n_head_kv, B, UB, NS, NLOC)
    elif positions == "inplace":
        from test_in_place_positions import InPlacePositions
        ref = InPlacePositions(n_layer, n_head_kv, B, UB, NS, NLOC)
    else:
        from test_kept_positions import KeptPositions
        ref = KeptPositions(n_layer, n_head_kv, B, UB, NS, NLOC, limit=800)

    calls = [(tokens[i:i + UB], i + UB >= 1400) for i in range(0, 1400, UB)]
    calls += [([t], True) for t in tokens[1400:1440]]
    calls += [(tokens[1500:1564], False), (tokens[1564:1600], True)]  # a second prompt
    n_past = run_and_compare(llm, ref, calls, layers, n_head_kv)
    st = llm.locret_stats()
    assert st["n_evictions"] >= 15 and st["pos_logical"] == n_past
    if positions is not None:
        assert st["n_repositions"] == ref.repositions >= (2 if positions != "inplace" else 0)
        assert st["n_rows_rotated"] > 0
        assert all(eviction.rope_positions(llm._ctx.ctx, il, h).tolist() == ref.held(il, h, 2)
                   for il in layers for h in range(n_head_kv))
    llm.close()


def test_gemma_pyramid_schedules_the_global_layers_only(gemma, gemma_heads, tokens):
    # a budget schedule on an iSWA model: the three global layers get PyramidKV's budgets (the window layers keep
    # llama.cpp's window cache and no budget), keep exactly what the numpy model with per-layer budgets keeps, and the
    # window cache still follows every compaction
    from test_schedule import ScheduledAlgorithm1, pyramid

    llm = make(gemma, gemma_heads, locret_budget_schedule="pyramid")
    heads_api.record_scores(llm)
    n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
    layers = evicting_layers(llm, n_layer)
    want = pyramid(len(layers), B, NS)
    assert layers == [5, 11, 17] and [llm.locret_layer_budget(il) for il in layers] == want
    assert [llm.locret_layer_budget(il) for il in range(n_layer) if il not in layers] == [-1] * (n_layer - 3)
    layer_b = [want[layers.index(il)] if il in layers else max(want) for il in range(n_layer)]
    ref = ScheduledAlgorithm1(n_layer, n_head_kv, layer_b, UB, NS, NLOC)

    calls = [(tokens[i:i + UB], i + UB >= 1400) for i in range(0, 1400, UB)]
    calls += [([t], True) for t in tokens[1400:1500]]
    run_and_compare(llm, ref, calls, layers, n_head_kv)
    assert llm.locret_stats()["n_evictions"] >= 5 and ref.post_counts and \
        [ref.post_counts[il] for il in layers] == want
    assert np.all(np.isfinite(last_logits(llm)))
    llm.close()


def state_bytes(state) -> bytes:
    """The bytes of a saved llama_cpp.LlamaState."""
    return bytes(state.llama_state[:state.llama_state_size])


@pytest.mark.parametrize("flash", [True, False], ids=["flash-attn", "v-transposed"])
def test_gemma_state_round_trip(gemma, gemma_heads, tokens, flash):
    """A state saved after evictions restores both caches: the same Locret state, the same window cells, the same
    bytes when saved again, and the next logits the saver itself computes, bit for bit (a fresh context and the saver
    reloading its own state)."""
    llm = make(gemma, gemma_heads, flash_attn=flash)
    n_past = 0
    for i in range(0, 1024, UB):
        n_past = decode(llm, tokens[i:i + UB], n_past, i + UB >= 1024)
    assert llm.locret_stats()["n_evictions"] > 3
    state = llm.save_state()
    saved = state_bytes(state)
    stats = llm.locret_stats()
    window = eviction.window(llm._ctx.ctx)
    decode(llm, tokens[1024:1030], n_past, True)
    want = last_logits(llm)

    other = make(gemma, gemma_heads, flash_attn=flash)
    other.load_state(state)
    # everything but the eviction timers and the count of compaction graphs (work this context did, not state)
    assert eviction.state_stats(other.locret_stats()) == eviction.state_stats(stats)
    assert eviction.window(other._ctx.ctx)[0].tolist() == window[0].tolist()   # the same cells, in the same order
    assert state_bytes(other.save_state()) == saved
    decode(other, tokens[1024:1030], n_past, True)
    np.testing.assert_array_equal(last_logits(other), want)
    llm.load_state(state)
    decode(llm, tokens[1024:1030], n_past, True)
    np.testing.assert_array_equal(last_logits(llm), want)
    llm.close()
    other.close()


# llama.cpp restored a whole cache's cells from cell 0 and started its next slot search there: a loaded window cache
# (a ring) held the saver's cells in another layout, attention summed them in another order, the rounding flipped a
# near-tie at the next eviction (one unit of 520 in two global layers) and the runs parted; plain llama.cpp Gemma
# parted the same way after a reload mid-prompt (logits 1.2 apart). A whole-cache state now records the cells' places
# and the search's head (patch "kv-cache: a whole-cache state restores its cells where they were").
@pytest.mark.parametrize("budget", [B, None], ids=["evicting", "plain"])
def test_gemma_reloaded_context_continues_like_the_saver(gemma, gemma_heads, tokens, budget):
    def new():
        if budget is None:
            return Llama(model_path=str(gemma), n_ctx=16384, n_batch=UB, n_ubatch=UB, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
        return make(gemma, gemma_heads)
    saver = new()
    n_past = 0
    for i in range(0, 512, UB):
        n_past = decode(saver, tokens[i:i + UB], n_past, True)
    loaded = new()
    loaded.load_state(saver.save_state())
    try:
        for start in range(512, 768, UB):   # the window slides; with a budget, one eviction per ubatch
            for llm in (saver, loaded):
                decode(llm, tokens[start:start + UB], n_past, True)
            n_past += UB
            np.testing.assert_array_equal(last_logits(loaded), last_logits(saver))
        if budget is not None:
            assert saver.locret_stats()["n_evictions"] == loaded.locret_stats()["n_evictions"] == 4
    finally:
        saver.close()
        loaded.close()


def _seq_state(llm, seq: int = 0):
    """llama_state_seq_get_data of one sequence (what llama-server's prompt cache keeps of a slot)."""
    import ctypes

    n = llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, seq)
    buf = (ctypes.c_uint8 * n)()
    assert llama_cpp.llama_state_seq_get_data(llm._ctx.ctx, buf, n, seq) == n
    return buf


@pytest.mark.parametrize("budget", [B, None], ids=["evicting", "plain"])
def test_gemma_a_sequence_state_keeps_what_the_window_cache_holds(gemma, gemma_heads, tokens, budget):
    """A sequence's save (llama-server's prompt cache) of an evicting context keeps every cell of its window cache:
    restored, the sequence holds the positions it held (llama-server continues a restored prompt only when the window
    cache holds one older than the window before its next token, else it reads the whole prompt again). Plain
    llama.cpp still leaves the masked cells out (it continues from a context checkpoint). Either continues as the saver
    does up to the order of the cells: a sequence's restore places them from cell 0 (a whole-cache restore puts them
    back where they were, patch 0021), so attention sums in another order, about 1 logit apart in plain llama.cpp
    too; the next token is the same."""
    def new():
        if budget is None:
            return Llama(model_path=str(gemma), n_ctx=16384, n_batch=UB, n_ubatch=UB, n_threads=THREADS,
                         n_threads_batch=THREADS, verbose=False, swa_full=False)
        return make(gemma, gemma_heads, swa_full=False)

    saver, other = new(), new()
    try:
        n_past = 0
        for i in range(0, 1024, UB):
            n_past = decode(saver, tokens[i:i + UB], n_past, i + UB >= 1024)
        held = llama_cpp.llama_memory_seq_pos_min(llama_cpp.llama_get_memory(saver._ctx.ctx), 0)
        assert 0 < held < n_past - WINDOW            # the window cache holds more than the window before the next token
        state = _seq_state(saver)
        assert llama_cpp.llama_state_seq_set_data(other._ctx.ctx, state, len(state), 0) == len(state)
        restored = llama_cpp.llama_memory_seq_pos_min(llama_cpp.llama_get_memory(other._ctx.ctx), 0)
        if budget is None:
            assert restored > held and restored >= n_past - WINDOW   # upstream: the window alone
        else:
            assert restored == held
            assert sorted(eviction.window(other._ctx.ctx)[0].tolist()) == \
                sorted(eviction.window(saver._ctx.ctx)[0].tolist())
        for llm in (saver, other):
            decode(llm, tokens[1024:1030], n_past, True)
        a, b = last_logits(other), last_logits(saver)
        assert int(np.argmax(a)) == int(np.argmax(b)) and np.corrcoef(a, b)[0, 1] > 0.998, np.abs(a - b).max()
    finally:
        saver.close()
        other.close()


def test_gemma_shipped_heads_answer_a_passkey_through_many_evictions(gemma, gemma_heads):
    """One fixed passkey prompt of 2,600 tokens, the key right after the instructions, in a cache of b + ubatch = 768
    cells (b = 512, Gemma's window): the heads must keep the key's tokens through about eight evictions of 256-token
    chunks (the streaming policy's sinks and recent window would drop them), with flash attention and the window
    cache alongside. Past 32K tokens the same path is an evaluation: experiments/eval_gemma_passkey.py (docs/results.md),
    ~150 s per prompt here."""
    budget, ubatch, n_tokens = 512, 256, 2600
    llm = Llama(model_path=str(gemma), n_ctx=8192, n_batch=ubatch, n_ubatch=ubatch, locret_heads=str(gemma_heads),
                locret_budget=budget, flash_attn=True, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    try:
        sample = tasks.get("passkey").generate(3, 0, tokenize=decoding.tokenizer(llm), n_tokens=n_tokens, depth=0.0,
                                               chat_format=decoding.chat_format(llm))
        assert len(sample.tokens) > 4 * budget
        llm.reset()
        llm.eval(sample.tokens)
        st = llm.locret_stats()
        assert st["n_cells"] == budget + ubatch and st["n_cells_used"] <= budget + ubatch, st
        assert st["n_evictions"] >= (len(sample.tokens) - budget) // ubatch - 1, st
        assert st["pos_logical"] == len(sample.tokens), st
        pos, _ = eviction.window(llm._ctx.ctx)   # the window layers hold their last WINDOW positions
        assert set(range(len(sample.tokens) - WINDOW, len(sample.tokens))) <= set(pos.tolist())
        answer, _ = decoding.greedy(llm, 16)
        assert sample.score(answer) == 1.0, f"key {sample.answers[0]} not in {answer!r}"
    finally:
        llm.close()


def test_sage_chooses_the_global_layers_of_an_iswa_model(gemma, tokens):
    # SAGE-KV on Gemma 3: the hook in build_attn's iSWA variant captures the global layers' queries (with Gemma's own
    # attention scale, 1.0: its queries are pre-scaled), the window layers keep llama.cpp's window cache, and the
    # chosen set holds across slides while the window cache follows every compaction
    from locret import eviction

    llm = Llama(model_path=str(gemma), n_ctx=4096, n_batch=256, n_ubatch=256, locret_budget=B, locret_policy="sage",
                n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    n_past = 0
    body = tokens[:1200]
    for i in range(0, len(body) - 1, 256):
        n_past = decode(llm, body[i:min(i + 256, len(body) - 1)], n_past, False)
    n_past = decode(llm, body[-1:], n_past, True)
    q, scale = eviction.read_query(llm._ctx.ctx, 5)   # layer 5: Gemma 3's first global layer
    assert scale == 1.0 and np.abs(q).max() > 0
    with pytest.raises(Exception, match="does not evict with the SAGE-KV policy|no evicting layer"):
        eviction.read_query(llm._ctx.ctx, 0)           # a window layer: not evicted, nothing captured
    n_past = decode(llm, tokens[1300:1301], n_past, True)
    chosen = llm.locret_retained(5, 0)[:B - B // 4].tolist()   # the sinks and the chosen units
    for t in tokens[1301:1301 + 300]:
        n_past = decode(llm, [t], n_past, True)
    stats = llm.locret_stats()
    assert stats["policy"] == "sage" and stats["n_evictions"] >= 2
    assert llm.locret_retained(5, 0)[:B - B // 4].tolist() == chosen   # the chosen set outlives the slides
    assert llm.locret_retained(5, 0)[-1] == n_past - 1
    pos, _ = eviction.window(llm._ctx.ctx)
    assert pos.max() == n_past - 1 and len(pos) >= WINDOW   # a ring: cell order is not position order
    llm.close()


def test_gemma_follow_up_restored_from_the_servers_prompt_cache_reads_only_its_new_tokens(gemma, gemma_heads,
                                                                                          tmp_path):
    """Through `locret serve` (one slot, so another user's prompt takes it between two turns): the follow-up's slot is
    restored from llama-server's prompt cache and reads only its new tokens, not the whole conversation again."""
    import subprocess
    import sys

    from conftest import free_port, post_json
    from locret import serve
    from locret.evaluation import items
    from locret.loadtest import users

    vocab = items.vocab_model(str(gemma))
    try:
        a, b = users.build(vocab, n_users=2, lengths=(1500, 1600), turns=2, mean_gap_s=1.0, seed=0)
    finally:
        vocab.close()
    assert a.completion                                  # a base model: completions
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "locret", "serve", "--model", str(gemma), "--heads",
                                   str(gemma_heads), "--slots", "1", "--budget", "512", "--ubatch", "128",
                                   "--context", "8192", "--threads", str(THREADS), "--port", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        serve.wait_healthy(url, server, log, 300)

        def complete(prompt: str) -> dict:
            return post_json(url + "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})

        first = complete(a.document)
        complete(b.document)                             # takes the one slot: a's state goes to the prompt cache
        follow = complete(users.follow_up_prompt(a.document, first["choices"][0]["text"], a.turns[0]))
        n_first = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1   # the last is not read
        cached = follow["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert n_first - 2 <= cached <= n_first, (cached, n_first, follow["usage"])
        assert follow["timings"]["prompt_n"] == follow["usage"]["prompt_tokens"] - cached < 64
    finally:
        serve.stop(server)


def test_the_evaluations_gemma_window_cache_is_the_tools_own(gemma, gemma_heads):
    """`locret eval` runs a method in locret.Llama, whose llama-cpp-python default sizes a sliding-window model's window
    cache like the whole cache; llama-server and llama-cli keep the window (swa_full off), and so must the evaluation,
    or Gemma's KV column counts memory no deployment allocates (1.5x at b 1024, 3.3x at b 6144 on 16K tokens). The
    context it creates allocates what the rule book says for the tools' window cache."""
    from locret.evaluation.worker import RunSpec, make_llm

    spec = RunSpec(model_path=str(gemma), method="locret", budget=1024, heads=str(gemma_heads), stabilizers=None,
                   local=None, n_ctx=4096, ubatch=128, threads=THREADS)
    llm = make_llm(spec)
    want = eviction.resolve_file(gemma, heads=gemma_heads, budget=1024, n_ctx=4096, n_ubatch=128, n_batch=128,
                                  swa_full=False)
    full_window = eviction.resolve_file(gemma, heads=gemma_heads, budget=1024, n_ctx=4096, n_ubatch=128, n_batch=128)
    assert want["window_bytes"] < full_window["window_bytes"]  # the check below can tell the two apart
    assert llm.locret_stats()["kv_bytes"] == want["kv_bytes"] + want["window_bytes"]
    llm.close()
    plain = make_llm(RunSpec(model_path=str(gemma), method="full", budget=None, heads=None, stabilizers=None,
                             local=None, n_ctx=4096, ubatch=128, threads=THREADS))
    assert plain.context_params.swa_full is False
    plain.close()
