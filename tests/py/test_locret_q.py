"""Locret-Q at inference: a query placed at the start of the prompt is pinned (never evicted, counted in
the budget), through the C API and `locret.Llama`'s `locret_query`, with refusals for a query the budget
cannot hold. (The retained sets with a pin equal the numpy model of Algorithm 1: test_eviction.py.)
"""
from __future__ import annotations

import re
import urllib.error

import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
import llama_cpp
from locret import eviction, heads as heads_api
from locret.query import place_query

from conftest import free_port, http_server, natural_text, post_json, run, tool
from test_eviction import B, UB, make

QUERY = "Which module reads and writes tar archives?"


def pinned_count(llm, tokens, query, limit):
    return eviction.query_tokens(llama_cpp.llama_model_get_vocab(llm._model.model), tokens, query, limit)


def _n_layer_heads(llm):
    return llama_cpp.llama_model_n_layer(llm._model.model), llama_cpp.llama_model_n_head_kv(llm._model.model)


def _pinned_everywhere(llm, n_pin):
    n_layer, n_head_kv = _n_layer_heads(llm)
    return all(llm.locret_retained(il, h)[:n_pin].tolist() == list(range(n_pin))
               for il in range(n_layer) for h in range(n_head_kv))


def test_pinned_query_survives_every_eviction_and_counts_in_the_budget(model_path, heads_file):
    llm = make(model_path, heads_file, n_batch=UB)
    tokens = llm.tokenize(place_query(QUERY, natural_text() * 2).encode(), add_bos=True)
    n_pin = pinned_count(llm, tokens, QUERY, B)
    # the query's tokens (and a BOS before them, if the model adds one), not one more or less
    assert llm.detokenize(tokens[:n_pin]).decode().strip().endswith(QUERY)
    assert not llm.detokenize(tokens[:n_pin - 1]).decode().strip().endswith(QUERY)
    llm.locret_pin_query(n_pin)
    n_past, evictions_checked = 0, 0
    for i in range(0, 2400, UB):
        chunk = tokens[i:i + UB]
        llm._batch.set_batch(batch=chunk, n_past=n_past, logits_all=False)
        llm._batch.batch.logits[len(chunk) - 1] = False  # prefill chunks: every one is evicted with stabilizers
        assert llama_cpp.llama_decode(llm._ctx.ctx, llm._batch.batch) == 0
        n_past += len(chunk)
        st = llm.locret_stats()
        if st["n_evictions"] > evictions_checked:
            evictions_checked = st["n_evictions"]
            assert _pinned_everywhere(llm, n_pin), f"a pinned unit was evicted by eviction {evictions_checked}"
            # counted in the budget: the eviction left b units (pinned included), then the chunk was placed
            assert st["n_cells_used"] == B + len(chunk)
    assert llm.locret_stats()["n_evictions"] >= 50
    assert llm.locret_stats()["n_pinned"] == n_pin


def test_a_query_the_budget_cannot_hold_is_refused(model_path, heads_file):
    llm = make(model_path, heads_file)
    with pytest.raises(heads_api.HeadsError, match="leaves no room in the budget"):
        llm.locret_pin_query(B - 16)  # + 16 stabilizers = the whole budget
    llm.locret_pin_query(B - 17)  # the largest that leaves one unit to choose
    with pytest.raises(heads_api.HeadsError, match="locret_query needs an evicting context"):
        plain = locret.Llama(model_path=str(model_path), n_ctx=512, verbose=False)
        plain.create_completion("text", max_tokens=1, locret_query=QUERY)
    long_query = " ".join(["word"] * 200)
    with pytest.raises(heads_api.HeadsError, match="not within the first 96 tokens"):
        llm.create_completion("text", max_tokens=1, locret_query=long_query)


def test_pinning_after_an_eviction_is_refused_until_the_sequence_is_emptied(model_path, heads_file):
    llm = make(model_path, heads_file, n_batch=UB)
    tokens = llm.tokenize(natural_text().encode(), add_bos=True)[:400]
    llm.eval(tokens)
    assert llm.locret_stats()["n_evictions"] > 0
    with pytest.raises(heads_api.HeadsError, match="already evicted units"):
        llm.locret_pin_query(10)
    llm._ctx.kv_cache_seq_rm(-1, 0, -1)
    llm.locret_pin_query(10)
    assert llm.locret_stats()["n_pinned"] == 10


