"""convert/heads_to_gguf.py: checkpoints of retaining heads to the heads GGUF (convert/HEADS-FORMAT.md).

Most runs call the command line's main() in this process (fast); a few run the script itself to
prove the entry point and its one-line refusals. Expected values are computed here independently:
the Q/K permutation is re-derived with explicit loops, and outputs are read back with gguf-py.
"""
from __future__ import annotations

import hashlib
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, run
from convert_fixtures import (TINY, Dims, gguf_kvs, gguf_tensor, head_name, random_heads, save_bin,
                              save_safetensors, save_sharded_directory, write_tiny_base)
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from safetensors import safe_open

from locret import models
from locret.gguf_header import check_gguf

from locret.convert import cli as heads_to_gguf  # noqa: E402  (the command behind convert/heads_to_gguf.py)

SCRIPT = REPO / "convert" / "heads_to_gguf.py"
SUPPORTED = ["llama", "mistral3", "smollm3", "granite", "qwen2", "qwen3", "phi3", "stablelm", "gemma", "gemma2", "gemma3"]
F32, F16, BF16, Q8_0 = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                      GGMLQuantizationType.Q8_0)
U32, STR, BOOL = [GGUFValueType.UINT32], [GGUFValueType.STRING], [GGUFValueType.BOOL]
D_R = 64  # hidden width of the heads made for the real models (small: fast tests)


# ---------------------------------------------------------------- the Q/K rule, written independently

def llama_cpp_rows(w_hf: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """Rows of Wq or Wk in llama.cpp's order, from HF order, by the rule in HEADS-FORMAT.md:
    within each head, llama.cpp row 2j is HF row j and row 2j+1 is HF row j + head_dim/2."""
    w = np.empty_like(w_hf)
    half = head_dim // 2
    for h in range(n_heads):
        for j in range(half):
            w[h * head_dim + 2 * j] = w_hf[h * head_dim + j]
            w[h * head_dim + 2 * j + 1] = w_hf[h * head_dim + half + j]
    return w


def w1_in_llama_cpp_order(w1: np.ndarray, dims: Dims) -> np.ndarray:
    """W1 with its Q and K columns reordered like the rows of Wq and Wk (V columns unchanged)."""
    n_q, n_k = dims.n_head * dims.head_dim, dims.n_head_kv * dims.head_dim
    q_cols = llama_cpp_rows(w1[:, :n_q].T, dims.n_head, dims.head_dim).T
    k_cols = llama_cpp_rows(w1[:, n_q:n_q + n_k].T, dims.n_head_kv, dims.head_dim).T
    return np.concatenate([q_cols, k_cols, w1[:, n_q + n_k:]], axis=1)


# ---------------------------------------------------------------- fixtures and helpers

@dataclass
class Result:
    returncode: int
    stderr: str


@pytest.fixture
def cli(capsys):
    """Run heads_to_gguf's main() in this process; return its exit status and stderr."""
    def run_cli(*args) -> Result:
        capsys.readouterr()
        returncode = heads_to_gguf.main([str(a) for a in args])
        return Result(returncode, capsys.readouterr().err)
    return run_cli


def assert_refused(result: Result, *expected: str, output: Path | None = None) -> None:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "heads_to_gguf: error:" in line]
    assert len(errors) == 1 and errors[0].startswith("heads_to_gguf: error: "), result.stderr
    for text in expected:
        assert text in errors[0], errors[0]
    if output is not None:
        assert not output.exists() and not output.with_name(output.name + ".partial").exists()


def checkpoint_heads(path: Path) -> dict[str, np.ndarray]:
    """A safetensors checkpoint's tensors as float32 numpy arrays (exact for bf16)."""
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k).to(torch.float32).numpy() for k in f.keys()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class RealModel:
    path: Path
    dims: Dims
    name: str
    reader: GGUFReader  # read once: gguf-py takes seconds over a model's vocabulary


