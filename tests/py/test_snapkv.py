"""SnapKV per chunk (--locret-policy snapkv): a training-free, query-aware scorer, checked against numpy.

The engine captures the post-RoPE queries of each part's last W tokens (the observation window, the policy's setting
`window`: --locret-policy snapkv:window=W) and, at every
eviction, scores every cached unit by their attention: softmax over the units each window query saw (causal), the
mean over the window and over the KV head's query heads, then an average over the `pool` units centred on each unit
(inside the sequence's cells). The top-b selection keeps the best units beside the window (kept like stabilizers)
and the plan's stabilizers. `SnapKV` below is an independent model of all of it: the scores in float64 numpy from the
queries and the K cache read back before each call that evicts, and the kept sets, followed through a chunked prefill
and generation. Every llama_decode call here is one ubatch, so what is read before a call is what its eviction scores.
"""
from __future__ import annotations

import re
import struct

import numpy as np
import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
import llama_cpp
from locret import eviction
from locret.heads import HeadsError
from locret.llama import Llama

from conftest import free_port, http_server, natural_text, post_json, run, tool
from test_eviction import decode, last_logits, prompt_tokens  # noqa: F401 (shared fixture)
from test_sage import all_held, assert_resumes_exactly, shape

B, UB, NS = 128, 64, 16
# snapkv's default settings (its policy file's, listed by eviction.policy_settings_help("snapkv"); checked below):
W, POOL = 32, 5   # window=32 (the observation window), pool=5
Q = 64            # question=64: the store rows of a pinned question, before the window's


def snapkv_scores(k: np.ndarray, queries: np.ndarray, scale: float, n_head_kv: int, d: int, pool: int,
                  causal: bool = True) -> np.ndarray:
    """k [n, n_head_kv*d] (the cache as stored), queries [nw, n_head*d] oldest first, query t in cell n - nw + t
    (causal) or after every cell (not causal: a pinned question read after the cache). Query head h reads KV head
    h // G; the CPU multiplies the F16 cache by queries rounded to F16. Returns [n, n_head_kv]: the mean attention
    over the window and the group, averaged over the `pool` cells around each cell."""
    n, nw = k.shape[0], queries.shape[0]
    n_head = queries.shape[1] // d
    group = n_head // n_head_kv
    q = queries.astype(np.float16).astype(np.float64).reshape(nw, n_head, d)
    k = k.astype(np.float64)
    out = np.zeros((n, n_head_kv))
    for h in range(n_head):
        kv = h // group
        logits = scale * (q[:, h, :] @ k[:, kv * d:(kv + 1) * d].T)  # [nw, n]
        for t in range(nw if causal else 0):
            logits[t, n - nw + t + 1:] = -np.inf
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        out[:, kv] += (p / p.sum(axis=1, keepdims=True)).sum(axis=0)
    out /= nw * group
    if pool > 1:
        r = pool // 2
        out = np.stack([out[max(0, j - r):min(n, j + r + 1)].mean(axis=0) for j in range(n)])
    return out


