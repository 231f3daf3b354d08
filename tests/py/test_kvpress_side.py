"""kvpress beside us (locret.peers.kvpress_side, evaluation/kvpress_backend.py): one prefill replayed per press gives
what kvpress's own pipeline gives, and the side by side reads the same token ids as our server.

- full attention through the side by side's attention function answers as transformers' own generate (an attention
  function without a mask of its own made SDPA align the question to the cache's first keys: garbage);
- replay against the pipeline: for SnapKV (the question outside and compressed), AdaKV, PyramidKV (layers of different
  lengths) and ExpectedAttention, the kept keys per layer and the greedy answer equal those of kvpress's pipeline run
  on the context alone (tests/py/kvpress_side_check.py, in .venv-kvpress);
- the "copied" setting's pin: a press given Locret-Q's pinned tokens keeps them in every layer and KV head (a plain
  ScorerPress and AdaKV's cross-head selection), where the same press without the pin drops them, and keeps as many
  units as without it;
- end to end: `locret eval --suite ruler` with a press beside our eviction at one compression ratio writes kvpress's
  rows and ours at the same budget, every server request read the ids kvpress was fed (tokens_match), and the check
  can fail (an item whose ids differ from what the server reads is counted).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import REPO, THREADS, natural_text, run

VENV_BIN = Path(sys.executable).parent


def test_replaying_one_prefill_gives_each_presss_own_result(tmp_path, model_path):
    from locret.evaluation import decoding
    from locret.evaluation.items import vocab_model
    from locret.peers.environment import kvpress_python

    vocab = vocab_model(str(model_path))
    try:
        chat, tokenize = decoding.chat_format(vocab), decoding.tokenizer(vocab)
        question = "\nWhat is the code for the north warehouse door? The code is"
        document = natural_text()[:2400] + " The code for the north warehouse door is 4-7-2-9. " + natural_text()[2400:3600]
        before, after = chat("\u0001").split("\u0001")
        tokens = tokenize(before + document + question + after, True)
        q_at = len(tokenize(before + document, True))
        end = len(tokenize(before + document + question, True))
    finally:
        vocab.close()
    item = tmp_path / "item.json"
    item.write_text(json.dumps({"model_path": str(model_path), "tokens": tokens, "question_at": q_at,
                                "input_end": end}))
    out = tmp_path / "out.json"
    proc = run([kvpress_python(), REPO / "tests" / "py" / "kvpress_side_check.py", item, out], timeout=900,
               cwd=REPO / "tests" / "py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    full, *cases = json.loads(out.read_text())
    assert full["answer"] == full["reference"] and full["answer"].startswith("The code for the north warehouse")
    assert len(cases) == 5
    for c in cases:
        where = f"{c['press']} ({c['setting']})"
        assert c["lengths"] == c["own_lengths"], where
        assert c["shared_rows"] is not None and c["shared_rows"] > 0.995, where  # near-ties at the cut aside
        assert c["answer"] == c["own_answer"], where
        if not c["press"].startswith("adakv"):  # AdaKV masks units (kvpress's head-wise budgets) instead of removing them
            assert max(c["lengths"]) < c["context"], where + ": nothing was compressed"
    pyramid = next(c for c in cases if c["press"] == "pyramidkv")
    assert len(set(pyramid["lengths"])) > 1  # layers of different lengths: the case transformers' SDPA mask refused


PIN_CHECK = """
import json, types, torch
from kvpress import AdaKVPress, KnormPress
from locret.peers.kvpress_side import pin_leading
torch.manual_seed(0)
keys = torch.randn(1, 3, 200, 64)
keys[..., :10, :] *= 50        # the largest norms: Knorm (keeps the smallest) drops them unless pinned
values = torch.randn(1, 3, 200, 64)
module = types.SimpleNamespace(head_dim=64, config=types.SimpleNamespace(_attn_implementation="sdpa"))
def kept(press, pinned):
    press = pin_leading(press, pinned)
    k, _ = press.compress(module, None, keys, values, None, {})
    if isinstance(press, AdaKVPress):   # masks instead of removing: per head, the positions not masked
        _, heads, seq = module.masked_key_indices
        return [sorted(set(range(200)) - set(seq[heads == h].tolist())) for h in range(3)]
    return [sorted(int((keys[0, h] == row).all(-1).nonzero()[0]) for row in k[0, h]) for h in range(3)]