@pytest.fixture(scope="session")
def smollm2(model_path) -> RealModel:
    reader = GGUFReader(model_path)  # the test's own reading of the facts, not the converter's
    n_head = reader.get_field("llama.attention.head_count").contents()
    dims = Dims(n_layer=reader.get_field("llama.block_count").contents(), n_head=n_head,
                n_head_kv=reader.get_field("llama.attention.head_count_kv").contents(),
                head_dim=reader.get_field("llama.embedding_length").contents() // n_head)
    assert dims == Dims(n_layer=30, n_head=9, n_head_kv=3, head_dim=64)
    return RealModel(model_path, dims, reader.get_field("general.name").contents(), reader)


@pytest.fixture(scope="session")
def smollm2_random(smollm2, tmp_path_factory) -> Path:
    """make-random for SmolLM2, through the script itself (the entry point end to end)."""
    out = tmp_path_factory.mktemp("random") / "smollm2-random.safetensors"
    proc = run([sys.executable, SCRIPT, "make-random", "--base", smollm2.path, "--d-r", D_R, "--seed", 7,
                "-o", out], timeout=120)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def smollm2_converted(smollm2, smollm2_random, tmp_path_factory):
    """Convert the random SmolLM2 heads once per (type, extra flags); cached for the session."""
    cache: dict[tuple, Path] = {}

    def convert(weight_type: str = "f32", *flags: str) -> Path:
        key = (weight_type, *flags)
        if key not in cache:
            out = tmp_path_factory.mktemp("converted") / "heads.gguf"
            assert heads_to_gguf.main(["--base", str(smollm2.path), "--heads", str(smollm2_random), "-o", str(out),
                                       "--type", weight_type, *flags]) == 0
            cache[key] = out
        return cache[key]
    return convert


@pytest.fixture
def tiny_base(tmp_path) -> Path:
    return write_tiny_base(tmp_path / "tiny.gguf")


# ---------------------------------------------------------------- make-random

def test_make_random_writes_published_checkpoint_format(smollm2, smollm2_random):
    dims = smollm2.dims
    with safe_open(smollm2_random, framework="pt") as f:
        names = set(f.keys())
        expected = {head_name(i, fc) for i in range(dims.n_layer) for fc in ("fc1", "fc2")}
        assert names == expected  # weights only: no biases, nothing else
        for i in range(dims.n_layer):
            fc1, fc2 = f.get_tensor(head_name(i, "fc1")), f.get_tensor(head_name(i, "fc2"))
            assert fc1.dtype == torch.bfloat16 and fc2.dtype == torch.bfloat16
            assert list(fc1.shape) == [D_R, dims.d_in] == [D_R, (9 + 3) * 64 + 3 * 64]
            assert list(fc2.shape) == [dims.n_head_kv, D_R]
            # nn.Linear-style init: uniform within ±1/sqrt(fan_in), with a real spread
            bound = 1 / np.sqrt(dims.d_in)
            values = fc1.to(torch.float32)
            assert values.abs().max() <= bound * 1.01 and values.std() > bound / 3
        assert f.metadata()["locret.training.source"] == "random"
        assert f.metadata()["locret.training.seed"] == "7"


def test_make_random_is_deterministic_per_seed(tiny_base, tmp_path, cli):
    paths = {}
    for label, seed, suffix in (("a", 0, "safetensors"), ("b", 0, "safetensors"), ("c", 1, "safetensors"),
                                ("bin", 0, "bin")):
        paths[label] = tmp_path / f"{label}.{suffix}"
        assert cli("make-random", "--base", tiny_base, "--d-r", 32, "--seed", seed, "-o", paths[label]).returncode == 0
    a, b, c = (checkpoint_heads(paths[k]) for k in "abc")
    assert set(a) == {head_name(i, fc) for i in range(TINY.n_layer) for fc in ("fc1", "fc2")}
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert all(not np.array_equal(a[k], c[k]) for k in a)
    from_bin = torch.load(paths["bin"], weights_only=True)
    assert set(from_bin) == set(a)
    assert all(from_bin[k].dtype == torch.bfloat16 and np.array_equal(from_bin[k].float().numpy(), a[k]) for k in a)


def test_make_random_f32(tiny_base, tmp_path, cli):
    out = tmp_path / "f32.safetensors"
    assert cli("make-random", "--base", tiny_base, "--d-r", 8, "--dtype", "f32", "-o", out).returncode == 0
    with safe_open(out, framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}


# ---------------------------------------------------------------- round trips on SmolLM2 (llama: permuted)

def expected_metadata(model: RealModel, checkpoint: Path) -> dict:
    return {
        "general.architecture": (STR, "llama"),
        "general.type": (STR, "locret_heads"),
        "general.name": (STR, f"Locret heads for {model.name}"),
        "locret.format_version": (U32, 1),
        "locret.base.architecture": (STR, "llama"),
        "locret.base.name": (STR, model.name),
        "locret.base.n_layer": (U32, 30),
        "locret.base.n_head": (U32, 9),
        "locret.base.n_head_kv": (U32, 3),
        "locret.base.head_dim_k": (U32, 64),
        "locret.base.head_dim_v": (U32, 64),
        "locret.input_layout": (STR, "q,k,v pre-rope"),
        "locret.qk_layout": (STR, "llama.cpp"),
        "locret.qk_permuted": (BOOL, True),
        "locret.hidden_size": (U32, D_R),
        "locret.activation": (STR, "silu"),
        "locret.recommended.budget": (U32, 6000),
        "locret.recommended.chunk": (U32, 3072),
        "locret.recommended.stabilizers": (U32, 2500),
        "locret.recommended.local": (U32, 100),
        "locret.training.source": (STR, "random"),
        "locret.training.seed": (U32, 7),
        "locret.training.notes": (STR, f"make-random: nn.Linear-style uniform init, d_R {D_R}, bf16, for {model.name}"),
        "locret.training.source_sha256": (STR, sha256(checkpoint)),
    }


@pytest.mark.parametrize("weight_type", ["f32", "f16", "bf16", "q8_0"])
def test_round_trip_smollm2(weight_type, smollm2, smollm2_random, smollm2_converted):
    out = smollm2_converted(weight_type)
    reader = GGUFReader(out)
    assert gguf_kvs(reader) == expected_metadata(smollm2, smollm2_random)
    source = checkpoint_heads(smollm2_random)
    dims = smollm2.dims
    assert len(reader.tensors) == 2 * dims.n_layer  # no biases in, no biases out
    for i in range(dims.n_layer):
        fc1, fc1_type, fc1_shape = gguf_tensor(reader, f"locret.blk.{i}.fc1.weight")
        fc2, fc2_type, fc2_shape = gguf_tensor(reader, f"locret.blk.{i}.fc2.weight")
        assert fc1_shape == [dims.d_in, D_R] and fc2_shape == [D_R, dims.n_head_kv]  # ggml ne order
        want_fc1 = w1_in_llama_cpp_order(source[head_name(i, "fc1")], dims)
        want_fc2 = source[head_name(i, "fc2")]
        expected_type = {"f32": F32, "f16": F16, "bf16": BF16, "q8_0": Q8_0}[weight_type]
        assert fc1_type == expected_type and fc2_type == expected_type
        for got, want in ((fc1, want_fc1), (fc2, want_fc2)):
            if weight_type in ("f32", "bf16"):  # the random checkpoint is bf16: BF16 is lossless
                assert np.array_equal(got, want)
            elif weight_type == "f16":
                assert np.array_equal(got, want.astype(np.float16).astype(np.float32))
                assert np.allclose(got, want, rtol=2**-11, atol=2**-24)
            else:  # Q8_0: per 32-value block, step d = max|block|/127 stored as f16 (relative error
                # 2^-11): error at most d/2 for rounding plus 127 * d * 2^-11 for the scale
                blocks_max = np.abs(want).reshape(want.shape[0], -1, 32).max(axis=2, keepdims=True)
                step = np.repeat(blocks_max / 127, 32, axis=2).reshape(want.shape)
                assert np.all(np.abs(got - want) <= step * (0.5 + 127 * 2**-11) + 1e-7)
                assert not np.array_equal(got, want)  # really quantised


@pytest.mark.parametrize("weight_type", ["f32", "f16"])
def test_round_trip_with_biases(weight_type, smollm2, tmp_path, cli):
    heads = random_heads(smollm2.dims, d_r=32, seed=3, biases=True)
    checkpoint = save_safetensors(heads, tmp_path / "with-biases.safetensors")
    out = tmp_path / "heads.gguf"
    result = cli("--base", smollm2.path, "--heads", checkpoint, "-o", out, "--type", weight_type)
    assert result.returncode == 0, result.stderr
    reader = GGUFReader(out)
    kvs = gguf_kvs(reader)
    assert kvs["locret.training.source"] == (STR, "with-biases.safetensors")
    assert kvs["locret.training.source_sha256"] == (STR, sha256(checkpoint))
    assert kvs["locret.hidden_size"] == (U32, 32)
    assert len(reader.tensors) == 4 * smollm2.dims.n_layer
    for i in range(smollm2.dims.n_layer):
        fc1, _, _ = gguf_tensor(reader, f"locret.blk.{i}.fc1.weight")
        want = w1_in_llama_cpp_order(heads[head_name(i, "fc1")], smollm2.dims)
        assert np.array_equal(fc1, want if weight_type == "f32" else want.astype(np.float16).astype(np.float32))
        for fc, shape in (("fc1", [32]), ("fc2", [smollm2.dims.n_head_kv])):
            bias, bias_type, bias_shape = gguf_tensor(reader, f"locret.blk.{i}.{fc}.bias")
            assert bias_type == F32 and bias_shape == shape  # biases are always F32
            assert np.array_equal(bias, heads[head_name(i, fc, "bias")])  # and never permuted


def test_q8_0_falls_back_to_f16_when_d_r_is_not_a_multiple_of_32(tiny_base, tmp_path, cli):
    checkpoint = save_safetensors(random_heads(TINY, d_r=48, seed=0), tmp_path / "h.safetensors")
    out = tmp_path / "heads.gguf"
    result = cli("--base", tiny_base, "--heads", checkpoint, "-o", out, "--type", "q8_0")
    assert result.returncode == 0, result.stderr
    assert "fc2.weight is written as F16, not Q8_0" in result.stderr
    reader = GGUFReader(out)
    assert gguf_tensor(reader, "locret.blk.0.fc1.weight")[1] == Q8_0  # d_in = 128: whole blocks
    assert gguf_tensor(reader, "locret.blk.0.fc2.weight")[1] == F16


def test_recommended_settings_and_name_are_written(tiny_base, tmp_path, cli):
    checkpoint = save_safetensors(random_heads(TINY, d_r=8, seed=0), tmp_path / "h.safetensors")
    out = tmp_path / "heads.gguf"
    assert cli("--base", tiny_base, "--heads", checkpoint, "-o", out, "--budget", 1024, "--chunk", 512,
               "--stabilizers", 64, "--local", 32, "--name", "my heads").returncode == 0
    kvs = gguf_kvs(GGUFReader(out))
    assert kvs["general.name"] == (STR, "my heads")
    assert [kvs[f"locret.recommended.{k}"] for k in ("budget", "chunk", "stabilizers", "local")] == [
        (U32, 1024), (U32, 512), (U32, 64), (U32, 32)]


def test_an_even_pooling_window_is_refused_by_the_librarys_loader(tiny_base, tmp_path, cli):
    """The converter keeps no copy of the pooling rule: the file it wrote is read back through the library, whose
    refusal it passes on, and no output is left."""
    checkpoint = save_safetensors(random_heads(TINY, d_r=8, seed=0), tmp_path / "h.safetensors")
    out = tmp_path / "heads.gguf"
    assert_refused(cli("--base", tiny_base, "--heads", checkpoint, "-o", out, "--pool", 4),
                   "locret.recommended.pool must be odd (a window centred on each token), got 4", output=out)


# ---------------------------------------------------------------- the permutation, proven by the math

def test_permuted_heads_score_llama_cpp_activations_like_hf_ones(smollm2, smollm2_random, smollm2_converted):
    """W1_gguf · concat(Q, K, V) from llama.cpp-ordered Wq/Wk == W1_hf · concat(Q, K, V) from HF ones,
    and the same check catches --skip-qk-permutation."""
    dims = smollm2.dims
    n_embd = dims.n_head * dims.head_dim
    rng = np.random.default_rng(0)
    wq_hf = rng.standard_normal((dims.n_head * dims.head_dim, n_embd))
    wk_hf = rng.standard_normal((dims.n_head_kv * dims.head_dim, n_embd))
    wv = rng.standard_normal((dims.n_head_kv * dims.head_dim, n_embd))
    wq_lc = llama_cpp_rows(wq_hf, dims.n_head, dims.head_dim)
    wk_lc = llama_cpp_rows(wk_hf, dims.n_head_kv, dims.head_dim)
    hidden = rng.standard_normal(n_embd)
    x_hf = np.concatenate([wq_hf @ hidden, wk_hf @ hidden, wv @ hidden])
    x_lc = np.concatenate([wq_lc @ hidden, wk_lc @ hidden, wv @ hidden])
    assert not np.allclose(x_hf, x_lc)  # the two orders really differ

    source = checkpoint_heads(smollm2_random)
    good = GGUFReader(smollm2_converted("f32"))
    wrong = GGUFReader(smollm2_converted("f32", "--skip-qk-permutation"))
    for i in range(dims.n_layer):
        w1_hf = source[head_name(i, "fc1")].astype(np.float64)
        reference = w1_hf @ x_hf
        w1_good = gguf_tensor(good, f"locret.blk.{i}.fc1.weight")[0].astype(np.float64)
        w1_wrong = gguf_tensor(wrong, f"locret.blk.{i}.fc1.weight")[0].astype(np.float64)
        np.testing.assert_allclose(w1_good @ x_lc, reference, rtol=1e-9, atol=1e-9)
        assert not np.allclose(w1_wrong @ x_lc, reference, rtol=1e-3, atol=1e-3)
        assert np.array_equal(w1_wrong, w1_hf)  # the flag writes HF order ...
    # ... and otherwise the same file, keys included
    assert gguf_kvs(wrong) == gguf_kvs(good)


def test_gemma3_columns_are_not_permuted(tmp_path, cli):
    """gemma3 uses NEOX rope: llama.cpp keeps HF's Q/K order, so W1 is written unchanged."""
    base = models.resolve("gemma3-270m", fetch=False)
    dims = Dims(n_layer=18, n_head=4, n_head_kv=1, head_dim=256)
    heads = random_heads(dims, d_r=32, seed=5)
    checkpoint = save_safetensors(heads, tmp_path / "gemma3-heads.safetensors")
    out = tmp_path / "heads.gguf"
    result = cli("--base", base, "--heads", checkpoint, "-o", out, "--type", "f32")
    assert result.returncode == 0, result.stderr
    reader = GGUFReader(out)
    kvs = gguf_kvs(reader)
    assert kvs["locret.qk_permuted"] == (BOOL, False)
    assert kvs["locret.activation"] == (STR, "gelu")
    assert kvs["general.architecture"] == (STR, "gemma3")
    assert [kvs[f"locret.base.{k}"][1] for k in ("n_layer", "n_head", "n_head_kv", "head_dim_k", "head_dim_v")] == [
        18, 4, 1, 256, 256]
    for i in range(dims.n_layer):
        assert np.array_equal(gguf_tensor(reader, f"locret.blk.{i}.fc1.weight")[0], heads[head_name(i, "fc1")])


# ---------------------------------------------------------------- input formats and provenance

def test_bin_safetensors_and_sharded_directories_give_the_same_file(tiny_base, tmp_path, cli):
    heads = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in random_heads(TINY, d_r=32, seed=1).items()}
    inputs = {
        "safetensors": save_safetensors(heads, tmp_path / "heads.safetensors"),
        "bin": save_bin(heads, tmp_path / "heads.bin"),
        "st-dir": save_sharded_directory(heads, tmp_path / "st-model"),
        "bin-dir": save_sharded_directory(heads, tmp_path / "bin-model", kind="bin"),
    }
    unindexed = tmp_path / "unindexed-model"
    shutil.copytree(inputs["st-dir"], unindexed)
    (unindexed / "model.safetensors.index.json").unlink()
    inputs["st-dir-no-index"] = unindexed

    outputs = {}
    for label, source in inputs.items():
        out = tmp_path / f"{label}.gguf"
        result = cli("--base", tiny_base, "--heads", source, "-o", out)
        assert result.returncode == 0, f"{label}: {result.stderr}"
        outputs[label] = GGUFReader(out)

    def without_provenance(reader):
        return {k: v for k, v in gguf_kvs(reader).items() if not k.startswith("locret.training.")}

    reference = outputs["safetensors"]
    for label, reader in outputs.items():
        assert without_provenance(reader) == without_provenance(reference), label
        assert [t.name for t in reader.tensors] == [t.name for t in reference.tensors]
        for tensor, ref in zip(reader.tensors, reference.tensors):
            assert tensor.tensor_type == ref.tensor_type and np.array_equal(tensor.data, ref.data), (label, tensor.name)

    provenance = {label: {k: v[1] for k, v in gguf_kvs(r).items() if k.startswith("locret.training.")}
                  for label, r in outputs.items()}
    assert provenance["safetensors"] == {"locret.training.source": "heads.safetensors",
                                         "locret.training.source_sha256": sha256(inputs["safetensors"])}
    assert provenance["bin"] == {"locret.training.source": "heads.bin",
                                 "locret.training.source_sha256": sha256(inputs["bin"])}
    index = inputs["st-dir"] / "model.safetensors.index.json"
    assert provenance["st-dir"] == {"locret.training.source": "st-model/model.safetensors.index.json",
                                    "locret.training.source_sha256": sha256(index)}
    index = inputs["bin-dir"] / "pytorch_model.bin.index.json"
    assert provenance["bin-dir"] == {"locret.training.source": "bin-model/pytorch_model.bin.index.json",
                                     "locret.training.source_sha256": sha256(index)}
    # unindexed heads over two files: the sha256 of a sha256sum-style listing of both
    shards = sorted(unindexed.glob("*.safetensors"))
    listing = "".join(f"{sha256(f)}  {f.name}\n" for f in shards).encode()
    assert provenance["st-dir-no-index"] == {"locret.training.source": "unindexed-model",
                                             "locret.training.source_sha256": hashlib.sha256(listing).hexdigest()}


