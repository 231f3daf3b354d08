"""Locret-Q auto (--locret-query auto, locret_query="auto"): the question at the end of a prompt or of a chat's last
user message, found by one written rule in the library (llama_locret_find_question), copied to the start and pinned.

The rule is checked on fixtures (question at the end, none, several, one inside a code block, a marker, one too long);
then that every tool pins what an explicit query of the found text pins, that an explicit query overrides auto, and
that a prompt without a question evicts as plain Locret.
"""
from __future__ import annotations

import ctypes
import json
import re
import sys
import urllib.request

import llama_cpp
import pytest

import locret  # noqa: F401  (points llama_cpp at our library)
from locret.llama import Llama
from locret.heads import HeadsError
from locret import eviction, models
from locret.query import (chat_query_message, find_prompt_question, find_question, pin_room, place_query,
                          place_query_in_prompt)

from conftest import REPO, free_port, http_server, natural_text, post_json, run, tool
from test_eviction import B, UB, make
from test_locret_q import PIN_LOG, _expected_pin

DOC = natural_text()[:1600]  # ~380 tokens: pinned in the first batch, then evicted around (b = 96)


@pytest.mark.parametrize("text, question", [
    # a chat message: a document, then the question in its own paragraph
    (DOC + "\n\nWhich module reads and writes tar archives?", "Which module reads and writes tar archives?"),
    # a marker, with markdown emphasis, the question on the marker's line
    (DOC + "\n**Question:** what is the code for the north door?\n", "what is the code for the north door?"),
    # a marker whose question follows on the next line; the marker is matched in any case
    (DOC + "\nQUERY:\nName the ship at berth 12.", "Name the ship at berth 12."),
    # several questions in the last paragraph: all of them
    (DOC + "\n\nWhat is A? And which one is B?", "What is A? And which one is B?"),
    # after the question, a remark that tells stays (as the generated tasks write theirs), an answer prefix goes
    (DOC + "\n\nWhat is the code? Answer with the code only.", "What is the code? Answer with the code only."),
    (DOC + "\n\nWhat is the code? The code is", "What is the code?"),
    # RULER's needle prompts: the question glued to the haystack's last line, then the answer prefix; a haystack
    # sentence with a question mark of its own before it is the document's
    (DOC + " Does that make it worse? It is more complex, which\nWhat is the special magic number for lyrical-kumquat"
     " mentioned in the provided text? The special magic number for lyrical-kumquat mentioned in the provided text is",
     "What is the special magic number for lyrical-kumquat mentioned in the provided text?"),
    ("The sky is blue. There and back again.\nWhat are all the special magic numbers for a, b, and c mentioned in the"
     " provided text? The special magic numbers for a, b, and c mentioned in the provided text are",
     "What are all the special magic numbers for a, b, and c mentioned in the provided text?"),
    # an answer's cue ("Answer:", "A:") ends a marked question, with or without a question mark before it
    (DOC + "\n\nQuestion: In what country is Normandy located? Answer:", "In what country is Normandy located?"),
    (DOC + "\nQuestion: Find all variables that are assigned the value 20480 in the text above. Answer: According to"
     " the chain(s) of variable assignment in the text above, 5 variables are assigned the value 20480, they are:",
     "Find all variables that are assigned the value 20480 in the text above."),
    (DOC + "\n\nWhich module reads tar archives?\nA:", "Which module reads tar archives?"),
    # a cue with a question after it is the document's ("Q: ... A: ..." notes), not the answer's start; RULER's
    # essays at 16K cut one so ("... afterwards.\nanswer: outsource any job ..."), which once lost the question
    ("I will quiz you about the number afterwards.\nanswer: outsource any job. " + DOC + "\nWhat is the special magic"
     " number for shiny-fleece mentioned in the provided text? The special magic number for shiny-fleece mentioned in"
     " the provided text is", "What is the special magic number for shiny-fleece mentioned in the provided text?"),
    (DOC + "\n\nThe notes say. A: keep the receipts. Which receipts should be kept?", "Which receipts should be kept?"),
    # a line opening in lower case continues the question of the line above
    (DOC + "\n\nWhich module reads archives,\nand which one writes them?",
     "Which module reads archives,\nand which one writes them?"),
    # an instruction without a question mark
    (DOC + "\n\nList the modules that read archives.", "List the modules that read archives."),
    # a document alone: its last paragraph is a statement
    (DOC + "\n\nThe harbour closed at dusk.", ""),
    # a field label whose first word could ask ("Name", "State"): a document's record, not a request
    (DOC + "\n\nName: John Smith\nState: closed", ""),
    # a marker only counts at a line start: here the rule's search window (the last 4 x 320 bytes) starts inside
    # "FAQ:", at "Q:" (1290 bytes in all), which is not a marker
    ("see the FAQ: x" + (" Yes." * 256)[:1276], ""),
    (DOC, ""),
    # a question inside a code block is the document's; one after it is the user's
    ("Some notes on f.\n\n```python\n# what does f do?\nf = 1\n```", ""),
    ("```\n# what does f do?\n```\n\nWhat does the code above print?", "What does the code above print?"),
    ("", ""),
])
def test_the_rule_finds_the_closing_question(text, question):
    assert find_question(text) == question


