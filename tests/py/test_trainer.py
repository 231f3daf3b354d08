"""The head trainer (convert/train_heads.py, locret.train): labels, learning, resumption,
the round trip into llama.cpp, and refusals.

The label reference here is brute force: the test hooks q_proj/k_proj itself, applies RoPE with its
own numpy code, builds the full attention-score matrix and takes the maxima with explicit loops.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, THREADS, natural_text, run
from trainer_fixtures import TINY_LLAMA, sentence, write_jsonl, write_tiny_llama, write_tiny_llama_gguf

TRAINER = REPO / "convert" / "train_heads.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    work = tmp_path_factory.mktemp("tiny-llama")
    return write_tiny_llama(work / "hf"), write_tiny_llama_gguf(work / "tiny.gguf")


# The settings of the run that the module shares (`trained`): long enough for the loss to fall clearly.
TRAINED_ARGS = ["--steps", 40, "--lr", 0.01, "--warmup-steps", 2, "--checkpoint-every", 5, "--seed", 3, "--d-r", 32]


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """One 40-step run on the tiny model, made once: its log, heads.safetensors and heads GGUF are read by the
    loss/resumption test and are the given heads of the fine-tuning and frozen-layer tests."""
    hf_dir, gguf = tiny
    work = tmp_path_factory.mktemp("trained")
    data = _data(work / "data.jsonl")
    _train("--base", hf_dir, "--gguf", gguf, "--data", data, *TRAINED_ARGS, "-o", work / "a.gguf")
    return work / "a.gguf", work / "a.run"


def _rope_rotate_half(x: np.ndarray, theta: float) -> np.ndarray:
    """x [n_heads, n_tokens, d] at positions 0..n-1, Hugging Face's rotate-half layout."""
    _, n, d = x.shape
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)            # [d/2]
    angles = np.arange(n, dtype=np.float64)[:, None] * inv_freq[None, :]     # [n, d/2]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., : d // 2].astype(np.float64), x[..., d // 2:].astype(np.float64)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _brute_force_labels(backbone, token_ids: list[int], n_prompt: int):
    """backbone.features for the sequence, the q_proj/k_proj outputs it captured by its own hooks, and per
    layer the labels written out: RoPE in numpy, every query x key score, maxima with explicit loops."""
    model = backbone.model
    captured = {}
    handles = [getattr(layer.self_attn, name).register_forward_hook(
        lambda _m, _i, out, i=i, name=name: captured.__setitem__((i, name), out[0].detach().numpy().copy()))
        for i, layer in enumerate(model.model.layers) for name in ("q_proj", "k_proj")]
    try:
        features = backbone.features(token_ids, n_prompt)
    finally:
        for h in handles:
            h.remove()

    n_tokens = len(token_ids)
    n_head, n_kv, d = TINY_LLAMA.n_head, TINY_LLAMA.n_head_kv, TINY_LLAMA.head_dim
    group = n_head // n_kv
    theta = 10000.0
    wants = []
    for layer in range(TINY_LLAMA.n_layer):
        q = _rope_rotate_half(captured[(layer, "q_proj")].reshape(n_tokens, n_head, d).transpose(1, 0, 2), theta)
        k = _rope_rotate_half(captured[(layer, "k_proj")].reshape(n_tokens, n_kv, d).transpose(1, 0, 2), theta)
        want = np.empty((n_kv, n_prompt))
        for j in range(n_kv):
            full = np.einsum("hpd,kd->hpk", q[j * group:(j + 1) * group], k[j]) / np.sqrt(d)  # all queries x keys
            for key in range(n_prompt):
                best = -np.inf
                for h in range(group):
                    for p in range(n_prompt, n_tokens):
                        best = max(best, full[h, p, key])
                want[j, key] = best
        wants.append(want)
    return features, captured, wants


def _assert_labels(features, wants, n_prompt):
    assert features.labels.shape == (TINY_LLAMA.n_layer, TINY_LLAMA.n_head_kv, n_prompt)
    for layer, want in enumerate(wants):
        got = features.labels[layer].numpy()
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), f"layer {layer}"
        assert want.std() > 0.5, "labels too uniform for the check to mean anything"


def test_labels_match_a_brute_force_reference(tiny):
    import torch
    from locret.train.backbone import load_backbone

    hf_dir, _ = tiny
    backbone = load_backbone(hf_dir)
    n_tokens, n_prompt = 48, 37
    token_ids = torch.randint(3, backbone.model.config.vocab_size, (n_tokens,),
                              generator=torch.Generator().manual_seed(1))
    features, captured, wants = _brute_force_labels(backbone, token_ids.tolist(), n_prompt)
    _assert_labels(features, wants, n_prompt)
    n_head, d = TINY_LLAMA.n_head, TINY_LLAMA.head_dim
    for layer in range(TINY_LLAMA.n_layer):
        # the heads' input is concat(Q, K, V) before RoPE, prompt tokens only
        x = features.inputs[layer].numpy()
        assert x.shape == (n_prompt, TINY_LLAMA.d_in)
        np.testing.assert_array_equal(x[:, : n_head * d], captured[(layer, "q_proj")][:n_prompt])


def _source(backbone, tmp_path, query_tokens, records=None):
    """The trainer's ExampleSource: over `records` written to a data file, or the built-in generator when
    there are none."""
    from locret.train.trainer import ExampleSource, TrainConfig

    data = [str(write_jsonl(tmp_path / "data.jsonl", records))] if records else []
    config = TrainConfig(base="", gguf="", output="", run_dir="", data=data, min_tokens=64, max_tokens=512,
                         query_tokens=query_tokens)
    return ExampleSource(config, backbone)