class SnapKV:
    """Per (layer, KV head) the logical positions held, in cell order; the plan of test_eviction's Algorithm 1 (no
    local tail), with the window kept like stabilizers."""

    def __init__(self, n_layer, n_head_kv, d, pool, pinned=0, rtol=1e-4, window=W):
        self.pinned = pinned  # leading units a pinned question holds (kept, never scored away)
        self.w = window       # the observation window: the queries of a part's last `window` tokens
        # how close the engine's float32 scores are to these: the queries are rounded to F16 for the product, and a
        # question's queries are rotated first (float32 there, float64 here), so a rounding can fall the other way
        self.rtol = rtol
        self.units = [[[] for _ in range(n_head_kv)] for _ in range(n_layer)]
        self.n_layer, self.n_head_kv, self.d, self.pool = n_layer, n_head_kv, d, pool
        self.prev_output, self.window = True, 0
        self.evictions, self.near_ties, self.checked = 0, 0, 0

    def n_used(self):
        return len(self.units[0][0])

    def plan(self, n_tokens, output):
        """(n_keep, plan's stabilizers) of the eviction before a part, or None (locret_plan_eviction)."""
        n_used = self.n_used()
        if not self.prev_output and n_used > B:
            return B, 0 if output else min(NS, n_used)
        if n_used + n_tokens > B + UB:
            return min(B, n_used), 0
        return None

    def evict(self, n_keep, plan_stab, k_cache, queries, engine_held, engine_scores, question=None):
        """question(il, n_used): the pinned question's queries of layer il re-rotated after the cache (the window
        then), or None (the last part's window)."""
        n_used, nw, n_pin = self.n_used(), self.window, self.pinned
        n_stab = plan_stab if question is not None else max(plan_stab, nw)
        n_top = n_keep - n_stab - n_pin
        for il in range(self.n_layer):
            q, scale = queries[il]
            if question is not None:
                s = snapkv_scores(k_cache[il][:n_used], question(il, n_used), scale, self.n_head_kv, self.d, self.pool,
                                  causal=False)
            else:
                s = snapkv_scores(k_cache[il][:n_used], q[len(q) - nw:], scale, self.n_head_kv, self.d, self.pool)
            got_scores = engine_scores(il)
            for h in range(self.n_head_kv):
                units = self.units[il][h]
                cand = np.arange(n_pin, n_used - n_stab)
                order = cand[np.lexsort((cand, -s[cand, h]))]
                chosen = sorted(order[:n_top].tolist())
                keep = list(range(n_pin)) + chosen + list(range(n_used - n_stab, n_used))
                want = [units[c] for c in keep]
                got = engine_held(il, h)[:n_keep]
                if got != want:
                    # only at the cut, within the float32 rounding of the engine's scores
                    cut = s[order[n_top - 1], h]
                    pos_score = {units[c]: s[c, h] for c in range(n_used)}
                    for p in set(got) ^ set(want):
                        assert abs(pos_score[p] - cut) <= self.rtol * cut + 1e-7, \
                            f"layer {il} head {h}: position {p} kept/evicted against the model, far from the cut"
                    self.near_ties += 1
                    want = got
                # the stored scores moved with their units
                np.testing.assert_allclose(got_scores[:n_keep, h], [s[units.index(p), h] for p in want],
                                           rtol=self.rtol, atol=1e-7, err_msg=f"layer {il} head {h}")
                self.checked += n_keep
                self.units[il][h] = want
        self.evictions += 1

    def place(self, positions, output):
        for layer in self.units:
            for units in layer:
                units.extend(positions)
        self.prev_output = output
        self.window = min(self.w, len(positions))


def make(model_path, **kw):
    args = dict(n_ctx=4096, n_batch=UB, n_ubatch=UB, locret_budget=B, locret_policy="snapkv", locret_stabilizers=NS,
                verbose=False, seed=1, n_threads=1, n_threads_batch=1)
    args.update(kw)
    return Llama(model_path=str(model_path), **args)


def read_queries(ctx, il, d_model):
    flat, scale = eviction.read_query(ctx, il)
    return flat.reshape(-1, d_model), scale


def step(llm, ref, tokens, output, n_past, d_model, question=None):
    """One llama_decode call of `tokens` followed by the model: the cache and queries read before it when it evicts,
    the eviction checked (ref.evict), its units placed. Returns (n_past after it, the queries read or None)."""
    ctx = llm._ctx.ctx
    planned = ref.plan(len(tokens), output)
    queries = None
    if planned is not None:
        k = [eviction.read_kv(ctx, il, ref.n_used(), width=ref.n_head_kv * ref.d) for il in range(ref.n_layer)]
        queries = [read_queries(ctx, il, d_model) for il in range(ref.n_layer)]
    n_before = llm.locret_stats()["n_evictions"]
    n_past = decode(llm, tokens, n_past, output)
    assert llm.locret_stats()["n_evictions"] == n_before + (planned is not None), (n_past, planned)
    if planned is not None:
        ref.evict(*planned, k, queries, lambda il, h: llm.locret_retained(il, h).tolist(),
                  lambda il: eviction.read_scores(ctx, il, planned[0], n_head_kv=ref.n_head_kv), question=question)
    ref.place(list(range(n_past - len(tokens), n_past)), output)
    return n_past, queries


