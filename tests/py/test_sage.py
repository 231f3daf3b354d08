"""SAGE-KV (--locret-policy sage): one selection per prompt by the attention of its last token, checked against numpy.

The engine reads a prompt whole (no eviction while it is read), captures the post-RoPE query of the last token of
every ubatch, and at the first ubatch after a prompt's end scores every cached unit with that query in a graph:
softmax over the units of scale * q.k per query head, the largest over each KV head's group of query heads. It keeps
b/4 sinks, b/4 recent units and the best b/2 of the rest per (layer, KV head); later evictions keep that set and
slide the recent window. `Sage` below is an independent model of all of it: when the engine evicts, the scores in
float64 numpy from the query and K cache read back before the call, and the kept sets. Every llama_decode call here
is one ubatch, so what is read before a call is exactly what its eviction scores.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
import llama_cpp
from locret import eviction
from locret.heads import HeadsError, _last_error
from locret.llama import Llama

from conftest import natural_text, run, tool
from test_eviction import decode, last_logits, prompt_tokens  # noqa: F401 (shared fixture)

B, UB = 128, 64
SINKS, RECENT = B // 4, B // 4   # LLAMA_LOCRET_SAGE_SINK_DIV, LLAMA_LOCRET_SAGE_RECENT_DIV


def sage_scores(k: np.ndarray, q: np.ndarray, scale: float, n_head_kv: int, d: int) -> np.ndarray:
    """The paper's attention of the last token over the units, per KV head: k [n, n_head_kv*d] (the cache as
    stored), q [n_head*d]. Query head h reads KV head h // G. The CPU multiplies an F16 cache by the query rounded to
    F16, so the model rounds it the same way. Returns [n, n_head_kv]: the largest probability over each group."""
    n_head = q.size // d
    group = n_head // n_head_kv
    q = q.astype(np.float16).astype(np.float64).reshape(n_head, d)
    k = k.astype(np.float64)
    out = np.zeros((k.shape[0], n_head_kv))
    for h in range(n_head):
        kv = h // group
        logits = scale * (k[:, kv * d:(kv + 1) * d] @ q[h])
        p = np.exp(logits - logits.max())
        out[:, kv] = np.maximum(out[:, kv], p / p.sum())
    return out


class Sage:
    """Per (layer, KV head) the logical positions held, in cell order; the sequence's chosen-set boundary."""

    def __init__(self, n_layer, n_head_kv, d):
        self.units = [[[] for _ in range(n_head_kv)] for _ in range(n_layer)]
        self.scores = {}  # (layer, head, logical position) -> the model's score at the last selection
        self.n_layer, self.n_head_kv, self.d = n_layer, n_head_kv, d
        self.scored_to, self.fresh, self.prev_output = 0, False, True
        self.selections, self.slides, self.near_ties = 0, 0, 0

    def n_used(self):
        return len(self.units[0][0])

    def plan(self, n_tokens):
        """n_keep of the eviction before a part of n_tokens, or None (the engine's plan_eviction)."""
        n_used = self.n_used()
        if not self.prev_output:
            return None
        if (self.fresh or n_used + n_tokens > B + UB) and n_used > B:
            return B
        return None

    def score(self, k_cache, queries):
        n_used = self.n_used()
        for il in range(self.n_layer):
            q, scale = queries[il]
            s = sage_scores(k_cache[il][:n_used], q, scale, self.n_head_kv, self.d)
            for h in range(self.n_head_kv):
                for c, p in enumerate(self.units[il][h]):
                    self.scores[(il, h, p)] = s[c, h]

    def evict(self, n_keep, engine_held):
        n_used = self.n_used()
        if self.fresh:
            n_pin, n_stab = SINKS, RECENT
            self.selections += 1
        else:
            n_pin = min(self.scored_to, n_keep)
            n_stab = n_keep - n_pin
            self.slides += 1
        n_top = n_keep - n_pin - n_stab
        for il in range(self.n_layer):
            for h in range(self.n_head_kv):
                units = self.units[il][h]
                cand = np.arange(n_pin, n_used - n_stab)
                chosen = []
                if n_top:
                    s = np.array([self.scores[(il, h, units[c])] for c in cand])
                    order = cand[np.lexsort((cand, -s))]
                    chosen = sorted(order[:n_top].tolist())
                keep = list(range(n_pin)) + chosen + list(range(n_used - n_stab, n_used))
                want = [units[c] for c in keep]
                got = engine_held(il, h)[:n_keep]
                if got != want:
                    # only at the cut, within the float32 rounding of the engine's probabilities
                    assert n_top, f"layer {il} head {h}: a slide kept other units than the chosen set and the newest"
                    cut = self.scores[(il, h, units[order[n_top - 1]])]
                    for p in set(got) ^ set(want):
                        assert abs(self.scores[(il, h, p)] - cut) <= 1e-4 * cut + 1e-7, \
                            f"layer {il} head {h}: position {p} kept/evicted against the model, far from the cut"
                    self.near_ties += 1
                    want = got
                self.units[il][h] = want
        if self.fresh:
            self.scored_to, self.fresh = n_keep - n_stab, False

    def place(self, positions, output):
        prompt_end = output and (len(positions) > 1 or not self.prev_output)
        for layer in self.units:
            for units in layer:
                units.extend(positions)
        self.prev_output = output
        if prompt_end:
            self.fresh = self.n_used() > B
            if not self.fresh:
                self.scored_to = self.n_used() - min(RECENT, self.n_used())


