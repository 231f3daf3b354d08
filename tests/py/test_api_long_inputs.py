"""The user-facing ways in, with the shipped trained heads: `locret.Llama` (prompt fed chunk by chunk, and chat
completion streamed) and `locret serve` (llama-server's OpenAI-compatible API). Each finds a passkey in a
1,800-token prompt with b = 256, B = 128: twelve evictions, and the cache never holds more than b + B units (in 512
cells, under a third of the prompt).

One fixed prompt per check, greedy decoding: these check that the answer comes through every path in bounded memory,
which a few thousand tokens exercise exactly as 37K do (the same chunks, evictions, compactions and positions, only
fewer of them). Inputs past SmolLM2's 8K window, and how often Locret finds the key across depths, lengths and
budgets, are the evaluation's job (scripts/eval_passkey.py, `locret eval`; figures in docs/results.md)."""
from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from conftest import REPO, THREADS, free_port, http_server, post_json, run

from locret import Llama, models, tasks  # before llama_cpp: it points llama-cpp-python at our libllama
import llama_cpp  # noqa: E402
from locret.evaluation import decoding
from locret.tasks import passkey

BUDGET, UBATCH, N_TOKENS, DEPTH = 256, 128, 1800, 0.5
CELLS = 512  # b + B = 384, padded to llama.cpp's 256


@pytest.fixture(scope="module")
def heads():
    path = models.shipped_heads(models.DEFAULT_MODEL)
    assert path is not None, "heads/ has no trained heads for the default model"
    return path


@pytest.fixture(scope="module")
def llm(model_path, heads):
    llm = Llama(str(model_path), n_ctx=8192, n_batch=UBATCH, n_ubatch=UBATCH, n_threads=THREADS, n_threads_batch=THREADS,
                flash_attn=True, locret_heads=str(heads), locret_budget=BUDGET, verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def sample(llm):
    return tasks.get("passkey").generate(7, 0, tokenize=decoding.tokenizer(llm), n_tokens=N_TOKENS, depth=DEPTH,
                                         chat_format=decoding.chat_format(llm))


def user_message(sample) -> str:
    return f"{passkey.INTRO}\n\n{sample.context}\n\n{passkey.QUESTION}"


def test_locret_llama_finds_the_passkey_in_bounded_cells(llm, sample):
    tokens = sample.tokens
    assert len(tokens) > 4 * BUDGET
    llm.reset()
    most = 0
    for start in range(0, len(tokens), UBATCH):  # one chunk per call: the cells are checked after each
        llm.eval(tokens[start: start + UBATCH], prompt_continues=start + UBATCH < len(tokens))
        st = llm.locret_stats()
        most = max(most, st["n_cells_used"])
        assert st["n_cells_used"] <= BUDGET + UBATCH, f"after {start + UBATCH} tokens: {st}"
    assert most > BUDGET  # the cache filled, and was compressed, again and again
    answer = []
    for _ in range(24):
        token = int(np.argmax(decoding.last_logits(llm)))
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
            break
        answer.append(token)
        llm.eval([token])
        assert llm.locret_stats()["n_cells_used"] <= BUDGET + UBATCH
    st = llm.locret_stats()
    assert st["pos_logical"] == len(tokens) + len(answer) and st["n_evictions"] >= (len(tokens) - BUDGET) // UBATCH - 1
    text = llm.detokenize(answer).decode(errors="replace")
    assert sample.score(text) == 1.0, f"key {sample.answers[0]} not in {text!r}"


def test_streamed_chat_completion_answers_a_long_message(llm, sample):
    llm.reset()
    pieces = []
    for chunk in llm.create_chat_completion(messages=[{"role": "user", "content": user_message(sample)}],
                                            max_tokens=24, temperature=0.0, stream=True):
        delta = chunk["choices"][0]["delta"]
        pieces.append(delta.get("content") or "")
    text = "".join(pieces)
    st = llm.locret_stats()
    assert len([p for p in pieces if p]) >= 2  # streamed piece by piece, not in one block
    assert st["pos_logical"] > N_TOKENS - 100 and st["n_cells_used"] <= BUDGET + UBATCH and st["n_cells"] == CELLS
    assert st["n_evictions"] >= (N_TOKENS - BUDGET) // UBATCH - 1
    assert sample.score(text) == 1.0, f"key {sample.answers[0]} not in {text!r}"


def test_locret_serve_refuses_bad_settings(model_path):
    serve = [sys.executable, "-m", "locret", "serve"]
    cases = (
        # llama-server itself checks the budget: it is started, and must exit with the reason
        (serve + ["--model", model_path, "--budget", "0", "--port", free_port()], "at least 1"),
        # locret resolves devices and models before any server starts
        (serve + ["--print-command", "--device", "pdp-11"], "pdp-11"),
        (serve + ["--print-command", "--model", "no-such-model"], "no-such-model"),
    )
    for cmd, message in cases:
        proc = run(cmd, timeout=120, cwd=REPO)
        assert proc.returncode != 0 and message in (proc.stdout + proc.stderr), proc.stdout[-1500:] + proc.stderr[-1500:]


def _chat(url, sample, max_tokens=24, **extra):
    return post_json(url + "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": user_message(sample)}], "max_tokens": max_tokens,
                      "temperature": 0, **extra})


