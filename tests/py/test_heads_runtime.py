"""Retaining heads inside llama.cpp: loading from a file or the model itself, leaving the model's
output unchanged, and refusing heads that do not fit the model.

The refusal fixtures are small heads GGUFs written here with gguf-py (independent of the
converter), each broken in one way; the real model and converter outputs are never modified.
"""
from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
from conftest import THREADS, natural_text, run, tool
from gguf import GGUFWriter

SMOLLM = dict(arch="llama", n_layer=30, n_head=9, n_head_kv=3, head_dim=64)
PROMPT = "The capital of France is"


def write_heads(path, *, arch="llama", n_layer=30, n_head=9, n_head_kv=3, head_dim=64, d_r=64,
                version=1, activation="silu", qk_layout="llama.cpp", skip_tensor=None, seed=0, f32_tensors=()):
    """A heads GGUF per convert/HEADS-FORMAT.md, with one property changed by the caller; the weights are F16, those
    named in f32_tensors F32 (the same values)."""
    w = GGUFWriter(path, arch)
    w.add_type("locret_heads")
    for key, value in [("locret.format_version", version), ("locret.base.n_layer", n_layer),
                       ("locret.base.n_head", n_head), ("locret.base.n_head_kv", n_head_kv),
                       ("locret.base.head_dim_k", head_dim), ("locret.base.head_dim_v", head_dim),
                       ("locret.hidden_size", d_r)]:
        w.add_uint32(key, value)
    for key, value in [("locret.base.architecture", arch), ("locret.input_layout", "q,k,v pre-rope"),
                       ("locret.qk_layout", qk_layout), ("locret.activation", activation)]:
        w.add_string(key, value)
    w.add_bool("locret.qk_permuted", True)
    rng = np.random.default_rng(seed)
    d_in = (n_head + 2 * n_head_kv) * head_dim
    for il in range(n_layer):
        for name, shape in [("fc1.weight", (d_r, d_in)), ("fc2.weight", (n_head_kv, d_r))]:
            full = f"locret.blk.{il}.{name}"
            if full != skip_tensor:
                weights = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float16)
                w.add_tensor(full, weights.astype(np.float32) if full in f32_tensors else weights)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def convert(*args) -> None:
    """The converter's command line (the main() of convert/heads_to_gguf.py) in this process: a subprocess per
    call would spend most of its time importing torch. The script itself is run by test_convert.py."""
    from locret.convert import cli

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    assert code == 0, (args, err.getvalue()[-3000:])


def completion(model, *extra, n_predict=24):
    return run([tool("llama-completion"), "-m", model, "-p", PROMPT, "-no-cnv", "--no-display-prompt",
                "--temp", "0", "--seed", "42", "-n", str(n_predict), "-c", "512", "-t", str(THREADS), *extra])


@pytest.fixture(scope="module")
def converted(tmp_path_factory, model_path):
    """Random heads in the published format, converted, and merged into a copy of the model."""
    work = tmp_path_factory.mktemp("heads")
    ckpt, heads, merged = work / "random.safetensors", work / "heads.gguf", work / "merged.gguf"
    for args in (["make-random", "--base", model_path, "--d-r", "128", "--seed", "1", "-o", ckpt],
                 ["--base", model_path, "--heads", ckpt, "-o", heads],
                 ["--heads", ckpt, "--merge-into", model_path, "-o", merged]):
        convert(*args)
    return heads, merged


def test_tools_output_is_token_identical_with_heads(model_path, converted):
    heads, merged = converted
    plain = completion(model_path)
    assert plain.returncode == 0 and plain.stdout.strip(), plain.stderr[-2000:]
    with_heads = completion(model_path, "--locret-heads", heads)
    assert with_heads.returncode == 0, with_heads.stderr[-2000:]
    assert with_heads.stdout == plain.stdout
    embedded = completion(merged)  # the heads inside the model file are attached by default
    assert embedded.returncode == 0, embedded.stderr[-2000:]
    assert embedded.stdout == plain.stdout
    assert "attached Locret retaining heads" in with_heads.stderr
    assert "attached Locret retaining heads" in embedded.stderr


def test_logits_are_identical_with_heads_and_scores_match_embedded_heads(model_path, converted):
    import locret  # noqa: F401
    import llama_cpp

    from locret import heads as H

    heads_file, merged = converted
    tokens = None
    results = {}
    for name, model, attach in [("plain", model_path, None), ("heads", model_path, heads_file),
                                ("embedded", merged, "model")]:
        llm = llama_cpp.Llama(model_path=str(model), n_ctx=512, n_ubatch=128, n_threads=THREADS, n_threads_batch=THREADS,
                              logits_all=True, verbose=False)
        tokens = tokens or llm.tokenize(b"Locret keeps the KV cache bounded by evicting units. " * 12)
        if attach is not None:
            H.attach(llm, None if attach == "model" else attach)
            H.record_scores(llm)
        llm.eval(tokens)
        logits = np.array(llm.scores[: len(tokens)], copy=True)
        scores = H.recorded_scores(llm)[0] if attach is not None else None
        results[name] = (logits, scores)
        llm.close()
    assert np.array_equal(results["plain"][0], results["heads"][0]), "heads changed the model's logits"
    assert np.array_equal(results["plain"][0], results["embedded"][0])
    assert results["heads"][1].shape == (30, 3, len(tokens))
    assert np.array_equal(results["heads"][1], results["embedded"][1])


