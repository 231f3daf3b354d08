"""LagKV (--locret-policy lagkv): attention-free scores from the cache itself, checked against numpy.

The engine scores a partition of `lag` units (the policy's setting, --locret-policy lagkv:lag=N) against the next
partition's per-channel min/max of K and V, in a graph over the cache, at eviction time. Here every llama_decode
call is one ubatch, so the K/V cache read back before a call is exactly what that call's eviction scores. `LagKV` below is an independent model of the whole
policy: which cells get scored when (sinks, pinned query, partitions with a complete successor), the paper's formula
in float64 numpy, and the selection (sinks and unscored tail kept, top-b of the rest). It checks the engine's stored
scores against its own after every eviction, and the retained sets against its selection.

Small settings as in test_eviction.py, one thread.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
import llama_cpp
from locret import eviction
from locret.heads import HeadsError
from locret.llama import Llama

from conftest import natural_text, run, tool
from test_eviction import decode, prompt_tokens  # noqa: F401 (shared fixture)

B, UB, NS, NLOC, LAG = 128, 64, 16, 8, 16
SINKS = 16      # LLAMA_LOCRET_LAGKV_SINKS
EPS = 1e-6      # LOCRET_LAGKV_EPS: added to the reference partition's range


def lagkv_partition_scores(z: np.ndarray, lag: int) -> np.ndarray:
    """The paper's score of the units of n_part partitions, from z [(n_part + 1) * lag, d] (one KV head's K or
    V, one row per unit): normalize partition p by partition p + 1's per-channel min/max, take the channel-wise
    sample standard deviation, softmax it over the partition. Returns [n_part * lag]."""
    z = np.asarray(z, dtype=np.float64)
    parts = z.reshape(-1, lag, z.shape[1])
    lo, hi = parts.min(axis=1), parts.max(axis=1)                    # [n_part + 1, d]
    norm = (parts[:-1] - lo[1:, None, :]) / (hi[1:, None, :] - lo[1:, None, :] + EPS)
    sd = norm.std(axis=2, ddof=1)                                      # [n_part, lag]
    e = np.exp(sd - sd.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).reshape(-1)


class LagKV:
    """Per (layer, KV head) the logical positions held, in cell order; one scored_to boundary for the sequence."""

    def __init__(self, n_layer, n_head_kv, d, n_pin=0):
        self.units = [[[] for _ in range(n_head_kv)] for _ in range(n_layer)]
        self.scores = {}  # (layer, head, logical position) -> the model's score
        self.n_layer, self.n_head_kv, self.d, self.n_pin = n_layer, n_head_kv, d, n_pin
        self.scored_to = 0
        self.prev_output = True
        self.n_scored = 0      # units the model scored (over layers and heads)
        self.near_ties = 0     # selections where engine and model differed only within float rounding of the cut

    def n_used(self):
        return len(self.units[0][0])

    def pinned_cells(self):
        return sum(1 for p in self.units[0][0] if p < self.n_pin)

    def plan(self, n_tokens, output):
        """(n_keep, n_stab) of the eviction before a part of n_tokens, or None: the engine's plan_eviction."""
        n_used = self.n_used()
        if not self.prev_output and n_used > B:
            return B, (0 if output else min(NS, n_used))
        if n_used + n_tokens > B + UB:
            return min(B, n_used), 0
        return None

    def score(self, k_cache, v_cache):
        """Score the partitions that have a complete successor, from the cache [cells, d*H] as the engine sees it."""
        n_used = self.n_used()
        start = max(self.scored_to, self.pinned_cells(), min(SINKS, n_used))
        n_part = (n_used - start) // LAG if n_used > start else 0
        if n_part < 2:
            self.scored_to = start
            return
        end = start + n_part * LAG
        for il in range(self.n_layer):
            for h in range(self.n_head_kv):
                cols = slice(h * self.d, (h + 1) * self.d)
                s = (lagkv_partition_scores(k_cache[il][start:end, cols], LAG) +
                     lagkv_partition_scores(v_cache[il][start:end, cols], LAG))
                for c, value in zip(range(start, end - LAG), s):
                    self.scores[(il, h, self.units[il][h][c])] = value
                self.n_scored += len(s)
        self.scored_to = start + (n_part - 1) * LAG

    def evict(self, n_keep, n_stab, engine_held):
        """Keep the sinks (and a pinned query), the unscored tail, and the top of the rest by the model's scores.
        Where the engine kept another unit, both must sit at the cut within float rounding (the engine scores in
        float32): the model then follows the engine. engine_held(il, h) -> what the engine holds after the call (the
        kept units, then the call's own)."""
        n_used = self.n_used()
        n_pin = max(self.pinned_cells(), min(SINKS, n_used))
        n_stab = max(n_stab, n_used - self.scored_to)
        assert n_pin + n_stab <= n_keep
        n_top = n_keep - n_pin - n_stab
        for il in range(self.n_layer):
            for h in range(self.n_head_kv):
                units = self.units[il][h]
                cand = np.arange(n_pin, n_used - n_stab)
                s = np.array([self.scores[(il, h, units[c])] for c in cand])
                order = cand[np.lexsort((cand, -s))]
                keep = list(range(n_pin)) + sorted(order[:n_top].tolist()) + list(range(n_used - n_stab, n_used))
                want = [units[c] for c in keep]
                got = engine_held(il, h)[:n_keep]
                if got != want:
                    cut = self.scores[(il, h, units[order[n_top - 1]])]
                    for p in set(got) ^ set(want):
                        assert abs(self.scores[(il, h, p)] - cut) < 1e-5, \
                            f"layer {il} head {h}: position {p} kept/evicted against the model, far from the cut"
                    self.near_ties += 1
                    want = got
                self.units[il][h] = want
        self.scored_to = n_keep - (n_used - self.scored_to)

    def place(self, positions, output):
        for layer in self.units:
            for units in layer:
                units.extend(positions)
        self.prev_output = output


