"""The kvpress side of tests/py/test_locret_press.py, run in the kvpress environment (.venv-kvpress).

kvpress 0.5.5 needs transformers below 5.3 and the project's own venv has a later one, so kvpress lives in a venv of
its own (scripts/setup.sh). The test runs this script there once: it loads SmolLM2 through transformers once, runs
LocretPress and the independent reference on the same input, and writes what it measured (arrays to results.npz,
the rest to results.json) for the test to judge in the project's venv, where Algorithm 1's numpy model lives.

    .venv-kvpress/bin/python tests/py/locret_press_side.py CONFIG.json OUT_DIR

CONFIG names the model GGUF, the heads, a file of natural text, the token count, the compression ratio, the pooling
window and a heads file made for another model.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from kvpress import AdaKVPress, KVPressTextGenerationPipeline  # noqa: E402
from kvpress.utils import compute_n_kept  # noqa: E402
from reference_cis import load_hf_model, reference_scores  # noqa: E402  (this script's folder is on sys.path)
from transformers import DynamicCache  # noqa: E402

from locret import hf_gguf  # noqa: E402
from locret.peers import LocretPress  # noqa: E402


def published_heads_from_gguf(path) -> dict[str, np.ndarray]:
    """The heads GGUF's weights in the published checkpoint format, W1's Q/K columns back in HF order, read with
    gguf-py and un-permuted here, independently of the converter's index map: within a head of size d, llama.cpp's
    column 2j + t holds HF's column t * d/2 + j (t = 0, 1), so a head's d columns read as [d/2, 2] and transposed to
    [2, d/2] are in HF's order."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    kv = {f.name: f.contents() for f in reader.fields.values() if f.name.startswith("locret.")}
    assert kv["locret.qk_permuted"] is True  # SmolLM2 is `llama`: the file's Q/K columns are in llama.cpp's order
    n_head, n_kv, d = kv["locret.base.n_head"], kv["locret.base.n_head_kv"], kv["locret.base.head_dim_k"]
    out = {}
    for t in reader.tensors:
        layer, fc, kind = t.name.split(".")[2:5]
        values = np.asarray(t.data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
        if fc == "fc1" and kind == "weight":
            rows, qk = values.shape[0], (n_head + n_kv) * d
            heads = values[:, :qk].reshape(rows, n_head + n_kv, d // 2, 2).transpose(0, 1, 3, 2).reshape(rows, qk)
            values = np.concatenate([heads, values[:, qk:]], axis=1)
        out[f"model.layers.{layer}.self_attn.{fc}.{kind}"] = values
    return out


def prefill(model, tokens, press=None) -> DynamicCache:
    """kvpress's prefill as its pipeline runs it: the base model on the context, the press hooked in."""
    cache = DynamicCache()
    with torch.no_grad(), (press(model) if press is not None else contextlib.nullcontext()):
        model.model(input_ids=torch.tensor([tokens]), past_key_values=cache)
    return cache


def kept_positions(compressed: DynamicCache, full: DynamicCache) -> np.ndarray:
    """[layer, kv head, n_kept]: the positions whose keys the compressed cache holds, in cache order, found by exact
    match against the uncompressed cache of the same prefill (kvpress compresses after each layer's attention, so
    every layer's keys before selection are the full run's, bit for bit). -1 where a kept key matches no single
    position."""
    out = []
    for layer in range(len(full.layers)):
        kept_keys, all_keys = compressed.layers[layer].keys[0], full.layers[layer].keys[0]  # [heads, n, dim]
        per_head = []
        for h in range(all_keys.shape[0]):
            match = (kept_keys[h][:, None, :] == all_keys[h][None, :, :]).all(-1)  # [n_kept, n]
            found = match.float().argmax(-1)
            per_head.append(torch.where(match.sum(-1) == 1, found, -1).numpy())
        out.append(per_head)
    return np.array(out)


def uncompressed_prefill(model, tokens) -> tuple[DynamicCache, dict[int, torch.Tensor]]:
    """The full cache of a prefill without a press, and each layer's attention input (what kvpress hands a press
    as hidden_states)."""
    captured = {}

    def hook(module, args, kwargs):
        captured[module.layer_idx] = kwargs["hidden_states"].detach()

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        cache = prefill(model, tokens)
    finally:
        for h in handles:
            h.remove()
    return cache, captured


def press_scores(press, model, inputs) -> np.ndarray:
    """LocretPress.score of every layer: [n_layer, n_head_kv, n_tokens]."""
    out = []
    for layer in model.model.layers:
        hidden = inputs[layer.self_attn.layer_idx]
        keys = torch.zeros(1, model.config.num_key_value_heads, hidden.shape[1], layer.self_attn.head_dim)
        out.append(press.score(layer.self_attn, hidden, keys, keys, None, {})[0].numpy())
    return np.stack(out)


def refusal(make) -> str:
    """'ValueError: message' when `make()` raises, else 'accepted'."""
    try:
        make()
    except Exception as e:  # recorded, judged by the test
        return f"{type(e).__name__}: {e}"
    return "accepted"


def main(config_path: str, out_dir: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    model_path, heads = Path(cfg["model"]), cfg["heads"]
    ratio, n_tokens = cfg["ratio"], cfg["n_tokens"]
    model = load_hf_model(model_path)
    tokenizer = hf_gguf.load_tokenizer(model_path)
    text = Path(cfg["text"]).read_text()
    tokens = tokenizer.encode(text, add_special_tokens=False)[:n_tokens]
    arrays, facts = {}, {"n_tokens": len(tokens), "n_kept": compute_n_kept(len(tokens), ratio)}

    # scores: the reference, the press, the press pooled
    arrays["reference"] = reference_scores(model, tokens, published_heads_from_gguf(heads))
    full, inputs = uncompressed_prefill(model, tokens)
    for name, pool in (("scores", 0), ("pooled", cfg["pool"]), ("pool1", 1)):
        arrays[name] = press_scores(LocretPress(ratio, heads=heads, pool=pool), model, inputs)

    # kept sets through kvpress's own hooks, with the permutation undone and (deliberately) not
    compressed = prefill(model, tokens, LocretPress(ratio, heads=heads))
    facts["cache_lengths"] = [layer.keys.shape[2] for layer in compressed.layers]
    arrays["kept"] = kept_positions(compressed, full)
    arrays["kept_unpermuted"] = kept_positions(prefill(model, tokens, LocretPress(ratio, heads=heads,
                                                                               _undo_qk_permutation=False)), full)

    # kvpress's pipeline end to end, plain and inside AdaKVPress
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    context, question = cfg["context"], cfg["question"]
    n_context = pipe.preprocess(context, questions=[question], answer_prefix="",
                                max_context_length=10**9)["context_ids"].shape[1]
    cache = DynamicCache()
    facts["answer"] = pipe(context, question=question, press=LocretPress(ratio, heads=heads), cache=cache,
                           max_new_tokens=8)["answer"]
    facts["pipeline"] = {"n_context": n_context, "n_kept": compute_n_kept(n_context, ratio),
                         "cache_lengths": [layer.keys.shape[2] for layer in cache.layers]}
    facts["adakv_answer"] = pipe(context, question=question, press=AdaKVPress(LocretPress(ratio, heads=heads)),
                                 max_new_tokens=8)["answer"]
    facts["adakv_masked"] = [len(layer.self_attn.masked_key_indices[0]) for layer in model.model.layers]

    # refusals
    def enter_with(press):
        with press(model):
            pass

    facts["refusals"] = {
        "other_model": refusal(lambda: enter_with(LocretPress(ratio, heads=cfg["other_heads"]))),
        "model_without_heads": refusal(lambda: LocretPress(ratio, heads=model_path)),
        "not_gguf": refusal(lambda: LocretPress(ratio, heads=cfg["text"])),
        "missing": refusal(lambda: LocretPress(ratio, heads=Path(out_dir) / "missing.gguf")),
        **{f"pool {p}": refusal(lambda p=p: LocretPress(ratio, heads=heads, pool=p)) for p in (2, 8, -1)},
    }

    np.savez(Path(out_dir) / "results.npz", **arrays)
    (Path(out_dir) / "results.json").write_text(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