def test_trainer_metadata_is_copied(tiny_base, tmp_path, cli):
    metadata = {"locret.training.source": "trainer run 2024-06-01", "locret.training.seed": "42",
                "locret.training.steps": "3000", "locret.training.notes": "LongAlign 3000 steps",
                "format": "pt"}
    checkpoint = save_safetensors(random_heads(TINY, d_r=8, seed=0), tmp_path / "trained.safetensors", metadata)
    out = tmp_path / "heads.gguf"
    assert cli("--base", tiny_base, "--heads", checkpoint, "-o", out).returncode == 0
    kvs = gguf_kvs(GGUFReader(out))
    assert {k: v for k, v in kvs.items() if k.startswith("locret.training.")} == {
        "locret.training.source": (STR, "trainer run 2024-06-01"),
        "locret.training.seed": (U32, 42),
        "locret.training.steps": (U32, 3000),
        "locret.training.notes": (STR, "LongAlign 3000 steps"),
        "locret.training.source_sha256": (STR, sha256(checkpoint)),
    }


# ---------------------------------------------------------------- reading a heads GGUF back

@pytest.mark.parametrize("weight_type", ["f32", "q8_0"])
def test_a_heads_gguf_reads_back_in_hugging_face_order(weight_type, tiny_base, tmp_path, cli):
    """The GGUF reader undoes the Q/K permutation: the tensors come back as the checkpoint had them (exactly
    for f32, within Q8_0's rounding), and converting the read-back GGUF again writes the same tensor data."""
    from locret.convert.checkpoint import read_checkpoint

    heads = random_heads(TINY, d_r=32, seed=4, biases=True)
    source = save_safetensors(heads, tmp_path / "heads.safetensors")
    first = tmp_path / "first.gguf"
    assert cli("--base", tiny_base, "--heads", source, "-o", first, "--type", weight_type).returncode == 0
    checkpoint = read_checkpoint(first)
    assert set(checkpoint.shapes) == set(heads)
    for name, values in heads.items():
        back = checkpoint.load(name)
        assert back.shape == values.shape, name
        if weight_type == "f32" or name.endswith("bias"):
            np.testing.assert_array_equal(back, values, err_msg=name)
        else:  # Q8_0: one scale per 32 values (blocks in llama.cpp's column order): at most half a step of the
            # row's largest value (plus the f16 scale's rounding), far less than a wrong column order would move them
            step = np.abs(values).max(axis=1, keepdims=True) / 127
            assert np.all(np.abs(back - values) <= 0.6 * step + 1e-7), name  # half a step, and the f16 scale
            assert np.abs(back - values).max() < 0.05 * np.abs(values).max(), name
    second = tmp_path / "second.gguf"
    assert cli("--base", tiny_base, "--heads", first, "-o", second, "--type", weight_type).returncode == 0
    a, b = GGUFReader(first), GGUFReader(second)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert x.tensor_type == y.tensor_type and np.array_equal(x.data, y.data), x.name
    assert gguf_kvs(b)["locret.training.source"][1] == "first.gguf"


