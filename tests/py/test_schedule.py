"""Budget schedules (--locret-budget-schedule, locret_budget_schedule=): a budget per evicting layer, the same
total as the uniform budget (PyramidKV's pyramid, or a file).

Small settings as in test_eviction.py (b = 96, ubatch 32, n_s = 16, n_loc = 8) so that a few hundred tokens go
through a dozen evictions. The random policy gives each unit a fixed, known score (test_policies.random_scores), so
the engine's kept sets can be compared with an independent numpy model of Algorithm 1 with per-layer budgets.
"""
from __future__ import annotations

import numpy as np
import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
from locret import eviction, heads as heads_api
from locret.heads import HeadsError
from locret.llama import Llama

from conftest import run, tool
from test_eviction import Algorithm1, compact_unless_asked, decode, last_logits, prompt_tokens  # noqa: F401 (shared fixture)
from test_kept_positions import KeptPositions, decode_and_compare
from test_policies import random_table, shape

B, UB, NS, NLOC = 96, 32, 16, 8
BETA = 20  # PyramidKV's


def pyramid(n_layer: int, b: int, n_s: int) -> list[int]:
    """PyramidKV's schedule, written from its paper: the last layer keeps b/beta (here at least n_s + 1), the first
    2b minus that, linear in between; whole units, the remainder of rounding down to the first layers."""
    last = max(b / BETA, n_s + 1)
    first = 2 * b - last
    exact = [first - (first - last) * l / (n_layer - 1) for l in range(n_layer)]
    out = [int(np.floor(v + 1e-9)) for v in exact]
    for l in range(n_layer * b - sum(out)):
        out[l % n_layer] += 1
    return out


def varied(n_layer: int, b: int) -> list[int]:
    """A schedule unlike a pyramid: budgets that go up and down, summing to n_layer * b."""
    out = [b + (37 if l % 3 == 0 else -23 if l % 3 == 1 else -14) for l in range(n_layer)]
    out[-1] += n_layer * b - sum(out)
    return out


class ScheduledAlgorithm1(Algorithm1):
    """Algorithm 1 with a budget per layer, each layer by its own rule: after a prefill chunk a layer holding more
    than its budget evicts to it, and before a generation part a layer it would take past its budget + B does; when
    one layer's rule is due, every layer keeps at most its own budget of the units it holds (its last n_stab as
    stabilizers, the best of the rest by score, ties to the earlier unit), so the largest layer keeps min(b_max, all).
    In prefill that is each layer's rule exactly; in generation a larger layer may evict up to B tokens before its own
    rule would (when the prompt was shorter than its budget)."""

    def __init__(self, n_layer, n_head_kv, layer_b, ub, n_s, n_loc):
        super().__init__(n_layer, n_head_kv, max(layer_b), ub, n_s, n_loc)
        self.layer_b = layer_b
        self.rows = 0  # cells in use: the largest layer's view (what the engine's n_cells_used counts)
        self.post_counts: list[int] = []
        self.n_evictions = 0
        self.n_partial = 0  # evictions that left the largest layer whole (only smaller layers dropped units)

    def evict(self, n_keep, n_stab):
        self.n_partial += n_keep >= self.rows
        for il, layer in enumerate(self.units):
            for h, units in enumerate(layer):
                n = len(units)
                n_live = min(n_keep, self.layer_b[il], n)
                stab = min(n_stab, n)
                cand = np.arange(n - stab)
                scores = np.array([units[i][1] for i in cand], dtype=np.float32)
                order = cand[np.lexsort((cand, -scores))]
                keep = sorted(order[:n_live - stab].tolist()) + list(range(n - stab, n))
                layer[h] = [units[i] for i in keep]
        self.rows = n_keep
        self.post_counts = [len(layer[0]) for layer in self.units]  # what each layer keeps after this eviction
        self.n_evictions += 1

    def over_budget(self):
        return max(len(layer[0]) - b for layer, b in zip(self.units, self.layer_b))

    def place(self, positions, scores_of, is_output):
        over = self.over_budget()
        if not self.prev_output and over > 0:
            self.evict(min(self.b, self.rows), 0 if is_output else min(self.n_s, self.rows))
        elif over + len(positions) > self.ub:
            self.evict(min(self.b, self.rows), 0)
        for il, layer in enumerate(self.units):
            for h, units in enumerate(layer):
                units.extend((int(p), float(scores_of[p][il, h])) for p in positions)
        self.rows += len(positions)
        self.prev_output = is_output