def test_locret_query_reaches_the_cache_from_python(model_path, heads_file):
    ub = 64  # the prompt is processed four times below: chunks of 64 halve the time of UB's 32, with the same paths
    llm = make(model_path, heads_file, n_batch=256, n_ubatch=ub, locret_query=QUERY)
    document = natural_text()[:3000]  # ~700 tokens: about 9 evictions at b = 96, ub = 64
    out = llm.create_completion(document, max_tokens=4, temperature=0.0)
    assert out["choices"][0]["text"] is not None
    st = llm.locret_stats()
    prompt = llm.tokenize(place_query(QUERY, document).encode(), add_bos=True)
    assert st["n_evictions"] >= (len(prompt) - B) // ub - 1 >= 5
    n_pin = pinned_count(llm, prompt, QUERY, B)
    assert st["n_pinned"] == n_pin and _pinned_everywhere(llm, n_pin)
    assert llm.detokenize(llm.input_ids[:n_pin].tolist()).decode().strip().endswith(QUERY)

    # per call: another query re-pins (the sequence is processed again); "" turns the query off. These calls read a
    # shorter document (~350 tokens: still some 3 evictions, none of them asserted on), which halves their time
    short = document[:1500]
    other = "What does the json module encode?"
    llm.create_completion(short, max_tokens=1, locret_query=other)
    assert llm.detokenize(llm.input_ids[:llm.locret_stats()["n_pinned"]].tolist()).decode().strip().endswith(other)
    llm.create_completion(short, max_tokens=1, locret_query="")
    assert llm.locret_stats()["n_pinned"] == 0

    # a chat: the query opens the first user turn, after the template's markers (pinned too), through the evictions
    llm.create_chat_completion([{"role": "user", "content": short}], max_tokens=1, locret_query=other)
    n_pin = llm.locret_stats()["n_pinned"]
    head = llm.detokenize(llm.input_ids[:n_pin].tolist(), special=True).decode()
    assert llm.locret_stats()["n_evictions"] > 0
    assert "user" in head and head.strip().endswith(other) and _pinned_everywhere(llm, n_pin)


def test_pinned_count_finds_the_query_however_it_is_split(model_path, heads_file):
    llm = make(model_path, heads_file)
    # a query glued to the text before it (no separator): its first token differs from the query's own
    tokens = llm.tokenize(("Preface:" + QUERY + "\n\nText").encode(), add_bos=True)
    n = pinned_count(llm, tokens, "  " + QUERY + " ", 100)
    assert llm.detokenize(tokens[:n]).decode().endswith(QUERY) and n < len(tokens)
    with pytest.raises(heads_api.HeadsError, match="not within the first 4 tokens"):
        pinned_count(llm, tokens, QUERY, 4)
    with pytest.raises(heads_api.HeadsError, match="empty"):
        pinned_count(llm, tokens, " \n ", 100)


# the tools: --locret-query for llama-completion and llama-cli (through its server), "locret_query" for llama-server

PIN_LOG = re.compile(r"Locret-Q: the first (\d+) positions of sequence (\d+) are pinned")


def _expected_pin(model_path, text, query, limit=B):
    vocab_only = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    tokens = vocab_only.tokenize(text.encode(), add_bos=True, special=True)
    return eviction.query_tokens(llama_cpp.llama_model_get_vocab(vocab_only._model.model), tokens, query, limit)


