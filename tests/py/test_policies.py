"""Scoring policies (--locret-policy, locret_policy=): the same eviction with scores from the retaining heads
("heads"), a fixed hash of each unit ("random") or attention sinks then recency ("streaming").

Small settings as in test_eviction.py (b = 96, ubatch 32, n_s = 16, n_loc = 8): a 500-token prompt goes
through a dozen evictions in a few seconds on SmolLM2. One thread, so that a busy 2-core machine does not
make llama.cpp's threads wait on each other; each policy's prompt runs once per module (`prompt_run`).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
import llama_cpp
from locret import eviction, heads as heads_api
from locret.llama import Llama

from conftest import natural_text, run, tool
from test_eviction import Algorithm1, compact_unless_asked, decode, prompt_tokens  # noqa: F401 (shared fixture)

B, UB, NS, NLOC = 96, 32, 16, 8
SINKS = 4      # StreamingLLM's attention sinks: logical positions 0..3
N_PROMPT = 500  # 15 full ubatches, then 12 tokens and the 8-token local tail
VALID = "valid policies: heads, random, streaming, lagkv"

# the random policy's hash, as in ggml_ext/src/locret-policy-random.cpp (locret_random_score)
RANDOM_SEED = np.uint64(0x4C6F63726574)
MIX_1, MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def random_scores(il: int, ih: int, positions) -> np.ndarray:
    """float32 scores of the units at these logical positions of layer il, KV head ih."""
    pos = np.asarray(positions, dtype=np.int64).astype(np.uint32).astype(np.uint64)
    x = (np.uint64(il) << np.uint64(48)) | (np.uint64(ih) << np.uint64(32)) | pos
    x = x ^ RANDOM_SEED
    x = x ^ (x >> np.uint64(30))
    x = x * MIX_1
    x = x ^ (x >> np.uint64(27))
    x = x * MIX_2
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(40)).astype(np.float32) / np.float32(1 << 24)


def random_table(n_layer: int, n_head_kv: int, n_positions: int) -> np.ndarray:
    """The random policy's scores of every unit: float32 [position, layer, head]."""
    return np.stack([np.stack([random_scores(il, h, np.arange(n_positions)) for h in range(n_head_kv)], axis=-1)
                     for il in range(n_layer)], axis=1)


def streaming_after_prompt(n_prompt: int) -> list[int]:
    """What every (layer, head) holds after a prompt of n_prompt tokens (n_prompt % UB > NLOC), by the rules:
    the chunk before the local tail is evicted without stabilizers to the 4 sinks plus the b - 4 most recent
    units, then the n_loc tail tokens are appended."""
    assert n_prompt % UB > NLOC
    tail_start = n_prompt - NLOC
    return list(range(SINKS)) + list(range(tail_start - (B - SINKS), tail_start)) + list(range(tail_start, n_prompt))


def make(model_path, policy, **kw):
    args = dict(n_ctx=16384, n_batch=UB, n_ubatch=UB, locret_budget=B, locret_stabilizers=NS, locret_local=NLOC,
                locret_policy=policy, verbose=False, seed=1, n_threads=1, n_threads_batch=1)
    args.update(kw)
    return Llama(model_path=str(model_path), **compact_unless_asked(args))


def shape(llm):
    model = llm._model.model
    return llama_cpp.llama_model_n_layer(model), llama_cpp.llama_model_n_head_kv(model)


def all_retained(llm) -> list[list[list[int]]]:
    n_layer, n_head_kv = shape(llm)
    return [[llm.locret_retained(il, h).tolist() for h in range(n_head_kv)] for il in range(n_layer)]


@pytest.fixture(scope="module")
def prompt_run(model_path, prompt_tokens, heads_file):
    """prompt_run(policy, with_heads): the context after the first N_PROMPT tokens, and what every (layer, head)
    retains then; each combination runs once per module."""
    runs = {}

    def get(policy, with_heads=False):
        if (policy, with_heads) not in runs:
            llm = make(model_path, policy, **(dict(locret_heads=heads_file) if with_heads else {}))
            llm.eval(prompt_tokens[:N_PROMPT])
            st = llm.locret_stats()
            assert st["policy"] == (policy or "heads") and st["pos_logical"] == N_PROMPT, st
            assert st["n_evictions"] >= 10, st
            runs[policy, with_heads] = llm, all_retained(llm)
        return runs[policy, with_heads]

    return get