def make(model_path, **kw):
    args = dict(n_ctx=2048, n_batch=UB, n_ubatch=UB, locret_budget=B, locret_policy="sage", verbose=False, seed=1,
                n_threads=1, n_threads_batch=1)
    args.update(kw)
    return Llama(model_path=str(model_path), **args)


def shape(llm):
    model = llm._model.model
    n_layer, n_head_kv = llama_cpp.llama_model_n_layer(model), llama_cpp.llama_model_n_head_kv(model)
    return n_layer, n_head_kv, llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)


def all_held(llm):
    """Every (layer, KV head)'s retained logical positions."""
    n_layer, n_head_kv, _ = shape(llm)
    return [llm.locret_retained(il, h).tolist() for il in range(n_layer) for h in range(n_head_kv)]


def assert_resumes_exactly(llm, data, tokens, n_past, n_end, want_held, want_logits):
    """A fresh context `llm` loads a saved state, decodes `tokens` after it, and then holds the same units in every
    (layer, KV head) and gives the same logits as the context that saved it did; closes `llm`."""
    from test_state_files import load_bytes

    assert load_bytes(llm, data) > 0
    assert decode(llm, tokens, n_past, True) == n_end
    assert all_held(llm) == want_held
    np.testing.assert_allclose(last_logits(llm), want_logits, rtol=0, atol=1e-4 * np.abs(want_logits).max())
    llm.close()


def prompt_calls(tokens, end_alone=True):
    """A prompt in ubatches without outputs, its last token alone asking for one."""
    body = tokens[:-1] if end_alone else tokens
    calls = [(body[i:i + UB], False) for i in range(0, len(body), UB)]
    return calls + [(tokens[-1:], True)]