def make(model_path, **kw):
    args = dict(n_ctx=16384, n_batch=UB, n_ubatch=UB, locret_budget=B, locret_stabilizers=NS, locret_local=NLOC,
                locret_policy=f"lagkv:lag={LAG}", verbose=False, seed=1, n_threads=1, n_threads_batch=1)
    args.update(kw)
    return Llama(model_path=str(model_path), **args)


def shape(llm):
    model = llm._model.model
    n_layer, n_head_kv = llama_cpp.llama_model_n_layer(model), llama_cpp.llama_model_n_head_kv(model)
    return n_layer, n_head_kv, llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)


@pytest.mark.parametrize("select,n_pin,flash_attn", [("host", 0, False), ("graph", 0, True), ("graph", 40, False)])
def test_lagkv_scores_and_retained_sets_match_numpy(select, n_pin, flash_attn, model_path, prompt_tokens, monkeypatch):
    # host: the host selects from the store (the CPU default); graph: the device's selection graph (a GPU's
    # default), both here on the CPU; n_pin: a Locret-Q query pinned at the start, longer than the sinks; without
    # flash attention the V cache is transposed (the scoring graph reads it by channel), with it V is stored by cell
    monkeypatch.setenv("LOCRET_DEBUG_SELECT", select)
    llm = make(model_path, flash_attn=flash_attn)
    if n_pin:
        llm.locret_pin_query(n_pin)
    ctx = llm._ctx.ctx
    n_layer, n_head_kv, d = shape(llm)
    width = n_head_kv * d
    ref = LagKV(n_layer, n_head_kv, d, n_pin)

    # a prompt of 11 ubatches without outputs, its last token alone as the prompt end (evicted without stabilizers),
    # then generation one token at a time past a full cache: every call is one ubatch
    prompt = prompt_tokens[:11 * UB + 1]
    calls = [(prompt[i:i + UB], False) for i in range(0, 11 * UB, UB)] + [(prompt[-1:], True)]
    calls += [([t], True) for t in prompt_tokens[800:880]]

    n_past, n_evictions, n_checked = 0, 0, 0
    for tokens, output in calls:
        plan = ref.plan(len(tokens), output)
        if plan is not None:
            n_used = ref.n_used()
            k = [eviction.read_kv(ctx, il, n_used, width=width) for il in range(n_layer)]
            v = [eviction.read_kv(ctx, il, n_used, width=width, values=True) for il in range(n_layer)]
            ref.score(k, v)
        n_past = decode(llm, tokens, n_past, output)
        if plan is not None:
            ref.evict(*plan, lambda il, h: llm.locret_retained(il, h).tolist())
            n_evictions += 1
            # the stored scores of every scored unit kept, cell by cell
            for il in range(n_layer):
                got = eviction.read_scores(ctx, il, ref.scored_to, n_head_kv=n_head_kv)
                for h in range(n_head_kv):
                    held = ref.units[il][h][:ref.scored_to]
                    cells = [c for c, p in enumerate(held) if (il, h, p) in ref.scores]
                    want = np.array([ref.scores[(il, h, held[c])] for c in cells])
                    np.testing.assert_allclose(got[cells, h], want, rtol=1e-4, atol=1e-6,
                                               err_msg=f"layer {il} head {h} after position {n_past}")
                    n_checked += len(cells)
        ref.place(list(range(n_past - len(tokens), n_past)), output)
        for il in range(n_layer):
            for h in range(n_head_kv):
                assert llm.locret_retained(il, h).tolist() == ref.units[il][h], f"layer {il} head {h} at {n_past}"

    stats = llm.locret_stats()
    assert stats["policy"] == "lagkv" and stats["policy_settings"] == f"lag={LAG}" and stats["n_pinned"] == n_pin
    assert n_evictions >= 9 and stats["n_evictions"] == n_evictions
    assert stats["n_host_syncs"] == n_evictions  # the partitions' scoring graph is queued: one wait per eviction
    assert n_checked > 50_000 and ref.n_scored > 50_000
    assert ref.near_ties <= 0.02 * n_evictions * n_layer * n_head_kv, ref.near_ties
    # the sinks (and a pinned query) survive every eviction, and heads keep different units
    first = list(range(max(SINKS, n_pin)))
    assert all(llm.locret_retained(il, h)[:len(first)].tolist() == first
               for il in range(n_layer) for h in range(n_head_kv))
    assert len({tuple(llm.locret_retained(il, h).tolist()) for il in range(n_layer) for h in range(n_head_kv)}) > 10