def test_a_gguf_without_heads_or_with_foreign_keys_is_refused(tiny_base, tmp_path, cli):
    out = tmp_path / "out.gguf"
    assert_refused(cli("--base", tiny_base, "--heads", tiny_base, "-o", out), f"checkpoint {tiny_base}",
                   "a GGUF without retaining heads", output=out)
    good = tmp_path / "good.gguf"
    assert cli("--base", tiny_base, "--heads", save_safetensors(random_heads(TINY, d_r=8, seed=0),
                                                                  tmp_path / "h.safetensors"), "-o", good).returncode == 0
    data = good.read_bytes()
    bad = tmp_path / "bad-layout.gguf"
    bad.write_bytes(data.replace(b"llama.cpp", b"llama.hf!"))  # locret.qk_layout's value, same length
    assert_refused(cli("--base", tiny_base, "--heads", bad, "-o", out), f"checkpoint {bad}",
                   "locret.qk_layout is 'llama.hf!'", output=out)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-64])
    assert_refused(cli("--base", tiny_base, "--heads", cut, "-o", out), f"checkpoint {cut}",
                   "corrupt or truncated GGUF file", output=out)


# ---------------------------------------------------------------- merging into a model

def test_merge_into_model_keeps_everything_and_adds_the_heads(smollm2, smollm2_random, smollm2_converted,
                                                              tmp_path, cli):
    merged_path = tmp_path / "merged.gguf"
    result = cli("--merge-into", smollm2.path, "--heads", smollm2_random, "-o", merged_path)
    assert result.returncode == 0, result.stderr
    check_gguf(merged_path)
    model, merged = smollm2.reader, GGUFReader(merged_path)
    standalone = GGUFReader(smollm2_converted("f16"))

    model_kvs, merged_kvs = gguf_kvs(model), gguf_kvs(merged)
    for key, value in model_kvs.items():
        assert merged_kvs[key] == value, key  # same type and value; general.type stays "model"
    assert merged_kvs["general.type"] == (STR, "model")
    standalone_kvs = gguf_kvs(standalone)
    heads_keys = {k for k in standalone_kvs if k.startswith("locret.")}
    assert set(merged_kvs) == set(model_kvs) | heads_keys
    assert all(merged_kvs[k] == standalone_kvs[k] for k in heads_keys)

    merged_tensors = {t.name: t for t in merged.tensors}
    assert [t.name for t in merged.tensors[: len(model.tensors)]] == [t.name for t in model.tensors]
    for tensor in model.tensors:
        copy = merged_tensors[tensor.name]
        assert copy.tensor_type == tensor.tensor_type and list(copy.shape) == list(tensor.shape), tensor.name
        assert copy.data.tobytes() == tensor.data.tobytes(), tensor.name
    for tensor in standalone.tensors:
        copy = merged_tensors[tensor.name]
        assert copy.tensor_type == tensor.tensor_type and copy.data.tobytes() == tensor.data.tobytes()
    assert len(merged.tensors) == len(model.tensors) + len(standalone.tensors)

    # a model that already has heads is refused
    again = tmp_path / "twice.gguf"
    assert_refused(cli("--merge-into", merged_path, "--heads", smollm2_random, "-o", again),
                   "already has Locret heads", output=again)


