"""Shape-alike benchmark models (locret.shapes): random weights with the exact shapes of the paper's models.

- the full shapes are the published Hugging Face configs (written out here independently of the module's table),
  with the real models' parameter counts and GGUF tensor counts, checked from the planned tensor list;
- the RoPE tensors and Phi-3's attention factor are exactly what llama.cpp's own convert_hf_to_gguf.py computes for
  those configs (its LlamaModel / Phi3MiniModel code run on a stand-in object);
- the scaled-down shapes are written and read back with gguf-py (keys, tensor names, shapes, types, RoPE data,
  tokenizer), their quantized blocks decode to finite weights of the intended scale, llama.cpp loads them with those
  hyperparameters, their random heads (d_R 1024) attach and score, and llama-bench runs with and without the heads;
- the SmolLM2 shape plans the shipped default model's tensors (names, shapes, types) and keys, read from that file;
- the full shapes' layer geometry (one layer at full width) loads in llama.cpp with its heads;
- a second build is found in the cache at once; the command line prints the two paths.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import types

import numpy as np
import pytest
from conftest import REPO, run, tool

from locret import shapes

gguf = shapes.gguf
MINI = ["llama3.1-8b-mini", "phi3-mini-128k-mini"]
FULL = ["llama3.1-8b", "phi3-mini-128k"]

# The configs of meta-llama/Llama-3.1-8B-Instruct and microsoft/Phi-3-mini-128k-instruct, and what llama.cpp's
# converter makes of them: parameter count and number of tensors in the converted GGUF.
PUBLISHED = {
    "llama3.1-8b": dict(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=14336,
                        n_vocab=128256, rms_eps=1e-5, rope_theta=500000.0, n_ctx_train=131072, n_ctx_orig=8192,
                        rope_scaling="llama3", llama3_factor=8.0, llama3_low_freq_factor=1.0,
                        llama3_high_freq_factor=4.0, params=8_030_261_248, n_tensors=292),
    "phi3-mini-128k": dict(arch="phi3", n_layer=32, n_embd=3072, n_head=32, n_head_kv=32, head_dim=96, n_ff=8192,
                           n_vocab=32064, rms_eps=1e-5, rope_theta=10000.0, n_ctx_train=131072, n_ctx_orig=4096,
                           rope_scaling="longrope", sliding_window=262144, params=3_821_079_552, n_tensors=197),
}


@pytest.mark.parametrize("name", FULL)
def test_full_shapes_are_the_published_configs(name):
    s = shapes.SHAPES[name]
    expected = dict(PUBLISHED[name])
    params, n_tensors = expected.pop("params"), expected.pop("n_tensors")
    assert {k: getattr(s, k) for k in expected} == expected
    assert shapes.n_parameters(s) == params
    assert len(shapes.plan_tensors(s)) == n_tensors


def test_scaled_down_shapes_keep_the_attention_geometry_and_rope():
    for mini, full in zip(MINI, FULL):
        m, f = shapes.SHAPES[mini], shapes.SHAPES[full]
        assert m.head_dim == f.head_dim and m.n_head // m.n_head_kv == f.n_head // f.n_head_kv
        assert m.n_ff * f.n_embd == f.n_ff * m.n_embd  # the FFN/embedding ratio
        rope_fields = ["arch", "rope_scaling", "rope_theta", "n_ctx_train", "n_ctx_orig", "llama3_factor",
                       "llama3_low_freq_factor", "llama3_high_freq_factor", "long_factor", "short_factor",
                       "sliding_window", "rms_eps"]
        assert [getattr(m, k) for k in rope_fields] == [getattr(f, k) for k in rope_fields]
        assert m.n_layer == 8 and shapes.n_parameters(m) < 0.2e9
        assert {k: v.tolist() for k, v in shapes.rope_tensors(m).items()} == \
            {k: v.tolist() for k, v in shapes.rope_tensors(f).items()}


def test_planned_tensors_have_llama_cpps_shapes():
    llama = {t.name: t.shape for t in shapes.plan_tensors(shapes.SHAPES["llama3.1-8b"])}
    assert llama["token_embd.weight"] == llama["output.weight"] == (128256, 4096)  # numpy order: ne reversed
    assert llama["blk.31.attn_q.weight"] == (4096, 4096) and llama["blk.31.attn_output.weight"] == (4096, 4096)
    assert llama["blk.0.attn_k.weight"] == llama["blk.0.attn_v.weight"] == (1024, 4096)
    assert llama["blk.0.ffn_gate.weight"] == llama["blk.0.ffn_up.weight"] == (14336, 4096)
    assert llama["blk.0.ffn_down.weight"] == (4096, 14336) and llama["rope_freqs.weight"] == (64,)
    phi3 = {t.name: t.shape for t in shapes.plan_tensors(shapes.SHAPES["phi3-mini-128k"])}
    assert phi3["blk.0.attn_qkv.weight"] == (3 * 3072, 3072) and "blk.0.attn_q.weight" not in phi3
    assert phi3["blk.0.ffn_up.weight"] == (2 * 8192, 3072) and "blk.0.ffn_gate.weight" not in phi3
    assert phi3["blk.0.ffn_down.weight"] == (3072, 8192)
    assert phi3["rope_factors_long.weight"] == phi3["rope_factors_short.weight"] == (48,)
    q4 = shapes.plan_tensors(shapes.SHAPES["llama3.1-8b"], "q4_0")
    assert 4.4e9 < sum(t.nbytes for t in q4) < 4.6e9  # the size of a real Llama-3.1-8B Q4_0 GGUF


def _converter():
    """llama.cpp's conversion package (convert_hf_to_gguf.py's model classes), or a skip."""
    tree = REPO / "third_party" / "llama.cpp"
    if not (tree / "conversion" / "llama.py").is_file():
        pytest.skip("the llama.cpp tree is not prepared")
    sys.path.insert(0, str(tree))
    try:
        import conversion.llama
        import conversion.phi
    except ImportError as e:
        pytest.skip(f"llama.cpp's converter cannot be imported here: {e}")
    finally:
        sys.path.remove(str(tree))
    return conversion


def _tensor_name(kind):
    return gguf.TENSOR_NAMES[kind] + ".weight"


def test_smollm2_shape_is_the_shipped_default_model():
    """The stand-in that GPU machines build (the real file cannot travel there) has the real file's tensors and keys."""
    from locret import models

    real = _reader(models.resolve(models.DEFAULT_MODEL))
    s = shapes.SHAPES["smollm2-135m"]
    planned = {t.name: (tuple(reversed(t.shape)), t.ggml_type) for t in shapes.plan_tensors(s, "q4_1")}
    actual = {t.name: (tuple(int(n) for n in t.shape), t.tensor_type) for t in real.tensors}
    assert planned == actual
    for key, want in [("llama.block_count", s.n_layer), ("llama.context_length", s.n_ctx_train),
                      ("llama.embedding_length", s.n_embd), ("llama.feed_forward_length", s.n_ff),
                      ("llama.attention.head_count", s.n_head), ("llama.attention.head_count_kv", s.n_head_kv),
                      ("llama.rope.dimension_count", s.head_dim)]:
        assert _value(real, key) == want, key
    assert _value(real, "llama.rope.freq_base") == pytest.approx(s.rope_theta)
    assert _value(real, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(s.rms_eps)
    assert real.get_field("llama.rope.scaling.type") is None and s.rope_scaling == "none"
    assert shapes.n_parameters(s) == sum(math.prod(int(n) for n in t.shape) for t in real.tensors)


def test_llama3_rope_freqs_are_the_converters():
    conversion = _converter()
    s = shapes.SHAPES["llama3.1-8b"]
    hf = types.SimpleNamespace(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        hparams={"hidden_size": 4096, "num_attention_heads": 32}, format_tensor_name=_tensor_name)
    reference = {name: t.numpy() for name, t in conversion.llama.LlamaModel.generate_extra_tensors(hf)}
    mine = shapes.rope_tensors(s)
    assert list(mine) == list(reference) == ["rope_freqs.weight"]
    assert mine["rope_freqs.weight"].dtype == np.float32
    assert np.array_equal(mine["rope_freqs.weight"], reference["rope_freqs.weight"])
    assert mine["rope_freqs.weight"][0] == 1.0 and mine["rope_freqs.weight"][-1] == 8.0  # it does scale


def test_phi3_longrope_factors_and_attention_factor_are_the_converters():
    conversion = _converter()
    s = shapes.SHAPES["phi3-mini-128k"]
    written = {}
    hparams = {"hidden_size": 3072, "num_attention_heads": 32, "max_position_embeddings": 131072}
    hf = types.SimpleNamespace(
        rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": 4096,
                         "long_factor": list(s.long_factor), "short_factor": list(s.short_factor)},
        find_hparam=lambda keys: next(hparams[k] for k in keys if k in hparams),
        gguf_writer=types.SimpleNamespace(add_rope_scaling_attn_factors=lambda v: written.update(attn_factor=v)),
        format_tensor_name=_tensor_name)
    reference = {name: t.numpy() for name, t in conversion.phi.Phi3MiniModel.generate_extra_tensors(hf)}
    mine = shapes.rope_tensors(s)
    assert list(mine) == list(reference) == ["rope_factors_long.weight", "rope_factors_short.weight"]
    for name in mine:
        assert np.array_equal(mine[name], reference[name]) and mine[name].dtype == np.float32
    assert s.attn_factor == written["attn_factor"]
    assert abs(s.attn_factor - 1.190238) < 1e-6  # what the converted Phi-3-mini-128K GGUFs carry
    assert (mine["rope_factors_long.weight"] >= 1).all() and (mine["rope_factors_short.weight"] >= 1).all()