def test_llama_completion_pins_its_query(model_path, heads_file, tmp_path):
    document = natural_text()[:3000]  # ~700 tokens: pinned in the first batch, then evicted around
    query_file = tmp_path / "query.txt"
    query_file.write_text(QUERY + "\n")
    for flag in (["--locret-query", QUERY], ["--locret-query-file", query_file]):
        proc = run([tool("llama-completion"), "-m", model_path, "--locret-heads", heads_file, "--locret-budget", B,
                    "-ub", UB, "-b", 256, "-c", 8192, "-p", document, "-n", 2, "-no-cnv", "--temp", 0, "-t", 2, "-lv", 4, *flag],
                   timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = PIN_LOG.search(proc.stderr)
        assert got, proc.stderr[-3000:]
        assert int(got.group(1)) == _expected_pin(model_path, place_query(QUERY, document), QUERY)


@pytest.mark.parametrize("flags,message", [
    (["--locret-query", " ".join(["word"] * 200)], "not within the first 96 tokens"),
    (["--locret-query", "  "], "the query is empty"),
    (["--locret-query-file", "/nonexistent/query.txt"], "cannot read"),
])
def test_llama_completion_refuses_a_query_it_cannot_pin(model_path, heads_file, flags, message):
    proc = run([tool("llama-completion"), "-m", model_path, "--locret-heads", heads_file, "--locret-budget", B,
                "-ub", UB, "-p", "some text", "-n", 2, "-no-cnv", *flags], timeout=120)
    assert proc.returncode > 0 and message in proc.stderr, proc.stderr[-2000:]


def test_llama_completion_refuses_a_query_without_a_budget(model_path):
    proc = run([tool("llama-completion"), "-m", model_path, "-p", "some text", "-n", 2, "-no-cnv",
                "--locret-query", QUERY], timeout=120)
    assert proc.returncode > 0 and "needs an evicting cache" in proc.stderr, proc.stderr[-2000:]


def test_llama_bench_pins_its_query_in_every_prompt_run(model_path, heads_file, tmp_path):
    query_file = tmp_path / "query.txt"
    query_file.write_text(QUERY)
    for flag in (["--locret-query", QUERY], ["--locret-query-file", query_file]):
        proc = run([tool("llama-bench"), "-m", model_path, "--locret-heads", heads_file, "--locret-budget", B, "-ub", UB,
                    "-b", UB, "-p", 256, "-n", 0, "-r", 2, "-t", 2, "-v", *flag], timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        pins = [int(m.group(1)) for m in PIN_LOG.finditer(proc.stderr)]
        # the warmup and both repetitions start an emptied sequence: pinned each time, the query's own tokens
        assert pins == [_expected_pin(model_path, place_query(QUERY, ""), QUERY)] * 3, proc.stderr[-3000:]
    proc = run([tool("llama-bench"), "-m", model_path, "-p", 256, "-n", 0, "-r", 1, "--locret-query", QUERY], timeout=120)
    assert proc.returncode > 0 and "the context does not evict" in proc.stderr, proc.stderr[-2000:]
    long_query = ["--locret-query", " ".join(["word"] * 200)]
    for extra, message in ((["-b", 64], "(201 tokens) does not fit in the prompt's first batch (64 tokens)"),
                           ([], "a pinned query of 200 tokens leaves no room in the budget")):
        proc = run([tool("llama-bench"), "-m", model_path, "--locret-heads", heads_file, "--locret-budget", B, "-ub", UB,
                    "-p", 256, "-n", 0, "-r", 1, *long_query, *extra], timeout=120)
        assert proc.returncode > 0 and message in proc.stderr, proc.stderr[-2000:]


def test_llama_cli_sends_its_query_to_the_cache(model_path, heads_file, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(natural_text()[:3000])
    proc = run([tool("llama-cli"), "-m", model_path, "-f", prompt, "-st", "--simple-io", "--no-display-prompt",
                "--temp", 0, "-n", 4, "-c", 8192, "-b", 256, "-ub", UB, "-t", 2, "--locret-heads", heads_file,
                "--locret-budget", B, "--locret-query", QUERY, "-lv", 4], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = PIN_LOG.search(proc.stderr)
    # the chat template's markers come before the query in the first user turn: more than the query's tokens
    assert got and int(got.group(1)) > _expected_pin(model_path, QUERY, QUERY), proc.stderr[-3000:]


def test_llama_server_pins_each_requests_query(model_path, heads_file, tmp_path):
    port = free_port()
    cmd = [tool("llama-server"), "-m", model_path, "--locret-heads", heads_file, "--locret-budget", B, "-c", 8192,
           "-b", 256, "-ub", UB, "-t", 2, "--host", "127.0.0.1", "--port", port, "-lv", 4]
    document = natural_text()[:3000]  # ~700 tokens: pinned in the first batch, then evicted around
    log = tmp_path / "server.log"
    with http_server(cmd, log, port) as url:
        reply = post_json(url + "/completion", {"prompt": document, "locret_query": QUERY, "n_predict": 2,
                                                "temperature": 0})
        assert reply["content"] is not None
        pins = [int(m.group(1)) for m in PIN_LOG.finditer(log.read_text())]
        assert pins == [_expected_pin(model_path, place_query(QUERY, document), QUERY)], pins

        other = "What does the json module encode?"
        reply = post_json(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": document}],
                                                         "locret_query": other, "max_tokens": 2, "temperature": 0})
        assert reply["choices"][0]["message"]["content"] is not None
        pins = [int(m.group(1)) for m in PIN_LOG.finditer(log.read_text())]
        assert len(pins) == 2 and pins[1] > _expected_pin(model_path, other, other), pins

        for body, message in (({"prompt": document, "locret_query": " ".join(["word"] * 200), "n_predict": 1},
                               "not within the first 96 tokens"),
                              ({"prompt": document, "locret_query": 7, "n_predict": 1}, "must be a non-empty string"),
                              ({"prompt": [1, 2, 3], "locret_query": QUERY, "n_predict": 1}, "'prompt' that is a string")):
            with pytest.raises(urllib.error.HTTPError) as e:
                post_json(url + "/completion", body)
            assert e.value.code == 400 and message in e.value.read().decode()
        # and it keeps serving
        assert post_json(url + "/completion", {"prompt": "Hello", "n_predict": 1})["content"] is not None