@pytest.mark.parametrize("select,pool,window", [("host", 0, W), ("graph", POOL, W), ("host", POOL, 16)])
def test_snapkv_scores_and_kept_sets_match_numpy(select, pool, window, model_path, prompt_tokens, monkeypatch):
    # host: the host selects from the store (the CPU default); graph: the device's selection graph (a GPU's default);
    # window 16: the policy's setting (snapkv:window=16), the same model with its window
    monkeypatch.setenv("LOCRET_DEBUG_SELECT", select)
    kw = {} if pool == POOL else dict(locret_pool=pool)  # POOL: the policy's default
    if window != W:
        kw["locret_policy"] = f"snapkv:window={window}"
    llm = make(model_path, **kw)
    ctx = llm._ctx.ctx
    n_layer, n_head_kv, d = shape(llm)
    d_model = llama_cpp.llama_model_n_head(llm._model.model) * d  # a query row: every query head's
    if window == W:
        assert len(eviction.read_query(ctx, 0)[0]) == (Q + W) * d_model
    ref = SnapKV(n_layer, n_head_kv, d, pool, window=window)
    stats = llm.locret_stats()
    assert stats["policy"] == "snapkv" and stats["stabilizers"] == NS
    assert f"window={window}" in stats["policy_settings"].split(","), stats["policy_settings"]

    # a prompt in 8 ubatches and a short last part (the window is its 20 tokens), generation, a second prompt
    body = prompt_tokens[:8 * UB + 20]
    calls = [(body[i:i + UB], i + UB >= len(body)) for i in range(0, len(body), UB)]
    calls += [([t], True) for t in prompt_tokens[700:800]]
    calls += [(prompt_tokens[900 + i:900 + i + UB], i == 2 * UB) for i in range(0, 3 * UB, UB)]
    n_past = 0
    for tokens, output in calls:
        n_past, queries = step(llm, ref, tokens, output, n_past, d_model)
        if queries is not None:
            assert all(scale == pytest.approx(1 / np.sqrt(d)) for _, scale in queries)
        for il in range(n_layer):
            for h in range(n_head_kv):
                assert llm.locret_retained(il, h).tolist() == ref.units[il][h], f"layer {il} head {h} at {n_past}"

    assert ref.evictions >= 10 and ref.checked == ref.evictions * n_layer * n_head_kv * B
    # the scoring graph is queued before the selection: one wait for the backend per eviction, as for the heads
    assert llm.locret_stats()["n_host_syncs"] == ref.evictions
    assert ref.near_ties <= 0.02 * ref.evictions * n_layer * n_head_kv, ref.near_ties
    # query-aware: the heads keep different units, and not just the newest
    held = {tuple(llm.locret_retained(il, h).tolist()) for il in range(n_layer) for h in range(n_head_kv)}
    assert len(held) > 10
    assert min(min(u) for u in held) < 700
    llm.close()


