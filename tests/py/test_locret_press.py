"""LocretPress (locret.peers): Locret's retaining heads inside kvpress, checked against independent references.

kvpress runs in its own environment (.venv-kvpress, made by scripts/setup.sh: it needs an older transformers than
the project's venv), so tests/py/locret_press_side.py does the measuring there, once for the module: SmolLM2 as
transformers loads it from the GGUF, the shipped heads (heads/smollm2-135m-instruct.gguf), LocretPress through
kvpress's own hooks and pipeline. The references:

- CIS from tests/py/reference_cis.py (hooks on q_proj/k_proj/v_proj, heads in the published checkpoint format), fed
  with W1/W2 read from the same heads GGUF by gguf-py and returned to Hugging Face order by the side script's own
  un-permutation (a reshape, not the converter's index map);
- the selection: Algorithm 1's numpy model (test_eviction.py), here, run as one chunk holding the whole input with
  no stabilizers and no local tail (keep the n_kept best, ties to the earlier position).
"""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from conftest import REPO, natural_text, run
from test_eviction import Algorithm1

HEADS = REPO / "heads" / "smollm2-135m-instruct.gguf"
N_TOKENS = 400
RATIO = 0.75
POOL = 7
N_PAIRS = 30 * 3  # SmolLM2: (layer, KV head) pairs


@pytest.fixture(scope="module")
def side(model_path, tmp_path_factory):
    """(arrays, facts) measured by the side script in the kvpress environment."""
    from locret.peers.environment import kvpress_python

    python = kvpress_python()  # .venv-kvpress, or a refusal that says how to make it
    work = tmp_path_factory.mktemp("locret-press")
    (work / "text.txt").write_text(natural_text())
    config = {"model": str(model_path), "heads": str(HEADS), "other_heads": str(REPO / "heads" / "gemma3-270m.gguf"),
              "text": str(work / "text.txt"), "n_tokens": N_TOKENS, "ratio": RATIO, "pool": POOL,
              "context": "The code for the north warehouse door is 4-7-2-9. " + natural_text()[:1200],
              "question": "What is the code for the north warehouse door?"}
    (work / "config.json").write_text(json.dumps(config))
    proc = run([python, REPO / "tests" / "py" / "locret_press_side.py", work / "config.json", work],
               timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(work / "results.npz") as arrays:
        return dict(arrays), json.loads((work / "results.json").read_text())


def algorithm1_kept(cis: np.ndarray, n_kept: int) -> np.ndarray:
    """[layer, kv head, n_kept]: Algorithm 1 on one chunk holding the whole input, no stabilizers, no local tail."""
    n_layer, n_head_kv, n = cis.shape
    ref = Algorithm1(n_layer, n_head_kv, b=n_kept, ub=n, n_s=0, n_loc=0)
    ref.place(list(range(n)), {p: cis[:, :, p] for p in range(n)}, True)
    ref.evict(n_kept, 0)
    if ref.cut_ties:
        print(f"\n{ref.cut_ties} (layer, KV head) cut(s) fell inside a run of equal scores, decided by position")
    return np.array([[[u[0] for u in units] for units in layer] for layer in ref.units])


def test_scores_equal_the_reference_cis(side):
    arrays, _ = side
    got, want = arrays["scores"], arrays["reference"]
    assert got.shape == want.shape == (30, 3, N_TOKENS)
    print(f"\nLocretPress.score vs reference CIS ({N_TOKENS} tokens, {N_PAIRS} (layer, KV head) pairs): max |diff| "
          f"{np.abs(got - want).max():.3g} (max |score| {np.abs(want).max():.3g})")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_kept_sets_equal_algorithm_1_on_one_chunk(side):
    arrays, facts = side
    n_kept = facts["n_kept"]
    assert facts["cache_lengths"] == [n_kept] * 30  # the cache was compressed, in every layer
    want = algorithm1_kept(arrays["reference"], n_kept)
    got = arrays["kept"]
    assert (got >= 0).all(), "a kept key matches no single position of the uncompressed cache"
    differing = [(il, h) for il in range(30) for h in range(3) if not np.array_equal(got[il, h], want[il, h])]
    print(f"\nkept {n_kept} of {N_TOKENS} per (layer, KV head): {N_PAIRS - len(differing)}/{N_PAIRS} equal to "
          f"Algorithm 1's")
    assert not differing, f"kept sets differ from Algorithm 1's at (layer, head) {differing[:10]}"


def test_without_undoing_the_permutation_the_kept_sets_differ(side):
    # the check above can fail: W1's Q/K columns left in the file's llama.cpp order pair weights with wrong inputs
    arrays, facts = side
    want = algorithm1_kept(arrays["reference"], facts["n_kept"])
    got = arrays["kept_unpermuted"]
    wrong = sum(not np.array_equal(got[il, h], want[il, h]) for il in range(30) for h in range(3))
    print(f"\nwithout undoing the Q/K permutation: {wrong}/{N_PAIRS} (layer, KV head) kept sets differ")
    assert wrong > N_PAIRS // 2, "the kept-set check cannot tell permuted from unpermuted heads"


def test_pooling_is_the_mean_over_the_window_clipped_at_the_edges(side):
    arrays, _ = side
    raw, pooled = arrays["scores"], arrays["pooled"]
    n, r = raw.shape[-1], POOL // 2
    want = np.stack([raw[..., max(0, i - r):min(n, i + r + 1)].mean(-1) for i in range(n)], axis=-1)
    np.testing.assert_allclose(pooled, want, rtol=1e-5, atol=1e-6)
    assert np.abs(pooled - raw).max() > 1e-2  # pooling changed the scores, so the comparison above can fail
    np.testing.assert_array_equal(arrays["pool1"], raw)  # a window of one token is no pooling


def test_the_pipeline_answers_from_a_compressed_cache(side):
    _, facts = side
    pipeline = facts["pipeline"]
    print(f"\ncontext {pipeline['n_context']} tokens, kept {pipeline['n_kept']}: answer {facts['answer']!r}; "
          f"inside AdaKVPress: {facts['adakv_answer']!r}")
    assert isinstance(facts["answer"], str) and facts["answer"].strip()
    # the pipeline takes the answer off the cache again: what stays is the compressed context, in every layer
    assert pipeline["cache_lengths"] == [pipeline["n_kept"]] * 30
    # AdaKVPress takes it: the same number of units per layer evicted (masked, in kvpress's way), spread over the heads
    assert isinstance(facts["adakv_answer"], str) and facts["adakv_answer"].strip()
    assert facts["adakv_masked"] == [3 * (pipeline["n_context"] - pipeline["n_kept"])] * 30


@pytest.mark.parametrize("case,message", [
    ("other_model", r"do not fit the model: the heads are for 18 layers.*the model has 30 layers"),
    ("model_without_heads", r"without retaining heads"),
    ("not_gguf", r"text\.txt.*not a GGUF"),
    ("missing", r"missing\.gguf"),
    ("pool 2", r"pool must be odd"),
    ("pool 8", r"pool must be odd"),
    ("pool -1", r"pool must be a non-negative integer"),
])
def test_refusals(side, case, message):
    got = side[1]["refusals"][case]
    assert got.startswith("ValueError: ") and re.search(message, got), got
