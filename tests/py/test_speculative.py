"""Speculative decoding on an evicting cache: a draft verified in one batch, its rejected tokens removed, leaves the
cache exactly as decoding the accepted tokens one by one does, evictions during generation included, as long as the
batch stays within the room before the next eviction (llama_locret_seq_room); and llama-server's n-gram speculation
with a budget evicts where the same server evicts without it, with its Locret state in /slots, /metrics and /props; so
does speculation with a draft model, whose own context evicts in a bounded cache of its own."""
from __future__ import annotations

import ctypes
import json
import re
import urllib.request

import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
import llama_cpp
from locret import heads as heads_api

from conftest import BIN, REPO, free_port, http_server, natural_text, post_json, run
from test_eviction import B, NLOC, NS, UB, Algorithm1, decode, make, prompt_tokens  # noqa: F401 (a fixture)

HEADS = REPO / "heads" / "smollm2-135m-instruct.gguf"


def _verify(llm, tokens, n_past):
    """One verification batch (the sampled token and its draft), every token asking for logits."""
    llm._batch.set_batch(batch=list(tokens), n_past=n_past, logits_all=True)
    assert llama_cpp.llama_decode(llm._ctx.ctx, llm._batch.batch) == 0


def _speculate(model_path, heads_file, prompt_tokens, respect_room, stop_at_mismatch=False):
    """A prompt, then generation in verification batches, each cut back to its accepted tokens, against Algorithm 1
    placing only the accepted tokens, one by one, with the scores the engine computed for them. The text decoded and
    how much of each draft is accepted follow a fixed pattern (the cache's behaviour does not depend on why a token was
    rejected): batches of 1 + min(room - 1, 6) tokens (6 drafts whatever the room with respect_room=False), of which
    the sampled token and 0..k drafts are kept. Returns the steps whose retained sets differ from the model's, the
    evictions during generation, and how many rejections came in a batch before which the cache evicted."""
    # pooling on (the heads' scores averaged over 7 tokens of a ubatch): a verification batch must not pool its tokens
    # together, or its accepted tokens would get other scores than token-by-token generation gives them
    llm = make(model_path, heads_file, locret_pool=7)
    heads_api.record_scores(llm)
    n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
    ref = Algorithm1(n_layer, n_head_kv, B, UB, NS, NLOC, 0, 7)

    def scores_of_call():
        scores, positions = heads_api.recorded_scores(llm)
        return {int(p): scores[:, :, i] for i, p in enumerate(positions)}

    prompt = prompt_tokens[:300]
    n_past = 0
    for i in range(0, len(prompt), UB):
        part = prompt[i:i + UB]
        last = i + UB >= len(prompt)
        n_past = decode(llm, part, n_past, last)
        ref.place_call(n_past - len(part), len(part), last, scores_of_call())

    text = prompt_tokens[300:]
    ev0 = llm.locret_stats()["n_evictions"]
    mismatches, n_rej_after_eviction, step = [], 0, 0
    while n_past < 300 + 150:
        room = llm.locret_room()
        assert room >= 1
        n = min(room, 7) if respect_room else 7
        batch = text[n_past - 300: n_past - 300 + n]
        ev = llm.locret_stats()["n_evictions"]
        _verify(llm, batch, n_past)
        scores = scores_of_call()
        kept = 1 + step % n  # the sampled token and step % n drafts
        step += 1
        if kept < n:
            assert llm._ctx.kv_cache_seq_rm(0, n_past + kept, -1) is not False
            n_rej_after_eviction += llm.locret_stats()["n_evictions"] > ev
        # generation parts are scored token by token (no pooling), as single generated tokens are
        ref.pool = 0
        for p in range(n_past, n_past + kept):
            ref.place([p], scores, True)
        ref.pool = 7
        n_past += kept
        if any(llm.locret_retained(il, h).tolist() != [u[0] for u in ref.units[il][h]]
               for il in range(n_layer) for h in range(n_head_kv)):
            mismatches.append(n_past)
            if stop_at_mismatch:
                break
    assert llm.locret_stats()["pos_logical"] == n_past
    return mismatches, llm.locret_stats()["n_evictions"] - ev0, n_rej_after_eviction