def test_the_window_holds_the_last_parts_last_queries(model_path, prompt_tokens):
    # the same tokens at the same positions in a 64-token part and in two parts: the window rows agree. Without flash
    # attention: the CPU's flash-attention kernel rounds queries to F16 and tiles by the part's shape, so one part
    # and two parts differ past the bound below in layer 3; the window's bookkeeping checked here is the same either way
    a, b = make(model_path, flash_attn=False), make(model_path, flash_attn=False)
    decode(a, prompt_tokens[:UB], 0, False)
    decode(b, prompt_tokens[:UB - W], 0, False)
    decode(b, prompt_tokens[UB - W:UB], UB - W, False)
    d_model = len(eviction.read_query(a._ctx.ctx, 0)[0]) // (Q + W)
    qa, qb = (read_queries(x._ctx.ctx, 3, d_model)[0][Q:] for x in (a, b))  # the window's rows (no pinned question)
    assert np.abs(qa).max() > 0.1
    np.testing.assert_allclose(qa, qb, rtol=0, atol=2e-3 * np.abs(qa).max())
    # a short part fills the newest rows: 5 new rows at the end, the older ones as they were
    decode(b, prompt_tokens[UB:UB + 5], UB, False)
    qc = read_queries(b._ctx.ctx, 3, d_model)[0][Q:]
    np.testing.assert_array_equal(qc[:W - 5], qb[:W - 5])
    assert np.abs(qc[W - 5:] - qb[W - 5:]).max() > 0.1 * np.abs(qa).max()
    a.close()
    b.close()


def test_a_pinned_question_is_the_window_read_after_the_cache(model_path, prompt_tokens):
    # Locret-Q with SnapKV: the pinned prefix's last queries (here all 40 pinned tokens) are captured when read and
    # score every eviction, re-rotated from their positions to right after the cache and reading every unit; the
    # pinned units and the plan's stabilizers are kept, no window. numpy: the same scores from the captured rows,
    # rotated by llama.cpp's RoPE in float64, and the kept sets, over a prompt of 8 ubatches and generation
    from test_eviction import rope_norm

    n_pin = 40
    llm = make(model_path)
    ctx = llm._ctx.ctx
    n_layer, n_head_kv, d = shape(llm)
    d_model = len(eviction.read_query(ctx, 0)[0]) // (Q + W)
    base = float(llm.metadata["llama.rope.freq_base"])
    llm.locret_pin_query(n_pin)
    ref = SnapKV(n_layer, n_head_kv, d, POOL, pinned=n_pin, rtol=1e-3)
    captured = {}

    def question(il, n_used):
        rows = captured[il][Q - n_pin:Q]                     # the pinned positions 0..39, oldest first
        heads = rows.reshape(-1, d)                          # [n_pin * n_head, d]
        delta = np.full(len(heads), n_used - 0)              # from position t to n_used + t
        return rope_norm(heads, delta, base, d).reshape(rows.shape)

    body = prompt_tokens[:8 * UB + 20]
    calls = [(body[i:i + UB], i + UB >= len(body)) for i in range(0, len(body), UB)]
    calls += [([t], True) for t in prompt_tokens[700:760]]
    n_past = 0
    for tokens, output in calls:
        # the question's rows as read before the call (`question` reads them when the eviction is checked)
        planned = ref.plan(len(tokens), output)
        if planned is not None:
            captured = {il: read_queries(ctx, il, d_model)[0] for il in range(n_layer)}
        n_past, _ = step(llm, ref, tokens, output, n_past, d_model, question=question)
        for il in range(n_layer):
            for h in range(n_head_kv):
                assert llm.locret_retained(il, h).tolist() == ref.units[il][h], f"layer {il} head {h} at {n_past}"
    assert ref.evictions >= 7 and ref.near_ties <= 0.02 * ref.evictions * n_layer * n_head_kv, ref.near_ties
    # the rows were captured once, when the pinned tokens were read: later parts left them as they were
    q_now = read_queries(ctx, 5, d_model)[0][Q - n_pin:Q]
    np.testing.assert_array_equal(q_now, captured[5][Q - n_pin:Q])
    assert np.abs(q_now).max() > 0.1 and not np.abs(read_queries(ctx, 5, d_model)[0][:Q - n_pin]).any()
    # the question decides: without the pin the same prompt keeps other units
    plain = make(model_path)
    n = 0
    for tokens, output in calls:
        n = decode(plain, tokens, n, output)
    differs = sum(plain.locret_retained(il, h).tolist()[n_pin:] != ref.units[il][h][n_pin:]
                  for il in range(n_layer) for h in range(n_head_kv))
    assert differs > n_layer * n_head_kv // 2, differs
    plain.close()
    llm.close()