@pytest.mark.parametrize("select,flash_attn", [("host", False), ("graph", True)])
def test_sage_scores_and_retained_sets_match_numpy(select, flash_attn, model_path, prompt_tokens, monkeypatch):
    # host: the host selects from the store (the CPU default); graph: the device's selection graph (a GPU's default)
    monkeypatch.setenv("LOCRET_DEBUG_SELECT", select)
    llm = make(model_path, flash_attn=flash_attn)
    ctx = llm._ctx.ctx
    n_layer, n_head_kv, d = shape(llm)
    ref = Sage(n_layer, n_head_kv, d)

    # a prompt of 11 ubatches, generation past several slides, a second prompt (a new user turn) and generation
    calls = prompt_calls(prompt_tokens[:11 * UB + 1])
    calls += [([t], True) for t in prompt_tokens[800:1000]]
    calls += prompt_calls(prompt_tokens[1100:1100 + 3 * UB + 1])
    calls += [([t], True) for t in prompt_tokens[1400:1420]]

    n_past, n_checked, n_evictions = 0, 0, 0
    for tokens, output in calls:
        n_keep = ref.plan(len(tokens))
        was_fresh = ref.fresh
        if n_keep is not None and was_fresh:
            k = [eviction.read_kv(ctx, il, ref.n_used(), width=n_head_kv * d) for il in range(n_layer)]
            queries = [eviction.read_query(ctx, il) for il in range(n_layer)]
            assert all(scale == pytest.approx(1 / np.sqrt(d)) for _, scale in queries)
            ref.score(k, queries)
        n_past = decode(llm, tokens, n_past, output)
        if n_keep is not None:
            ref.evict(n_keep, lambda il, h: llm.locret_retained(il, h).tolist())
            n_evictions += 1
            if was_fresh:
                # the stored scores moved with their units: every kept cell holds its unit's score
                for il in range(n_layer):
                    got = eviction.read_scores(ctx, il, n_keep, n_head_kv=n_head_kv)
                    for h in range(n_head_kv):
                        want = [ref.scores[(il, h, p)] for p in ref.units[il][h][:n_keep]]
                        np.testing.assert_allclose(got[:, h], want, rtol=1e-4, atol=1e-7,
                                                   err_msg=f"layer {il} head {h} after position {n_past}")
                        n_checked += n_keep
        ref.place(list(range(n_past - len(tokens), n_past)), output)
        for il in range(n_layer):
            for h in range(n_head_kv):
                assert llm.locret_retained(il, h).tolist() == ref.units[il][h], f"layer {il} head {h} at {n_past}"

    stats = llm.locret_stats()
    assert stats["policy"] == "sage" and stats["budget"] == B and stats["stabilizers"] == RECENT
    assert stats["n_evictions"] == n_evictions and ref.selections == 2 and ref.slides >= 3, (ref.selections, ref.slides)
    assert stats["n_host_syncs"] == n_evictions  # one wait per eviction, selections and slides alike
    assert n_checked == 2 * n_layer * n_head_kv * B
    assert ref.near_ties <= 0.02 * ref.selections * n_layer * n_head_kv, ref.near_ties
    # the sinks survive, and the heads chose differently
    assert all(llm.locret_retained(il, h)[:SINKS].tolist() == list(range(SINKS))
               for il in range(n_layer) for h in range(n_head_kv))
    assert len({tuple(llm.locret_retained(il, h).tolist()) for il in range(n_layer) for h in range(n_head_kv)}) > 10