REFUSALS = {
    "other architecture": (dict(arch="gemma3"), "heads are for architecture 'gemma3' but the model is 'llama'"),
    "other n_head_kv": (dict(n_head_kv=4), "n_head_kv is 4 in the heads file but 3 in the model"),
    "other n_layer": (dict(n_layer=18), "n_layer is 18 in the heads file but 30 in the model"),
    "missing tensor": (dict(skip_tensor="locret.blk.7.fc2.weight"), "missing tensor 'locret.blk.7.fc2.weight'"),
    "future format": (dict(version=2), "heads format version 2 is not supported"),
    "unknown activation": (dict(activation="swish2"), "unknown activation 'swish2'"),
    "hf q/k order": (dict(qk_layout="hf"), "Q/K columns are in 'hf' order"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_tools_refuse_heads_that_do_not_fit(case, model_path, tmp_path):
    changes, message = REFUSALS[case]
    bad = write_heads(tmp_path / "bad.gguf", **{**SMOLLM, **changes})
    proc = completion(model_path, "--locret-heads", bad, n_predict=4)
    assert proc.returncode != 0 and proc.returncode > 0, (proc.returncode, proc.stderr[-2000:])
    assert message in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.strip() == "", "the tool generated text despite the refused heads"


@pytest.mark.parametrize("case", ["truncated", "not gguf", "no heads in file", "missing file"])
def test_tools_refuse_unreadable_heads_files(case, model_path, tmp_path):
    path = tmp_path / "heads.gguf"
    if case == "truncated":
        data = write_heads(tmp_path / "good.gguf", **SMOLLM).read_bytes()
        path.write_bytes(data[: len(data) * 2 // 3])
        message = "lies beyond the end of the file"
    elif case == "not gguf":
        path.write_text("not a gguf file\n")
        message = "cannot read the file as GGUF"
    elif case == "no heads in file":
        path = model_path  # a model without embedded heads
        message = "the file has no retaining heads"
    else:
        message = "cannot read the file as GGUF"
    proc = completion(model_path, "--locret-heads", path, n_predict=4)
    assert proc.returncode > 0, (proc.returncode, proc.stderr[-2000:])
    assert message in proc.stderr, proc.stderr[-3000:]


def test_python_api_refuses_with_the_reason(model_path, tmp_path):
    import locret  # noqa: F401
    import llama_cpp

    from locret import heads as H

    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=256, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    try:
        with pytest.raises(H.HeadsError, match="n_head_kv is 4 in the heads file but 3 in the model"):
            H.attach(llm, write_heads(tmp_path / "bad.gguf", **{**SMOLLM, "n_head_kv": 4}))
        assert H.file_has_heads(write_heads(tmp_path / "good.gguf", **SMOLLM))
        assert not H.file_has_heads(model_path)
        with pytest.raises(H.HeadsError, match="cannot be read as GGUF"):
            H.file_has_heads(tmp_path / "missing.gguf")
    finally:
        llm.close()


def test_every_weight_type_loads_and_scores_like_f32(model_path, tmp_path):
    """Every stored type of the heads' weights scores like the F32 heads."""
    import locret  # noqa: F401
    import llama_cpp

    from locret import heads as H
    from reference_cis import spearman

    ckpt = tmp_path / "random.safetensors"
    files = {}
    convert("make-random", "--base", model_path, "--d-r", "64", "--seed", "2", "-o", ckpt)
    for weight_type in ("f32", "f16", "bf16", "q8_0"):
        files[weight_type] = tmp_path / f"heads-{weight_type}.gguf"
        convert("--base", model_path, "--heads", ckpt, "-o", files[weight_type], "--type", weight_type)
    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=512, n_ubatch=256, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    tokens = llm.tokenize(natural_text().encode())[:400]  # distinct tokens: rank correlation is meaningful
    scores = {}
    for weight_type, path in files.items():
        H.attach(llm, path)
        H.record_scores(llm)
        llm.reset()
        llm.eval(tokens)
        scores[weight_type] = H.recorded_scores(llm)[0]
    llm.close()
    ref = scores["f32"]
    for weight_type in ("f16", "bf16", "q8_0"):
        got = scores[weight_type]
        corr = min(spearman(got[il, h], ref[il, h]) for il in range(ref.shape[0]) for h in range(ref.shape[1]))
        print(f"{weight_type}: min rank correlation with f32 heads {corr:.4f}")
        assert corr >= 0.99, (weight_type, corr)
        assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max(), weight_type


@pytest.mark.parametrize("tool_name", ["llama-cli", "llama-server", "llama-bench"])
def test_other_tools_refuse_heads_that_do_not_fit(tool_name, model_path, tmp_path):
    """llama-cli and llama-server get --locret-heads from common, llama-bench has its own."""
    bad = write_heads(tmp_path / "bad.gguf", **{**SMOLLM, "n_head_kv": 4})
    args = {
        "llama-cli": ["-p", "hi", "-st", "--simple-io", "-n", "4", "-c", "256"],
        "llama-server": ["--port", "0", "-c", "256"],
        "llama-bench": ["-p", "16", "-n", "0", "-r", "1"],
    }[tool_name]
    proc = run([tool(tool_name), "-m", model_path, "--locret-heads", bad, *args], timeout=120)
    assert proc.returncode > 0, (proc.returncode, proc.stderr[-2000:])
    assert "n_head_kv is 4 in the heads file but 3 in the model" in proc.stdout + proc.stderr, proc.stderr[-3000:]