# ---------------------------------------------------------------- refusals

def modified_heads(tmp_path: Path, change, d_r: int = 16) -> Path:
    """A tiny-base checkpoint after `change(heads)`; written as safetensors (float32)."""
    heads = random_heads(TINY, d_r=d_r, seed=0)
    change(heads)
    return save_safetensors(heads, tmp_path / "heads.safetensors")


def test_refuses_shape_mismatch(tiny_base, tmp_path, cli):
    def wrong_d_in(heads):
        heads[head_name(1, "fc1")] = np.zeros((16, 100), dtype=np.float32)
    out = tmp_path / "out.gguf"
    assert_refused(cli("--base", tiny_base, "--heads", modified_heads(tmp_path, wrong_d_in), "-o", out),
                   "layer 1: model.layers.1.self_attn.fc1.weight has shape [16, 100], expected [16, 128]",
                   "(4 + 2) * 16 + 2 * 16", output=out)


def test_refuses_wrong_kv_head_count_in_fc2(tiny_base, tmp_path, cli):
    def wrong_fc2(heads):
        heads[head_name(2, "fc2")] = np.zeros((3, 16), dtype=np.float32)
    out = tmp_path / "out.gguf"
    assert_refused(cli("--base", tiny_base, "--heads", modified_heads(tmp_path, wrong_fc2), "-o", out),
                   "layer 2: model.layers.2.self_attn.fc2.weight has shape [3, 16], expected [2, 16]", output=out)