def test_model_scores_are_the_max_over_each_kv_heads_group():
    # 4 query heads on 2 KV heads (G = 2), d = 2: head h reads KV head h // 2
    k = np.array([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    q = np.array([2.0, 0.0, 0.0, 2.0, 0.0, 0.0, 1.0, 0.0])
    got = sage_scores(k, q, 0.5, 2, 2)

    def softmax(x):
        return np.exp(x) / np.exp(x).sum()

    head0 = softmax(0.5 * np.array([2.0, 0.0, 2.0]))   # KV head 0's columns [1,0],[0,1],[1,1] against q0 = (2, 0)
    head1 = softmax(0.5 * np.array([0.0, 2.0, 2.0]))   # against q1 = (0, 2)
    head2 = softmax(np.zeros(3))                        # KV head 1 against q2 = (0, 0)
    head3 = softmax(0.5 * np.array([0.0, 1.0, 0.0]))   # columns [0,1],[1,0],[0,0] against q3 = (1, 0)
    np.testing.assert_allclose(got[:, 0], np.maximum(head0, head1))
    np.testing.assert_allclose(got[:, 1], np.maximum(head2, head3))


def test_the_captured_query_is_the_last_tokens_whatever_its_ubatch(model_path, prompt_tokens):
    # a: the prompt's last token ends a 5-token ubatch; b: it comes alone. Both must hold its query (same token, same
    # position), and before it a's store held another token's
    tokens = prompt_tokens[:3 * UB + 5]
    a, b = make(model_path), make(model_path)
    n_a = 0
    for i in range(0, 3 * UB, UB):
        n_a = decode(a, tokens[i:i + UB], n_a, False)
    q_before, _ = eviction.read_query(a._ctx.ctx, 5)
    n_a = decode(a, tokens[3 * UB:], n_a, True)
    n_b = 0
    for tok, out in prompt_calls(tokens):
        n_b = decode(b, tok, n_b, out)
    assert n_a == n_b == len(tokens)
    qa, _ = eviction.read_query(a._ctx.ctx, 5)
    qb, _ = eviction.read_query(b._ctx.ctx, 5)
    assert np.abs(qb).max() > 0.1
    np.testing.assert_allclose(qa, qb, rtol=0, atol=2e-3 * np.abs(qb).max())
    assert np.abs(q_before - qb).max() > 0.1 * np.abs(qb).max()
    a.close()
    b.close()


def test_sage_settings_are_checked(model_path):
    for kw, msg in ((dict(locret_stabilizers=16), "--locret-stabilizers and --locret-local do not apply"),
                    (dict(locret_local=8), "--locret-stabilizers and --locret-local do not apply"),
                    (dict(locret_policy="sage:lag=16"), re.escape("policy sage has no settings (got 'lag=16')")),
                    (dict(locret_pool=5), "policy sage has none"),
                    (dict(locret_budget=4), "must be at least 8 units"),
                    (dict(n_ctx=256, locret_budget=240), r"the context per sequence \(\d+\) must be larger than the budget plus the ubatch"),
                    (dict(locret_policy="sag"), "unknown Locret policy 'sag'")):
        with pytest.raises((HeadsError, ValueError), match=msg):
            make(model_path, **kw)
    llm = make(model_path)
    with pytest.raises(HeadsError, match="a pinned query \\(Locret-Q\\) does not apply"):
        llm.locret_pin_query(10)


def test_a_prompt_longer_than_the_context_is_refused(model_path, prompt_tokens):
    llm = make(model_path, n_ctx=512)
    n_past = 0
    with pytest.raises(AssertionError, match="llama_decode returned"):
        for tokens, output in prompt_calls(prompt_tokens[:9 * UB + 1]):
            n_past = decode(llm, tokens, n_past, output)
    assert "policy sage: the policy keeps the whole prompt until its end" in _last_error()
    assert n_past == 8 * UB  # the ubatches that fit were kept
    assert llm.locret_stats()["n_evictions"] == 0


def test_tools_evict_with_sage(model_path):
    base = [tool("llama-completion"), "-m", model_path, "-c", "1024", "-b", "512", "-ub", "64",
            "-p", natural_text()[:2400], "-n", "8", "-no-cnv", "--temp", "0", "-t", "1", "-lv", "4"]
    proc = run(base + ["--locret-policy", "sage", "--locret-budget", "128", "-v"], timeout=180)  # -v: evictions
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"Locret eviction: policy sage \(selection on the host\), budget 128, stabilizers 32, local 0, "
                     r"32 sinks and 32 recent units", proc.stderr), proc.stderr[-3000:]
    # the cache is sized for the context, the prompt read whole, then one selection down to the budget
    assert re.search(r"llama_kv_cache: size = +[\d.]+ MiB \( +1024 cells", proc.stderr), proc.stderr[-3000:]
    n_prompt = int(re.search(r"prompt eval time = +[\d.]+ ms / +(\d+) tokens", proc.stderr).group(1))
    assert n_prompt > 256
    assert re.search(rf"Locret eviction 1 of sequence 0: {n_prompt} -> 128 units per head \(32 stabilizers\)",
                     proc.stderr), proc.stderr[-3000:]
    for bad, msg in ((["--locret-budget", "128", "--locret-policy", "sage", "--locret-stabilizers", "8"],
                      "do not apply to it"),
                     (["--locret-budget", "128", "--locret-policy", "sage", "-c", "512", "-ub", "512"],
                      "must be larger than the budget plus the ubatch")):
        proc = run(base + bad, timeout=120)
        assert proc.returncode == 1 and msg in proc.stderr, (bad, proc.stderr[-2000:])
    # llama-bench: a prompt read whole, then generation that selects once and slides
    bench = [tool("llama-bench"), "-m", model_path, "-p", "512", "-n", "96", "-r", "1", "-t", "1", "-ub", "64",
             "-b", "512", "--locret-budget", "128", "--locret-policy", "sage", "-o", "json"]
    proc = run(bench, timeout=300)
    assert proc.returncode == 0 and '"avg_ts"' in proc.stdout, proc.stderr[-2000:]
    proc = run(bench + ["--locret-stabilizers", "8"], timeout=120)
    assert proc.returncode == 1 and "do not apply to it" in proc.stderr, proc.stderr[-2000:]


def test_a_sage_state_resumes_exactly(model_path, prompt_tokens):
    from test_state_files import refusal_of

    # saved between the prompt's end and its selection: the pending selection and its query must come back
    a = make(model_path)
    n_past = 0
    for tokens, output in prompt_calls(prompt_tokens[:6 * UB + 1]):
        n_past = decode(a, tokens, n_past, output)
    data = bytes(a.save_state().llama_state)
    n_end = decode(a, prompt_tokens[900:901], n_past, True)
    assert a.locret_stats()["n_evictions"] == 1
    want_held, want_logits = all_held(a), last_logits(a)
    a.close()

    assert_resumes_exactly(make(model_path), data, prompt_tokens[900:901], n_past, n_end, want_held, want_logits)

    # another budget would choose another set from the same query: refused, never mixed
    c = make(model_path, locret_budget=96)
    refused = refusal_of(c, data)
    assert "made with another model or budget" in refused, refused
    c.close()


def test_sage_scoring_stays_within_the_buffers_reserved_at_creation(model_path, prompt_tokens):
    # the scoring graph grows with the cells (the whole prompt): it was reserved for a full cache at creation
    llm = make(model_path, n_ctx=2048, n_batch=256, n_ubatch=256)
    before = eviction.compute_buffers(llm._ctx.ctx)
    n_past = 0
    body = prompt_tokens[:1400]
    for i in range(0, len(body) - 1, 256):
        n_past = decode(llm, body[i:min(i + 256, len(body) - 1)], n_past, False)
    n_past = decode(llm, body[-1:], n_past, True)
    decode(llm, prompt_tokens[1400:1401], n_past, True)
    assert llm.locret_stats()["n_evictions"] == 1
    assert eviction.compute_buffers(llm._ctx.ctx) == before


def test_sequences_select_on_their_own_in_a_shared_context(model_path, prompt_tokens):
    # two sequences in one context (the server's slots): prompts in mixed batches, then generation one token per
    # sequence in one ubatch, which captures both sequences' queries at once. Each sequence must choose exactly what
    # a context holding it alone chooses from the same tokens: its own query, its own cache.
    from test_sequences import decode_batch

    prompts = [prompt_tokens[:5 * UB + 17], prompt_tokens[300:300 + 7 * UB + 3]]
    gen = [prompt_tokens[1000:1100], prompt_tokens[1200:1300]]
    shared = make(model_path, n_seq_max=2, n_ctx=2 * 1024, n_batch=2 * UB)
    used = [0, 0]
    while any(used[s] < len(prompts[s]) for s in range(2)):
        parts = []
        for s in range(2):
            take = min(UB, len(prompts[s]) - used[s])
            if take > 0:
                parts.append((s, prompts[s][used[s]:used[s] + take], used[s], used[s] + take == len(prompts[s])))
                used[s] += take
        decode_batch(shared, parts)
    for g in range(100):
        decode_batch(shared, [(s, [gen[s][g]], len(prompts[s]) + g, True) for s in range(2)])

    n_layer, n_head_kv, _ = shape(shared)
    for s in range(2):
        alone = make(model_path, n_ctx=1024)
        n_past = 0
        for i in range(0, len(prompts[s]), UB):
            chunk = prompts[s][i:i + UB]
            n_past = decode(alone, chunk, n_past, i + len(chunk) == len(prompts[s]))
        for g in range(100):
            n_past = decode(alone, [gen[s][g]], n_past, True)
        st_shared, st_alone = eviction.stats(shared._ctx.ctx, s), \
            alone.locret_stats()
        assert st_shared["n_evictions"] == st_alone["n_evictions"] >= 2
        for il in range(n_layer):
            for h in range(n_head_kv):
                assert eviction.retained(shared._ctx.ctx, il, h, s).tolist() == \
                    alone.locret_retained(il, h).tolist(), f"sequence {s} layer {il} head {h}"
        alone.close()
    shared.close()


def test_a_prompt_cut_back_within_the_budget_is_kept_whole(model_path, prompt_tokens):
    # a prompt's end asks for a selection; the client then removes its tail (a server reusing part of a prompt)
    # so that what is left fits the budget: no selection with the stale query, and what is left stays like a prompt
    # within the budget (all but the recent window kept, generation sliding after it)
    llm = make(model_path)
    n_past = 0
    for tokens, output in prompt_calls(prompt_tokens[:5 * UB + 1]):
        n_past = decode(llm, tokens, n_past, output)
    assert llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm._ctx.ctx), 0, 100, -1)
    n_past = 100
    for t in prompt_tokens[800:900]:
        n_past = decode(llm, [t], n_past, True)
    assert llm.locret_stats()["n_evictions"] == 1   # one slide, no selection
    kept = list(range(100 - RECENT))
    n_layer, n_head_kv, _ = shape(llm)
    for il in range(n_layer):
        for h in range(n_head_kv):
            held = llm.locret_retained(il, h).tolist()
            assert held[:len(kept)] == kept and held[len(kept):] == list(range(n_past - (len(held) - len(kept)), n_past))
