"""Several sequences in one evicting context (one KV stream per sequence, llama.cpp's non-unified cache): every
sequence evicts on its own, exactly as the numpy model of Algorithm 1 (test_eviction.Algorithm1) run on that sequence
alone predicts, while the batches mix the sequences the way llama-server does (prompt chunks of several slots in one
call, then one token per slot). State save/load carries every sequence, and a single sequence's state (the server's
prompt cache) moves between contexts.
"""
from __future__ import annotations

import ctypes
import re
import sys

import numpy as np
import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
import llama_cpp
from locret import eviction, heads as heads_api

from conftest import run, tool
from test_eviction import CONVERTER, B, NLOC, NS, UB, Algorithm1, make, prompt_tokens  # noqa: F401 (fixture)


def decode_batch(llm, parts):
    """One llama_decode of several sequences' tokens: parts are (seq, tokens, first position, last asks for logits)."""
    n = sum(len(toks) for _, toks, _, _ in parts)
    batch = llama_cpp.llama_batch_init(n, 0, 1)
    try:
        i = 0
        for seq, toks, p0, out in parts:
            for j, tok in enumerate(toks):
                batch.token[i] = tok
                batch.pos[i] = p0 + j
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = bool(out) and j == len(toks) - 1
                i += 1
        batch.n_tokens = n
        rc = llama_cpp.llama_decode(llm._ctx.ctx, batch)
    finally:
        llama_cpp.llama_batch_free(batch)
    assert rc == 0, f"llama_decode returned {rc}"


def logits_of(llm, i):
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm._model.model))
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, i), shape=(n_vocab,)).copy()