def test_snapkv_settings_are_checked(model_path):
    for kw, msg in ((dict(locret_budget=W), "must be larger than its observation window"),
                    (dict(locret_budget=16, locret_stabilizers=8, locret_policy="snapkv:window=16"),
                     "must be larger than its observation window"),
                    (dict(locret_pool=4), "must be odd"),
                    (dict(locret_policy="snapkv:lag=16"), "policy snapkv has no setting 'lag'"),
                    (dict(locret_policy="snapkv:window=0"), r"snapkv:window .*\(got '0'\)"),
                    (dict(locret_policy="snapkv:window=16,window=8"), "snapkv:window is given twice"),
                    (dict(locret_policy="snapkv:pool=4"), "snapkv:pool must be odd"),
                    (dict(locret_policy="snapkv:pool=3", locret_pool=3), "snapkv:pool and --locret-pool both set"),
                    (dict(locret_budget_schedule="pyramid"), "not snapkv")):
        with pytest.raises((HeadsError, ValueError), match=msg):
            make(model_path, **kw)
    # the window the budget must exceed is the policy's setting: a window of 16 fits where the default does not
    make(model_path, locret_budget=W, locret_policy="snapkv:window=16").close()
    # the settings' defaults are the constants this file's model takes
    settings_help = eviction.policy_settings_help("snapkv")
    for key, default in (("window", W), ("question", Q), ("pool", POOL)):
        assert f"{key}=" in settings_help and f"default {default}" in settings_help, settings_help
    llm = make(model_path, locret_policy="snapkv:pool=3")  # the pooling window as a setting of the policy
    assert llm.locret_stats()["pool"] == 3
    llm.close()
    llm = make(model_path)
    assert llm.locret_stats()["pool"] == POOL
    assert {f"window={W}", f"question={Q}"} <= set(llm.locret_stats()["policy_settings"].split(","))
    with pytest.raises(HeadsError, match="leaves no room in the budget"):
        llm.locret_pin_query(B - NS - (W - NS))
    llm.locret_pin_query(8)
    llm.close()


def test_a_snapkv_state_resumes_exactly(model_path, prompt_tokens):
    from test_state_files import refusal_of

    # saved after a part whose window the next eviction reads: the window's queries must come back
    a = make(model_path)
    n_past = 0
    for i in range(0, 3 * UB, UB):
        n_past = decode(a, prompt_tokens[i:i + UB], n_past, False)
    data = bytes(a.save_state().llama_state)
    n_end = decode(a, prompt_tokens[3 * UB:3 * UB + 40], n_past, True)
    assert a.locret_stats()["n_evictions"] == 1
    want_held, want_logits = all_held(a), last_logits(a)
    a.close()

    assert_resumes_exactly(make(model_path), data, prompt_tokens[3 * UB:3 * UB + 40], n_past, n_end, want_held,
                           want_logits)

    # other pooling would rank the units on another scale: refused, never mixed
    c = make(model_path, locret_pool=3)
    refused = refusal_of(c, data)
    assert "pooled over 5 tokens" in refused, refused
    c.close()
    # another observation window would score by other queries: refused, naming the settings
    c = make(model_path, locret_policy="snapkv:window=16")
    refused = refusal_of(c, data)
    assert re.search(r"Locret: the saved state was made with policy settings \S*window=32\S*, this context's are "
                     r"\S*window=16", refused), refused
    c.close()

    # the same state as a build before state version 9 wrote it (no settings block: SnapKV's were its defaults)
    # resumes under the defaults, and is refused under another window, whose query rows it does not hold
    old = _as_state_version_8(data)
    assert_resumes_exactly(make(model_path), old, prompt_tokens[3 * UB:3 * UB + 40], n_past, n_end, want_held,
                           want_logits)
    c = make(model_path, locret_policy="snapkv:window=16")
    refused = refusal_of(c, old)
    assert re.search(r"made with policy settings window=32,question=64,pool=5, this context's are window=16", refused), \
        refused
    c.close()