def test_rows_that_do_not_split_into_blocks_are_refused_before_writing(tmp_path):
    odd = dataclasses.replace(shapes.SHAPES["llama3.1-8b-mini"], n_ff=1000)
    with pytest.raises(shapes.ShapeError, match="not a multiple of the q4_0 block"):
        shapes.write_shape_model(odd, tmp_path / "odd.gguf", progress=False)
    with pytest.raises(shapes.ShapeError, match="unknown weight type"):
        shapes.write_shape_model("llama3.1-8b-mini", tmp_path / "odd.gguf", weight_type="q3_k", progress=False)
    with pytest.raises(shapes.ShapeError, match="unknown shape"):
        shapes.write_shape_model("llama-9b", tmp_path / "odd.gguf", progress=False)
    assert list(tmp_path.iterdir()) == []


# --- written files --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shapes")


@pytest.fixture(scope="module")
def built(out_dir):
    return {name: shapes.make_shape_models(name, out_dir, progress=False, log=lambda msg: None) for name in MINI}


def _reader(path):
    return gguf.GGUFReader(path, "r")


def _value(reader, key):
    field = reader.get_field(key)
    return None if field is None else field.contents()


@pytest.mark.parametrize("name", MINI)
def test_written_model_reads_back_with_the_intended_hparams(name, built):
    s = shapes.SHAPES[name]
    r = _reader(built[name][0])
    a = s.arch
    keys = {
        "general.architecture": a, f"{a}.block_count": s.n_layer, f"{a}.embedding_length": s.n_embd,
        f"{a}.attention.head_count": s.n_head, f"{a}.attention.head_count_kv": s.n_head_kv,
        f"{a}.feed_forward_length": s.n_ff, f"{a}.rope.dimension_count": s.head_dim,
        f"{a}.context_length": 131072, f"{a}.rope.freq_base": s.rope_theta,
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q4_0), "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.bos_token_id": 1,
    }
    if a == "llama":
        keys.update({"llama.vocab_size": s.n_vocab, "tokenizer.ggml.eos_token_id": 2})
    else:
        keys.update({"phi3.rope.scaling.original_context_length": 4096, "phi3.attention.sliding_window": 262144,
                     "tokenizer.ggml.eos_token_id": 32000})
    got = {k: _value(r, k) for k in keys}
    assert got == {k: pytest.approx(v) if isinstance(v, float) else v for k, v in keys.items()}
    assert _value(r, f"{a}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    if a == "phi3":
        assert _value(r, "phi3.rope.scaling.attn_factor") == pytest.approx(1.1902381, abs=1e-6)
        assert r.get_field("phi3.rope.scaling.type") is None  # the converter writes none for Phi-3
    tokens = _value(r, "tokenizer.ggml.tokens")
    assert len(tokens) == len(set(tokens)) == s.n_vocab and tokens[3] == "<0x00>" and tokens[258] == "<0xFF>"

    plan = shapes.plan_tensors(s)
    tensors = {t.name: t for t in r.tensors}
    assert list(tensors) == [t.name for t in plan]
    for p in plan:
        t = tensors[p.name]
        assert tuple(int(d) for d in t.shape) == tuple(reversed(p.shape)), p.name  # GGUF stores ne order
        assert t.tensor_type == p.ggml_type, p.name
    for rope_name, values in shapes.rope_tensors(s).items():
        assert np.array_equal(tensors[rope_name].data, values)
    assert (tensors["output_norm.weight"].data == 1).all() and (tensors["blk.0.ffn_norm.weight"].data == 1).all()
    if a == "llama":
        assert tensors["blk.0.attn_k.weight"].shape.tolist() == [1024, 256]
    else:
        assert tensors["blk.0.attn_qkv.weight"].shape.tolist() == [768, 3 * 768]
        assert tensors["blk.0.ffn_up.weight"].shape.tolist() == [768, 2 * 2048]


def _check_quantized(raw: np.ndarray, ggml_type, n_in: int):
    """Decode block bytes [rows, bytes per row]; check the scales and the weights' finiteness and scale."""
    block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = raw.reshape(-1, type_size)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32).ravel()
    base = shapes._scale(n_in, ggml_type)
    assert np.isfinite(d).all() and (d > 0).all()
    assert d.min() >= 0.499 * base and d.max() <= 1.501 * base
    weights = gguf.quants.dequantize(raw, ggml_type)
    assert weights.shape == (raw.shape[0], n_in) and np.isfinite(weights).all()
    max_code = 8 if ggml_type in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1) else 128
    assert np.abs(weights).max() <= max_code * d.max() * 1.0001
    row_rms = np.sqrt((weights.astype(np.float64) ** 2).mean(axis=1))
    assert np.allclose(row_rms * math.sqrt(n_in), 1.0, atol=0.25)  # unit-RMS inputs give O(1) outputs
    return weights