def test_refuses_missing_layers(tiny_base, tmp_path, cli):
    def drop_layers(heads):
        for layer in (0, 2):
            del heads[head_name(layer, "fc1")]
    out = tmp_path / "out.gguf"
    assert_refused(cli("--base", tiny_base, "--heads", modified_heads(tmp_path, drop_layers), "-o", out),
                   "missing fc1.weight for layers 0, 2", output=out)


def test_refuses_layers_beyond_the_model(tiny_base, tmp_path, cli):
    def extra_layer(heads):
        heads[head_name(3, "fc1")] = heads[head_name(0, "fc1")].copy()
    out = tmp_path / "out.gguf"
    assert_refused(cli("--base", tiny_base, "--heads", modified_heads(tmp_path, extra_layer), "-o", out),
                   "heads for layers 3 but the base model has 3 layers", output=out)


def test_refuses_non_finite_weights(tiny_base, tmp_path, cli):
    def poison(heads):
        heads[head_name(2, "fc2")][0, :3] = np.nan
        heads[head_name(2, "fc2")][1, :2] = np.inf
    out = tmp_path / "out.gguf"
    assert_refused(cli("--base", tiny_base, "--heads", modified_heads(tmp_path, poison), "-o", out),
                   "layer 2: model.layers.2.self_attn.fc2.weight has 5 NaN/Inf values", output=out)


