"""Real clients: the official `openai` Python package against `locret serve` (the patched llama-server, the shipped
plain heads, Locret-Q auto), and llama-cpp-python's own `create_chat_completion` in-process through `locret.Llama`.

Every request is a passkey document of ~840 tokens in a budget of b = 128 units with chunks of B = 64: 256 cells
per slot, so each request evicts about ten times while its prompt is read; the question at the end of the user
message is found by Locret-Q auto, copied to the start and pinned. The answers are checked for the key (greedy
decoding; the seeds are ones this model answers right in this setting, alone and two at a time: seed 3, for one,
it misses), the server's log for the evictions of each request (-lv 5 prints llama.cpp's debug lines: one per
eviction), and the streamed, the concurrent and the aborted paths for what a client sees. One server for the
module; 33-36 s on 2 idle cores.
"""
from __future__ import annotations

import re
import sys
import threading
import time

import openai  # the official client (scripts/requirements.txt pins it; setup.sh installs it)
import pytest

from conftest import REPO, THREADS, free_port, http_server

from locret import Llama, tasks  # before llama_cpp: it points llama-cpp-python at our libllama
import llama_cpp  # noqa: E402
from locret.evaluation import decoding
from locret.tasks import passkey

HEADS = REPO / "heads" / "smollm2-135m-instruct.gguf"
BUDGET, UBATCH, N_TOKENS = 128, 64, 800   # prompts of ~840 tokens with the chat template
CELLS = 256                               # a slot's cache: b + B, padded to 256
MAX_TOKENS = 24                           # "The five-digit passkey hidden in the text is 12345." is 18 tokens
EVICTION = re.compile(r"Locret eviction \d+ of sequence (\d+):")
# seeds whose keys this model finds with these settings (greedy): each test its own, so no answer can come from
# another test's cache
SEED_ALONE, SEED_PAIR, SEED_ABORTED, SEED_AFTER, SEED_IN_PROCESS = 13, (7, 11), 17, 19, 5


@pytest.fixture(scope="module")
def vocab(model_path):
    return llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)


def sample(vocab, seed: int):
    return tasks.get("passkey").generate(seed, 0, tokenize=decoding.tokenizer(vocab), n_tokens=N_TOKENS, depth=0.5)


def messages(sample) -> list[dict]:
    # the question closes the user message: the server's Locret-Q auto finds and pins it
    return [{"role": "user", "content": f"{passkey.INTRO}\n\n{sample.context}\n\n{passkey.QUESTION}"}]


class Server:
    def __init__(self, url: str, log_path):
        self.url, self.log_path = url, log_path

    def client(self):
        # no retries: a request the server drops must fail the test, not be sent again
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=600)

    def log_size(self) -> int:
        return len(self.log_path.read_text(errors="replace"))

    def log_since(self, offset: int, until: str | None = None, wait_s: float = 10) -> str:
        """The log written after `offset`; with `until`, waits (the log is written by a thread) until it holds it."""
        deadline = time.monotonic() + wait_s
        while True:
            text = self.log_path.read_text(errors="replace")[offset:]
            if until is None or until in text or time.monotonic() > deadline:
                return text
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("openai") / "server.log"
    cmd = [sys.executable, "-m", "locret", "serve", "--model", model_path, "--heads", HEADS, "--budget", BUDGET,
           "--ubatch", UBATCH, "--context", "8k", "--slots", 2, "--threads", 2, "--port", port,
           "--", "--locret-query", "auto", "-lv", 5]
    with http_server(cmd, log_path, port, startup_s=240) as url:
        yield Server(url, log_path)


def evictions(log: str) -> dict[int, int]:
    """evictions per sequence (= slot) in a piece of the server's log"""
    counts: dict[int, int] = {}
    for m in EVICTION.finditer(log):
        counts[int(m.group(1))] = counts.get(int(m.group(1)), 0) + 1
    return counts


def least_evictions(prompt_tokens: int) -> int:
    # the cache fills at b + B tokens, then one eviction per chunk of B
    return (prompt_tokens - BUDGET - UBATCH) // UBATCH


@pytest.fixture(scope="module")
def alone(server, vocab):
    """One chat completion, not streamed: (sample, reply, the server's log of it)."""
    s = sample(vocab, SEED_ALONE)
    offset = server.log_size()
    reply = server.client().chat.completions.create(model="smollm2", messages=messages(s), max_tokens=MAX_TOKENS,
                                                    temperature=0)
    return s, reply, server.log_since(offset, until="stop processing")


def test_chat_completion_finds_the_key_past_the_budget(alone):
    s, reply, log = alone
    choice = reply.choices[0]
    assert s.score(choice.message.content) == 1.0, f"key {s.answers[0]} not in {choice.message.content!r}"
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert reply.object == "chat.completion" and reply.usage.prompt_tokens > 4 * BUDGET
    assert reply.usage.completion_tokens <= MAX_TOKENS
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    # llama-server's own fields come through the client as extras
    assert reply.model_extra["timings"]["prompt_n"] == reply.usage.prompt_tokens
    # the question was found and pinned, and the prompt was read in a cache of 256 cells, evicting all along
    assert f'pinned: "{passkey.QUESTION}"' in log, log[-3000:]
    assert sum(evictions(log).values()) >= least_evictions(reply.usage.prompt_tokens), evictions(log)