def calls_of(prompt, generated, second):
    """A prompt in ubatches (the last asks for logits), generation one token at a time, a second prompt."""
    calls = [(prompt[i:i + UB], i + UB >= len(prompt)) for i in range(0, len(prompt), UB)]
    calls += [([t], True) for t in generated]
    return calls + [(second[i:i + UB], i + UB >= len(second)) for i in range(0, len(second), UB)]


def place_and_compare(llm, ref, tokens, n_past, output_last, scores_of):
    """Place the call just decoded (ending at n_past) in the model and check every (layer, KV head)'s kept units."""
    first, offset = n_past - len(tokens), 0
    for size in ref.split(len(tokens), output_last):
        ref.place(list(range(first + offset, first + offset + size)), scores_of,
                  output_last and offset + size == len(tokens))
        offset += size
    for il, layer in enumerate(ref.units):
        for h, units in enumerate(layer):
            assert llm.locret_retained(il, h).tolist() == [u[0] for u in units], \
                f"layer {il} head {h} after position {n_past}"


def make(model_path, schedule, policy="random", **kw):
    args = dict(n_ctx=16384, n_batch=UB, n_ubatch=UB, locret_budget=B, locret_stabilizers=NS, locret_local=NLOC,
                locret_policy=policy, locret_budget_schedule=schedule, verbose=False, seed=1, n_threads=1,
                n_threads_batch=1)
    args.update(kw)
    return Llama(model_path=str(model_path), **compact_unless_asked(args))


def schedule_file(tmp_path, budgets, name="schedule.txt"):
    path = tmp_path / name
    path.write_text("# per-layer budgets\n" + "\n".join(f"{v}, " if i % 2 else str(v) for i, v in enumerate(budgets)) + "\n")
    return path