@pytest.mark.parametrize("name", MINI)
def test_quantized_blocks_are_valid(name, built):
    r = _reader(built[name][0])
    checked = 0
    for t in r.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_0 or not (t.name.startswith(("blk.0.", "token_embd"))):
            continue
        rows = np.asarray(t.data[:64])
        n_in = int(t.shape[0])
        weights = _check_quantized(rows, gguf.GGMLQuantizationType.Q4_0, n_in)
        assert len(np.unique(weights[0])) > 8  # random codes, not a constant
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("weight_type", ["q4_1", "q8_0", "f16"])
def test_other_weight_types_are_valid(weight_type):
    qtype = shapes.WEIGHT_TYPES[weight_type][0]
    data = shapes.random_matrix(48, 1024, qtype, np.random.default_rng(1))
    if weight_type == "f16":
        assert data.dtype == np.float16 and data.shape == (48, 1024) and np.isfinite(data).all()
        rms = np.sqrt((data.astype(np.float64) ** 2).mean())
        assert abs(rms * math.sqrt(1024) - 1) < 0.1
    else:
        _check_quantized(data, qtype, 1024)


def _load(model_path, **kw):
    import locret  # noqa: F401  (points llama_cpp at our library)
    import llama_cpp

    return llama_cpp.Llama(model_path=str(model_path), n_threads=1, n_threads_batch=1, verbose=False, **kw)


