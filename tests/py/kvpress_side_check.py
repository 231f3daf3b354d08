"""The kvpress side of tests/py/test_kvpress_side.py, run in the kvpress environment (.venv-kvpress).

First full attention: kvpress's decoding after an uncompressed cache, through the side by side's attention function,
against transformers' own `generate`. Then for each press and question setting it runs the same prompt twice: the side by side's replay of one shared prefill
(locret.peers.kvpress_side.replay) and kvpress's own pipeline (`_forward` with the press hooked into a prefill of the
context alone), and writes both answers and both caches' per-layer lengths, and the largest difference of their kept
keys, to OUT.json for the test to judge.

    .venv-kvpress/bin/python tests/py/kvpress_side_check.py ITEM.json OUT.json
"""
from __future__ import annotations

import json
import sys

import torch
from transformers import DynamicCache

from locret.peers import kvpress_side as side

# the presses whose replay could go wrong in its own way: SnapKV in both settings (its window is the context's end),
# AdaKV (head-wise masks on the modules), PyramidKV (layers of different lengths), ExpectedAttention (query statistics
# through the rotary embedding the press context sets); TOVA, Knorm and StreamingLLM score like SnapKV from the same
# arguments (checked once by hand: same answers, same kept keys)
CASES = [("snapkv", "outside"), ("snapkv", "compressed"), ("adakv-snapkv", "outside"), ("pyramidkv", "outside"),
         ("expected", "compressed")]
RATIO = 0.5


def pipeline_cache(pipe, press, context_ids):
    cache = DynamicCache()
    with torch.no_grad(), press(pipe.model):
        pipe.model.model(input_ids=torch.tensor([context_ids]), past_key_values=cache)
    return cache


def shared_rows(a, b, tol: float = 1e-3) -> float:
    """The share of kept key rows of cache `a` that cache `b` holds too, per (layer, KV head), as rows equal within
    `tol`: a prefill of the context alone and the replay's cut of a longer one agree to ~1e-5, so a unit whose score
    ties with the cut's within that may be kept by one and not the other."""
    found = total = 0
    for la, lb in zip(a.layers, b.layers):
        ka, kb = la.keys[0], lb.keys[0]              # [heads, n, d]
        for h in range(ka.shape[0]):
            dist = torch.cdist(ka[h], kb[h], p=float("inf"))
            found += int((dist.min(dim=1).values < tol).sum())
            total += ka.shape[1]
    return found / total


def main(item_path: str, out_path: str) -> None:
    item = json.loads(open(item_path).read())
    tokens, cuts = item["tokens"], {"outside": item["question_at"], "compressed": item["input_end"]}
    model, _, pipe = side.load(item["model_path"], threads=1)
    capture, full = side.prefill(model, tokens[:item["input_end"]])
    out = []
    # full attention through the side by side's attention function and kvpress's decoding, against transformers'
    # own generate (its masks made by transformers): a cache followed by new tokens must be attended causally
    full_answer, _ = side.pipeline_answer(pipe, None, tokens[:cuts["outside"]], tokens[cuts["outside"]:], 24)
    with torch.no_grad():
        generated = model.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                                   max_new_tokens=24, do_sample=False)
    reference = pipe.tokenizer.decode(generated[0, len(tokens):], skip_special_tokens=True)
    out.append({"press": "none", "answer": full_answer, "reference": reference})
    for name, setting in CASES:
        n = cuts[setting]
        replayed = side.replay(side.make_press(name, RATIO, None), model, capture, full, n)
        lengths = [layer.keys.shape[2] for layer in replayed.layers]
        own = pipeline_cache(pipe, side.make_press(name, RATIO, None), tokens[:n])
        same = shared_rows(replayed, own) if lengths == [l.keys.shape[2] for l in own.layers] else None
        answer = side.answer_after(pipe, replayed, tokens[n:], n, 24)
        own_answer, _ = side.pipeline_answer(pipe, side.make_press(name, RATIO, None), tokens[:n], tokens[n:], 24)
        out.append({"press": name, "setting": setting, "context": n, "answer": answer, "own_answer": own_answer,
                    "lengths": lengths, "own_lengths": [l.keys.shape[2] for l in own.layers], "shared_rows": same})
    open(out_path, "w").write(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