def test_random_hash_model_is_uniform_and_varies_by_layer_head_and_position():
    s = random_scores(0, 0, np.arange(100_000))
    assert 0.0 <= s.min() and s.max() < 1.0 and abs(float(s.mean()) - 0.5) < 0.01
    assert len(np.unique(s)) > 99_000
    assert not np.array_equal(s[:1000], random_scores(0, 1, np.arange(1000)))
    assert not np.array_equal(s[:1000], random_scores(1, 0, np.arange(1000)))


def test_streaming_keeps_the_sinks_and_the_most_recent_units(prompt_run, prompt_tokens):
    llm, got = prompt_run("streaming")  # only this test uses (and goes on with) the streaming context
    assert llm._locret_heads is None  # no heads anywhere
    want = streaming_after_prompt(N_PROMPT)
    assert want[:SINKS + 1] == [0, 1, 2, 3, 400] and len(want) == B + NLOC
    for il, layer in enumerate(got):
        for h, kept in enumerate(layer):
            assert kept == want, f"layer {il} head {h}"
    assert llm.locret_stats()["n_cells_used"] == B + NLOC

    # generation: the cache fills to b + B and goes back to b, keeping the sinks and the most recent units
    units, n_past = list(want), N_PROMPT
    for t in prompt_tokens[N_PROMPT:N_PROMPT + 2 * UB + 5]:
        if len(units) + 1 > B + UB:
            units = units[:SINKS] + units[len(units) - (B - SINKS):]
        n_past = decode(llm, [t], n_past, True)
        units.append(n_past - 1)
        assert llm.locret_stats()["n_cells_used"] <= B + UB
    st = llm.locret_stats()
    assert st["n_evictions"] >= 15 and st["n_host_syncs"] == st["n_evictions"], st  # one wait per eviction
    assert all(kept == units for layer in all_retained(llm) for kept in layer)


def test_streaming_expectation_fails_for_the_other_policies(prompt_run):
    want = streaming_after_prompt(N_PROMPT)
    for policy, with_heads in ((None, True), ("random", False)):  # None: the default policy, heads
        _, got = prompt_run(policy, with_heads)
        assert all(kept != want for layer in got for kept in layer), policy


def test_random_policy_is_algorithm_1_with_hashed_scores(model_path, prompt_tokens):
    llm = make(model_path, "random")
    assert llm._locret_heads is None
    n_layer, n_head_kv = shape(llm)
    ref = Algorithm1(n_layer, n_head_kv, B, UB, NS, NLOC)

    # as test_eviction.py: a prompt in batches of one ubatch, generation one token at a time, a second prompt
    prompt = prompt_tokens[:520]
    calls = [(prompt[i:i + UB], i + UB >= len(prompt)) for i in range(0, len(prompt), UB)]
    calls += [([t], True) for t in prompt_tokens[600:660]]
    second = prompt_tokens[700:780]
    calls += [(second[i:i + UB], i + UB >= len(second)) for i in range(0, len(second), UB)]
    n_positions = len(prompt) + 60 + len(second)
    table = random_table(n_layer, n_head_kv, n_positions)

    n_past, before = 0, llm.locret_stats()
    for tokens, output_last in calls:
        n_past = decode(llm, tokens, n_past, output_last)
        # the host computes these scores from positions it holds: an eviction waits once (before its move tables are
        # written), a call that evicts nothing never waits
        now = llm.locret_stats()
        assert now["n_host_syncs"] - before["n_host_syncs"] == now["n_evictions"] - before["n_evictions"], now
        before = now
        first, offset = n_past - len(tokens), 0
        for size in ref.split(len(tokens), output_last):
            ref.place(list(range(first + offset, first + offset + size)), table,
                      output_last and offset + size == len(tokens))
            offset += size
        for il in range(n_layer):
            for h in range(n_head_kv):
                assert llm.locret_retained(il, h).tolist() == [u[0] for u in ref.units[il][h]], \
                    f"layer {il} head {h} after position {n_past}"
        assert llm.locret_stats()["n_cells_used"] <= B + UB
    st = llm.locret_stats()
    assert st["n_evictions"] >= 15 and st["pos_logical"] == n_past == n_positions and st["policy"] == "random"