def test_refuses_inconsistent_biases(tiny_base, tmp_path, cli):
    def some_biases(heads):
        for layer in (0, 1):
            heads[head_name(layer, "fc1", "bias")] = np.zeros(16, dtype=np.float32)
    out = tmp_path / "out.gguf"
    assert_refused(cli("--base", tiny_base, "--heads", modified_heads(tmp_path, some_biases), "-o", out),
                   "inconsistent biases: fc1.bias is present for layers 0, 1 but missing for layers 2", output=out)


def test_refuses_unsupported_architecture(tmp_path, cli):
    base = write_tiny_base(tmp_path / "gpt2.gguf", arch="gpt2")
    out = tmp_path / "out.gguf"
    assert_refused(cli("--base", base, "--heads", modified_heads(tmp_path, lambda h: None), "-o", out),
                   f"unsupported architecture gpt2; supported: {', '.join(SUPPORTED)}", output=out)


def test_refuses_per_layer_head_counts_that_vary(tmp_path, cli):
    base = write_tiny_base(tmp_path / "varying.gguf", head_count_kv=[2, 1, 2])
    out = tmp_path / "out.gguf"
    assert_refused(cli("--base", base, "--heads", modified_heads(tmp_path, lambda h: None), "-o", out),
                   "llama.attention.head_count_kv varies per layer ([2, 1, 2])", output=out)


def test_accepts_per_layer_head_counts_that_are_constant(tmp_path, cli):
    base = write_tiny_base(tmp_path / "constant.gguf", head_count_kv=[2, 2, 2])
    out = tmp_path / "out.gguf"
    result = cli("--base", base, "--heads", modified_heads(tmp_path, lambda h: None), "-o", out)
    assert result.returncode == 0, result.stderr
    assert gguf_kvs(GGUFReader(out))["locret.base.n_head_kv"] == (U32, 2)


@pytest.mark.parametrize("case", ["missing", "truncated-safetensors", "garbage-bin", "truncated-bin", "unknown-suffix",
                                  "no-heads", "empty-directory"])