out = {}
for name, make in (("knorm", lambda: KnormPress(compression_ratio=0.75)),
                   ("adakv-knorm", lambda: AdaKVPress(KnormPress(compression_ratio=0.75)))):
    out[name] = {"pinned": kept(make(), 10), "plain": kept(make(), 0)}
print(json.dumps(out))
"""


def test_pinned_leading_tokens_are_kept_by_every_selection(tmp_path):
    from locret.peers.environment import kvpress_python

    proc = run([kvpress_python(), "-c", PIN_CHECK], timeout=300, cwd=REPO / "py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, got in out.items():
        pinned, plain = got["pinned"], got["plain"]
        assert all(set(range(10)) <= set(head) for head in pinned), name
        assert all(not set(range(10)) & set(head) for head in plain), name + ": the check cannot fail"
        assert sum(map(len, pinned)) == sum(map(len, plain)), name + ": the pin changed how many units are kept"
    assert all(len(head) == 50 for head in out["knorm"]["pinned"])  # int(200 x 0.25) a head


def test_the_side_by_side_feeds_kvpress_the_ids_the_server_reads(tmp_path, model_path):
    """One RULER prompt, ours and SnapKV at compression 0.75 with the question outside and compressed: rows at the same
    budget, scores, token ids checked. Then the same item with one id changed is seen as a mismatch."""
    out = tmp_path / "ruler"
    proc = run([VENV_BIN / "locret", "eval", "--model", model_path, "--suite", "ruler", "--tasks", "vt", "--lengths",
                "4096", "--samples", "1", "--methods", "locret", "--presses", "snapkv", "--ratios", "0.75",
                "--press-question", "outside,compressed", "-o", out, "--no-plots"], timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    by_method = {s["method"]: s for s in samples}
    assert set(by_method) == {"locret", "kvpress:snapkv", "kvpress:snapkv+q"}
    assert {s["budget"] for s in samples} == {1024}               # round((1 - 0.75) x 4096) for all three
    assert by_method["locret"]["tokens_match"] is True            # the server read the ids kvpress was fed
    assert by_method["kvpress:snapkv"]["context_tokens"] < by_method["kvpress:snapkv+q"]["context_tokens"]
    assert all(0.0 <= s["score"] <= 1.0 for s in samples)
    ruler = json.loads((out / "ruler.json").read_text())
    assert ruler["tokens_mismatched"] == 0
    assert {e["method"] for e in ruler["entries"]} == set(by_method)
    assert "Average against compression ratio" in (out / "summary.md").read_text()

    # the check can fail: the server, given the same item with its ids changed, reads other ids than the item's
    from locret.evaluation import server_backend
    from locret.evaluation.items import Item
    from locret.evaluation.worker import RunSpec

    s = by_method["locret"]
    item = Item(id=s["item"], source=s["source"], length=4096, depth=None, tokens=(), max_new_tokens=8,
                answers=tuple(s["answers"]), extra=s["extra"])
    spec = RunSpec(model_path=str(model_path), method="full", budget=None, heads=None, stabilizers=None, local=None,
                   n_ctx=8192, ubatch=512, threads=THREADS, labels={"run": "check"})
    port = server_backend.serve.free_port()
    server = server_backend.Server(server_backend.command(spec, port), tmp_path / "server.log", port)
    try:
        ids = server_backend.server_tokens(server, item)
        assert len(ids) == s["prompt_tokens"]
        changed = Item(**{**item.__dict__, "tokens": tuple(ids[:-1]) + (ids[-1] + 1,)})
        assert server_backend.server_tokens(server, changed) != list(changed.tokens)
        assert server_backend.server_tokens(server, item) == ids
    finally:
        server.stop()