def test_locret_q_labels_match_a_brute_force_reference(tiny, tmp_path):
    """--query-tokens: the tokens the trainer feeds start with the query, the last L_Q tokens of
    the user's text, and the labels still match the brute-force reference over every prompt token, the
    query's included."""
    from locret.train.backbone import load_backbone

    hf_dir, _ = tiny
    backbone = load_backbone(hf_dir)
    tokenizer = backbone.tokenizer
    text = " ".join(sentence(i) for i in range(3)) + " which code is in the vault ?"
    source = _source(backbone, tmp_path, 6, [{"prompt": text, "answer": "code 2 ."}])
    example, _ = source.get(0)
    query = tokenizer.encode(text, add_special_tokens=False)[-6:]
    assert tokenizer.decode(query) == "code is in the vault ?"
    # the tiny tokenizer has no chat template and adds no BOS: nothing comes before the query
    assert not tokenizer.chat_template and tokenizer.encode("code", add_special_tokens=True) == query[:1]
    assert example.token_ids[:6] == query
    # the user's whole text follows, unchanged, and then the answer
    assert example.token_ids[6:example.n_prompt] == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(example.token_ids[example.n_prompt:]) == "code 2 . </s>"
    features, _, wants = _brute_force_labels(backbone, example.token_ids, example.n_prompt)
    _assert_labels(features, wants, example.n_prompt)


def test_locret_q_puts_the_question_or_the_last_user_tokens_in_front(tiny, tmp_path):
    """What --query-tokens L_Q puts in front of the first user turn: a built-in example's question (the text
    its prompt ends with), cut to its last L_Q tokens when longer; a record's last L_Q tokens of its last user
    turn. With 0 every example is as before."""
    from locret.convert.errors import ConversionError
    from locret.train.backbone import load_backbone
    from locret.train.synthetic import TASKS, SyntheticData
    from locret.train.training_data import Example, read_examples, with_query

    # the tasks about real source need its text; the teacher tasks take any answer here (the layout is under test)
    data = SyntheticData(lambda text: len(text.split()), seed=3, min_tokens=100, max_tokens=200, tasks=TASKS,
                         contexts=("pydoc", "pypackages"), teacher=lambda prompt: "it reads the file .")
    examples = [data.example(i) for i in range(60)]
    assert {ex.task for ex in examples} == set(TASKS)
    for ex in examples:
        assert ex.question.strip() and ex.prompt.endswith("\n\n" + ex.question), (ex.task, ex.question)

    hf_dir, _ = tiny
    backbone = load_backbone(hf_dir)
    tokenizer = backbone.tokenizer
    plain, whole, cut = (_source(backbone, tmp_path, n) for n in (0, 64, 3))
    for step in range(8):
        ex = plain.synthetic.example(step)
        before, task = plain.example(step)
        assert before.messages == (("user", ex.prompt),) and task == ex.task
        assert whole.example(step)[0] == Example((("user", ex.question + "\n\n" + ex.prompt),), ex.answer,
                                                 before.where)
        last3 = tokenizer.decode(tokenizer.encode(ex.question, add_special_tokens=False)[-3:]).strip()
        assert cut.example(step)[0].messages == (("user", last3 + "\n\n" + ex.prompt),)

    first = " ".join(sentence(i) for i in range(3))
    records = [{"prompt": first + " which code is in the vault ?", "answer": "code 1 ."},
               {"messages": [{"role": "system", "content": "read the document ."},
                             {"role": "user", "content": first},
                             {"role": "assistant", "content": "it is open ."},
                             {"role": "user", "content": "and which code is in the vault ?"},
                             {"role": "assistant", "content": "code 4 ."}]}]
    plain, q = _source(backbone, tmp_path, 0, records), _source(backbone, tmp_path, 5, records)
    originals = {e.where: e for e in read_examples(tmp_path / "data.jsonl")}
    assert {plain.example(step)[0] for step in range(2)} == set(originals.values())
    rewritten = {e.where: e for e in (q.example(step)[0] for step in range(2))}
    single, turns = rewritten[f"{tmp_path / 'data.jsonl'}:1"], rewritten[f"{tmp_path / 'data.jsonl'}:2"]
    assert single.messages == (("user", "is in the vault ?\n\n" + records[0]["prompt"]),)
    assert [m[1] for m in turns.messages] == ["read the document .", "is in the vault ?\n\n" + first,
                                              "it is open .", "and which code is in the vault ?"]
    assert turns.answer == "code 4 ."

    with pytest.raises(ConversionError, match="the last user turn is empty"):
        with_query(tokenizer, Example((("user", first), ("assistant", "ok ."), ("user", " ")), "a", "x:1"), 5)


def test_query_tokens_is_recorded_checked_and_part_of_the_settings(tiny, tmp_path):
    """--query-tokens: kept in the log and the checkpoint's fingerprint (a run without it resumes as before,
    one with it is not resumed without it), refused when negative."""
    from locret.train.trainer import TrainConfig

    hf_dir, gguf = tiny
    data = _data(tmp_path / "data.jsonl")
    common = ["--base", hf_dir, "--gguf", gguf, "--data", data, "--warmup-steps", 0, "--seed", 3, "--d-r", 32,
              "--steps", 2, "--lr", 0.01]
    proc = _train(*common, "-o", tmp_path / "c.gguf", "--query-tokens", -1, check=False)
    assert proc.returncode == 1 and "--query-tokens must be >= 0" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "c.gguf").exists()

    _train_script(*common, "-o", tmp_path / "a.gguf", "--query-tokens", 4)  # the script, end to end
    log = json.loads((tmp_path / "a.run" / "train-log.json").read_text())
    assert log["finished"] and log["config"]["query_tokens"] == 4
    assert "Locret-Q layout: the query (at most 4 tokens)" in log["data"]
    proc = _train(*common, "-o", tmp_path / "a.gguf", check=False)
    assert proc.returncode == 1 and "belongs to a run with other settings" in proc.stderr, proc.stderr[-2000:]

    # the fingerprint of a run from before the option (the value it had then), unchanged with L_Q 0
    config = TrainConfig(base="m.gguf", gguf="m.gguf", output="h.gguf", run_dir="r")
    assert config.fingerprint() == "40819bad1368d29d"
    config.query_tokens = 64
    assert config.fingerprint() != "40819bad1368d29d"


