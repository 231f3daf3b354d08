"""The web page people open: llama-server's own web UI (llama.cpp's Svelte app in tools/ui, built from its sources
with npm by the build, CMakeLists.txt LOCRET_UI) served by `locret serve` at /, driven in a real browser (Debian's
chromium, headless, through Playwright).

One server for the module (the shipped plain heads, b = 128, B = 64: 256 cells a slot, greedy by the server's
default), one browser. The page must load from / (a build without the UI's assets answers / with 404, and the first
test fails); a long document with a question pasted into the chat box and sent must get the right answer in the
page, read in a cache that evicted; the operator's view of that slot (/slots, /metrics, which llama-server serves
beside the page) must show Locret's figures for it. About 20 s on 2 idle cores.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
import time

import pytest
from playwright.sync_api import expect, sync_playwright

from conftest import REPO, free_port, http_server

from locret import tasks  # before llama_cpp: it points llama-cpp-python at our libllama
import llama_cpp  # noqa: E402
from locret.evaluation import decoding
from locret.tasks import passkey

HEADS = REPO / "heads" / "smollm2-135m-instruct.gguf"
BUDGET, UBATCH, N_TOKENS = 128, 64, 800   # a passkey document of ~840 tokens: about ten evictions while it is read
SEED = 13                                 # a key this model finds in this setting (tests/py/test_openai_client.py)
ANSWER_S = 240                            # the page's answer, on a loaded 2-core machine


def chromium() -> str:
    path = shutil.which("chromium")
    assert path, "Debian's chromium is not installed: run scripts/setup.sh (it installs the package)"
    return path


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("web-ui") / "server.log"
    # the page sends no sampling settings of its own unless the user sets them: the server's defaults decide
    # (greedy, 24 tokens at most, enough for "The passkey is 12345.")
    cmd = [sys.executable, "-m", "locret", "serve", "--model", model_path, "--heads", HEADS, "--budget", BUDGET,
           "--ubatch", UBATCH, "--context", "8k", "--slots", 1, "--threads", 2, "--port", port,
           "--", "--locret-query", "auto", "--temp", 0, "-n", 24, "--metrics"]
    with http_server(cmd, log_path, port, startup_s=240) as url:
        yield url


@pytest.fixture(scope="module")
def page():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), headless=True)
        try:
            yield browser.new_page()
        finally:
            browser.close()


@pytest.fixture(scope="module")
def document(model_path):
    vocab = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    s = tasks.get("passkey").generate(SEED, 0, tokenize=decoding.tokenizer(vocab), n_tokens=N_TOKENS, depth=0.5)
    return s, f"{passkey.INTRO}\n\n{s.context}\n\n{passkey.QUESTION}"


def slots(page, url) -> list[dict]:
    reply = page.request.get(url + "/slots")
    assert reply.ok, reply.status
    return reply.json()


def test_the_page_loads_from_root(server, page):
    reply = page.goto(server + "/")
    # without the UI's assets llama-server answers / with 404
    assert reply is not None and reply.status == 200, f"/ answered {reply and reply.status}: the web UI is not built in"
    assert "text/html" in reply.headers.get("content-type", "")
    # the app ran: its chat box is on the page, with the model the server loaded named beside it
    expect(page.locator("textarea")).to_be_visible(timeout=30_000)
    expect(page.locator("body")).to_contain_text("SmolLM2", timeout=30_000)


def test_a_long_document_pasted_into_the_chat_gets_its_answer(server, page, document):
    s, message = document
    page.goto(server + "/")
    box = page.locator("textarea")
    box.fill(message)
    page.locator("button[type=submit]").click()
    answer = page.locator(".chat-message-assistant").first
    # the key shows in the page's answer; greedy decoding, so this model's answer in this setting is known
    expect(answer).to_contain_text(s.answers[0], timeout=ANSWER_S * 1000)
    # and the message the page sent was the document: its prompt was ~840 tokens, read in a cache of 256 cells
    deadline = time.time() + 60
    while slots(page, server)[0]["is_processing"]:
        assert time.time() < deadline, "the slot is still busy a minute after the answer showed"
        time.sleep(0.5)
    slot = slots(page, server)[0]
    assert slot["locret"]["n_evictions"] >= 1 and slot["locret"]["n_units_evicted"] > 0, slot["locret"]


def test_the_operator_sees_the_slots_locret_figures(server, page):
    # llama-server's own operator endpoints, served beside the page: the slot's cache and its evictions
    page.goto(server + "/slots")
    shown = json.loads(page.locator("body").inner_text())
    locret = shown[0]["locret"]
    assert locret["budget"] == BUDGET and locret["policy"] == "heads"
    assert 0 < locret["n_cells_used"] <= locret["n_cells"] <= 2 * (BUDGET + UBATCH)
    assert locret["n_evictions"] >= 1 and locret["n_pinned"] > 0, locret   # Locret-Q auto pinned the question
    page.goto(server + "/metrics")
    metrics = page.locator("body").inner_text()
    used = re.search(r'^llamacpp:locret_cells_used\{slot="0"\} (\d+)', metrics, re.M)
    assert used and int(used.group(1)) == locret["n_cells_used"], metrics[:3000]