def test_a_draft_verified_and_cut_back_leaves_the_cache_algorithm_1_gives_the_accepted_tokens(model_path, heads_file,
                                                                                              prompt_tokens):
    mismatches, n_evictions, n_rej = _speculate(model_path, heads_file, prompt_tokens, respect_room=True)
    assert mismatches == [], f"retained sets differ from Algorithm 1 after positions {mismatches[:5]}"
    # generation passed several evictions (b + B = 128 cells), and the case the room is for happened: tokens
    # rejected from a batch before which the cache evicted
    assert n_evictions >= 4 and n_rej >= 1, (n_evictions, n_rej)


def test_a_draft_past_the_room_would_change_what_is_kept(model_path, heads_file, prompt_tokens):
    # the same run with batches of 7 whatever the room: an eviction falls inside a batch, where token-by-token
    # generation would not evict (so the comparison above can fail)
    mismatches, _, _ = _speculate(model_path, heads_file, prompt_tokens, respect_room=False, stop_at_mismatch=True)
    assert mismatches


def _get(url):
    with urllib.request.urlopen(url, timeout=60) as r:
        body = r.read().decode()
    return body if url.endswith("/metrics") else json.loads(body)


def _metric(text, name):
    """A Locret line of /metrics: its value (the first line named so)."""
    for line in text.splitlines():
        if line.startswith("llamacpp:" + name + " ") or line.startswith("llamacpp:" + name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics:\n{text}")


def test_server_ngram_speculation_with_a_budget_evicts_where_plain_generation_does(tmp_path, model_path):
    # a document and the start of its copy, past the budget: the continuation quotes the input (what prompt lookup is
    # for); 130 generated tokens pass at least two evictions (b + B = 320 cells, one every 64 tokens)
    text = natural_text()[:2500]
    body = {"prompt": text + "\n\nRepeat the text above word for word:\n\n" + text[:300], "n_predict": 130,
            "temperature": 0, "cache_prompt": False}
    base = [BIN / "llama-server", "-m", model_path, "--locret-heads", HEADS, "--locret-budget", "256", "-ub", "64",
            "-b", "256", "-c", "8192", "-np", "1", "--metrics", "--slot-save-path", tmp_path]
    runs = {}
    for name, extra in (("plain", []), ("ngram", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                                  "--spec-ngram-simple-size-m", "8"]),
                        # the default model drafting for itself, its context evicting with the streaming policy (it
                        # has no heads of its own) to a budget of 192: the two caches evict at different points
                        ("draft", ["-md", model_path, "--spec-type", "draft-simple", "--spec-draft-n-max", "8",
                                   "--locret-draft-budget", "192", "-lv", "4"])):
        port = free_port()
        with http_server(base + extra + ["--port", port], tmp_path / f"{name}.log", port) as url:
            before = _get(url + "/metrics")
            answer = post_json(url + "/completion", body)
            slot = _get(url + "/slots")[0]["locret"]
            after = _get(url + "/metrics")
            props = _get(url + "/props")["locret"]
            runs[name] = answer, slot, before, after, props
            if name == "ngram":
                # the slot's cache saved and restored round-trips its Locret state
                saved = post_json(url + "/slots/0?action=save", {"filename": "slot0.bin"})
                assert saved["n_saved"] == slot["pos_logical"]
                post_json(url + "/slots/0?action=erase", {})
                assert _get(url + "/slots")[0]["locret"]["n_cells_used"] == 0
                assert post_json(url + "/slots/0?action=restore", {"filename": "slot0.bin"})["n_restored"] == \
                    slot["pos_logical"]
                assert _get(url + "/slots")[0]["locret"] == slot

    (plain, plain_slot, *_), (spec, slot, before, after, props) = runs["plain"], runs["ngram"]
    # the draft model: drafts accepted, the target's evictions where plain generation has them, and the draft's
    # context in its own cache of pad(192 + 64, 256) cells, evicting as it reads the same tokens
    draft, draft_slot = runs["draft"][:2]
    assert draft["tokens_predicted"] == 130 and draft_slot == plain_slot, (draft_slot, plain_slot)
    assert draft["timings"].get("draft_n_accepted", 0) > 0, draft["timings"]
    log = (tmp_path / "draft.log").read_text()
    assert "Locret: the draft model evicts in its own cache: budget 192, policy streaming" in log
    assert re.search(r"budget 192\b.*-> 256 KV cells per sequence", log), log[-3000:]
    assert plain["tokens_predicted"] == spec["tokens_predicted"] == 130
    # drafts were made and accepted
    assert spec["timings"].get("draft_n", 0) > 0 and spec["timings"].get("draft_n_accepted", 0) > 0, spec["timings"]
    # the evictions fell where they fall without speculation: the same count, the same units evicted, the same cells
    # held (a draft batch crossing an eviction point would evict earlier, fewer units); the greedy text itself may
    # differ, as llama-server's does without a budget: the CPU backend's logits for a batch differ slightly from one
    # token's, and a near-tie can pick another token
    assert slot == plain_slot, (slot, plain_slot)
    # the prompt (~590 tokens) evicts at least twice in 320 cells, the 130 generated tokens at least twice more
    assert slot["n_evictions"] >= 4 and slot["pos_logical"] == spec["tokens_evaluated"] + 129
    # /metrics: counters from zero to the slot's figures (one request on a fresh server), the gauge of its cells
    assert _metric(before, "locret_evictions_total") == 0
    assert _metric(after, "locret_evictions_total") == slot["n_evictions"]
    assert _metric(after, "locret_units_evicted_total") == slot["n_units_evicted"]
    assert _metric(after, "locret_eviction_seconds_total") > 0
    assert _metric(after, 'locret_cells_used') == slot["n_cells_used"] and 0 < slot["n_cells_used"] <= 320
    assert props["budget"] == 256 and props["policy"] == "heads" and props["n_ubatch"] == 64

    # the same state in-process: the slot's saved cache, loaded into a context with the server's settings, gives
    # locret_stats() equal to the /slots fields
    from locret.llama import Llama

    llm = Llama(model_path=str(model_path), locret_heads=str(HEADS), locret_budget=256, n_ctx=8192, n_batch=256,
                n_ubatch=64, flash_attn=True, verbose=False)
    tokens, n = (llama_cpp.llama_token * 8192)(), ctypes.c_size_t()
    assert llama_cpp.llama_state_seq_load_file(llm._ctx.ctx, str(tmp_path / "slot0.bin").encode(), 0, tokens, 8192,
                                               ctypes.byref(n)) > 0
    st = llm.locret_stats()
    assert {k: st[k] for k in slot} == slot, (st, slot)


def test_speculation_with_sage_kv_is_refused_at_start(model_path):
    # a draft model is refused too (test_eviction.py's refusals of llama-server settings)
    proc = run([BIN / "llama-server", "-m", model_path, "--locret-heads", HEADS, "--locret-budget", "256",
                "--locret-policy", "sage", "--spec-type", "ngram-simple", "--port", "0"], timeout=120)
    assert proc.returncode != 0
    assert "SAGE-KV selects once" in proc.stderr, proc.stderr[-2000:]


def test_python_refuses_llama_cpp_pythons_draft_model_with_a_budget(model_path):
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    from locret.heads import HeadsError
    from locret.llama import Llama

    with pytest.raises(HeadsError, match="draft_model cannot be used with locret_budget"):
        Llama(model_path=str(model_path), locret_heads=str(HEADS), locret_budget=256, verbose=False,
              draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4))