def test_a_long_question_keeps_its_trailing_sentences_within_the_bound():
    # the document's sentences before the question, in its paragraph, are not the question
    assert find_question("x " * 10 + "\n\n" + "This sentence is filler. " * 20 + "Where is the key?") == \
        "Where is the key?"
    paragraph = "Is it in the box? " * 30 + "Where is the key?"
    got = find_question("x " * 10 + "\n\n" + paragraph)
    # whole sentences from a sentence start, within LLAMA_LOCRET_AUTO_QUERY_MAX_BYTES, ending with the question
    assert len(got.encode()) <= 320 and got.startswith("Is it in the box?") and got.endswith("Where is the key?")
    assert paragraph.endswith(got) and len(got) > 320 - len("Is it in the box? ")
    # one sentence longer than the bound: nothing (a cut sentence would not be the user's question)
    assert find_question("Why " + "very " * 80 + "long?") == ""


# a completion prompt that holds a chat template written out (llama_locret_find_prompt_question, _prompt_layout)

def _vocab(path):
    vocab_only = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return vocab_only, eviction.model_vocab(vocab_only)


def chatml(*turns, open_turn="assistant"):
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns) + f"<|im_start|>{open_turn}\n"


def test_a_templated_completion_prompt_has_its_question_found_and_placed_in_its_user_turn(model_path):
    keep, vocab = _vocab(model_path)  # SmolLM2: ChatML's markers are control tokens
    q, q2 = "Which module reads and writes tar archives?", "And which one compresses data?"
    one = chatml(("system", "Answer from the document."), ("user", DOC + "\n\n" + q))
    # the question is the user turn's, without the template's closing marker (the text rule alone runs into it)
    assert find_question(one).endswith("<|im_end|>") and find_prompt_question(vocab, one) == q
    # the layout opens the user turn's text, as the chat template writes a chat's layout
    placed = place_query_in_prompt(vocab, q, one)
    assert placed == chatml(("system", "Answer from the document."), ("user", place_query(q, DOC + "\n\n" + q)))
    # a follow-up: the question is the last user turn's, the layout still opens the first user turn
    two = chatml(("user", DOC + "\n\n" + q), ("assistant", "The tarfile module."), ("user", q2))
    assert find_prompt_question(vocab, two) == q2
    assert place_query_in_prompt(vocab, q2, two).startswith(f"<|im_start|>user\n{q2}\n\n{DOC[:40]}")
    # the last user turn asks nothing: no question (a question in an assistant's turn is not the user's)
    assert find_prompt_question(vocab, chatml(("user", DOC), ("assistant", "Which part?"), ("user", "All of it."))) == ""
    # an answer begun in the open assistant turn does not hide the user's question
    assert find_prompt_question(vocab, one + "The module is") == q
    # a role alone between markers (Llama 3's shape) names the next piece, whose text starts after its white space
    llama3 = f"<|im_start|>user<|im_end|>\n\n{DOC}\n\n{q}<|endoftext|><|im_start|>assistant<|im_end|>\n\n"
    assert find_prompt_question(vocab, llama3) == q
    assert place_query_in_prompt(vocab, q, llama3).startswith(f"<|im_start|>user<|im_end|>\n\n{q}\n\n{DOC[:40]}")
    # no markers (or no vocabulary): the plain rule and layout, byte for byte
    for text in (DOC + "\n\n" + q, "  " + DOC + "\n\nQuestion: " + q, DOC):
        for v in (vocab, None):
            assert find_prompt_question(v, text) == find_question(text)
            assert place_query_in_prompt(v, q, text) == place_query(q, text)
    # a marker's text means nothing without the vocabulary whose control token it is
    assert find_prompt_question(None, one) == find_question(one)
    if not models.is_installed("gemma3-270m"):
        pytest.skip("gemma3-270m is not installed")
    keep_g, gemma = _vocab(models.resolve("gemma3-270m", fetch=False))
    turn = f"<bos><start_of_turn>user\n{DOC}\n\n{q}<end_of_turn>\n<start_of_turn>model\n"
    assert find_prompt_question(gemma, turn) == q
    assert place_query_in_prompt(gemma, q, turn) == turn.replace("user\n", f"user\n{q}\n\n", 1)
    assert find_prompt_question(vocab, turn) != q  # SmolLM2's vocabulary does not know Gemma's markers