def test_refuses_unreadable_checkpoints(case, tiny_base, tmp_path, cli):
    good = modified_heads(tmp_path, lambda h: None)
    bin_file = save_bin(random_heads(TINY, d_r=16, seed=0), tmp_path / "good.bin")
    bad, expected = {
        "missing": (tmp_path / "nope.safetensors", "no such file or directory"),
        "truncated-safetensors": (tmp_path / "cut.safetensors", "not a readable safetensors file"),
        "garbage-bin": (tmp_path / "garbage.bin", "not a readable PyTorch checkpoint"),
        "truncated-bin": (tmp_path / "cut.bin", "not a readable PyTorch checkpoint"),
        "unknown-suffix": (tmp_path / "heads.npz", "unknown file type"),
        "no-heads": (tmp_path / "other.safetensors", "has no retaining-head tensors"),
        "empty-directory": (tmp_path / "empty-dir", "directory has no *.safetensors or *.bin files"),
    }[case]
    if case == "truncated-safetensors":
        bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif case == "garbage-bin":
        bad.write_bytes(b"this is not a pickle\x00" * 50)
    elif case == "truncated-bin":
        bad.write_bytes(bin_file.read_bytes()[: bin_file.stat().st_size // 2])
    elif case == "unknown-suffix":
        bad.write_bytes(good.read_bytes())
    elif case == "no-heads":
        save_safetensors({"model.embed_tokens.weight": np.zeros((4, 4), dtype=np.float32)}, bad)
    elif case == "empty-directory":
        bad.mkdir()
    out = tmp_path / "out.gguf"
    assert_refused(cli("--base", tiny_base, "--heads", bad, "-o", out), f"checkpoint {bad}", expected, output=out)


@pytest.mark.parametrize("case", ["missing", "not-gguf", "truncated-header", "truncated-data"])
def test_refuses_unreadable_base_model(case, tiny_base, tmp_path, cli):
    data = tiny_base.read_bytes()
    bad = tmp_path / f"{case}.gguf"
    expected = {"missing": "no such file", "not-gguf": "not a GGUF file",
                "truncated-header": "corrupt or truncated GGUF file", "truncated-data": "truncated GGUF file"}[case]
    if case == "not-gguf":
        bad.write_bytes(b"PK\x03\x04" + data[4:])
    elif case == "truncated-header":
        bad.write_bytes(data[:100])
    elif case == "truncated-data":
        bad.write_bytes(data[:-100])  # the tiny tensor's data is cut
    out = tmp_path / "out.gguf"
    heads = modified_heads(tmp_path, lambda h: None)
    assert_refused(cli("--base", bad, "--heads", heads, "-o", out), f"base model {bad}", expected, output=out)


def test_refuses_bad_type(tiny_base, tmp_path, cli):
    out = tmp_path / "out.gguf"
    assert_refused(cli("--base", tiny_base, "--heads", modified_heads(tmp_path, lambda h: None), "-o", out,
                       "--type", "q4_0"), "argument --type: invalid choice: 'q4_0'", output=out)


def test_refuses_bad_output_paths(tiny_base, tmp_path, cli):
    heads = modified_heads(tmp_path, lambda h: None)
    before = (tiny_base.read_bytes(), heads.read_bytes())
    assert_refused(cli("--base", tiny_base, "--heads", heads, "-o", heads), f"output {heads} is the same file as input")
    assert_refused(cli("--base", tiny_base, "--heads", heads, "-o", tmp_path / "." / "tiny.gguf"),
                   "is the same file as input")
    assert_refused(cli("make-random", "--base", tiny_base, "-o", tiny_base), "is the same file as input")
    assert (tiny_base.read_bytes(), heads.read_bytes()) == before
    missing_folder = tmp_path / "no-such-folder"
    assert_refused(cli("--base", tiny_base, "--heads", heads, "-o", missing_folder / "out.gguf"),
                   f"folder {missing_folder} does not exist")
    assert_refused(cli("make-random", "--base", tiny_base, "-o", missing_folder / "r.bin"),
                   f"folder {missing_folder} does not exist")
    assert_refused(cli("make-random", "--base", tiny_base, "-o", tmp_path / "r.npz"),
                   "unknown checkpoint type (use .safetensors or .bin)", output=tmp_path / "r.npz")


def test_refuses_bad_trainer_metadata(tiny_base, tmp_path, cli):
    checkpoint = save_safetensors(random_heads(TINY, d_r=8, seed=0), tmp_path / "trained.safetensors",
                                  {"locret.training.steps": "many"})
    out = tmp_path / "out.gguf"
    assert_refused(cli("--base", tiny_base, "--heads", checkpoint, "-o", out),
                   "locret.training.steps = 'many' is not an unsigned 32-bit integer", output=out)


def test_refuses_conflicting_arguments(tiny_base, tmp_path, cli):
    heads = modified_heads(tmp_path, lambda h: None)
    out = tmp_path / "out.gguf"
    assert_refused(cli("--base", tiny_base, "--merge-into", tiny_base, "--heads", heads, "-o", out),
                   "not allowed with argument", output=out)
    assert_refused(cli("--merge-into", tiny_base, "--heads", heads, "-o", out, "--name", "x"),
                   "--name sets general.name of a standalone heads file", output=out)
    assert_refused(cli("--heads", heads, "-o", out), "one of the arguments --base --merge-into is required", output=out)


# ---------------------------------------------------------------- the script itself

def test_script_refusal_is_one_line_without_traceback(tiny_base, tmp_path):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x80\x05garbage" * 20)
    out = tmp_path / "out.gguf"
    proc = run([sys.executable, SCRIPT, "--base", tiny_base, "--heads", garbage, "-o", out], timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("heads_to_gguf: error: checkpoint ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_script_help_documents_defaults_and_the_testing_flag():
    proc = run([sys.executable, SCRIPT, "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "Phi-3-mini-128K" in text and "default 6000" in text and "default 3072" in text
    assert "default 2500" in text and "default 100" in text
    assert "WRONG heads for architectures that need the permutation" in text
    assert ", ".join(SUPPORTED) in text