def test_random_policy_differs_per_head_and_repeats_across_runs(prompt_run):
    llm, first = prompt_run("random")
    assert llm._locret_heads is None
    flat = [tuple(kept) for layer in first for kept in layer]
    assert len(set(flat)) == len(flat)  # every (layer, head) keeps its own set
    assert all(len(kept) == B + NLOC for kept in flat)
    # a fresh context gives the same sets; heads given with this policy are not loaded and change nothing
    llm, again = prompt_run("random", True)
    assert llm._locret_heads is None
    assert again == first


def test_default_policy_evicts_by_the_heads(prompt_run):
    llm, got = prompt_run(None, True)
    assert llm._locret_heads is not None and llm.locret_stats()["policy"] == "heads"
    _, random_sets = prompt_run("random")
    assert all(a != b for la, lb in zip(got, random_sets) for a, b in zip(la, lb))


def test_unknown_policy_is_refused(model_path):
    with pytest.raises(heads_api.HeadsError, match=VALID):
        make(model_path, "sink")
    with pytest.raises(heads_api.HeadsError, match=VALID):
        eviction.policy_value("Random")  # names are exact
    for exe, extra in (("llama-completion", ["-p", "hi", "-n", "1", "-no-cnv"]), ("llama-bench", [])):
        proc = run([tool(exe), "-m", model_path, "--locret-budget", "64", "--locret-policy", "sink", *extra],
                   timeout=120)
        assert proc.returncode == 1, (exe, proc.returncode, proc.stderr[-2000:])
        assert "unknown Locret policy 'sink'" in proc.stderr and VALID in proc.stderr, proc.stderr[-2000:]


def test_heads_policy_without_heads_is_still_refused(model_path):
    proc = run([tool("llama-completion"), "-m", model_path, "--locret-policy", "heads", "--locret-budget", "64",
                "-p", "hi", "-n", "1", "-no-cnv"], timeout=120)
    assert proc.returncode == 1 and "needs retaining heads" in proc.stderr, proc.stderr[-2000:]
    with pytest.raises(heads_api.HeadsError, match="needs retaining heads"):
        make(model_path, "heads")


def test_policy_without_budget_is_refused(model_path):
    proc = run([tool("llama-completion"), "-m", model_path, "--locret-policy", "random", "-p", "hi", "-n", "1",
                "-no-cnv"], timeout=120)
    assert proc.returncode == 1 and "--locret-policy random needs --locret-budget" in proc.stderr, \
        proc.stderr[-2000:]
    with pytest.raises(heads_api.HeadsError, match="needs --locret-budget"):
        make(model_path, "streaming", locret_budget=None, locret_stabilizers=None, locret_local=None)


def test_tools_evict_without_heads_with_streaming(model_path, heads_file):
    proc = run([tool("llama-completion"), "-m", model_path, "--locret-policy", "streaming", "--locret-budget", "64",
                "--locret-heads", heads_file, "-c", "4096", "-b", "512", "-ub", "32", "-p", natural_text()[:1200],
                "-n", "2", "-no-cnv", "--temp", "0", "-t", "1", "-lv", "4"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Locret eviction: policy streaming, budget 64" in proc.stderr, proc.stderr[-3000:]
    assert "policy streaming does not use retaining heads" in proc.stderr, proc.stderr[-3000:]
    assert "attached Locret retaining heads" not in proc.stderr
    # a cache of 256 cells held a prompt of about 300 tokens: it evicted
    assert re.search(r"llama_kv_cache: size = +[\d.]+ MiB \( +256 cells", proc.stderr), proc.stderr[-3000:]
    n_prompt = re.search(r"prompt eval time = +[\d.]+ ms / +(\d+) tokens", proc.stderr)
    assert n_prompt and int(n_prompt.group(1)) > 256, proc.stderr[-3000:]