def test_python_auto_pins_what_the_found_question_pins(model_path, heads_file):
    llm = make(model_path, heads_file, n_batch=256, n_ubatch=64, locret_query="auto")
    question = "Which module reads and writes tar archives?"
    prompt = DOC + "\n\n" + question
    llm.create_completion(prompt, max_tokens=1, temperature=0.0)
    auto_pin = llm.locret_stats()["n_pinned"]
    assert auto_pin == _expected_pin(model_path, place_query(question, prompt), question) > 0
    head = llm.detokenize(llm.input_ids[:auto_pin].tolist()).decode().strip()
    assert head.endswith(question)
    # an explicit query wins over the constructor's auto
    other = "What does the json module encode?"
    llm.create_completion(prompt, max_tokens=1, locret_query=other)
    assert llm.detokenize(llm.input_ids[:llm.locret_stats()["n_pinned"]].tolist()).decode().strip().endswith(other)
    # no question: plain Locret, nothing pinned, and still evicting
    llm.create_completion(DOC + "\n\nThe harbour closed at dusk.", max_tokens=1)
    st = llm.locret_stats()
    assert st["n_pinned"] == 0 and st["n_evictions"] > 0
    # a chat: the last user message's question opens the first user turn
    chat = [{"role": "system", "content": "Answer from the document."}, {"role": "user", "content": prompt}]
    llm.create_chat_completion(chat, max_tokens=1)
    n_pin = llm.locret_stats()["n_pinned"]
    assert "user" in llm.detokenize(llm.input_ids[:n_pin].tolist(), special=True).decode()
    assert llm.detokenize(llm.input_ids[:n_pin].tolist()).decode().strip().endswith(question)
    # the same chat written out by its template as a completion prompt: the same tokens pinned
    llm.create_completion(chatml(("system", "Answer from the document."), ("user", prompt)), max_tokens=1)
    assert llm.locret_stats()["n_pinned"] == n_pin


def test_the_chat_rule_says_whose_question_is_the_query():
    # llama_locret_chat_query_message, the one rule llama-server and locret.Llama follow: with requery the last user
    # message's question; without, the first message that ends with one (a follow-up keeps it), else the last message
    doc_q1, doc = DOC + "\n\nWhich module reads and writes tar archives?", DOC + "\n\nThe harbour closed at dusk."
    follow = "And which one compresses data?"
    assert chat_query_message([]) == chat_query_message([], requery=False) == -1
    assert chat_query_message([doc_q1, follow]) == 1
    assert chat_query_message([doc_q1, follow], requery=False) == 0
    assert chat_query_message([doc, doc_q1, follow], requery=False) == 1   # the first message with a question
    assert chat_query_message([doc, "Thanks. That is all."], requery=False) == 1  # none: the last, as with requery
    assert chat_query_message([doc_q1], requery=False) == chat_query_message([doc_q1]) == 0