def _check_loaded(llm, s: shapes.Shape, heads_path):
    """llama.cpp's view of the model matches the shape; the heads attach and score a random prompt."""
    import ctypes

    import llama_cpp
    from locret import heads as heads_api

    model = llm._model.model
    assert llama_cpp.llama_model_n_layer(model) == s.n_layer
    assert llama_cpp.llama_model_n_head(model) == s.n_head
    assert llama_cpp.llama_model_n_head_kv(model) == s.n_head_kv
    assert llama_cpp.llama_model_n_embd(model) == s.n_embd
    assert llama_cpp.llama_model_n_ctx_train(model) == s.n_ctx_train
    assert llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)) == s.n_vocab
    buf = ctypes.create_string_buffer(128)
    assert llama_cpp.llama_model_meta_val_str(model, f"{s.arch}.rope.dimension_count".encode(), buf, 128) > 0
    assert int(buf.value) == s.head_dim

    h = heads_api.attach(llm, heads_path)
    assert h.hidden_size == shapes.PUBLISHED_D_R
    heads_api.record_scores(llm)
    tokens = np.random.default_rng(0).integers(3, s.n_vocab, 96).tolist()
    llm.eval(tokens)
    scores, positions = heads_api.recorded_scores(llm)
    assert scores.shape == (s.n_layer, s.n_head_kv, len(tokens)) and positions.tolist() == list(range(len(tokens)))
    assert np.isfinite(scores).all() and scores.std() > 0
    logits = np.array(llm.scores[: len(tokens)])
    assert np.isfinite(logits).all() and 0.2 < logits.std() < 5  # random weights of the intended scale