def _as_state_version_8(data: bytes) -> bytes:
    """A version-10 context state of a one-sequence SnapKV context without a budget schedule, rewritten as version 8
    wrote it: the Locret header (magic "LRCT", version, ...; 40 bytes), the schedule count (0), the positions (2
    words), then, since version 9, the policy's settings (layout version, count, values), which are cut out, then the
    sequence's meta part, whose eighth word (since version 10: told a long prompt, 0 here) is cut out too."""
    at = data.find(b"LRCT")
    assert at >= 0 and data.find(b"LRCT", at + 1) < 0
    version, = struct.unpack_from("<I", data, at + 4)
    n_streams, = struct.unpack_from("<I", data, at + 24)
    n_sched, = struct.unpack_from("<I", data, at + 40)
    layout, n_values = struct.unpack_from("<II", data, at + 52)
    assert (version, n_streams, n_sched, layout, n_values) == (10, 1, 0, 1, 3)
    settings_end = at + 60 + 4 * n_values
    long_prompt = settings_end + 7 * 4
    assert struct.unpack_from("<I", data, long_prompt) == (0,)
    return data[:at + 4] + struct.pack("<I", 8) + data[at + 8:at + 52] + data[settings_end:long_prompt] + \
        data[long_prompt + 4:]


def test_tools_evict_with_snapkv(model_path, tmp_path):
    text = natural_text()[:2400]
    base = [tool("llama-completion"), "-m", model_path, "-c", "1024", "-b", "512", "-ub", "64", "-p", text, "-n", "8",
            "-no-cnv", "--temp", "0", "-t", "1", "-lv", "4"]
    proc = run(base + ["--locret-policy", "snapkv", "--locret-budget", "128", "-v"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"Locret eviction: policy snapkv \(selection on the host\), budget 128, stabilizers \d+, local \d+, "
                     r"score pooling 5, observation window 32", proc.stderr), proc.stderr[-3000:]
    assert re.search(r"Locret eviction 3 of sequence 0: 192 -> 128 units per head \(\d+ stabilizers\)", proc.stderr)
    proc = run(base + ["--locret-policy", "snapkv", "--locret-budget", "32"], timeout=120)
    assert proc.returncode == 1 and "larger than its observation window" in proc.stderr, proc.stderr[-2000:]

    bench = [tool("llama-bench"), "-m", model_path, "-p", "256", "-n", "32", "-r", "1", "-t", "1", "-ub", "64",
             "-b", "256", "--locret-budget", "128", "--locret-policy", "snapkv", "-o", "json"]
    proc = run(bench, timeout=300)
    assert proc.returncode == 0 and '"avg_ts"' in proc.stdout, proc.stderr[-2000:]

    port = free_port()
    cmd = [tool("llama-server"), "-m", model_path, "--port", port, "-c", "1024", "-ub", "64", "-b", "512", "-t", "1",
           "-np", "1", "--locret-budget", "128", "--locret-policy", "snapkv", "-lv", "4"]
    with http_server(cmd, tmp_path / "server.log", port) as url:
        reply = post_json(url + "/completion", {"prompt": text, "n_predict": 4, "temperature": 0})
        assert reply["tokens_evaluated"] > 256 and reply["content"], reply
    log = (tmp_path / "server.log").read_text()
    assert "Locret eviction: policy snapkv" in log and "observation window 32" in log, log[-2000:]
