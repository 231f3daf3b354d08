"""The passkey task (py/locret/tasks/passkey.py) and its evaluation runner (py/locret/passkey_eval.py)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from locret.tasks import passkey


def _word_tokenizer():
    vocab: dict[str, int] = {"<s>": 0}

    def tokenize(text: str, add_bos: bool) -> list[int]:
        ids = [vocab.setdefault(w, len(vocab)) for w in text.split()]
        return ([0] if add_bos else []) + ids
    return tokenize, vocab


def test_prompt_holds_the_needle_once_at_the_asked_offset():
    tokenize, vocab = _word_tokenizer()
    pieces = passkey.prompt_pieces(tokenize, lambda user: f"<user> {user} </user> <assistant>", n_filler=700)
    assert len(pieces.filler) == 700 and pieces.head[0] == 0
    keys = passkey.make_keys(3, 20)
    assert keys == passkey.make_keys(3, 20) and keys != passkey.make_keys(4, 20)
    assert all(len(k) == 5 for k in keys)
    for key, at in zip(keys[:5], (0, 1, 350, 699, 700)):
        needle = tokenize(passkey.needle_text(key), False)
        prompt = pieces.build(700, at, needle)
        start = len(pieces.head) + at
        assert prompt[start:start + len(needle)] == needle
        key_id = vocab[f"{key}."]
        assert prompt.count(key_id) == 2  # the needle says it twice, nothing else does
        words = {i: w for w, i in vocab.items()}
        offsets = passkey.key_token_offsets(needle, lambda ids: " ".join(words[i] for i in ids).encode())
        assert [needle[k] for k in offsets] == [key_id, key_id]  # found although merged with the full stop
        assert len(prompt) == len(pieces.head) + 700 + len(needle) + len(pieces.tail)
    with pytest.raises(ValueError):
        pieces.build(700, 701, [])


def test_depths_and_chunk_aligned_insert_points():
    assert passkey.spread_depths(5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    points = passkey.aligned_insert_points(n_head=30, n_filler=5000, align=512, depths=[0.0, 0.1, 0.5, 1.0])
    assert points[0] == 0
    for t in points[1:]:
        assert (30 + t) % 512 == 0 and 0 < t <= 5000
    assert points[2] == min((t for t in range(482, 5001, 512)), key=lambda t: abs(t - 2500))
    assert points == sorted(points)


@pytest.mark.parametrize("answer,key,ok", [
    ("48213", "48213", True),
    ("The passkey is 48213.", "48213", True),
    ("48213 48213", "48213", True),
    ("482130", "48213", False),     # a longer number is not the key
    ("4821", "48213", False),
    ("48 213", "48213", False),
    ("", "48213", False),
])
def test_score(answer, key, ok):
    assert passkey.score(answer, key) is ok


def test_prefix_reuse_is_exact_under_eviction(model_path, tmp_path):
    """Saving the cache after the shared prefix and reloading it gives the same logits as one pass."""
    from locret import passkey_eval

    setup = passkey_eval.Setup(model_path=str(model_path), heads=None, random_heads=None, n_ubatch=128)
    single, reused = passkey_eval.check_prefix_reuse(setup, "streaming", length=800, budget=256, seed=0,
                                                     return_logits=True)
    # Two arrays of their own, finite after the context is gone (views of llama.cpp's buffer were neither).
    assert not np.shares_memory(single, reused)
    assert np.isfinite(single).all() and np.isfinite(reused).all()
    assert np.abs(single - reused).max() <= 1e-4 * np.abs(single).max()


def test_trials_record_whether_the_cache_still_holds_the_key(model_path):
    """Under streaming (sinks + recent units), a key at the start of the filler or in the middle is evicted
    from every (layer, KV head) and one at the very end is held by all; the table reports both."""
    from locret import passkey_eval

    setup = passkey_eval.Setup(model_path=str(model_path), heads=None, random_heads=None, n_ubatch=128)
    trials = passkey_eval.run_length(setup, "streaming", length=800, budget=256, trials=3, seed=0)
    assert [t.depth for t in trials] == [0.0, 0.5, 1.0]
    n_pairs = 30 * 3  # SmolLM2-135M: 30 layers, 3 KV heads
    for t in trials[:2]:
        assert t.key_held_by_layer == [0.0] * 30 and t.pairs_holding_key == 0, t
    assert trials[2].key_held_by_layer == [1.0] * 30 and trials[2].pairs_holding_key == n_pairs, trials[2]
    row, = passkey_eval.summarize(trials)
    assert row["key_held"] == pytest.approx(1 / 3, abs=1e-3) and row["pairs_holding_key"] == n_pairs / 3
    assert "| 0.33 / 30.0 |" in passkey_eval.markdown_table([row])


def test_key_tokens_are_found_in_both_statements_of_the_key(model_path):
    from locret import Llama

    llm = Llama(str(model_path), n_ctx=256, verbose=False, vocab_only=True)
    needle = llm.tokenize(passkey.needle_text("48213").encode(), add_bos=False)
    offsets = passkey.key_token_offsets(needle, llm.detokenize)
    spelled = "".join(llm.detokenize([needle[k]]).decode().strip() for k in offsets)
    assert spelled == "4821348213"


def test_the_passkey_runs_pool_only_when_asked(model_path):
    """scripts/eval_passkey.py --pool: the window reaches the context of the heads methods; without it nothing pools,
    even with heads that recommend a window (the shipped Locret-Q heads recommend 15), so that a figure names its
    pooling."""
    import ctypes

    from locret import eviction, models, passkey_eval

    heads = str(models.shipped_heads("smollm2-135m", query=True))
    rec = eviction._Settings()
    assert eviction._api().llama_locret_file_recommended(heads.encode(), ctypes.byref(rec)) >= 0
    assert rec.pool == 15  # else the first case below could not fail
    for pool, expected in ((0, 0), (5, 5)):
        setup = passkey_eval.Setup(model_path=str(model_path), heads=heads, random_heads=None, n_ubatch=128,
                                   pool=pool)
        llm = passkey_eval._make_llm(setup, "locret", budget=256, n_ctx=1024)
        try:
            assert llm.locret_stats()["pool"] == expected
        finally:
            llm.close()


def test_the_passkey_script_refuses_a_window_the_rule_book_refuses():
    """Before any trial: an even window is the library's refusal, with its reason and exit status 2."""
    from conftest import REPO, run

    base = [sys.executable, REPO / "scripts" / "eval_passkey.py", "--lengths", "1000", "--trials", "1", "--budgets",
            "256", "-o", "/dev/null"]
    proc = run(base + ["--methods", "locret", "--pool", "4"], timeout=120)
    assert proc.returncode == 2 and "pooling window must be odd" in proc.stderr, proc.stderr[-2000:]
    # and, as locret eval, a window with no method that has heads to pool
    proc = run(base + ["--methods", "streaming", "--pool", "5"], timeout=120)
    assert proc.returncode == 2 and "--pool smooths the retaining heads' scores" in proc.stderr, proc.stderr[-2000:]
