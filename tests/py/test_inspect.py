"""`locret inspect`: its per-(layer, KV head) needle counts equal what the cache retains, read independently
through locret.Llama with the same settings; its pin is the query's; a needle not in the prompt is refused."""
from __future__ import annotations

import json
import sys

import numpy as np

import locret  # noqa: F401  (points llama_cpp at our library)
import llama_cpp
from locret import eviction, models
from locret.llama import Llama
from locret.query import place_query

from conftest import THREADS, natural_text, run
from test_eviction import B, UB

NEEDLE = "4-0-6-2"
QUESTION = "What is the boathouse code?"


def test_inspect_reports_what_the_cache_holds(model_path, heads_file, tmp_path):
    text = natural_text()
    # about 660 tokens with the query in front: some 16 evictions at b = 96, B = 32 (10 or more asserted below; 5,000
    # characters, about 1,340 tokens, took twice as long)
    doc = text[:1500] + f" Note: the boathouse code is {NEEDLE}. " + text[1500:3000]
    (tmp_path / "doc.txt").write_text(doc)
    out = tmp_path / "report.json"
    proc = run([sys.executable, "-m", "locret", "inspect", "--model", model_path, "--heads", heads_file,
                "--prompt-file", tmp_path / "doc.txt", "--needle", NEEDLE, "--query", QUESTION, "--budget", B,
                "--ubatch", UB, "--stabilizers", 16, "--local", 8, "--pool", 3, "--layers", "0,5", "--runs", 2,
                "--threads", 2, "--json", out], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "layer 5 head 1: needle" in proc.stdout and "layer 1 head 0" not in proc.stdout

    # the same run, read here: the prompt with its query in front, pinned through the query
    llm = Llama(model_path=str(model_path), n_ctx=4096, n_batch=4096, n_ubatch=UB, locret_heads=heads_file,
                locret_budget=B, locret_stabilizers=16, locret_local=8, locret_pool=3, verbose=False)
    tokens = llm.tokenize(place_query(QUESTION, doc).encode(), add_bos=True)
    n_pin = eviction.query_tokens(llama_cpp.llama_model_get_vocab(llm._model.model), tokens, QUESTION, B)
    llm.locret_pin_next_prompt(n_pin)
    llm.eval(tokens)
    assert report["prompt_tokens"] == len(tokens) and report["pinned"] == n_pin > 0
    assert report["evictions"] == llm.locret_stats()["n_evictions"] >= 10

    # the needle's tokens: those whose text overlaps the needle's characters
    at = doc.index(NEEDLE) + len(place_query(QUESTION, ""))
    ends = np.cumsum([len(llm.detokenize([t])) for t in tokens])
    starts = ends - [len(llm.detokenize([t])) for t in tokens]
    want = [i for i in range(len(tokens)) if ends[i] > at and starts[i] < at + len(NEEDLE)]
    assert report["needle_positions"] == want

    held = {(p["layer"], p["head"]): p["needle_held"] for p in report["by_pair"]}
    n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
    assert len(held) == n_layer * n_head_kv
    assert report["schedule"] == "uniform" and report["layer_budgets"] == [B] * n_layer
    for (il, ih), n in held.items():
        assert n == int(np.isin(want, llm.locret_retained(il, ih)).sum()), (il, ih)
    assert report["pairs_holding_all"] == sum(n == len(want) for n in held.values())
    # the runs shown are retained text of the prompt
    full = "".join(llm.detokenize([t]).decode(errors="replace") for t in tokens)
    shown = [r for p in report["by_pair"] for r in p["runs"]]
    assert shown and all(text in full for _, _, _, text in shown)
    llm.close()


def test_answer_spans_follow_each_answer_once_wherever_it_is_written():
    from locret.retention import answer_spans

    pieces = [b"In", b" Fr", b"ance", b" and", b" France", b" 12", b"3"]
    # RULER's qa lists an answer once per annotator: each distinct answer is followed once, at every place
    assert answer_spans(pieces, ["France", "France", "France"]) == [("answer", 1, 3), ("answer", 4, 5)]
    assert answer_spans(pieces, ["France", "123"], limit=1) == [("answer", 1, 3), ("answer", 5, 7)]
    assert answer_spans(pieces, ["Spain"]) == []


def test_inspect_refuses_a_needle_that_is_not_there(model_path, heads_file, tmp_path):
    (tmp_path / "doc.txt").write_text(natural_text()[:2000])
    proc = run([sys.executable, "-m", "locret", "inspect", "--model", model_path, "--heads", heads_file,
                "--prompt-file", tmp_path / "doc.txt", "--needle", "no such words", "--budget", B, "--ubatch", UB,
                "--stabilizers", 16], timeout=300)
    assert proc.returncode == 1 and "the needle 'no such words' is not in the prompt" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_inspect_follows_every_needle_of_an_evaluation_prompt(model_path, heads_file, tmp_path):
    """--task: the evaluation's own niah prompt with Locret-Q (question in front, pinned); every needle's held share
    equals what the cache retains, read here through locret.Llama over the same prompt."""
    from locret.evaluation import items as items_module

    out = tmp_path / "task.json"
    # 700 tokens: some 18 evictions at b = 96, B = 32 (10 or more asserted below; 1200 read 500 more tokens twice)
    L = 700
    proc = run([sys.executable, "-m", "locret", "inspect", "--model", model_path, "--heads", heads_file,
                "--task", "niah", "--length", L, "--method", "locret-q", "--budget", B, "--ubatch", UB,
                "--stabilizers", 16, "--local", 8, "--threads", 2, "--json", out], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "answer / distractor held:" in proc.stdout
    (row,) = report["items"]

    vocab = items_module.vocab_model(str(model_path))
    (item,) = items_module.task_items(vocab, ["niah"], [L], [0.5], 1, 0)
    vocab.close()
    tokens = list(item.query_tokens)
    # the evaluation's context settings (flash attention, 2 threads): the scores, and so the ties, are the same
    llm = Llama(model_path=str(model_path), n_ctx=2048, n_batch=2048, n_ubatch=UB, locret_heads=heads_file,
                locret_budget=B, locret_stabilizers=16, locret_local=8, flash_attn=True, n_threads=THREADS,
                n_threads_batch=THREADS, verbose=False)
    n_pin = eviction.query_tokens(llama_cpp.llama_model_get_vocab(llm._model.model), tokens, item.query, B)
    llm.locret_pin_next_prompt(n_pin)
    llm.eval(tokens)
    assert row["prompt_tokens"] == len(tokens) and row["pinned"] == n_pin > 0
    assert row["evictions"] == llm.locret_stats()["n_evictions"] >= 10

    # the needles, found here by their text in the prompt: 2 asked numbers, 6 look-alikes of the other keys
    text = llm.detokenize(tokens).decode()
    assert sorted(n["label"] for n in row["needles"]) == ["answer"] * 2 + ["distractor"] * 6
    n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
    assert report["pairs"] == n_layer * n_head_kv
    kept = [llm.locret_retained(il, ih) for il in range(n_layer) for ih in range(n_head_kv)]
    for n in row["needles"]:
        a, b = n["positions"]
        needle = llm.detokenize(tokens[a:b]).decode().strip()
        assert needle.startswith("One of the archive numbers for") and text.count(needle) == 1
        assert (any(v in needle for v in item.answers)) == (n["label"] == "answer")
        shares = [np.isin(np.arange(a, b), k).mean() for k in kept]
        assert n["held_share"] == round(float(np.mean(shares)), 4) and n["pairs_whole"] == sum(s == 1.0 for s in shares)
        check_token_layer_and_value_shares(llm, tokens, n, kept, n_layer, n_head_kv, item.answers)
    answers = [n["held_share"] for n in row["needles"] if n["label"] == "answer"]
    assert report["by_label"]["answer"]["held_share"] == round(float(np.mean(answers)), 4)
    llm.close()


def check_token_layer_and_value_shares(llm, tokens, n, kept, n_layer, n_head_kv, answers):
    """A needle's per-token and per-layer shares and its value's share, recomputed from the cache's retained sets
    (kept: every (layer, KV head) pair, layer-major)."""
    a, b = n["positions"]
    held = np.array([[p in set(k.tolist()) for p in range(a, b)] for k in kept], dtype=float)  # [pairs, tokens]
    assert n["token_shares"] == [round(float(x), 4) for x in held.mean(axis=0)]
    assert n["layer_shares"] == [round(float(held[il * n_head_kv:(il + 1) * n_head_kv].mean()), 4)
                                 for il in range(n_layer)]
    # the value: the shortest run of the needle's tokens that reads as one of the answers
    runs = [(j, k) for j in range(a, b) for k in range(j + 1, b + 1)
            if llm.detokenize(tokens[j:k]).decode(errors="replace").strip() in answers]
    if not runs:
        assert n["value"] is None and n["value_held_share"] is None
        return
    j, k = min(runs, key=lambda r: (r[1] - r[0], r[0]))
    assert n["value"].strip() in answers
    assert n["value_held_share"] == round(float(held[:, j - a:k - a].mean()), 4)


def test_inspect_follows_the_found_question_and_a_real_numbers_digits(model_path, tmp_path):
    """--method locret-q-auto on a real-text task under a budget schedule file: the question the auto rule finds is
    pinned (as the tools' defaults), each layer keeps its schedule's budget, and the number's own tokens are followed
    inside its needle sentence; the shares equal what the cache retains, read through locret.Llama over the same
    prompt with the same schedule; the layer map says which layers lost it."""
    from locret import retention
    from locret.evaluation import items as items_module

    assert retention.layer_map([0.0, 1.0, 0.55, 0.05, 0.999]) == ".#509"
    out = tmp_path / "real.json"
    # 1000 tokens (about 940 and 1,010 with the question in front): each prompt evicts some ten times (3 or more
    # asserted below) and every layer fills its schedule's budget, at most 276 + a chunk of 64 (1500 took half as
    # long again)
    L = 1000
    heads = str(models.shipped_heads("smollm2-135m", query=True))
    # layers 0-3 keep half the budget, the others share what that frees (30 layers x 256 units in all)
    budgets = [128] * 4 + [276] * 18 + [275] * 8
    (tmp_path / "upper.txt").write_text(" ".join(map(str, budgets)) + "\n")
    proc = run([sys.executable, "-m", "locret", "inspect", "--model", model_path, "--task", "real_number",
                "--haystacks", "pysource", "--length", L, "--depth", "0.25,0.75", "--method", "locret-q-auto",
                "--budget", 256, "--budget-schedule", tmp_path / "upper.txt",
                "--ubatch", 64, "--stabilizers", 16, "--local", 8, "--pool", 5, "--threads", 2, "--json", out],
               timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    # the evaluation's items for those depths, in its order: the prompt at 0.75 is its second (index 1)
    assert [r["item"] for r in report["items"]] == [f"real_number@pysource/{L}/d0.25/0",
                                                    f"real_number@pysource/{L}/d0.75/1"]
    row = report["items"][1]
    (n,) = row["needles"]
    assert "by layer " in proc.stdout and f"value {n['value'].strip()!r} held" in proc.stdout
    assert report["schedule"] == "upper.txt" and report["layer_budgets"] == budgets
    assert "b = 256 (schedule upper.txt)" in proc.stdout

    vocab = items_module.vocab_model(str(model_path))
    item = items_module.task_items(vocab, ["real_number"], [L], [0.25, 0.75], 1, 0, haystacks=("pysource",))[1]
    vocab.close()
    assert item.auto_query and item.auto_query_tokens
    tokens = list(item.auto_query_tokens)
    llm = Llama(model_path=str(model_path), n_ctx=2048, n_batch=64, n_ubatch=64, locret_heads=heads,
                locret_budget=256, locret_stabilizers=16, locret_local=8, locret_pool=5, locret_query="off",
                locret_budget_schedule=str(tmp_path / "upper.txt"), flash_attn=True, n_threads=THREADS, n_threads_batch=THREADS,
                verbose=False)
    n_pin = eviction.query_tokens(llama_cpp.llama_model_get_vocab(llm._model.model), tokens, item.auto_query, 256)
    llm.locret_pin_next_prompt(n_pin)
    for i in range(0, len(tokens), 64):  # one ubatch a call, as the evaluation feeds an evicting prompt
        llm.eval(tokens[i:i + 64], prompt_continues=i + 64 < len(tokens))
    assert row["prompt_tokens"] == len(tokens) and row["pinned"] == n_pin > 0
    assert row["evictions"] == llm.locret_stats()["n_evictions"] >= 3
    n_layer = llama_cpp.llama_model_n_layer(llm._model.model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(llm._model.model)
    assert report["layers"] == list(range(n_layer)) and len(n["layer_shares"]) == n_layer
    kept = [llm.locret_retained(il, ih) for il in range(n_layer) for ih in range(n_head_kv)]
    # each layer holds its schedule's budget after the prompt, and the local tail (8) beyond it
    assert [len(k) for k in kept[::n_head_kv]] == [b + 8 for b in budgets]
    assert n["label"] == "answer" and any(v in n["text"] for v in item.answers)
    check_token_layer_and_value_shares(llm, tokens, n, kept, n_layer, n_head_kv, item.answers)
    assert n["value"] is not None and 0 < len(n["token_shares"])
    llm.close()


def test_inspect_refuses_mixed_or_missing_modes(model_path):
    cases = (
        ([], "give either --prompt-file (with --needle) or --task"),
        (["--prompt-file", "doc.txt", "--task", "niah", "--length", "600"], "give either --prompt-file"),
        (["--task", "niah"], "--task needs --length"),
        (["--task", "niah", "--length", "600", "--needle", "x"], "--task brings its own needles"),
        (["--prompt-file", "doc.txt"], "--prompt-file needs --needle"),
        (["--prompt-file", "doc.txt", "--needle", "x", "--method", "locret-q"], "--method applies to --task"),
        (["--task", "haystack", "--length", "600"], "unknown task 'haystack'"),
        (["--task", "common_words", "--length", "8000"], "places no needles"),
        (["--task", "niah", "--length", "600", "--depth", "0.5,1.5"], "depth 1.5 is outside [0, 1]"),
        (["--task", "niah", "--length", "600", "--depth", ","], "--depth takes numbers in [0, 1]"),
        (["--task", "niah", "--length", "600", "--depth", "half"], "--depth takes numbers in [0, 1]"),
        (["--task", "niah", "--length", "600", "--ruler-mode", "completion"], "--ruler-mode applies to --suite ruler"),
        (["--task", "niah", "--length", "600", "--budget-schedule", "steep"],
         "budget schedule 'steep' is neither uniform, pyramid nor a readable file"),   # the library's reason
    )
    for args, message in cases:
        proc = run([sys.executable, "-m", "locret", "inspect", "--model", model_path, *args], timeout=300)
        assert proc.returncode == 1 and message in proc.stderr, (args, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr


def test_inspect_follows_rulers_answer_in_either_mode(model_path, heads_file, tmp_path):
    """RULER's prompts as `locret eval --ruler-mode` sends them: chat (one user message) or completion (the model's
    template around the package's prompt, what a model without a chat template is evaluated with); the package draws
    each mode's sample for its own wrapping, and the answer is followed in both."""
    from locret import models
    from locret.evaluation import items as items_module

    for mode in ("chat", "completion"):
        out = tmp_path / f"{mode}.json"
        proc = run([sys.executable, "-m", "locret", "inspect", "--model", model_path, "--heads", heads_file,
                    "--suite", "ruler", "--task", "niah_single_1", "--length", "1024", "--ruler-mode", mode,
                    "--budget", "256", "--ubatch", "128", "--threads", "2", "--json", out], timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        item = json.loads(out.read_text())["items"][0]
        vocab = items_module.vocab_model(str(model_path))
        try:
            expected = items_module.ruler_items(vocab, ["niah_single_1"], [1024], 1, 0, mode=mode, random_start=True,
                                                cache=models.cache_dir() / "ruler-samples")[0]
        finally:
            vocab.close()
        assert item["prompt_tokens"] == len(expected.tokens)
        assert item["needles"] and all(n["value"] in expected.answers for n in item["needles"])