def test_locret_serve_answers_a_long_request_and_reuses_only_what_it_holds(model_path, heads, llm, tmp_path):
    """`locret serve --slots 2` (llama-server's OpenAI API, -np 2): it finds the shipped heads itself, and a slot with
    its own budget of cells answers a request that evicts about twelve times (two concurrent clients: the official
    OpenAI client's test, test_openai_client.py). Then a new request on the slot:
    one that leaves the cached prompt in its last part reuses the cached prefix; one that leaves it inside the
    compressed part (the needle changed) is processed whole, and answers the new key. Stopping `locret serve` stops
    the server it runs."""
    # ~40-80 s on 2 cores: a server start and three 1.8K-token prefills (the first request, the reused prefix, the
    # changed needle); the slot paths it checks (prefix reuse, divergence in the compressed part) need all three
    import urllib.request

    samples = [tasks.get("passkey").generate(7, 0, tokenize=decoding.tokenizer(llm), n_tokens=N_TOKENS, depth=DEPTH,
                                             chat_format=decoding.chat_format(llm))]
    port = free_port()
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "locret", "serve", "--model", model_path, "--budget", BUDGET, "--ubatch", UBATCH,
           "--context", "32k", "--slots", 2, "--threads", str(THREADS), "--port", port, "--", "-lv", "4"]
    with http_server(cmd, log_path, port, startup_s=240) as url:
        # every request on slot 0: the one that holds the first prompt (the other slot is idle and empty)
        replies = [_chat(url, samples[0], id_slot=0)]
        for sample, reply in zip(samples, replies):
            assert reply["usage"]["prompt_tokens"] > N_TOKENS - 100
            answer = reply["choices"][0]["message"]["content"]
            assert sample.score(answer) == 1.0, f"key {sample.answers[0]} not in {answer!r}"

        # the same document, another question: the prompts part in the last few hundred tokens, which the slot
        # placed after its last eviction
        asked = tasks.get("passkey").generate(7, 0, tokenize=decoding.tokenizer(llm), n_tokens=N_TOKENS, depth=DEPTH,
                                              chat_format=decoding.chat_format(llm))
        again = post_json(url + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": user_message(asked).replace(passkey.QUESTION,
                                                                                 "What is the pass key? Reply with it.")}],
            "max_tokens": 24, "temperature": 0, "id_slot": 0})
        assert again["timings"]["cache_n"] > N_TOKENS - 2 * UBATCH, again["timings"]
        # a different needle in the middle: the cached prompt cannot be cut there
        other = tasks.get("passkey").generate(13, 0, tokenize=decoding.tokenizer(llm), n_tokens=N_TOKENS,
                                              depth=DEPTH, chat_format=decoding.chat_format(llm))
        changed = _chat(url, other, id_slot=0)
        assert changed["timings"]["cache_n"] == 0, changed["timings"]
        answer = changed["choices"][0]["message"]["content"]
        assert other.score(answer) == 1.0, f"key {other.answers[0]} not in {answer!r}"
    # stopping `locret serve` stopped the server it runs (it execs llama-server): nothing answers on the port
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=5)
    text = log_path.read_text()
    command = text.splitlines()[0]
    assert f"--locret-heads {heads}" in command, command  # `locret serve` found the shipped (plain) heads itself
    assert " -np 2 " in command and " -c 65536 " in command, command  # -c: 32K for each slot
    # two streams of b + ubatch cells, whatever -c is
    assert re.search(rf"llama_kv_cache: size = +[\d.]+ MiB \( *{CELLS} cells, +30 layers, +2/2 seqs\)", text), text[-3000:]
    assert "diverges inside the compressed part" in text