def test_streamed_chat_completion_is_the_same_answer(server, alone):
    s, reply, _ = alone
    offset = server.log_size()
    stream = server.client().chat.completions.create(model="smollm2", messages=messages(s), max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    text = "".join(pieces)
    assert len([p for p in pieces if p]) >= 5, pieces  # piece by piece, not in one block
    assert text == reply.choices[0].message.content, (text, reply.choices[0].message.content)
    assert finish == "stop"
    assert usage is not None and usage.prompt_tokens == reply.usage.prompt_tokens
    assert usage.completion_tokens == reply.usage.completion_tokens
    # the same prompt on the slot that holds it compressed: read again whole, with its evictions
    log = server.log_since(offset, until="stop processing")
    assert sum(evictions(log).values()) >= least_evictions(usage.prompt_tokens), evictions(log)


def test_two_clients_at_once_each_get_their_own_key(server, vocab):
    samples = [sample(vocab, seed) for seed in SEED_PAIR]
    keys = [s.answers[0] for s in samples]
    assert keys[0] != keys[1]
    replies: list = [None, None]
    errors: list = []
    start = threading.Barrier(2)

    def ask(k: int) -> None:
        try:
            client = server.client()  # a client of its own, as two programs would have
            start.wait(timeout=30)
            replies[k] = client.chat.completions.create(model="smollm2", messages=messages(samples[k]),
                                                        max_tokens=MAX_TOKENS, temperature=0)
        except Exception as e:  # noqa: BLE001  (reported below, in the test's thread)
            errors.append(e)

    offset = server.log_size()
    threads = [threading.Thread(target=ask, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    for k, reply in enumerate(replies):
        answer = reply.choices[0].message.content
        assert samples[k].score(answer) == 1.0, f"key {keys[k]} not in {answer!r}"
        assert not passkey.score(answer, keys[1 - k]), f"the other request's key {keys[1 - k]} in {answer!r}"
    log = server.log_since(offset)
    # both slots read their documents at once, each evicting in its own sequence
    counts = evictions(log)
    assert sorted(counts) == [0, 1], counts
    assert min(counts.values()) >= least_evictions(min(r.usage.prompt_tokens for r in replies)), counts


def test_a_client_that_leaves_mid_stream_frees_its_slot(server, vocab):
    aborted, after = sample(vocab, SEED_ABORTED), sample(vocab, SEED_AFTER)
    client = server.client()
    offset = server.log_size()
    # a long answer asked for, on slot 1 (llama-server's id_slot, through the client's extra_body)
    stream = client.chat.completions.create(model="smollm2", messages=messages(aborted), max_tokens=200,
                                            temperature=0, stream=True, extra_body={"id_slot": 1})
    got = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got.append(chunk.choices[0].delta.content)
        if len(got) == 3:
            break
    stream.close()  # the client goes away: the connection is closed with the answer unfinished
    assert len(got) == 3, got
    log = server.log_since(offset, until="stop processing")
    assert "cancel task" in log, log[-3000:]
    prompt = re.search(r"id +1 \| task \d+ \| new prompt, .*task\.n_tokens = (\d+)", log)
    released = re.search(r"id +1 \| task \d+ \| stop processing: n_tokens = (\d+)", log)
    assert prompt and released, log[-3000:]
    # stopped soon after the client left, far from the 200 tokens asked
    assert int(released.group(1)) < int(prompt.group(1)) + 50, (prompt.group(0), released.group(0))
    # the same slot answers the next client, from its own document
    reply = client.chat.completions.create(model="smollm2", messages=messages(after), max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"id_slot": 1})
    answer = reply.choices[0].message.content
    assert after.score(answer) == 1.0, f"key {after.answers[0]} not in {answer!r}"
    assert not passkey.score(answer, aborted.answers[0])
    assert reply.model_extra["timings"]["cache_n"] == 0  # nothing of the aborted request was reused


def test_llama_cpp_python_chat_completion_in_process(model_path):
    llm = Llama(str(model_path), n_ctx=4096, n_batch=UBATCH, n_ubatch=UBATCH, n_threads=THREADS, n_threads_batch=THREADS,
                locret_heads=str(HEADS), locret_budget=BUDGET, locret_query="auto", verbose=False)
    try:
        s = sample(llm, SEED_IN_PROCESS)
        reply = llm.create_chat_completion(messages=messages(s), max_tokens=MAX_TOKENS, temperature=0.0)
        answer = reply["choices"][0]["message"]["content"]
        assert s.score(answer) == 1.0, f"key {s.answers[0]} not in {answer!r}"
        assert reply["choices"][0]["finish_reason"] == "stop"
        st = llm.locret_stats()
        usage = reply["usage"]
        assert usage["prompt_tokens"] > 4 * BUDGET
        assert st["pos_logical"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert st["n_evictions"] >= least_evictions(usage["prompt_tokens"]), st
        assert st["n_cells_used"] <= BUDGET + UBATCH and st["n_cells"] == CELLS, st
        assert st["n_pinned"] > 0, st  # the question found at the end, pinned at the start
    finally:
        llm.close()