def test_model_formula_is_the_papers_on_a_hand_example():
    # two partitions of 2 units, d = 3: partition 1 is the reference of partition 0
    z = np.array([[0.0, 1.0, 2.0], [1.0, 1.0, 1.0],      # partition 0 (scored)
                  [0.0, 0.0, 0.0], [2.0, 4.0, 8.0]])     # partition 1: min 0, max (2, 4, 8)
    norm = np.array([[0.0, 0.25, 0.25], [0.5, 0.25, 0.125]])
    sd = norm.std(axis=1, ddof=1)
    want = np.exp(sd) / np.exp(sd).sum()
    np.testing.assert_allclose(lagkv_partition_scores(z, 2), want, rtol=1e-5)


def test_lagkv_settings_are_checked(model_path):
    # the budget must hold the sinks, two partitions and the stabilizers: 16 + 2*48 + 16 = 128
    with pytest.raises(HeadsError, match=r"with LagKV the budget \(128\) must exceed what it keeps unscored: .*"
                                         r"\(lower lagkv:lag or --locret-stabilizers, or raise the budget\)"):
        make(model_path, locret_policy="lagkv:lag=48")
    for bad in ("1", "0", "x", "65537"):
        with pytest.raises(HeadsError, match=re.escape(f"lagkv:lag must be an integer from 2 to 65536 (got '{bad}')")):
            make(model_path, locret_policy=f"lagkv:lag={bad}")
    with pytest.raises(HeadsError, match=re.escape("policy streaming has no settings (got 'lag=16')")):
        make(model_path, locret_policy="streaming:lag=16")
    # (with or without settings: "--locret-policy lagkv needs", "the settings of --locret-policy lagkv need")
    with pytest.raises(HeadsError, match="--locret-policy lagkv need"):
        make(model_path, locret_budget=None, locret_stabilizers=None, locret_local=None)
    # the default lag (128, the paper's) does not fit this budget either
    with pytest.raises(HeadsError, match="2 partitions of 128 units"):
        make(model_path, locret_policy="lagkv")
    # a pinned query must leave room for what LagKV keeps
    llm = make(model_path)
    with pytest.raises(HeadsError, match="LagKV's 16 sinks and 2 partitions of 16"):
        llm.locret_pin_query(70)
    llm.locret_pin_query(60)


