"""`locret inspect`: its per-(layer, KV head) needle counts equal what the cache retains, read independently
through locret.Llama with the same settings; its pin is the query's; a needle not in the prompt is refused."""
from __future__ import annotations

import json
import sys

import numpy as np

import locret  # noqa: F401  (points llama_cpp at our library)
import llama_cpp
from locret import eviction
from locret.llama import Llama
from locret.query import place_query

from conftest import natural_text, run
from test_eviction import B, UB, heads_file  # noqa: F401  (fixture)

NEEDLE = "4-0-6-2"
QUESTION = "What is the boathouse code?"


def test_inspect_reports_what_the_cache_holds(model_path, heads_file, tmp_path):
    text = natural_text()
    doc = text[:2500] + f" Note: the boathouse code is {NEEDLE}. " + text[2500:5000]
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
    for (il, ih), n in held.items():
        assert n == int(np.isin(want, llm.locret_retained(il, ih)).sum()), (il, ih)
    assert report["pairs_holding_all"] == sum(n == len(want) for n in held.values())
    # the runs shown are retained text of the prompt
    full = "".join(llm.detokenize([t]).decode(errors="replace") for t in tokens)
    shown = [r for p in report["by_pair"] for r in p["runs"]]
    assert shown and all(text in full for _, _, _, text in shown)
    llm.close()


def test_inspect_refuses_a_needle_that_is_not_there(model_path, heads_file, tmp_path):
    (tmp_path / "doc.txt").write_text(natural_text()[:2000])
    proc = run([sys.executable, "-m", "locret", "inspect", "--model", model_path, "--heads", heads_file,
                "--prompt-file", tmp_path / "doc.txt", "--needle", "no such words", "--budget", B, "--ubatch", UB,
                "--stabilizers", 16], timeout=300)
    assert proc.returncode == 1 and "the needle 'no such words' is not in the prompt" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