def test_label_capture_leaves_the_forward_pass_unchanged(tiny):
    import torch
    from locret.train.backbone import load_backbone
    from transformers import AutoModelForCausalLM

    hf_dir, _ = tiny
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        stock = AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager")(ids).logits
        ours = load_backbone(hf_dir).model(ids).logits
    assert torch.allclose(stock, ours, atol=1e-4)


def _train(*args, check=True):
    """The trainer's command line run in this process: the main() that convert/train_heads.py calls, with its
    exit status and output captured (a subprocess would spend most of a tiny run importing torch). An exception
    that is not a refusal escapes and fails the test, as a traceback on stderr would. One run goes through the
    script itself (_train_script, in test_query_tokens_is_recorded_checked_and_part_of_the_settings)."""
    from locret.train import cli

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    proc = subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _train_script(*args, check=True):
    """convert/train_heads.py itself, in a process of its own."""
    proc = run([sys.executable, TRAINER, *map(str, args)], timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _data(path, n=6):
    records = [{"prompt": " ".join(sentence(i + j) for j in range(12)) + " which code ?",
                "answer": f"code {i % 5}"} for i in range(n)]
    return write_jsonl(path, records)


def test_training_reduces_the_loss_and_resumes_exactly(tiny, trained, tmp_path):
    from safetensors.numpy import load_file

    hf_dir, gguf = tiny
    a_gguf, a_run = trained  # TRAINED_ARGS, run once for the module
    data = _data(tmp_path / "data.jsonl")  # the same records as the shared run's, in a file of this test's
    common = ["--base", hf_dir, "--gguf", gguf, "--data", data, *TRAINED_ARGS]
    log = json.loads((a_run / "train-log.json").read_text())
    losses = [s["loss"] for s in log["steps"]]
    assert len(losses) == 40 and log["finished"]
    first, last = np.mean(losses[:6]), np.mean(losses[-6:])
    print(f"\ntiny model: loss {first:.4f} -> {last:.4f}, top-10% "
          f"{log['steps'][0]['top10_accuracy']:.3f} -> {log['steps'][-1]['top10_accuracy']:.3f}")
    assert last < 0.7 * first
    # each layer's accuracy is logged, and the step's figure is their mean
    for s in log["steps"]:
        assert len(s["top10_by_layer"]) == log["backbone"]["n_layer"]
        assert all(0.0 <= a <= 1.0 for a in s["top10_by_layer"])
        assert s["top10_accuracy"] == pytest.approx(np.mean(s["top10_by_layer"]), abs=1e-3)
    assert len({tuple(s["top10_by_layer"]) for s in log["steps"]}) > 1
    assert (a_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert a_gguf.stat().st_size > 0

    # the same run, stopped twice and resumed, ends with the same heads
    _train(*common, "-o", tmp_path / "b.gguf", "--stop-after-steps", 12)
    stopped = json.loads((tmp_path / "b.run" / "train-log.json").read_text())
    assert stopped["steps_done"] == 12 and not stopped["finished"]
    _train(*common, "-o", tmp_path / "b.gguf", "--stop-after-steps", 13)
    done = _train(*common, "-o", tmp_path / "b.gguf")
    by_layer = [line for line in done.stdout.splitlines() if line.startswith("top-10% accuracy by layer: ")]
    assert len(by_layer) == 1 and by_layer[0].split(": ")[1].split()[0].startswith("0:")
    # the summary's figures are the means of the last 50 steps of the log it wrote
    summary = re.search(r"last (\d+) steps: loss ([0-9.]+), top-10% accuracy ([0-9.]+)", done.stdout)
    done_log = json.loads((tmp_path / "b.run" / "train-log.json").read_text())["steps"][-50:]
    assert summary and int(summary[1]) == len(done_log)
    assert float(summary[2]) == pytest.approx(np.mean([s["loss"] for s in done_log]), abs=1e-4)
    assert float(summary[3]) == pytest.approx(np.mean([s["top10_accuracy"] for s in done_log]), abs=1e-3)
    a, b = load_file(a_run / "heads.safetensors"), load_file(tmp_path / "b.run" / "heads.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    resumed = json.loads((tmp_path / "b.run" / "train-log.json").read_text())
    assert [s["loss"] for s in resumed["steps"]] == losses


def test_fine_tuning_starts_from_the_given_heads(tiny, trained, tmp_path):
    """--init-heads loads a heads checkpoint: at a vanishing learning rate the run ends with the very heads it
    started from, and its first loss is the trained heads' loss, not a random init's."""
    from safetensors.numpy import load_file

    hf_dir, gguf = tiny
    data = _data(tmp_path / "data.jsonl")
    common = ["--base", hf_dir, "--gguf", gguf, "--data", data, "--warmup-steps", 0, "--seed", 3, "--d-r", 32]
    a_gguf, a_run = trained  # the module's 40-step run (TRAINED_ARGS)
    trained = a_run / "heads.safetensors"
    _train(*common, "-o", tmp_path / "b.gguf", "--steps", 2, "--lr", 1e-30, "--init-heads", trained)
    _train(*common, "-o", tmp_path / "c.gguf", "--steps", 2, "--lr", 1e-30)
    a, b = load_file(trained), load_file(tmp_path / "b.run" / "heads.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-6, atol=1e-12, err_msg=name)
    first = {run: json.loads((tmp_path / f"{run}.run" / "train-log.json").read_text())["steps"][0]["loss"]
             for run in "bc"}
    assert first["b"] < 0.7 * first["c"], first
    assert "--init-heads" in json.loads((tmp_path / "b.run" / "train-log.json").read_text())["command"]
    # the heads GGUF the first run wrote (f16, W1's Q/K columns in llama.cpp order) starts a run just as well:
    # the same heads within f16's rounding, so a shipped heads file can be fine-tuned
    # A heads file that recommends pooling (and positions) passes them on: --pool auto measures the fine-tune as its
    # start was measured; one from safetensors recommends none
    from locret.convert.gguf_output import rewrite_recommended
    from locret.heads import file_recommended

    pooled = tmp_path / "pooled.gguf"
    rewrite_recommended(Path(a_gguf), pooled, pool=15, query=None, positions="keep", pool_from=6)
    _train(*common, "-o", tmp_path / "e.gguf", "--steps", 2, "--lr", 1e-30, "--init-heads", pooled)
    e = load_file(tmp_path / "e.run" / "heads.safetensors")
    for name in a:
        np.testing.assert_allclose(e[name], a[name], rtol=2e-3, atol=1e-6, err_msg=name)
    got = file_recommended(tmp_path / "e.gguf")
    assert (got["pool"], got["pool_from"], got["positions"]) == (15, 6, "keep"), got
    got = file_recommended(tmp_path / "b.gguf")
    assert (got["pool"], got["pool_from"], got["positions"]) == (0, 0, None), got

    # a checkpoint of another width, a file that is not safetensors, a missing file
    not_safetensors = tmp_path / "heads.safetensors"
    not_safetensors.write_bytes(b"\x00" * 64)
    for init, d_r, needle in ((trained, 16, "heads have d_R 32, this run's --d-r is 16"), (not_safetensors, 32, "not a readable safetensors"),
                              (tmp_path / "missing.safetensors", 32, "no such file")):
        proc = _train(*common[:-1], d_r, "-o", tmp_path / "d.gguf", "--steps", 2, "--init-heads", init,
                      "--no-resume", check=False)
        assert proc.returncode == 1 and needle in proc.stderr, (init, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr


def test_trained_heads_round_trip_into_llama_cpp(model_path, tmp_path, monkeypatch):
    """Heads from a short run on SmolLM2 go through the converter; llama.cpp's scores in its graph match the
    trainer's own scores (its backbone's captured Q/K/V through its own head module)."""
    import torch
    import locret  # noqa: F401
    import llama_cpp
    from locret.train import trainer
    from locret.train.backbone import load_backbone
    from locret.train.heads_model import RetainingHeads
    from safetensors.torch import load_file

    from locret import heads as runtime_heads

    # Dequantizing SmolLM2 into transformers is most of this test's time: it is done once, by load_backbone as
    # the trainer calls it, and the trainer's call is handed that backbone.
    backbone = load_backbone(model_path)
    calls = []

    def shared_backbone(source, threads=None, device="cpu"):
        assert Path(source) == Path(model_path) and threads is None and device == "cpu", (source, threads, device)
        calls.append(source)
        return backbone

    monkeypatch.setattr(trainer, "load_backbone", shared_backbone)
    out = tmp_path / "smol-heads.gguf"
    _train("--base", model_path, "-o", out, "--steps", 2, "--warmup-steps", 1, "--min-tokens", 128,
           "--max-tokens", 256, "--d-r", 64, "--seed", 5)
    assert len(calls) == 1
    log = json.loads((tmp_path / "smol-heads.run" / "train-log.json").read_text())
    assert log["finished"] and log["backbone"]["architecture"] == "llama"

    tensors = load_file(str(tmp_path / "smol-heads.run" / "heads.safetensors"))
    module = RetainingHeads(backbone.n_layer, backbone.d_in, 64, backbone.n_head_kv, backbone.activation, seed=0)
    with torch.no_grad():
        for i in range(backbone.n_layer):
            module.fc1[i].copy_(tensors[f"model.layers.{i}.self_attn.fc1.weight"])
            module.fc2[i].copy_(tensors[f"model.layers.{i}.self_attn.fc2.weight"])

    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=1024, n_batch=512, n_ubatch=256, n_threads=THREADS, n_threads_batch=THREADS,
                          verbose=False)
    tokens = llm.tokenize(natural_text().encode())[:400]
    features = backbone.features(tokens + tokens[:1], n_prompt=len(tokens))  # one dummy answer token
    with torch.no_grad():
        want = torch.stack([module.layer_scores(i, x) for i, x in enumerate(features.inputs)]).numpy()
    runtime_heads.attach(llm, out)
    runtime_heads.record_scores(llm)
    llm.eval(tokens)
    got, positions = runtime_heads.recorded_scores(llm)
    llm.close()
    assert positions.tolist() == list(range(len(tokens)))
    assert got.shape == want.shape
    scale = np.abs(want).max()
    err = np.abs(got - want).max()
    corr = min(np.corrcoef(got[l, h], want[l, h])[0, 1] for l in range(got.shape[0]) for h in range(got.shape[1]))
    print(f"\ntrained heads through the converter: max |llama.cpp - trainer| {err:.4g} of scale {scale:.4g}, "
          f"min correlation {corr:.5f}")
    assert corr > 0.99 and err < 0.05 * scale


def test_frozen_layers_keep_the_given_heads(tiny, trained, tmp_path):
    """--freeze-layers: the named layers end exactly as --init-heads gave them while the others learn."""
    from safetensors.numpy import load_file

    hf_dir, gguf = tiny
    data = _data(tmp_path / "data.jsonl")
    common = ["--base", hf_dir, "--gguf", gguf, "--data", data, "--warmup-steps", 0, "--seed", 3, "--d-r", 32]
    given = trained[1] / "heads.safetensors"  # the module's shared run
    _train(*common, "-o", tmp_path / "b.gguf", "--steps", 5, "--lr", 0.01, "--init-heads", given,
           "--freeze-layers", "0")
    a, b = load_file(given), load_file(tmp_path / "b.run" / "heads.safetensors")
    for kind in ("fc1", "fc2"):
        frozen, trained = f"model.layers.0.self_attn.{kind}.weight", f"model.layers.1.self_attn.{kind}.weight"
        np.testing.assert_array_equal(b[frozen], a[frozen])
        assert np.abs(b[trained] - a[trained]).max() > 1e-4, kind

    n_layer = TINY_LLAMA.n_layer
    for extra, needle in (([], "without --init-heads they would stay random"),
                          (["--init-heads", given, "--freeze-layers", "0-1,x"], "expected layer numbers and ranges"),
                          (["--init-heads", given, "--freeze-layers", f"{n_layer}"], f"the model has layers 0-{n_layer - 1}"),
                          (["--init-heads", given, "--freeze-layers", f"0-{n_layer - 1}"], "nothing would be trained")):
        args = extra if extra else ["--freeze-layers", "0"]
        proc = _train(*common, "-o", tmp_path / "c.gguf", "--steps", 2, "--no-resume", *args, check=False)
        assert proc.returncode == 1 and needle in proc.stderr, (args, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr


def test_attention_kl_matches_a_numpy_reference():
    """--rank-weight's term: KL(softmax(label) || softmax(pred)) per KV head, written out in float64 numpy."""
    import torch
    from locret.train.heads_model import SMOOTHNESS_WEIGHT, attention_kl, head_loss

    rng = np.random.default_rng(5)
    pred, label = rng.normal(size=(3, 40)) * 2, rng.normal(size=(3, 40)) * 3
    expected = []
    for p_row, l_row in zip(pred, label):
        p_attn = np.exp(l_row - l_row.max()) / np.exp(l_row - l_row.max()).sum()
        q_attn = np.exp(p_row - p_row.max()) / np.exp(p_row - p_row.max()).sum()
        expected.append(sum(p_attn[k] * np.log(p_attn[k] / q_attn[k]) for k in range(len(p_row))))
    pred_t, label_t = torch.tensor(pred), torch.tensor(label)
    assert float(attention_kl(pred_t, label_t)) == pytest.approx(np.mean(expected), rel=1e-10)
    # a per-head offset changes nothing; a perfect order and gaps give zero
    offsets = torch.tensor([[1.5], [-7.0], [30.0]], dtype=torch.float64)
    assert float(attention_kl(pred_t + offsets, label_t)) == pytest.approx(np.mean(expected), rel=1e-10)
    assert float(attention_kl(label_t + offsets, label_t)) == pytest.approx(0.0, abs=1e-12)
    # head_loss: the paper's loss exactly when the weight is 0, plus the weighted term otherwise
    huber = np.where(np.abs(pred - label) < 1, 0.5 * (pred - label) ** 2, np.abs(pred - label) - 0.5).mean()
    paper = huber + SMOOTHNESS_WEIGHT * ((pred[:, 1:] - pred[:, :-1]) ** 2).mean()
    assert float(head_loss(pred_t, label_t)) == pytest.approx(paper, rel=1e-10)
    assert float(head_loss(pred_t, label_t, 0.5)) == pytest.approx(paper + 0.5 * np.mean(expected), rel=1e-10)


def test_rank_weight_is_used_recorded_and_checked(tiny, tmp_path):
    """--rank-weight changes what is learnt, is kept in the log's settings, and is refused when negative."""
    from safetensors.numpy import load_file

    hf_dir, gguf = tiny
    data = _data(tmp_path / "data.jsonl")
    common = ["--base", hf_dir, "--gguf", gguf, "--data", data, "--warmup-steps", 0, "--seed", 3, "--d-r", 32,
              "--steps", 4, "--lr", 0.01]
    _train(*common, "-o", tmp_path / "a.gguf")
    _train(*common, "-o", tmp_path / "b.gguf", "--rank-weight", 2)
    log = json.loads((tmp_path / "b.run" / "train-log.json").read_text())
    assert log["config"]["rank_weight"] == 2
    plain = json.loads((tmp_path / "a.run" / "train-log.json").read_text())
    assert log["steps"][0]["loss"] > plain["steps"][0]["loss"]  # same heads and data at step 0: the KL adds
    a, b = load_file(tmp_path / "a.run" / "heads.safetensors"), load_file(tmp_path / "b.run" / "heads.safetensors")
    assert max(np.abs(a[n] - b[n]).max() for n in a) > 1e-4
    for bad in ("-1", "nan"):
        proc = _train(*common, "-o", tmp_path / "c.gguf", "--rank-weight", bad, check=False)
        assert proc.returncode == 1 and "--rank-weight must be a finite number >= 0" in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("case,needle", [
    ("empty", "the file is empty"),
    ("malformed", "data.jsonl:2: not a JSON object"),
    ("unknown-form", "not a known record form"),
    ("short-prompt", "is shorter than the answer"),
    ("no-answer", "needs a user turn followed by an assistant answer"),
])
def test_bad_training_data_is_refused(tiny, tmp_path, case, needle):
    hf_dir, gguf = tiny
    data = tmp_path / "data.jsonl"
    if case == "empty":
        data.write_text("")
    elif case == "malformed":
        data.write_text('{"prompt": "a b c", "answer": "a"}\n{"prompt": "a b c", "answer": \n')
    elif case == "unknown-form":
        write_jsonl(data, [{"text": "the code"}])
    elif case == "short-prompt":
        write_jsonl(data, [{"prompt": "code", "answer": "the record holds code 4 and the crate is open"}])
    else:
        write_jsonl(data, [{"conversations": [{"from": "human", "value": "which code ?"}]}])
    proc = _train("--base", hf_dir, "--gguf", gguf, "--data", data, "-o", tmp_path / "h.gguf", "--steps", 2,
                  "--warmup-steps", 0, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "train_heads: error:" in proc.stderr and needle in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "h.gguf").exists()


def test_unsupported_base_models_are_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(gpt2)
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    cases = [
        (["--base", gpt2, "--gguf", gguf], "does not support model type 'gpt2'"),
        (["--base", tmp_path / "missing.gguf"], "no such file"),
        (["--base", gguf], "cannot load it with transformers"),  # a GGUF transformers cannot load
        (["--base", gpt2], "give the model GGUF the heads are for with --gguf"),
        (["--base", gpt2, "--gguf", gguf, "--d-r", 0], "--d-r must be positive"),
        (["--base", gpt2, "--gguf", gguf, "--tasks", "passkey,sorting"], "unknown synthetic task(s) sorting"),
    ]
    for args, needle in cases:
        proc = _train(*args, "-o", tmp_path / "h.gguf", check=False)
        assert proc.returncode == 1 and needle in proc.stderr, (args, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr


def test_synthetic_examples_are_seeded_and_hold_their_answer():
    from locret.train.synthetic import DEFAULT_TASKS, SOURCE_TASKS, TASKS, TEACHER_TASKS, SyntheticData

    def count(text):
        return len(text.split())  # a stand-in tokenizer: words

    # real source, the model's own answers and identifiers have tests of their own
    tasks = tuple(t for t in TASKS if t not in SOURCE_TASKS + TEACHER_TASKS + ("identifier",))
    data = SyntheticData(count, seed=7, min_tokens=300, max_tokens=600, tasks=tasks)
    again = SyntheticData(count, seed=7, min_tokens=300, max_tokens=600, tasks=tasks)
    other = SyntheticData(count, seed=8, min_tokens=300, max_tokens=600, tasks=tasks)
    seen = set()
    for i in range(80):
        ex = data.example(i)
        assert ex == again.example(i)
        seen.add(ex.task)
        context = ex.prompt.rsplit("\n\n", 1)[0]
        if ex.task in ("passkey", "lookup", "tracking", "quote"):
            assert ex.answer in context, (ex.task, ex.answer)
        if ex.task == "frequent":
            assert context.count(f"The {ex.answer} was seen again.") >= 6
        if ex.task == "repeats":
            # the code is stated once, in a context made of one passage repeated
            code = re.search(r"\d+", ex.answer).group()
            assert context.count(code) == 1
            blocks = context.split("\n\n")[1:]
            passage = max(set(blocks), key=blocks.count)
            assert blocks.count(passage) >= len(blocks) - 1 >= 3, blocks[:3]
        assert count(ex.prompt) <= 600 + 5
    assert seen == set(tasks)
    assert [data.example(i) for i in range(10)] != [other.example(i) for i in range(10)]
    assert {data.example(i).context for i in range(80)} == {"pydoc"}
    # the default mix is the shipped heads' recipe: fixed, without the opt-in task
    assert SyntheticData(count, seed=7, min_tokens=300, max_tokens=600).tasks == DEFAULT_TASKS
    assert "repeats" not in DEFAULT_TASKS


def test_identifiers_are_stated_once_among_look_alikes_of_their_form():
    from locret.train.synthetic import SyntheticData

    data = SyntheticData(lambda text: len(text.split()), seed=5, min_tokens=300, max_tokens=600,
                         tasks=("identifier",))
    forms = {
        "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
        "ipv4": r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}",
        "version": r"\d{1,2}\.\d{1,2}\.\d{1,2}",
        "hash": r"[0-9a-f]{7,16}",
    }
    seen = set()
    for i in range(40):
        ex = data.example(i)
        context, question = ex.prompt.rsplit("\n\n", 1)
        form = next(f for f, pattern in forms.items() if re.fullmatch(pattern, ex.answer))
        seen.add(form)
        # the value stated once, as a whole token run (not inside a longer identifier)
        assert len(re.findall(rf"(?<![\w.-]){re.escape(ex.answer)}(?![\w-]|\.\d)", context)) == 1, ex.answer
        # its look-alikes: at least three other values of the same form, each a record of its own key
        others = set(re.findall(rf"(?<![\w.-]){forms[form]}(?![\w-]|\.\d)", context)) - {ex.answer}
        assert len(others) >= 3, (form, others)
        key = re.search(r"of (\w+)\?$", question).group(1)
        (record,) = [block for block in context.split("\n\n") if ex.answer in block]
        assert re.search(rf"\b{key}\b", record) and len(record) < 100, (record, question)
        assert ex == SyntheticData(lambda text: len(text.split()), seed=5, min_tokens=300, max_tokens=600,
                                   tasks=("identifier",)).example(i)
    assert seen == set(forms)


def test_synthetic_contexts_draw_the_haystack_families():
    """--contexts: each example's text is one kind, drawn per example; the needles and the answer are in it
    as with the Python reference; a family's text is its generator's (code lines, log lines, clauses); the
    quote task, which asks about a section, keeps the reference; an unknown kind is refused."""
    from locret.tasks import realtext
    from locret.tasks.haystacks import FAMILIES
    from locret.train.synthetic import CONTEXTS, DEFAULT_TASKS, SyntheticData

    def count(text):
        return len(text.split())

    data = SyntheticData(count, seed=5, min_tokens=300, max_tokens=600, contexts=CONTEXTS)
    kinds = {}
    for i in range(120):
        ex = data.example(i)
        assert ex == SyntheticData(count, seed=5, min_tokens=300, max_tokens=600, contexts=CONTEXTS).example(i)
        kinds.setdefault(ex.context, []).append(ex)
        context = ex.prompt.rsplit("\n\n", 1)[0]
        if ex.task in ("passkey", "lookup", "tracking", "quote"):
            assert ex.answer in context, (ex.task, ex.context, ex.answer)
        if ex.task == "frequent":
            assert context.count(f"The {ex.answer} was seen again.") >= 6
        if ex.task == "quote":
            assert ex.context == "pydoc" and "Section: " in context
        elif ex.context != "pydoc":
            assert "Section: " not in context, ex.context
        assert count(ex.prompt) <= 600 + 5
    assert set(kinds) == set(CONTEXTS), {k: len(v) for k, v in kinds.items()}
    assert CONTEXTS == ("pydoc",) + FAMILIES + ("pypackages",) == ("pydoc",) + FAMILIES + realtext.TRAINING_FAMILIES
    code = "\n\n".join(ex.prompt for ex in kinds["code"])
    logs = "\n\n".join(ex.prompt for ex in kinds["logs"])
    assert code.count("def ") + code.count("import ") >= 10 and "\n    " in code  # indented code lines
    assert logs.count("] ") >= 20 and "Section: " not in logs
    # the default is the Python reference alone, drawing exactly the examples it drew before the option
    # existed (the digest was taken with the generator as it was before, so the shipped heads' data is kept)
    plain = SyntheticData(count, seed=5, min_tokens=300, max_tokens=600)
    assert plain.contexts == ("pydoc",) and plain.tasks == DEFAULT_TASKS
    # The text is pydoc_data.topics of the running Python, which differs between releases; the digest is of
    # 3.11.7's (this project's machines), elsewhere only the rest of this test applies.
    if sys.version_info[:3] == (3, 11, 7):
        text = "".join(plain.example(i).prompt + plain.example(i).answer for i in range(12))
        assert hashlib.sha256(text.encode()).hexdigest() == \
            "eb817a4ca555c9d6f028f9339907a5ec27599925b7d9bd9da4ac7afbd3dfe30b"
    with pytest.raises(ValueError, match="unknown context kind"):
        SyntheticData(count, seed=5, min_tokens=300, max_tokens=600, contexts=("pydoc", "poetry"))


SOURCE_SNIPPET = '''MAXITER = 500
TOL = 1e-8
TOL = 2e-8          # assigned twice: never asked
FLAG = 1            # one character: says nothing
NAME = 'brent'


def solve(f, a, b, xtol=2e-12, method="hybr", maxiter=MAXITER, k=0):
    """Find a root of f between a and b. The bracket must change sign.

    More text.
    """
    return a


def again(x=0.25):
    return x


def again(x=0.5):
    """Defined twice, so its name names no one function: never asked about."""
'''


def test_source_facts_and_docstrings_are_what_the_code_states():
    """The fact task asks a literal a name is set to once, or a literal default of a function defined once; the
    docstring task a first sentence; never a value of one character, a name assigned twice, a twice-defined
    function or a non-literal default."""
    from locret.train.synthetic import source_docstrings, source_facts

    asked = {q.split(" the source code above, ")[1]: a for q, a in source_facts(SOURCE_SNIPPET)}
    assert asked == {"which value is MAXITER set to?": "500", "which value is NAME set to?": "'brent'",
                     "what is the default value of the parameter xtol of the function solve?": "2e-12",
                     "what is the default value of the parameter method of the function solve?": '"hybr"'}
    assert source_docstrings(SOURCE_SNIPPET) == [("solve", "Find a root of f between a and b.")]


def test_source_tasks_ask_what_the_real_source_states():
    """fact and docstring examples: the text is a stretch of the pypackages corpus with nothing inserted (every
    block of it is one of the corpus's paragraphs), and the answer is what that text states."""
    from locret.tasks import realtext
    from locret.train.synthetic import SyntheticData, source_docstrings, source_facts

    def count(text):
        return len(text.split())

    corpus = realtext.load("pypackages")
    paragraphs = {p for d in corpus.documents for p in d.paragraphs}
    data = SyntheticData(count, seed=11, min_tokens=300, max_tokens=600, tasks=("fact", "docstring"),
                         contexts=("pydoc", "pypackages"))
    tasks = set()
    for i in range(16):
        ex = data.example(i)
        tasks.add(ex.task)
        assert ex.context == "pypackages" and ex.prompt.endswith("\n\n" + ex.question)
        intro, context = ex.prompt[:-len(ex.question) - 2].split("\n\n", 1)
        assert all(block in paragraphs for block in context.split("\n\n")), i
        if ex.task == "fact":
            assert (ex.question, ex.answer) in source_facts(context) and ex.answer in context
        else:
            name = re.search(r"function (\w+) in the source", ex.question).group(1)
            assert (name, ex.answer) in source_docstrings(context)
            assert ex.answer in " ".join(context.split())
        assert count(ex.prompt) <= 600 + 5
    assert tasks == {"fact", "docstring"}


def test_held_out_families_and_source_tasks_without_source_are_refused():
    from locret import holdout
    from locret.tasks import realtext
    from locret.train.synthetic import SyntheticData

    assert set(realtext.FAMILIES) == set(holdout.HELD_OUT_FAMILIES)
    for family in holdout.HELD_OUT_FAMILIES:
        with pytest.raises(ValueError, match=f"{family} is a held-out real-text family"):
            SyntheticData(len, seed=1, min_tokens=300, max_tokens=600, contexts=("pydoc", family))
    with pytest.raises(ValueError, match="fact ask about real source text: add pypackages"):
        SyntheticData(len, seed=1, min_tokens=300, max_tokens=600, tasks=("passkey", "fact"))


@pytest.mark.parametrize("args,needle", [
    (["--contexts", "pydoc,man"], "--contexts: man is a held-out real-text family"),
    (["--tasks", "passkey,docstring"], "--tasks docstring ask about real source text: add pypackages to --contexts"),
    (["--tasks", "summarize,explain"], "--tasks explain ask about real source text: add pypackages to --contexts"),
])
def test_the_trainer_refuses_held_out_text_and_a_mix_it_cannot_draw(tiny, tmp_path, args, needle):
    hf_dir, gguf = tiny
    proc = _train("--base", hf_dir, "--gguf", gguf, "-o", tmp_path / "h.gguf", "--steps", 2, "--warmup-steps", 0,
                  *args, check=False)
    assert proc.returncode == 1 and needle in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("task", ["fact", "docstring", "identifier"])
def test_labels_of_real_source_answers_match_a_brute_force_reference(tiny, task):
    """The new kinds of answer (real source's own facts and passages, identifiers among look-alikes): an example of
    each, as the trainer tokenizes it, gets labels equal to the brute-force reference (the attention its answer tokens
    give each prompt token)."""
    from locret.train.backbone import load_backbone
    from locret.train.trainer import ExampleSource, TrainConfig

    hf_dir, _ = tiny
    backbone = load_backbone(hf_dir)
    config = TrainConfig(base="", gguf="", output="", run_dir="", min_tokens=400, max_tokens=512, tasks=[task],
                         contexts=["pypackages"])
    example, got = ExampleSource(config, backbone).get(0)
    assert got == task and 0 < example.n_prompt < len(example.token_ids) <= 512
    features, _, wants = _brute_force_labels(backbone, example.token_ids, example.n_prompt)
    _assert_labels(features, wants, example.n_prompt)


def test_the_training_log_names_the_real_text_corpus_once(tiny):
    """ExampleSource.corpora (the log's "corpora"): each real-text family of --contexts once, by its cache id, file
    count and the sha256 of its manifest (every file's name and sha256), so an evaluation can tell what was read."""
    from locret.tasks import realtext
    from locret.tasks.realtext import corpus as corpus_module
    from locret.train.backbone import load_backbone
    from locret.train.trainer import ExampleSource, TrainConfig

    backbone = load_backbone(tiny[0])
    config = TrainConfig(base="", gguf="", output="", run_dir="", contexts=["pydoc", "pypackages", "code",
                                                                            "pypackages"])
    (entry,) = ExampleSource(config, backbone).corpora()
    corpus = realtext.load("pypackages")
    listing = json.dumps(corpus_module.manifest(corpus), sort_keys=True).encode()
    assert entry == {"family": "pypackages", "id": corpus.id, "files": len(corpus_module.manifest(corpus)),
                     "manifest_sha256": hashlib.sha256(listing).hexdigest()}
    assert ExampleSource(TrainConfig(base="", gguf="", output="", run_dir=""), backbone).corpora() == []


# ---------------------------------------------------------------- teacher answers (the model's own)

def _greedy_without_a_cache(model, prompt_ids: list[int], n: int, eos: int) -> list[int]:
    """The reference: the whole sequence through the model again for every token, its last logits' argmax."""
    import torch

    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if token == eos:
                break
            ids.append(token)
    return ids[len(prompt_ids):]


def test_teacher_answers_are_the_models_greedy_answer_and_get_the_papers_labels(tiny):
    """summarize: the answer is the backbone's greedy continuation of the rendered prompt (against a reference that
    runs the whole sequence for each token, no cache), the same on a second call, and the example's labels equal the
    brute-force reference."""
    from locret.train.backbone import load_backbone
    from locret.train.synthetic import TEACHER_TOKENS
    from locret.train.trainer import ExampleSource, TrainConfig
    from locret.train.training_data import render_prompt

    backbone = load_backbone(tiny[0])
    prompt = render_prompt(backbone.tokenizer, (("user", " ".join(natural_text().split()[:60])),))
    want = _greedy_without_a_cache(backbone.model, prompt, 12, backbone.tokenizer.eos_token_id)
    assert backbone.greedy(prompt, 12) == want and len(want) >= 1

    config = TrainConfig(base="", gguf="", output="", run_dir="", min_tokens=400, max_tokens=512,
                         tasks=["summarize"], contexts=["pydoc", "code"])
    source = ExampleSource(config, backbone)
    example, _ = source.example(0)
    user = example.messages[0][1]
    reference = _greedy_without_a_cache(backbone.model, render_prompt(backbone.tokenizer, (("user", user),)),
                                        TEACHER_TOKENS, backbone.tokenizer.eos_token_id)
    assert example.answer == backbone.tokenizer.decode(reference, skip_special_tokens=True).strip() != ""
    assert source.example(0)[0] == example                       # greedy: a resumed run draws the same example
    tokenized, task = source.get(0)
    assert task == "summarize" and tokenized.n_prompt < len(tokenized.token_ids) <= 512
    features, _, wants = _brute_force_labels(backbone, tokenized.token_ids, tokenized.n_prompt)
    _assert_labels(features, wants, tokenized.n_prompt)
    assert "greedy answers with full attention" in source.describe()


def test_teacher_tasks_need_a_teacher_and_redraw_an_unanswered_prompt():
    from locret.train.synthetic import SyntheticData

    with pytest.raises(ValueError, match="summarize take the model's own answer: they need a teacher"):
        SyntheticData(len, seed=1, min_tokens=300, max_tokens=600, tasks=("passkey", "summarize"))
    with pytest.raises(ValueError, match="--tasks explain ask about real source text: add pypackages"):
        SyntheticData(len, seed=1, min_tokens=300, max_tokens=600, tasks=("explain",), teacher=lambda p: "x")

    asked = []

    def shy(prompt):          # no answer to the first two prompts
        asked.append(prompt)
        return "" if len(asked) <= 2 else f"answer {len(asked)}"

    data = SyntheticData(lambda t: len(t.split()), seed=1, min_tokens=300, max_tokens=600, tasks=("summarize",),
                         teacher=shy)
    ex = data.example(0)
    assert ex.answer == "answer 3" and ex.prompt == asked[-1] and len(asked) == 3
    assert ex.prompt.endswith("\n\n" + ex.question)
    silent = SyntheticData(len, seed=1, min_tokens=300, max_tokens=600, tasks=("summarize",), teacher=lambda p: " ")
    with pytest.raises(RuntimeError, match="no answer to 8 summarize prompts"):
        silent.example(0)
