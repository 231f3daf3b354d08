"""Failures leave an evicting context consistent and usable (SmolLM2, b = 96, ubatch 32, n_s = 16, n_loc = 8).

Each failure is forced (llama_locret_debug_inject_fault, or llama.cpp's own abort callback) at a chosen point; the
context is then compared with one that never failed: after the failure the cache, the bookkeeping and the positions are
what they were, and after the failed call is repeated the two contexts hold the same units and give the same logits.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
import llama_cpp
from locret import eviction

from test_eviction import B, NLOC, NS, UB, decode, last_logits, make, prompt_tokens  # noqa: F401 (shared fixture)

LAYERS = (0, 13, 29)


def snapshot(llm):
    """Everything an eviction or a placement changes: statistics, retained units, K and V data, positions."""
    st = llm.locret_stats()
    n = st["n_cells_used"]
    n_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
    width = n_kv * 64
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    return {
        "stats": {k: st[k] for k in ("n_cells_used", "pos_logical", "n_evictions", "n_units_evicted")},
        "retained": {(il, h): llm.locret_retained(il, h).tolist() for il in range(30) for h in range(n_kv)},
        "rope": {(il, h): eviction.rope_positions(llm._ctx.ctx, il, h).tolist() for il in LAYERS for h in range(n_kv)},
        "k": {il: eviction.read_kv(llm._ctx.ctx, il, n, width=width) for il in LAYERS},
        "v": {il: eviction.read_kv(llm._ctx.ctx, il, n, values=True, width=width) for il in LAYERS},
        "pos": (llama_cpp.llama_memory_seq_pos_min(mem, 0), llama_cpp.llama_memory_seq_pos_max(mem, 0)),
    }


def assert_same(a, b):
    assert a["stats"] == b["stats"]
    assert a["retained"] == b["retained"] and a["rope"] == b["rope"]
    assert a["pos"] == b["pos"]
    for part in ("k", "v"):
        for il in LAYERS:
            assert np.array_equal(a[part][il], b[part][il]), f"{part} of layer {il} changed"


def try_decode(llm, tokens, n_past, output_last):
    llm._batch.set_batch(batch=list(tokens), n_past=n_past, logits_all=False)
    llm._batch.batch.logits[len(tokens) - 1] = bool(output_last)
    return llama_cpp.llama_decode(llm._ctx.ctx, llm._batch.batch)


def chunks(tokens, n):
    """n prefill chunks of one ubatch, the last asking for logits"""
    return [(tokens[i * UB:(i + 1) * UB], i == n - 1) for i in range(n)]


def assert_empty_then_like_a_fresh_context(llm, model_path, heads_file, tokens, n_chunks):
    """After a failure that empties the sequence: no cells, no positions, and the next prefill of `n_chunks`
    chunks gives the logits of a context that never failed."""
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    assert llm.locret_stats()["n_cells_used"] == 0 and llama_cpp.llama_memory_seq_pos_max(mem, 0) == -1
    fresh = make(model_path, heads_file)
    n = 0
    for toks, out in chunks(tokens, n_chunks):
        decode(llm, toks, n, out)
        n = decode(fresh, toks, n, out)
    np.testing.assert_array_equal(last_logits(llm), last_logits(fresh))
    fresh.close()


@pytest.fixture
def pair(model_path, heads_file, request):
    """A reference context and one to make fail, with the same settings (positions compacted, or kept when a test
    is parametrized indirectly with "keep")."""
    positions = getattr(request, "param", None)
    ref, llm = (make(model_path, heads_file, locret_positions=positions) for _ in range(2))
    yield ref, llm
    ref.close()
    llm.close()


def run_with_failure(pair, tokens, fail_at, fail, eviction_stands=False, n_kept=B):
    """Decode the same chunks in both contexts; in the second, make chunk `fail_at` fail first (calling `fail`),
    check that nothing changed (or, with eviction_stands, that only the eviction before the chunk happened, which
    left n_kept cells in use), then decode it again. Returns the number of chunks."""
    ref, llm = pair
    calls = chunks(tokens, 12)
    n_past = 0
    for i, (toks, out) in enumerate(calls):
        decode(ref, toks, n_past, out)
        if i == fail_at:
            before = snapshot(llm)
            rc = fail(llm, toks, n_past, out)
            assert rc != 0, "the forced failure did not fail the decode"
            after = snapshot(llm)
            if eviction_stands:
                assert after["stats"]["n_evictions"] == before["stats"]["n_evictions"] + 1
                assert after["stats"]["n_cells_used"] == n_kept and after["pos"][1] == before["pos"][1]
                assert after["stats"]["pos_logical"] == before["stats"]["pos_logical"]
            else:
                assert_same(after, before)
        n_past = decode(llm, toks, n_past, out)
    assert ref.locret_stats()["n_evictions"] >= 6
    assert_same(snapshot(llm), snapshot(ref))
    np.testing.assert_array_equal(last_logits(llm), last_logits(ref))
    return len(calls)


def injected(fault):
    def fail(llm, toks, n_past, out):
        eviction.inject_fault(llm._ctx.ctx, fault)
        return try_decode(llm, toks, n_past, out)
    return fail


@pytest.mark.parametrize("fault", ["evict_alloc", "evict_compute"])
def test_a_failed_eviction_leaves_cache_bookkeeping_and_positions_as_before(pair, prompt_tokens, fault):
    # chunk 5 comes after 5 chunks of 32 > b = 96 units: an eviction runs before it
    run_with_failure(pair, prompt_tokens, 5, injected(fault))


@pytest.mark.parametrize("fail_at,fault", [(3, "evict_alloc"), (6, "evict_compute")])
def test_a_failed_eviction_with_a_schedule_leaves_every_layer_as_before(model_path, heads_file, prompt_tokens,
                                                                         tmp_path, fault, fail_at):
    # budgets 73 to 133 per layer (mean b = 96): chunk 3 follows 96 units, an eviction of the smaller layers only
    # (the largest keeps all it holds); chunk 6 follows one where every layer is at its budget
    from test_schedule import schedule_file, varied

    path = schedule_file(tmp_path, varied(30, B))
    pair = tuple(make(model_path, heads_file, locret_budget_schedule=str(path)) for _ in range(2))
    run_with_failure(pair, prompt_tokens, fail_at, injected(fault))
    for llm in pair:
        llm.close()


def test_a_failed_ubatch_with_a_schedule_is_taken_back_in_every_layers_cache(model_path, heads_file, prompt_tokens,
                                                                              tmp_path):
    # a schedule's layers sit in a cache per budget: the failed ubatch was placed in each, and each gives its cells
    # back (by position), so the retry continues as the context that never failed (its logits, bit for bit)
    from test_schedule import schedule_file, varied

    path = schedule_file(tmp_path, varied(30, B))
    pair = tuple(make(model_path, heads_file, locret_budget_schedule=str(path)) for _ in range(2))
    run_with_failure(pair, prompt_tokens, 6, injected("ubatch"), eviction_stands=True, n_kept=max(varied(30, B)))
    for llm in pair:
        llm.close()


@pytest.mark.parametrize("fail_at,pair", [(2, None), (6, None), (6, "keep"), (6, "inplace")], indirect=["pair"],
                         ids=["no-eviction-before", "after-an-eviction", "after-an-eviction-kept-positions",
                              "after-an-eviction-in-place-positions"])
def test_a_failed_ubatch_is_taken_back_in_the_clients_positions(pair, prompt_tokens, fail_at):
    # the ubatch is placed (its positions mapped to cells) and computed, then counts as failed: llama_decode takes it
    # back with seq_rm in the client's positions. After an eviction, the eviction stands and the retry does not
    # evict again, exactly as the context that never failed evicted once.
    run_with_failure(pair, prompt_tokens, fail_at, injected("ubatch"), eviction_stands=fail_at == 6)


ABORT_CB = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)


def test_an_aborted_decode_is_taken_back(pair, prompt_tokens):
    always = ABORT_CB(lambda _: True)

    def abort(llm, toks, n_past, out):
        llama_cpp.llama_set_abort_callback(llm._ctx.ctx, always, None)
        try:
            return try_decode(llm, toks, n_past, out)
        finally:
            llama_cpp.llama_set_abort_callback(llm._ctx.ctx, ABORT_CB(0), None)

    run_with_failure(pair, prompt_tokens, 2, abort)  # no eviction is due before chunk 2: the model graph aborts


def test_an_eviction_aborted_part_way_empties_its_sequence(model_path, heads_file, prompt_tokens):
    """An abort inside the compaction graph may leave rows half moved: the sequence is emptied (never read
    inconsistent) and the context goes on from scratch."""
    llm = make(model_path, heads_file)
    n_past = 0
    for toks, out in chunks(prompt_tokens, 5):
        n_past = decode(llm, toks, n_past, False)
    always = ABORT_CB(lambda _: True)
    llama_cpp.llama_set_abort_callback(llm._ctx.ctx, always, None)
    assert try_decode(llm, prompt_tokens[n_past:n_past + UB], n_past, False) != 0
    llama_cpp.llama_set_abort_callback(llm._ctx.ctx, ABORT_CB(0), None)
    assert_empty_then_like_a_fresh_context(llm, model_path, heads_file, prompt_tokens, 3)
    llm.close()


def _state(llm) -> bytes:
    size = llama_cpp.llama_state_get_size(llm._ctx.ctx)
    buf = (ctypes.c_uint8 * size)()
    assert llama_cpp.llama_state_get_data(llm._ctx.ctx, buf, size) == size
    return bytes(buf)


def _load(llm, data: bytes) -> int:
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    return llama_cpp.llama_state_set_data(llm._ctx.ctx, buf, len(data))


@pytest.mark.parametrize("damage", ["injected", "truncated", "corrupt-bookkeeping"])
def test_a_failed_state_load_leaves_the_context_empty_and_usable(model_path, heads_file, prompt_tokens, damage):
    src = make(model_path, heads_file)
    n_past = 0
    for toks, out in chunks(prompt_tokens, 8):
        n_past = decode(src, toks, n_past, out)
    data = _state(src)
    n_used = src.locret_stats()["n_cells_used"]
    src.close()

    llm = make(model_path, heads_file)
    decode(llm, prompt_tokens[:UB], 0, True)  # something to lose
    if damage == "injected":
        eviction.inject_fault(llm._ctx.ctx, "state_read")
    elif damage == "truncated":
        data = data[: len(data) - 200]  # inside the Locret section at the end
    else:
        # the state ends with the last (layer, KV head)'s positions then scores, n_used of each: negative positions
        # must be refused
        tail = bytearray(data)
        at = len(tail) - 8 * n_used
        tail[at:at + 8] = b"\xff" * 8
        data = bytes(tail)
    assert _load(llm, data) == 0
    assert llm.locret_stats()["pos_logical"] == 0
    assert_empty_then_like_a_fresh_context(llm, model_path, heads_file, prompt_tokens, 6)
    llm.close()