def conversation(tokens, n_seq):
    """Calls of a multi-slot server: prompts of different lengths arriving in chunks (some calls carry only some
    sequences), then generation one token per sequence, then a second prompt for every sequence. Each call is a
    list of (seq, tokens, last asks for logits); positions follow per sequence."""
    streams = [tokens[s * 97:] for s in range(n_seq)]  # a different text for every sequence
    lengths = [288 + 64 * s for s in range(n_seq)]      # prompts end at different calls
    calls, used = [], [0] * n_seq
    for k in range(0, max(lengths), UB):
        call = []
        for s in range(n_seq):
            if k < lengths[s] and not (s % 2 == 1 and (k // UB) % 3 == 1):  # odd sequences skip some calls
                take = min(UB if s % 2 == 0 else 2 * UB, lengths[s] - used[s])
                if take > 0:
                    call.append((s, streams[s][used[s]:used[s] + take], used[s] + take >= lengths[s]))
                    used[s] += take
        if call:
            calls.append(call)
    while any(used[s] < lengths[s] for s in range(n_seq)):  # the rest of the skipped chunks
        call = []
        for s in range(n_seq):
            take = min(UB, lengths[s] - used[s])
            if take > 0:
                call.append((s, streams[s][used[s]:used[s] + take], used[s] + take >= lengths[s]))
                used[s] += take
        calls.append(call)
    for g in range(40):  # generation: one token per sequence, one batch
        calls.append([(s, [streams[s][500 + g]], True) for s in range(n_seq)])
    for s in range(n_seq):
        used[s] += 40
    second = [(s, streams[s][600:680], True) for s in range(n_seq)]
    calls.append(second)
    return calls


# layout "keep:200": kept positions (test_kept_positions.py), compacted every few parts of each sequence; "inplace":
# in-place positions (test_in_place_positions.py), whose keys re-rotated where they stay follow a turn's moves
# (turns of 3 with compact positions ran here too, and 2 sequences in one turn: 4 sequences in turns of 1 and of 4
# cover what they did)
@pytest.mark.parametrize("n_seq,compact_seq,layout", [(4, None, None), (4, 1, None), (4, 3, "keep:200"),
                                                        (4, 2, "inplace")])
def test_every_sequence_evicts_as_algorithm_1_on_its_own(model_path, heads_file, prompt_tokens, n_seq, compact_seq,
                                                         layout, monkeypatch):
    # compact_seq: the sequences one compaction moves (LOCRET_DEBUG_COMPACT_SEQ; by default up to 4): a ubatch that
    # evicts more of them evicts them in turns, which must keep exactly the same units
    if compact_seq is not None:
        monkeypatch.setenv("LOCRET_DEBUG_COMPACT_SEQ", str(compact_seq))
    llm = make(model_path, heads_file, n_seq_max=n_seq, n_batch=1024, locret_positions=layout)
    heads_api.record_scores(llm)
    n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
    if layout is None:
        refs = [Algorithm1(n_layer, n_head_kv, B, UB, NS, NLOC) for _ in range(n_seq)]
    elif layout == "inplace":
        from test_in_place_positions import InPlacePositions
        refs = [InPlacePositions(n_layer, n_head_kv, B, UB, NS, NLOC) for _ in range(n_seq)]
    else:
        from test_kept_positions import KeptPositions
        refs = [KeptPositions(n_layer, n_head_kv, B, UB, NS, NLOC, limit=int(layout.split(":")[1]))
                for _ in range(n_seq)]
    n_past = [0] * n_seq
    checked = 0
    most_at_once = 0  # the most sequences one call evicted
    per_turn = compact_seq or min(n_seq, 4)
    for call in conversation(prompt_tokens, n_seq):
        before = [llm.locret_stats(seq_id=s)["n_evictions"] for s in range(n_seq)]
        compactions = llm.locret_stats()["n_compactions"]
        decode_batch(llm, [(s, toks, n_past[s], out) for s, toks, out in call])
        if all(len(toks) == 1 for _, toks, _ in call):  # one ubatch: its evictions share one plan
            evicting = sum(llm.locret_stats(seq_id=s)["n_evictions"] > before[s] for s in range(n_seq))
            most_at_once = max(most_at_once, evicting)
            # the sequences that evict share compactions, per_turn at a time, whichever others sit between them (a
            # turn whose units all leave from the end moves nothing and runs none)
            assert llm.locret_stats()["n_compactions"] - compactions <= -(-evicting // per_turn), (evicting, per_turn)
        scores, positions = heads_api.recorded_scores(llm)
        seqs = heads_api.recorded_sequences(llm)
        scores_of = {(int(q), int(p)): scores[:, :, i] for i, (q, p) in enumerate(zip(seqs, positions))}
        for s, toks, out in call:
            first, offset = n_past[s], 0
            for size in refs[s].split(len(toks), out):
                pos = list(range(first + offset, first + offset + size))
                refs[s].place(pos, {p: scores_of[(s, p)] for p in pos}, out and offset + size == len(toks))
                offset += size
            n_past[s] += len(toks)
        for s in range(n_seq):
            for il in range(n_layer):
                for h in range(n_head_kv):
                    got = llm.locret_retained(il, h, seq_id=s).tolist()
                    assert got == [u[0] for u in refs[s].units[il][h]], f"sequence {s} layer {il} head {h}"
                    if layout is not None:
                        assert eviction.rope_positions(llm._ctx.ctx, il, h, seq_id=s).tolist() == \
                            refs[s].held(il, h, 2), f"sequence {s} layer {il} head {h}"
                    checked += 1
            st = llm.locret_stats(seq_id=s)
            assert st["n_cells_used"] <= B + UB and st["pos_logical"] == n_past[s]
    # generation in step brings several sequences to their eviction in the same ubatch (with compact_seq 1 or 3 and 4
    # sequences: more than one turn)
    assert most_at_once >= 2, most_at_once
    assert llm.locret_stats()["n_compactions"] > 0
    if layout is not None:
        assert all(r.repositions >= (2 if layout != "inplace" else 0) for r in refs) and llm.locret_stats()["n_repositions"] == sum(r.repositions for r in refs)
    single = make(model_path, heads_file)
    for s in range(n_seq):
        st = llm.locret_stats(seq_id=s)
        assert st["n_evictions"] >= 8, (s, st)
        assert st["n_seq"] == n_seq and st["n_cells"] == single.locret_stats()["n_cells"]
    # KV memory: n_seq x (b + ubatch) cells, padded
    assert llm.locret_stats()["kv_bytes"] == n_seq * single.locret_stats()["kv_bytes"]
    # the sequences really hold different units
    assert llm.locret_retained(0, 0, seq_id=0).tolist() != llm.locret_retained(0, 0, seq_id=1).tolist()
    single.close()
    llm.close()


def test_sequences_evicting_together_share_a_compaction(model_path, heads_file, prompt_tokens, monkeypatch):
    # 4 slots, 2 sequences per compaction: sequences 0 and 3 (same prompt length) reach their eviction in the same
    # generation ubatch while 1 and 2 (short prompts) do not; the two evicting ones are one turn, one compaction,
    # although 1 and 2 sit between them in the ubatch
    monkeypatch.setenv("LOCRET_DEBUG_COMPACT_SEQ", "2")
    llm = make(model_path, heads_file, n_seq_max=4, n_batch=1024)
    lengths = [200, 20, 24, 200]
    n_past = [0] * 4
    for s in range(4):
        decode_batch(llm, [(s, prompt_tokens[s * 97:s * 97 + lengths[s]], 0, True)])
        n_past[s] = lengths[s]
    evicted_together = False
    for g in range(B + UB):
        before = [llm.locret_stats(seq_id=s)["n_evictions"] for s in range(4)]
        compactions = llm.locret_stats()["n_compactions"]
        decode_batch(llm, [(s, [prompt_tokens[900 + g]], n_past[s], True) for s in range(4)])
        n_past = [n + 1 for n in n_past]
        evicting = [llm.locret_stats(seq_id=s)["n_evictions"] > before[s] for s in range(4)]
        assert not evicting[1] and not evicting[2] and evicting[0] == evicting[3], (g, evicting)
        if evicting[0]:
            assert llm.locret_stats()["n_compactions"] - compactions == 1, g
            evicted_together = True
            break
    assert evicted_together
    llm.close()


def _prefill(llm, tokens, n_seq):
    calls = conversation(tokens, n_seq)[:6]
    n_past = [0] * n_seq
    for call in calls:
        decode_batch(llm, [(s, toks, n_past[s], out) for s, toks, out in call])
        for s, toks, _ in call:
            n_past[s] += len(toks)
    return n_past


def test_state_round_trip_with_several_sequences(model_path, heads_file, prompt_tokens):
    llm = make(model_path, heads_file, n_seq_max=3, n_batch=1024)
    n_past = _prefill(llm, prompt_tokens, 3)
    assert all(llm.locret_stats(seq_id=s)["n_evictions"] > 0 for s in range(3))
    state = llm.save_state()
    kept = {(s, il): llm.locret_retained(il, 1, seq_id=s).tolist() for s in range(3) for il in (0, 29)}
    nxt = [(s, prompt_tokens[900 + s:905 + s], n_past[s], True) for s in range(3)]
    decode_batch(llm, nxt)
    want = [logits_of(llm, 4 + 5 * s) for s in range(3)]

    other = make(model_path, heads_file, n_seq_max=3, n_batch=1024)
    other.load_state(state)
    for s in range(3):
        assert other.locret_stats(seq_id=s)["pos_logical"] == n_past[s]
        for il in (0, 29):
            assert other.locret_retained(il, 1, seq_id=s).tolist() == kept[(s, il)]
    decode_batch(other, nxt)
    for s in range(3):
        np.testing.assert_allclose(logits_of(other, 4 + 5 * s), want[s], rtol=0, atol=1e-4 * np.abs(want[s]).max())
    llm.close()
    other.close()


def test_one_sequences_state_moves_to_another_context(model_path, heads_file, prompt_tokens):
    """What llama-server's prompt cache does: save a slot's sequence, load it into a slot of another context."""
    llm = make(model_path, heads_file, n_seq_max=2, n_batch=1024)
    n_past = _prefill(llm, prompt_tokens, 2)
    size = llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, 1)
    buf = (ctypes.c_uint8 * size)()
    assert llama_cpp.llama_state_seq_get_data(llm._ctx.ctx, buf, size, 1) == size

    other = make(model_path, heads_file, n_seq_max=2, n_batch=1024)
    assert llama_cpp.llama_state_seq_set_data(other._ctx.ctx, buf, size, 1) == size
    assert other.locret_stats(seq_id=0)["n_cells_used"] == 0
    assert other.locret_stats(seq_id=1)["pos_logical"] == n_past[1]
    for il in range(30):
        assert other.locret_retained(il, 2, seq_id=1).tolist() == llm.locret_retained(il, 2, seq_id=1).tolist()
    nxt = [(1, prompt_tokens[900:905], n_past[1], True)]
    decode_batch(llm, nxt)
    decode_batch(other, nxt)
    want = logits_of(llm, 4)
    np.testing.assert_allclose(logits_of(other, 4), want, rtol=0, atol=1e-4 * np.abs(want).max())
    llm.close()
    other.close()


def test_a_schedules_caches_with_several_sequences(model_path, heads_file, prompt_tokens, monkeypatch):
    # A pyramid held in a cache per budget, 4 sequences as a server mixes them (prompt chunks, then one token per
    # sequence in one ubatch, whose mask the groups read side by side): the logits of every call equal those of one
    # cache that masks what each layer does not keep (LOCRET_DEBUG_ALLOC=masked); the memory is 4 x one sequence's;
    # a saved state of every sequence loads into a new context and continues with the same logits.
    n_seq = 4
    runs = {}
    for alloc in ("grouped", "masked"):
        monkeypatch.setenv("LOCRET_DEBUG_ALLOC", alloc)
        llm = make(model_path, heads_file, n_seq_max=n_seq, n_batch=1024, locret_budget_schedule="pyramid")
        n_past, logits = [0] * n_seq, []
        for call in conversation(prompt_tokens, n_seq):
            decode_batch(llm, [(s, toks, n_past[s], out) for s, toks, out in call])
            i = 0
            for s, toks, out in call:
                i += len(toks)
                n_past[s] += len(toks)
                if out:
                    logits.append(logits_of(llm, i - 1))
        runs[alloc] = (logits, [llm.locret_stats(seq_id=s)["n_evictions"] for s in range(n_seq)], llm, n_past)
    (grouped, ev_grouped, llm, n_past), (masked, ev_masked, masked_llm, _) = runs["grouped"], runs["masked"]
    assert ev_grouped == ev_masked and min(ev_grouped) >= 8
    assert len(grouped) == len(masked) > 100
    for i, (a, b) in enumerate(zip(grouped, masked)):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}")
    monkeypatch.setenv("LOCRET_DEBUG_ALLOC", "grouped")
    single = make(model_path, heads_file, locret_budget_schedule="pyramid")
    assert llm.locret_stats()["kv_bytes"] == n_seq * single.locret_stats()["kv_bytes"] < \
        masked_llm.locret_stats()["kv_bytes"]
    single.close()
    masked_llm.close()

    state = llm.save_state()
    nxt = [(s, prompt_tokens[900 + s:905 + s], n_past[s], True) for s in range(n_seq)]
    decode_batch(llm, nxt)
    want = [logits_of(llm, 4 + 5 * s) for s in range(n_seq)]
    again = make(model_path, heads_file, n_seq_max=n_seq, n_batch=1024, locret_budget_schedule="pyramid")
    again.load_state(state)
    decode_batch(again, nxt)
    for s in range(n_seq):
        np.testing.assert_array_equal(logits_of(again, 4 + 5 * s), want[s])
    again.close()
    llm.close()


def test_pooling_for_long_prompts_is_decided_per_sequence(model_path, heads_file, prompt_tokens, tmp_path):
    """Heads that recommend pooling for long prompts only (locret.recommended.pool_from): each sequence pools as the
    length of the prompt it was told to start with says, beside one that does not, in alternating ubatches of one
    shape (a graph built for one must not be reused with the other's window), each as Algorithm 1 on its own."""
    pool_heads = tmp_path / "pool-from-4.gguf"
    proc = run([sys.executable, str(CONVERTER), "recommend", str(heads_file), "--pool", "9", "--pool-from", "4",
                "-o", str(pool_heads)])
    assert proc.returncode == 0, proc.stderr
    llm = make(model_path, pool_heads, n_seq_max=2, n_batch=1024)
    assert llm._locret_heads.recommended["pool_from"] == 4
    heads_api.record_scores(llm)
    n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
    lengths = [4 * B, 4 * B - 1]  # 4 budgets, and one token less
    assert [eviction.seq_prompt(llm._ctx.ctx, lengths[s], s) for s in (0, 1)] == [True, False]
    refs = [Algorithm1(n_layer, n_head_kv, B, UB, NS, NLOC, pool=9), Algorithm1(n_layer, n_head_kv, B, UB, NS, NLOC)]
    unpooled_0 = Algorithm1(n_layer, n_head_kv, B, UB, NS, NLOC)  # sequence 0 as it would be without pooling
    streams = [prompt_tokens[s * 97:] for s in (0, 1)]
    n_past = [0, 0]
    for k in range(0, max(lengths), UB):
        for s in (0, 1):
            toks = streams[s][k:min(k + UB, lengths[s])]
            out = k + len(toks) >= lengths[s]
            decode_batch(llm, [(s, toks, n_past[s], out)])
            scores, positions = heads_api.recorded_scores(llm)
            seqs = heads_api.recorded_sequences(llm)
            scores_of = {int(p): scores[:, :, i] for i, (q, p) in enumerate(zip(seqs, positions)) if q == s}
            for ref in [refs[s]] + ([unpooled_0] if s == 0 else []):
                ref.place_call(n_past[s], len(toks), out, scores_of)
            n_past[s] += len(toks)
    held = {s: [llm.locret_retained(il, h, seq_id=s).tolist() for il in range(n_layer) for h in range(n_head_kv)]
            for s in (0, 1)}
    for s in (0, 1):
        assert held[s] == [[u[0] for u in refs[s].units[il][h]] for il in range(n_layer) for h in range(n_head_kv)], s
        assert llm.locret_stats(seq_id=s)["n_evictions"] >= 8
    assert held[0] != [[u[0] for u in unpooled_0.units[il][h]] for il in range(n_layer) for h in range(n_head_kv)]
    assert [llm.locret_stats(seq_id=s)["pool"] for s in (0, 1)] == [9, 0]
    assert all((llm.locret_stats(seq_id=s)["pool_window"], llm.locret_stats(seq_id=s)["pool_from"]) == (9, 4)
               for s in (0, 1))
    # a saved state carries each sequence's decision
    other = make(model_path, pool_heads, n_seq_max=2, n_batch=1024)
    other.load_state(llm.save_state())
    assert [other.locret_stats(seq_id=s)["pool"] for s in (0, 1)] == [9, 0]
    other.close()
    # told a longer prompt while it holds tokens (a follow-up), a sequence keeps its decision; emptied, it decides anew
    assert eviction.seq_prompt(llm._ctx.ctx, 10 * B, 1) is False
    llm._ctx.kv_cache_seq_rm(1, -1, -1)
    assert eviction.seq_prompt(llm._ctx.ctx, 10 * B, 1) is True
    # a negative count is refused by both calls about a sequence's tokens, with the caller named
    for call, name in ((eviction.seq_prompt, "llama_locret_seq_prompt"), (eviction.pin_query, "llama_locret_pin_query")):
        with pytest.raises(heads_api.HeadsError, match=rf"{name}: a negative token count \(-1\)"):
            call(llm._ctx.ctx, -1, 0)
    llm.close()
    # Python's eval tells a prompt given whole; the tools tell theirs and log the decision
    for n, pool in ((4 * B, 9), (2 * B, 0)):
        one = make(model_path, pool_heads)
        one.eval(prompt_tokens[:n])
        assert one.locret_stats()["pool"] == pool, n
        one.close()
    proc = run([tool("llama-completion"), "-m", model_path, "--locret-heads", pool_heads, "--locret-budget", "256",
                "-p", "hi", "-n", "2", "-no-cnv", "-lv", "4"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "score pooling 9 for prompts of 4 budgets or more" in proc.stderr, proc.stderr[-2000:]
    assert re.search(r"sequence 0: a prompt of \d+ tokens, under 4 budgets: score pooling off", proc.stderr)
    # a window for long prompts needs a window: refused when none is given, or when it is taken away
    for heads, args in ((heads_file, ["--pool-from", "4"]), (pool_heads, ["--pool", "0"])):
        proc = run([sys.executable, str(CONVERTER), "recommend", str(heads), *args, "-o", str(tmp_path / "no.gguf")])
        assert proc.returncode != 0 and "pool_from (4 budgets) needs locret.recommended.pool" in proc.stderr \
            and not (tmp_path / "no.gguf").exists(), proc.stderr
    proc = run([sys.executable, str(CONVERTER), "recommend", str(pool_heads), "--pool", "0", "--pool-from", "0",
                "-o", str(tmp_path / "none.gguf")])
    assert proc.returncode == 0, proc.stderr