def test_pyramid_is_pyramidkv_and_sums_to_the_uniform_total(model_path):
    llm = make(model_path, "pyramid")
    n_layer, _ = shape(llm)
    got = [llm.locret_layer_budget(il) for il in range(n_layer)]
    want = pyramid(n_layer, B, NS)
    assert got == want
    assert sum(got) == n_layer * B and got[0] > got[-1] == NS + 1  # b/20 < n_s + 1 here: raised to n_s + 1
    assert all(a >= b for a, b in zip(got, got[1:]))
    st = llm.locret_stats()
    # the cache holds the largest layer budget and a chunk, padded
    assert st["budget"] == B and st["n_cells"] == -(-(max(got) + UB) // 256) * 256
    assert llm.locret_layer_budget(n_layer) == -1


def test_the_experiments_schedule_file_is_the_default_models_at_b_2048(model_path, repo):
    # experiments/schedules/smollm2-upper.txt (docs/results.md's 32K real-text rows): the library reads it for the
    # default model as written, a mean of 2048 units a layer (the memory of b 2048), layers 0-3 at 512
    path = repo / "experiments" / "schedules" / "smollm2-upper.txt"
    llm = make(model_path, str(path), locret_budget=2048, n_ctx=4096)
    n_layer, _ = shape(llm)
    got = [llm.locret_layer_budget(il) for il in range(n_layer)]
    assert got == [int(v) for line in path.read_text().splitlines() if not line.startswith("#") for v in line.split()]
    assert sum(got) == n_layer * 2048 and got[:4] == [512] * 4 and min(got[4:]) == 2284


@pytest.mark.parametrize("kind,n_prompt", [("file", 520), ("pyramid", 520), ("file", 110)])
def test_kept_sets_and_counts_follow_the_schedule(model_path, prompt_tokens, tmp_path, kind, n_prompt):
    # a long prompt takes every layer to its budget; a short one (110: between the smallest budget, 73, and the
    # largest, 133) leaves the larger layers holding everything while the smaller evict, into generation
    probe = make(model_path, None)
    n_layer, n_head_kv = shape(probe)
    del probe
    layer_b = varied(n_layer, B) if kind == "file" else pyramid(n_layer, B, NS)
    llm = make(model_path, schedule_file(tmp_path, layer_b) if kind == "file" else "pyramid")
    assert [llm.locret_layer_budget(il) for il in range(n_layer)] == layer_b
    ref = ScheduledAlgorithm1(n_layer, n_head_kv, layer_b, UB, NS, NLOC)

    # a prompt in ubatches, generation one token at a time, a second prompt: prefill and decode evictions
    prompt = prompt_tokens[:n_prompt]
    second = prompt_tokens[800:800 + (80 if n_prompt > max(layer_b) else 400)]
    calls = calls_of(prompt, prompt_tokens[600:760], second)
    n_positions = len(prompt) + 160 + len(second)
    table = random_table(n_layer, n_head_kv, n_positions)

    n_past, checked_full = 0, 0
    for tokens, output_last in calls:
        evictions_before = ref.n_evictions
        n_past = decode(llm, tokens, n_past, output_last)
        place_and_compare(llm, ref, tokens, n_past, output_last, table)
        assert llm.locret_stats()["n_cells_used"] == ref.rows
        if ref.n_evictions > evictions_before and ref.post_counts[0] == layer_b[0]:
            # an eviction to the full budget: each layer kept exactly its own budget (the total of the uniform
            # budget), and holds the tokens placed after it besides
            assert ref.post_counts == layer_b and sum(ref.post_counts) == n_layer * B
            after = ref.rows - ref.b
            counts = [len(llm.locret_retained(il, h)) - after for il in range(n_layer) for h in range(n_head_kv)]
            assert counts == [b for b in layer_b for _ in range(n_head_kv)]
            checked_full += 1
    st = llm.locret_stats()
    assert st["n_evictions"] == ref.n_evictions >= 20 and checked_full >= 3 and st["pos_logical"] == n_positions
    # some evictions left the largest layer whole (the cells in use did not drop) while smaller layers evicted: while
    # the prompt (or the second prompt) passes from the smallest budget to the largest
    assert ref.n_partial >= 2


@pytest.mark.parametrize("select", ["graph", "host"])
@pytest.mark.parametrize("n_prompt", [110, 400])
def test_heads_kept_sets_follow_the_schedule_selected_on_the_device_or_the_host(select, n_prompt, model_path,
        heads_file, prompt_tokens, tmp_path, monkeypatch):
    # the trained heads' scores (recorded as the engine computes them), selected by the device's graph (each layer its
    # own count, around its masked cells) or by the host: both must keep what the numpy model keeps, after every call.
    # A repeated stretch makes layer 0 score many units alike, so that cuts fall inside ties.
    monkeypatch.setenv("LOCRET_DEBUG_SELECT", select)
    n_layer, n_head_kv = shape(make(model_path, None))
    layer_b = varied(n_layer, B)
    llm = make(model_path, schedule_file(tmp_path, layer_b), policy=None, locret_heads=heads_file, locret_pool=0)
    heads_api.record_scores(llm)
    ref = ScheduledAlgorithm1(n_layer, n_head_kv, layer_b, UB, NS, NLOC)
    prompt = (prompt_tokens[:60] + prompt_tokens[100:112] * 5 + prompt_tokens[60:400])[:n_prompt]
    second = prompt_tokens[800:800 + (224 if n_prompt > max(layer_b) else 400)]
    n_past = 0
    for tokens, output_last in calls_of(prompt, prompt_tokens[600:760], second):
        n_past = decode(llm, tokens, n_past, output_last)
        scores, positions = heads_api.recorded_scores(llm)
        place_and_compare(llm, ref, tokens, n_past, output_last,
                          {int(p): scores[:, :, i] for i, p in enumerate(positions)})
    st = llm.locret_stats()
    assert st["n_evictions"] == ref.n_evictions >= 20
    # one wait for the backend per eviction, on either path
    assert st["n_host_syncs"] == st["n_evictions"]


@pytest.mark.parametrize("select", ["graph", "host"])
def test_a_pinned_query_pooling_and_kept_positions_with_a_schedule(select, model_path, heads_file, prompt_tokens,
                                                                   tmp_path, monkeypatch):
    # Locret-Q's pinned question (every layer keeps it: its cells lead each layer's run), pooled scores and kept
    # positions compacted at a limit, with the device's per-layer selection or the host's
    monkeypatch.setenv("LOCRET_DEBUG_SELECT", select)
    n_layer, n_head_kv = shape(make(model_path, None))
    layer_b = varied(n_layer, B)
    n_pin, pool, limit = 24, 5, 300
    llm = make(model_path, schedule_file(tmp_path, layer_b), policy=None, locret_heads=heads_file, locret_pool=pool,
               locret_positions=f"keep:{limit}")
    heads_api.record_scores(llm)
    llm.locret_pin_query(n_pin)
    ref = KeptPositions(n_layer, n_head_kv, B, UB, NS, NLOC, n_pin, pool, limit=limit, layer_b=layer_b)
    n_past = 0
    for tokens, output_last in calls_of(prompt_tokens[:110], prompt_tokens[600:760], prompt_tokens[800:1200]):
        n_past = decode_and_compare(llm, ref, tokens, n_past, output_last)
    st = llm.locret_stats()
    assert st["n_evictions"] == ref.evictions >= 20 and st["n_repositions"] == ref.repositions >= 2
    assert (st["n_rows_kept"], st["n_rows_moved"], st["n_rows_rotated"]) == \
        (ref.rows_kept, ref.rows_moved, ref.rows_rotated)
    assert all(llm.locret_retained(il, h)[:n_pin].tolist() == list(range(n_pin))
               for il in range(n_layer) for h in range(n_head_kv))


@pytest.mark.parametrize("positions", ["keep:200", "inplace"])
def test_kept_positions_follow_the_schedule(model_path, prompt_tokens, tmp_path, positions):
    # --locret-positions keep with a schedule: each layer's kept sets and key positions as the model says, positions
    # compacted at a limit of 200 every few parts; inplace: compact's positions after each layer's masked cells
    probe = make(model_path, None)
    n_layer, n_head_kv = shape(probe)
    del probe
    layer_b = varied(n_layer, B)
    llm = make(model_path, schedule_file(tmp_path, layer_b), locret_positions=positions)
    if positions == "inplace":
        from test_in_place_positions import InPlacePositions
        ref = InPlacePositions(n_layer, n_head_kv, B, UB, NS, NLOC, layer_b=layer_b)
    else:
        ref = KeptPositions(n_layer, n_head_kv, B, UB, NS, NLOC, limit=200, layer_b=layer_b)
    prompt, second = prompt_tokens[:520], prompt_tokens[800:880]
    calls = calls_of(prompt, prompt_tokens[600:700], second)
    table = random_table(n_layer, n_head_kv, len(prompt) + 100 + len(second))
    n_past = 0
    for tokens, output_last in calls:
        n_past = decode(llm, tokens, n_past, output_last)
        ref.place_call(n_past - len(tokens), len(tokens), output_last, table)
        for il in range(n_layer):
            for h in range(n_head_kv):
                where = f"layer {il} head {h} after position {n_past}"
                assert llm.locret_retained(il, h).tolist() == ref.held(il, h, 0), where
                assert eviction.rope_positions(llm._ctx.ctx, il, h).tolist() == ref.held(il, h, 2), where
    st = llm.locret_stats()
    assert st["n_evictions"] == ref.evictions >= 10 and st["n_repositions"] == ref.repositions
    assert ref.repositions >= 3 if positions != "inplace" else ref.repositions == 0
    assert (st["n_rows_kept"], st["n_rows_moved"], st["n_rows_rotated"]) == \
        (ref.rows_kept, ref.rows_moved, ref.rows_rotated)


@pytest.mark.parametrize("kind", ["pyramid", "file"])
def test_layers_are_held_in_groups_of_caches_the_rule_book_sizes(model_path, tmp_path, kind, monkeypatch):
    # each layer's cache holds its group's cells (never fewer than its budget and a chunk); the context's K/V bytes are
    # their sum, as the rule book resolves them before the model is loaded, and below what one cache would hold
    n_layer = shape(make(model_path, None))[0]
    layer_b = pyramid(n_layer, B, NS) if kind == "pyramid" else varied(n_layer, B)
    schedule = "pyramid" if kind == "pyramid" else schedule_file(tmp_path, layer_b)
    llm = make(model_path, schedule)
    st = llm.locret_stats()
    row = 2 * 2 * 192  # SmolLM2: K and V of 3 KV heads x 64, F16
    cells = [eviction.layer_cells(llm._ctx.ctx, il) for il in range(n_layer)]
    # a cache per distinct budget: the largest budget's in the context's cells (its budget and a chunk, padded to 256),
    # every other one its budget and a chunk
    assert cells == [st["n_cells"] if b == max(layer_b) else b + UB for b in layer_b]
    assert st["n_cells"] == -(-(max(layer_b) + UB) // 256) * 256
    assert st["kv_bytes"] == row * sum(cells) < row * n_layer * st["n_cells"]
    r = eviction.resolve_file(model_path, n_ctx=16384, n_ubatch=UB, budget=B, stabilizers=NS, local=NLOC,
                              policy="random", budget_schedule=str(schedule))
    assert r["kv_bytes"] == st["kv_bytes"] and list(r["layer_kv_bytes"]) == [row * c for c in cells]
    assert eviction.layer_cells(llm._ctx.ctx, n_layer) == -1
    # the form that holds every layer in one cache of the largest budget (LOCRET_DEBUG_ALLOC=masked) is what it was
    monkeypatch.setenv("LOCRET_DEBUG_ALLOC", "masked")
    one = make(model_path, schedule)
    assert [eviction.layer_cells(one._ctx.ctx, il) for il in range(n_layer)] == [st["n_cells"]] * n_layer
    assert one.locret_stats()["kv_bytes"] == row * n_layer * st["n_cells"]


@pytest.mark.parametrize("select,positions,cache", [("graph", None, None), ("host", None, None),
                                                    ("host", "keep:300", None), ("graph", None, "q8_0 fa"),
                                                    ("graph", "inplace", None)])
def test_groups_of_caches_give_the_logits_of_one_masked_cache(model_path, heads_file, prompt_tokens, tmp_path,
                                                              monkeypatch, select, positions, cache):
    # The same schedule held in groups of caches (the default) and in one cache sized for the largest budget whose
    # layers mask what they do not keep (LOCRET_DEBUG_ALLOC=masked): every unit a layer reads sits in another cell of
    # another tensor, moved by other rows, yet attention reads the same keys and values at the same positions, so the
    # logits after every call (prefill, generation, a second prompt: dozens of evictions) are the same: bit for bit in
    # these settings (ubatches of 32, one thread); where a kernel sums in blocks whose bounds the one cache's hole
    # moves (512-token ubatches on two threads with flash attention) they part by rounding (docs/results.md).
    monkeypatch.setenv("LOCRET_DEBUG_SELECT", select)
    n_layer = shape(make(model_path, None))[0]
    runs = []
    for alloc in ("grouped", "masked"):
        monkeypatch.setenv("LOCRET_DEBUG_ALLOC", alloc)
        extra = dict(type_k=8, type_v=8, flash_attn=True) if cache else {}  # F16 masks, rows of 8-bit blocks
        llm = make(model_path, "pyramid", policy=None, locret_heads=heads_file, locret_pool=5,
                   locret_positions=positions, **extra)
        cells = {eviction.layer_cells(llm._ctx.ctx, il) for il in range(n_layer)}
        assert (len(cells) > 20) == (alloc == "grouped"), cells
        logits, n_past = [], 0
        for tokens, output_last in calls_of(prompt_tokens[:400], prompt_tokens[600:640], prompt_tokens[800:1000]):
            n_past = decode(llm, tokens, n_past, output_last)
            if output_last:
                logits.append(last_logits(llm))
        st = llm.locret_stats()
        runs.append((logits, st["n_evictions"], [llm.locret_retained(il, 1).tolist() for il in range(n_layer)]))
    (grouped, n_grouped, kept_grouped), (masked, n_masked, kept_masked) = runs
    assert n_grouped == n_masked >= 20 and kept_grouped == kept_masked
    assert len(grouped) == len(masked) > 40
    for i, (a, b) in enumerate(zip(grouped, masked)):
        np.testing.assert_array_equal(a, b, err_msg=f"call {i}")


@pytest.mark.parametrize("alloc", ["grouped", "masked"])
@pytest.mark.parametrize("positions", [None, "keep"])
def test_masked_cells_are_not_attended(model_path, prompt_tokens, tmp_path, heads_file, positions, alloc,
                                       monkeypatch):
    """After evictions, overwrite the cells each layer masks with keys of 0 and values of 100: if attention read
    them, the next logits would move far; they must stay what they were. Also the cells past those in use, which the
    mask blocks: in groups of caches (a cache per budget) a layer holds no masked cell, and each group's mask is read
    out of the first group's, extended by blocked cells; in one cache, every layer below the largest budget masks."""
    monkeypatch.setenv("LOCRET_DEBUG_ALLOC", alloc)
    path = "pyramid"
    logits = []
    for poison in (False, True):
        llm = make(model_path, path, policy=None, locret_heads=heads_file, locret_positions=positions)
        n_past = 0
        for i in range(0, 400, UB):
            n_past = decode(llm, prompt_tokens[i:min(400, i + UB)], n_past, i + UB >= 400)
        for t in prompt_tokens[400:420]:
            n_past = decode(llm, [t], n_past, True)
        if poison:
            assert eviction.fill_masked(llm._ctx.ctx, 0.0, 100.0) > 0
        n_past = decode(llm, prompt_tokens[420:421], n_past, True)
        logits.append(last_logits(llm))
    assert np.all(np.isfinite(logits[0]))
    np.testing.assert_array_equal(logits[1], logits[0])


def test_uniform_file_equals_no_schedule(model_path, prompt_tokens, tmp_path):
    n_layer = shape(make(model_path, None))[0]
    runs = []
    for schedule in (None, schedule_file(tmp_path, [B] * n_layer)):
        llm = make(model_path, schedule)
        n_past = 0
        for i in range(0, 300, UB):
            n_past = decode(llm, prompt_tokens[i:min(300, i + UB)], n_past, i + UB >= 300)
        runs.append((last_logits(llm), [llm.locret_retained(il, 0).tolist() for il in range(n_layer)]))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


def test_state_round_trip_and_another_schedule_refused(model_path, prompt_tokens, tmp_path):
    n_layer = shape(make(model_path, None))[0]
    path = schedule_file(tmp_path, varied(n_layer, B))
    llm = make(model_path, path)
    n_past = 0
    for i in range(0, 300, UB):
        n_past = decode(llm, prompt_tokens[i:min(300, i + UB)], n_past, i + UB >= 300)
    state = llm.save_state()
    want = [llm.locret_retained(il, 0).tolist() for il in range(n_layer)]
    n_past = decode(llm, prompt_tokens[300:301], n_past, True)
    want_logits = last_logits(llm)

    again = make(model_path, path)
    again.load_state(state)
    assert [again.locret_retained(il, 0).tolist() for il in range(n_layer)] == want
    decode(again, prompt_tokens[300:301], n_past - 1, True)
    np.testing.assert_array_equal(last_logits(again), want_logits)

    for other in ("pyramid", None):
        ctx = make(model_path, other)
        with pytest.raises(Exception):
            ctx.load_state(state)
        assert "budget schedule" in locret.heads._last_error() or ctx.locret_stats()["n_cells_used"] == 0


def test_refusals(model_path, tmp_path):
    n_layer = shape(make(model_path, None))[0]
    cases = {
        "missing": (tmp_path / "nope.txt", "neither uniform, pyramid nor a readable file"),
        "word": (schedule_file(tmp_path, ["96"] * (n_layer - 1) + ["lots"], "word.txt"), "'lots' is not a budget"),
        "count": (schedule_file(tmp_path, [B] * (n_layer - 1), "count.txt"), f"this model evicts {n_layer} layers"),
        "sum": (schedule_file(tmp_path, [B] * (n_layer - 1) + [B + 1], "sum.txt"),
                f"sums to {n_layer * B + 1} units"),
        "small": (schedule_file(tmp_path, [NS] + [B] * (n_layer - 2) + [2 * B - NS], "small.txt"),
                  "layer 0's budget (16) must be larger than the stabilizers"),
    }
    for name, (path, message) in cases.items():
        with pytest.raises(Exception) as err:
            make(model_path, path)
        assert message in str(err.value) or message in locret.heads._last_error(), (name, str(err.value))

    # schedules are for the policies that select per layer
    for policy in ("lagkv", "sage"):
        with pytest.raises(HeadsError, match="heads, random and streaming policies"):
            make(model_path, "pyramid", policy=policy, locret_stabilizers=None, locret_local=None, n_ctx=4096)

    # the tools: an unknown name, and a schedule without a budget
    proc = run([tool("llama-completion"), "-m", model_path, "--locret-policy", "random", "--locret-budget", "64",
                "--locret-budget-schedule", "steep", "-p", "hi", "-n", "1", "-no-cnv"], timeout=120)
    assert proc.returncode != 0 and "budget schedule 'steep' is neither uniform, pyramid nor a readable file" in \
        proc.stderr, proc.stderr[-2000:]
    proc = run([tool("llama-completion"), "-m", model_path, "--locret-budget-schedule", "pyramid", "-p", "hi",
                "-n", "1", "-no-cnv"], timeout=120)
    assert proc.returncode != 0 and "set a budget first" in proc.stderr, proc.stderr[-2000:]


def test_tools_run_a_pyramid(model_path, prompt_tokens):
    from conftest import natural_text
    # about 770 tokens on one thread: the pyramid's largest layer (about 2b = 256 units, + a chunk of 64) still evicts
    # some seven times, every other layer more (6,000 characters added 4 s and ran no other code)
    prompt = natural_text()[:3000]
    for exe, extra in (("llama-completion", ["-p", prompt, "-n", "4", "-no-cnv", "--temp", "0"]),
                       ("llama-bench", ["-p", "512", "-n", "0", "-r", "1"])):
        proc = run([tool(exe), "-m", model_path, "--locret-policy", "streaming", "--locret-budget", "128",
                    "-ub", "64", "-b", "64", "--locret-budget-schedule", "pyramid", "-t", "1", "-v", *extra], timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        if exe == "llama-completion":
            assert "Locret budget schedule (layer:units): 0:" in proc.stderr, proc.stderr[-3000:]