def test_python_with_requery_off_a_follow_up_reads_only_its_new_tokens(model_path, heads_file):
    # locret.Llama(locret_requery=False) with auto: the second turn keeps the first question pinned at its start, so
    # llama-cpp-python's prefix match reuses the cached conversation and reads only the new tokens; with requery (the
    # default) the new question opens the first turn and the whole conversation is read again for it
    q1, q2 = "Which module reads and writes tar archives?", "And which module compresses data in the zlib format?"
    first = [{"role": "user", "content": DOC + "\n\n" + q1}]
    for requery in (False, True):
        llm = make(model_path, heads_file, n_batch=256, n_ubatch=64, locret_query="auto", locret_requery=requery)
        read = []
        evaluate = llm.eval
        llm.eval = lambda tokens, *a, **k: (read.append(len(tokens)), evaluate(tokens, *a, **k))[1]
        r1 = llm.create_chat_completion(first, max_tokens=4, temperature=0.0)
        pin1 = llm.locret_stats()["n_pinned"]
        second = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                          {"role": "user", "content": q2}]
        read.clear()
        r2 = llm.create_chat_completion(second, max_tokens=4, temperature=0.0)
        st = llm.locret_stats()
        head = llm.detokenize(llm.input_ids[:st["n_pinned"]].tolist()).decode().strip()
        prompt_tokens = r2["usage"]["prompt_tokens"]
        assert st["n_evictions"] > 0 and prompt_tokens > 4 * B
        if requery:
            assert head.endswith(q2) and read[0] == prompt_tokens      # the whole conversation, read again
        else:
            assert head.endswith(q1) and st["n_pinned"] == pin1 > 0
            assert 0 < read[0] < 64, read                              # the answer and the follow-up only
        llm.close()
    with pytest.raises(HeadsError, match="locret_requery must be True or False"):
        make(model_path, heads_file, locret_requery="off")