@pytest.mark.parametrize("name", MINI)
def test_llama_cpp_loads_the_model_and_its_heads(name, built):
    model, heads = built[name]
    llm = _load(model, n_ctx=256, n_ubatch=64, logits_all=True)
    try:
        _check_loaded(llm, shapes.SHAPES[name], heads)
    finally:
        llm.close()


@pytest.mark.parametrize("name", FULL)
def test_one_full_width_layer_loads_with_its_heads(name, tmp_path):
    """The full shapes' layer geometry in llama.cpp (one layer; Llama's vocabulary cut to 32000 to stay small)."""
    s = dataclasses.replace(shapes.SHAPES[name], n_layer=1, n_vocab=min(shapes.SHAPES[name].n_vocab, 32064))
    model, heads = shapes.make_shape_models(s, tmp_path, progress=False, log=lambda msg: None)
    llm = _load(model, n_ctx=128, n_ubatch=96, logits_all=True)
    try:
        _check_loaded(llm, s, heads)
    finally:
        llm.close()
        model.unlink()
        heads.unlink()


@pytest.mark.parametrize("name", MINI)
def test_llama_bench_runs_with_and_without_heads(name, built):
    model, heads = built[name]
    base = [tool("llama-bench"), "-m", model, "-p", "128", "-n", "0", "-r", "1", "-t", "1", "-o", "json"]
    for extra in ([], ["--locret-heads", heads, "--locret-budget", "64", "-ub", "32"]):
        proc = run(base + extra, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (result,) = json.loads(proc.stdout)
        assert result["n_prompt"] == 128 and result["avg_ts"] > 0
        # llama.cpp counts every element, the RoPE factors included
        assert result["model_n_params"] == sum(t.n_elements for t in shapes.plan_tensors(shapes.SHAPES[name]))


def test_a_second_build_is_found_in_the_cache(built, out_dir):
    model, heads = built["llama3.1-8b-mini"]
    mtimes = (model.stat().st_mtime_ns, heads.stat().st_mtime_ns)
    started = time.perf_counter()
    assert shapes.make_shape_models("llama3.1-8b-mini", out_dir, progress=False) == (model, heads)
    assert time.perf_counter() - started < 5.0                  # a build takes far longer; the mtimes below are the proof
    assert (model.stat().st_mtime_ns, heads.stat().st_mtime_ns) == mtimes
    assert model.parent.name.startswith("llama3.1-8b-mini-q4_0-")
    other = shapes.build_paths("llama3.1-8b-mini", out_dir, seed=1)
    assert other.folder != model.parent and not other.folder.exists()
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(built[n][0].parent.name for n in MINI)


def test_command_line_prints_the_two_paths(built, out_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "py"), str(REPO / "third_party/llama.cpp/gguf-py")]))
    script = REPO / "scripts" / "make_shape_models.py"
    proc = run([sys.executable, script, "--shape", "llama3.1-8b-mini", "--out", out_dir], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [str(p) for p in built["llama3.1-8b-mini"]]
    listing = run([sys.executable, script, "--list"], env=env, timeout=120)
    assert listing.returncode == 0 and [line.split("\t")[0] for line in listing.stdout.splitlines()] == \
        list(shapes.SHAPES)
    bad = run([sys.executable, script, "--shape", "llama-9b"], env=env, timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