def test_tools_evict_with_lagkv(model_path):
    base = [tool("llama-completion"), "-m", model_path, "-c", "4096", "-b", "512", "-ub", "64",
            "-p", natural_text()[:2400], "-n", "4", "-no-cnv", "--temp", "0", "-t", "1", "-lv", "4"]
    proc = run(base + ["--locret-policy", "lagkv:lag=32", "--locret-budget", "192"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"Locret eviction: policy lagkv \(selection on the host\), budget 192, stabilizers \d+, "
                     r"local \d+, lag 32, 16 sinks", proc.stderr), proc.stderr[-3000:]
    n_prompt = re.search(r"prompt eval time = +[\d.]+ ms / +(\d+) tokens", proc.stderr)
    # a cache of 256 cells held a prompt of about 500 tokens: it evicted
    assert re.search(r"llama_kv_cache: size = +[\d.]+ MiB \( +256 cells", proc.stderr), proc.stderr[-3000:]
    assert n_prompt and int(n_prompt.group(1)) > 256, proc.stderr[-3000:]
    for bad, msg in ((["--locret-policy", "lagkv:lag=32"], "--locret-policy lagkv need"),
                     (["--locret-budget", "192", "--locret-policy", "heads:lag=32"],
                      "policy heads has no settings (got 'lag=32')"),
                     (["--locret-budget", "100", "--locret-policy", "lagkv"], "must exceed what it keeps unscored")):
        proc = run(base + bad, timeout=120)
        assert proc.returncode == 1 and msg in proc.stderr, (bad, proc.stderr[-2000:])
    # the settings are checked where the option is read, naming what is wrong; the old option names the new form
    for bad, msg in ((["--locret-budget", "192", "--locret-policy", "lagkv:lags=3"],
                      "policy lagkv has no setting 'lags' (its settings: lag)"),
                     (["--locret-budget", "192", "--locret-policy", "lagkv:lag=32,lag=16"], "lagkv:lag is given twice"),
                     (["--locret-budget", "192", "--locret-policy", "lagkv", "--locret-lag", "32"],
                      "--locret-lag is gone: LagKV's partition is a setting of its policy, --locret-policy lagkv:lag=N")):
        proc = run(base + bad, timeout=120)
        assert proc.returncode != 0 and msg in proc.stderr, (bad, proc.stderr[-2000:])
    proc = run([tool("llama-bench"), "-m", model_path, "-p", "32", "-n", "0", "-r", "1", "--locret-budget", "64",
                "--locret-policy", "lagkv:lag=1"], timeout=120)
    assert proc.returncode == 1 and "lagkv:lag must be an integer from 2 to 65536 (got '1')" in proc.stderr, \
        proc.stderr[-2000:]


def test_a_lagkv_state_resumes_exactly_and_other_settings_are_refused(model_path, prompt_tokens):
    from test_state_files import load_bytes, refusal_of

    def prefill(llm, tokens, n_past):
        for i in range(0, len(tokens), UB):
            n_past = decode(llm, tokens[i:i + UB], n_past, False)
        return n_past

    def all_held(llm):
        n_layer, n_head_kv, _ = shape(llm)
        return [llm.locret_retained(il, h).tolist() for il in range(n_layer) for h in range(n_head_kv)]

    first, then = prompt_tokens[:8 * UB + 24], prompt_tokens[8 * UB + 24:11 * UB + 24]
    a = make(model_path)
    n_past = prefill(a, first, 0)
    assert a.locret_stats()["n_evictions"] >= 5
    data = bytes(a.save_state().llama_state)
    n_end = prefill(a, then, n_past)
    want_held = all_held(a)
    decode(a, prompt_tokens[900:901], n_end, True)
    want_logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(a._ctx.ctx, -1), shape=(a.n_vocab(),)).copy()
    a.close()

    b = make(model_path)
    assert load_bytes(b, data) > 0
    assert prefill(b, then, n_past) == n_end
    assert all_held(b) == want_held  # the LagKV boundary came back with the state: the same partitions were scored
    decode(b, prompt_tokens[900:901], n_end, True)
    got = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(b._ctx.ctx, -1), shape=(b.n_vocab(),))
    np.testing.assert_allclose(got, want_logits, rtol=0, atol=1e-4 * np.abs(want_logits).max())
    b.close()

    for kw, reason in ((dict(locret_policy="lagkv:lag=8"),
                        "Locret: the saved state was made with policy settings lag=16, this context's are lag=8"),
                       (dict(locret_policy="streaming"), "another policy")):
        c = make(model_path, **kw)
        refused = refusal_of(c, data)
        assert reason in refused, refused
        c.close()