def test_llama_completion_auto_pins_the_closing_question(model_path, heads_file):
    question = "Which module reads and writes tar archives?"
    base = [tool("llama-completion"), "-m", model_path, "--locret-heads", heads_file, "--locret-budget", B, "-ub", UB,
            "-b", 256, "-c", 8192, "-n", 1, "-no-cnv", "--temp", 0, "-t", 2, "-lv", 4, "--locret-query", "auto"]
    prompt = DOC + "\n\nQuestion: " + question
    proc = run(base + ["-p", prompt], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f'Locret-Q (auto): the question at the end of the prompt goes to its start and is pinned: "{question}"' \
        in proc.stderr, proc.stderr[-3000:]
    got = PIN_LOG.search(proc.stderr)
    assert got and int(got.group(1)) == _expected_pin(model_path, place_query(question, prompt), question)
    proc = run(base + ["-p", DOC], timeout=300)
    assert proc.returncode == 0 and "Locret-Q (auto): no question at the end of the prompt" in proc.stderr
    assert not PIN_LOG.search(proc.stderr)
    # a prompt that holds a chat template written out: the user turn's question, pinned at the start of its text
    templated = chatml(("user", DOC + "\n\n" + question))
    proc = run(base + ["-p", templated], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f'pinned: "{question}"' in proc.stderr and "not pinned" not in proc.stderr, proc.stderr[-3000:]
    got = PIN_LOG.search(proc.stderr)
    vocab_only, vocab = _vocab(model_path)
    assert got and int(got.group(1)) == _expected_pin(model_path, place_query_in_prompt(vocab, question, templated),
                                                      question)


def test_llama_server_auto_pins_the_question_of_each_chat(model_path, heads_file, tmp_path):
    port = free_port()
    cmd = [tool("llama-server"), "-m", model_path, "--locret-heads", heads_file, "--locret-budget", B, "-c", 8192,
           "-b", 256, "-ub", UB, "-t", 2, "-np", 2, "--host", "127.0.0.1", "--port", port, "-lv", 4,
           "--locret-query", "auto"]
    question = "Which module reads and writes tar archives?"
    chat = {"messages": [{"role": "system", "content": "Answer from the document."},
                         {"role": "user", "content": DOC + "\n\n" + question}], "max_tokens": 1, "temperature": 0}
    log = tmp_path / "server.log"
    with http_server(cmd, log, port) as url:
        # an OpenAI client's request, no extra field: the question is found and pinned (slot 0)
        post_json(url + "/v1/chat/completions", chat | {"id_slot": 0})
        # the same chat with the question given explicitly (slot 1): the same pinned tokens
        post_json(url + "/v1/chat/completions", chat | {"locret_query": question, "id_slot": 1})
        # a document alone: nothing pinned
        post_json(url + "/v1/chat/completions", chat | {"messages": [{"role": "user", "content": DOC}], "id_slot": 0})
        text = log.read_text()
        # the chat written out by the server's own template, sent to /completion: the same tokens pinned (this once
        # answered 400: the question found ran on into the template's closing marker)
        templated = post_json(url + "/apply-template", chat)["prompt"]
        assert templated.count("<|im_start|>") == 3
        post_json(url + "/completion", {"prompt": templated, "n_predict": 1, "id_slot": 1})
        post_json(url + "/v1/completions", {"prompt": templated, "max_tokens": 1, "id_slot": 0,
                                            "locret_query": question})
        later = log.read_text()[len(text):]
    pins = {int(m.group(2)): int(m.group(1)) for m in PIN_LOG.finditer(text)}
    assert len(pins) == 2 and pins[0] == pins[1] > _expected_pin(model_path, question, question), pins
    assert f'pinned: "{question}"' in text and "no question at the end of the request" in text
    assert [int(m.group(1)) for m in PIN_LOG.finditer(later)] == [pins[0], pins[0]], later[-3000:]


# settings that travel with the heads: the pooling window and auto, recommended by the shipped Locret-Q heads

QUERY_HEADS = REPO / "heads" / "smollm2-135m-instruct.query.gguf"


def recommended(path) -> dict:
    from locret import eviction
    s = eviction._Settings()
    assert eviction._api().llama_locret_file_recommended(str(path).encode(), ctypes.byref(s)) >= 0
    return {name: getattr(s, name) for name, _ in s._fields_}


def test_settings_loaded_from_the_heads_are_the_files_recommended_ones(model_path, heads_file, tmp_path):
    rec = recommended(QUERY_HEADS)
    assert rec["pool"] == 15 and rec["query_auto"] == 1
    assert recommended(heads_file)["pool"] == 0 and recommended(heads_file)["query_auto"] == 0
    # the shipped plain heads recommend neither: pooling traded codes for numbers on held-out text (docs/results.md
    # "The plain heads and pooling"), and they were not trained with a question at the start
    plain = recommended(REPO / "heads" / "smollm2-135m-instruct.gguf")
    assert plain["pool"] == 0 and plain["query_auto"] == 0
    kw = dict(n_ctx=4096, n_batch=64, n_ubatch=64, locret_budget=256, verbose=False)
    llm = Llama(model_path=str(model_path), locret_heads=str(QUERY_HEADS), **kw)
    assert llm.locret_stats()["pool"] == rec["pool"] and llm.locret_query == "auto"
    assert llm.locret_stats()["stabilizers"] == min(rec["stabilizers"], 64)
    llm.close()
    llm = Llama(model_path=str(model_path), locret_heads=str(QUERY_HEADS), locret_pool=0, locret_query="off", **kw)
    assert llm.locret_stats()["pool"] == 0 and llm.locret_query is None
    llm.close()
    # another recommendation, written by the converter, is what a context then uses
    other = tmp_path / "heads-pool7.gguf"
    proc = run([sys.executable, REPO / "convert" / "heads_to_gguf.py", "recommend", heads_file, "--pool", "7",
                "--query", "auto", "-o", other], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert recommended(other)["pool"] == 7 and recommended(other)["query_auto"] == 1
    llm = Llama(model_path=str(model_path), locret_heads=str(other), **kw)
    assert llm.locret_stats()["pool"] == 7 and llm.locret_query == "auto"
    llm.close()
    # a pooling window that does not fit the ubatch is not taken from the file (an explicit one is refused)
    llm = Llama(model_path=str(model_path), locret_heads=str(QUERY_HEADS), **(kw | dict(n_batch=8, n_ubatch=8)))
    assert llm.locret_stats()["pool"] == 0
    llm.close()
    # an even window: the library's loader refuses the file the converter wrote (read back before it is kept)
    for args, message in ((["--pool", "4"], "locret.recommended.pool must be odd (a window centred on each token), got 4"),
                          ([], "give --pool, --pool-from, --query and/or --positions"),
                          (["--positions", "sideways"], "Locret positions must be compact, inplace, keep or keep:N")):
        proc = run([sys.executable, REPO / "convert" / "heads_to_gguf.py", "recommend", heads_file, *args,
                    "-o", tmp_path / "x.gguf"], timeout=120)
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr
        assert not (tmp_path / "x.gguf").exists()


def test_the_heads_recommended_positions_are_the_default_where_they_apply(model_path, heads_file, tmp_path):
    from locret.heads import Heads

    def positions(heads, **kw) -> tuple[str, int]:
        llm = Llama(model_path=str(model_path), locret_heads=str(heads), n_ctx=4096, n_batch=64, n_ubatch=64,
                    locret_budget=256, verbose=False, **kw)
        try:
            stats = llm.locret_stats()
            return stats["positions"], stats["position_limit"]
        finally:
            llm.close()

    assert positions(heads_file) == ("inplace", 0)  # no recommendation: the model's and policy's default
    keep = tmp_path / "heads-keep.gguf"
    proc = run([sys.executable, REPO / "convert" / "heads_to_gguf.py", "recommend", heads_file, "--positions",
                "keep:3000", "-o", keep], timeout=120)
    assert proc.returncode == 0, proc.stderr
    rec = recommended(keep)
    assert (rec["positions"], rec["position_limit"], rec["pool"]) == (1 + 1, 3000, 0)  # 1 + LLAMA_LOCRET_POSITIONS_KEEP
    llm = Llama(model_path=str(model_path), locret_heads=str(keep), n_ctx=4096, verbose=False)
    assert llm._locret_heads.recommended["positions"] == "keep:3000"
    llm.close()
    assert positions(keep) == ("keep", 3000)
    assert positions(keep, locret_positions="inplace") == ("inplace", 0)  # asked for: the request wins
    # a recommendation that cannot apply is skipped, where the same setting asked for is refused: a policy that
    # reads its units in position order, and a limit below the budget plus the chunk (256 + 64)
    assert positions(keep, locret_policy="snapkv")[0] == "compact"
    with pytest.raises(HeadsError, match="policy snapkv reads the units in position order"):
        positions(heads_file, locret_policy="snapkv", locret_positions="keep")
    small = tmp_path / "heads-keep-small.gguf"
    assert run([sys.executable, REPO / "convert" / "heads_to_gguf.py", "recommend", heads_file, "--positions",
                "keep:300", "-o", small], timeout=120).returncode == 0
    assert positions(small) == ("inplace", 0)
    with pytest.raises(HeadsError, match="position limit"):
        positions(heads_file, locret_positions="keep:300")


def test_the_tools_apply_the_heads_recommendations_unless_told_otherwise(model_path):
    base = [tool("llama-completion"), "-m", model_path, "--locret-heads", QUERY_HEADS, "--locret-budget", 256,
            "-ub", 64, "-b", 256, "-c", 8192, "-n", 1, "-no-cnv", "--temp", 0, "-t", 2, "-lv", 4,
            "-p", DOC + "\n\nWhich module reads and writes tar archives?"]
    proc = run(base, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "score pooling 15" in proc.stderr and "Locret-Q (auto): the heads recommend it" in proc.stderr
    assert PIN_LOG.search(proc.stderr), proc.stderr[-3000:]
    proc = run(base + ["--locret-pool", "0", "--locret-query", "off"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "score pooling" not in proc.stderr and "Locret-Q (auto)" not in proc.stderr
    assert not PIN_LOG.search(proc.stderr)


def test_a_second_question_rereads_the_conversation_with_it_pinned(model_path, heads_file, tmp_path):
    # A follow-up question about a document the first turn compressed: with auto, each request's closing question
    # opens the first user turn (Locret-Q's layout), so a new question changes the prompt from there on and the
    # server reads the whole conversation again with the new question pinned, instead of answering from what the
    # first question's eviction kept. The second turn on the slot that holds the first must then hold what a fresh
    # read of the same conversation holds: the same pinned count, the same tokens read, the same answer and the same
    # top candidates (a fresh slot is the reference).
    port = free_port()
    cmd = [tool("llama-server"), "-m", model_path, "--locret-heads", heads_file, "--locret-budget", B, "-c", 8192,
           "-b", 256, "-ub", UB, "-t", 2, "-np", 2, "--host", "127.0.0.1", "--port", port, "-lv", 4,
           "--locret-query", "auto", "--slot-prompt-similarity", 0]
    q1 = "Which module reads and writes tar archives?"
    q2 = "Which module of the standard library compresses and decompresses data in the zlib format?"
    first = [{"role": "user", "content": DOC + "\n\n" + q1}]
    log = tmp_path / "server.log"
    with http_server(cmd, log, port) as url:
        req = {"max_tokens": 8, "temperature": 0, "n_probs": 5}
        r1 = post_json(url + "/v1/chat/completions", req | {"messages": first, "id_slot": 0})
        second = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                          {"role": "user", "content": q2}]
        before = len(log.read_text())
        again = post_json(url + "/v1/chat/completions", req | {"messages": second, "id_slot": 0})
        turn2_log = log.read_text()[before:]
        fresh = post_json(url + "/v1/chat/completions", req | {"messages": second, "id_slot": 1})
        text = log.read_text()
    pins = [(int(m.group(2)), int(m.group(1))) for m in PIN_LOG.finditer(text)]
    assert f'pinned: "{q2}"' in turn2_log and f'pinned: "{q1}"' not in turn2_log
    # slot 0 pinned twice (q1, then q2), slot 1 once (q2): the same count for the same question
    assert [n for s, n in pins if s == 0][-1] == [n for s, n in pins if s == 1][-1] != [n for s, n in pins if s == 0][0]
    # read again whole: as many prompt tokens processed as the fresh slot, all of the conversation
    assert again["timings"]["prompt_n"] == fresh["timings"]["prompt_n"] == again["usage"]["prompt_tokens"] > 4 * B
    assert again["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]
    assert again["choices"][0]["logprobs"] == fresh["choices"][0]["logprobs"]
    # the re-read's cost is in the server's log: the whole prompt's tokens, read again for the new question
    reread = re.findall(r"slot 0: .* processing the whole prompt again(?: with this one)? \((\d+) tokens\)", turn2_log)
    assert [int(n) for n in reread] == [again["usage"]["prompt_tokens"]], turn2_log[-2000:]


def test_a_pyramid_keeps_room_for_the_longest_question_the_rule_finds(model_path):
    # the longest question auto finds (whole sentences within LLAMA_LOCRET_AUTO_QUERY_MAX_BYTES), in a pyramid whose
    # last layer PyramidKV would give b/20 or the stabilizers and one unit: the Locret-Q heads' pin must still fit
    question = "Which of the archive formats does this text describe? " * 6 + "Which module reads and writes tar archives?"
    found = find_question(DOC + "\n\n" + question)
    assert 280 < len(found.encode()) <= 320 and found.endswith("tar archives?")
    b = 256
    llm = Llama(model_path=str(model_path), locret_heads=str(QUERY_HEADS), locret_budget=b, n_ctx=16384, n_batch=64,
                n_ubatch=64, locret_budget_schedule="pyramid", verbose=False, seed=1)
    n_layer = int(llm.metadata["llama.block_count"])
    st = llm.locret_stats()
    n_s, room = st["stabilizers"], pin_room()
    budgets = [llm.locret_layer_budget(il) for il in range(n_layer)]
    assert budgets[-1] == n_s + 1 + room > b // 20 and sum(budgets) == n_layer * b
    assert budgets == sorted(budgets, reverse=True)
    llm.create_completion(DOC + "\n\n" + question, max_tokens=1, temperature=0.0)  # raised before: no room for the pin
    st = llm.locret_stats()
    assert 0 < st["n_pinned"] <= room and st["n_evictions"] > 0
    assert llm.detokenize(llm.input_ids[:st["n_pinned"]].tolist()).decode().strip().endswith(found)
    # plain heads recommend no auto query: their pyramid keeps PyramidKV's last layer
    plain = Llama(model_path=str(model_path), locret_heads=str(REPO / "heads" / "smollm2-135m-instruct.gguf"),
                  locret_budget=b, n_ctx=4096, n_batch=64, n_ubatch=64, locret_budget_schedule="pyramid", verbose=False)
    assert plain.locret_layer_budget(n_layer - 1) == plain.locret_stats()["stabilizers"] + 1
    plain.close()
    llm.close()


def test_with_requery_off_a_follow_up_reads_only_its_new_tokens(model_path, heads_file, tmp_path):
    # --locret-requery off: a chat's query stays its first question, so the second turn's prompt opens as the first
    # one's did and the slot reads only what is new (the first answer and the follow-up), the first question still
    # pinned; an unknown value is refused before the model loads
    port = free_port()
    cmd = [tool("llama-server"), "-m", model_path, "--locret-heads", heads_file, "--locret-budget", B, "-c", 8192,
           "-b", 256, "-ub", UB, "-t", 2, "-np", 1, "--host", "127.0.0.1", "--port", port, "-lv", 4,
           "--locret-query", "auto", "--locret-requery", "off"]
    q1 = "Which module reads and writes tar archives?"
    q2 = "Which module of the standard library compresses and decompresses data in the zlib format?"
    first = [{"role": "user", "content": DOC + "\n\n" + q1}]
    log = tmp_path / "server.log"
    with http_server(cmd, log, port) as url:
        with urllib.request.urlopen(url + "/props", timeout=30) as response:
            assert json.load(response)["locret"]["requery"] is False
        req = {"max_tokens": 8, "temperature": 0}
        r1 = post_json(url + "/v1/chat/completions", req | {"messages": first})
        second = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                          {"role": "user", "content": q2}]
        before = len(log.read_text())
        r2 = post_json(url + "/v1/chat/completions", req | {"messages": second})
        turn2_log = log.read_text()[before:]
    assert f'first question stays at its start and pinned (--locret-requery off): "{q1}"' in turn2_log, turn2_log[-2000:]
    assert q2 not in "".join(line for line in turn2_log.splitlines() if "Locret-Q" in line)
    assert "processing the whole prompt again" not in turn2_log
    # the follow-up's own tokens only: the conversation's first turn (more than 4 budgets of it) is not read again
    assert 0 < r2["timings"]["prompt_n"] < 64 < 4 * B < r2["usage"]["prompt_tokens"], r2["timings"]
    assert r2["choices"][0]["message"]["content"].strip()
    pins = [(int(m.group(2)), int(m.group(1))) for m in PIN_LOG.finditer(log.read_text())]
    assert len({n for _, n in pins}) == 1, pins                     # the same pin both turns: q1's

    bad = run([tool("llama-server"), "-m", model_path, "--locret-budget", B, "--locret-requery", "maybe"], timeout=60)
    assert bad.returncode != 0 and "--locret-requery: expected on or off, got 'maybe'" in bad.stderr + bad.stdout