def test_lagkv_graphs_stay_within_the_buffers_reserved_at_creation(model_path, prompt_tokens):
    # the scoring graph runs on the eviction scheduler, reserved at creation for the largest one (a full cache): no
    # eviction may grow its buffers. A ubatch far above the budget makes the scoring graph, which grows with the
    # cells, larger than the compaction graph, which grows with the budget: the reservation must be LagKV's (at a
    # ubatch of 1024, 1.50x the reservation of the streaming policy, whose largest graph is the compaction; 2.17x at
    # 2048, which took twice the time).
    kw = dict(n_ctx=8192, n_batch=1024, n_ubatch=1024, locret_budget=64, locret_stabilizers=0)
    streaming = make(model_path, locret_policy="streaming", **kw)
    _, evict_streaming = eviction.compute_buffers(streaming._ctx.ctx)
    streaming.close()
    llm = make(model_path, locret_policy="lagkv:lag=8", **kw)
    before = eviction.compute_buffers(llm._ctx.ctx)
    assert before[1] > 1.3 * evict_streaming, (before, evict_streaming)
    llm.eval((prompt_tokens * 2)[:1076])  # a full ubatch (it evicts), then a short one
    for t in prompt_tokens[700:720]:
        llm.eval([t])
    assert llm.locret_stats()["n_evictions"] >= 2
    assert eviction.compute_buffers(llm._ctx.ctx) == before


def test_bench_measures_lagkv_beside_the_heads(model_path, monkeypatch):
    import bench_eviction  # scripts/, on sys.path through conftest

    commands = []
    real_run = bench_eviction.subprocess.run

    def recording_run(cmd, *args, **kw):
        commands.append(list(cmd))
        return real_run(cmd, *args, **kw)

    monkeypatch.setattr(bench_eviction.subprocess, "run", recording_run)
    args = bench_eviction.parse(["--model", str(model_path), "--budget", "256", "--ubatch", "128",
                                 "--policy-settings", "lagkv:lag=32", "--threads", "1", "--policies", "lagkv"])
    assert args.policy_settings == {"lagkv": "lag=32"}
    bench_eviction.apply_device(args)
    r = bench_eviction.bench(args, locret=True, prompt=1024, gen=0, depth=0, policy="lagkv")
    # (the default lag, 128, does not fit this budget: the settings reached llama-bench)
    assert r["tps"] > 0 and r["eviction_ms"] > 0  # llama-bench evicted: 1024 tokens through 384 cells
    cmd = commands[-1]
    assert cmd[cmd.index("--locret-policy") + 1] == "lagkv:lag=32", cmd
    monkeypatch.undo()
    for argv, msg in ((["--policies", "lagkv,sink"], "unknown policy sink"),
                      (["--policies", "lagkv", "--policy-settings", "lagkv:lags=3"], "'lags'"),
                      (["--policies", "lagkv", "--policy-settings", "snapkv:window=16"],
                       "--policy-settings for snapkv, which --policies does not measure"),
                      (["--policies", "lagkv", "--policy-settings", "lagkv"], "--policy-settings takes NAME:")):
        with pytest.raises(SystemExit, match=re.escape(msg)):
            bench_eviction.sys.argv = ["bench_eviction.py", "--model", str(model_path), *argv]
            bench_eviction.main()
