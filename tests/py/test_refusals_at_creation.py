"""Models Locret cannot score are refused when the context is made, not at the first decode.

The fixture is a tiny OpenELM GGUF, written here with gguf-py (OpenELM is one of the llama.cpp builders that compute
Q, K and V without build_qkv, where the heads' hook lives), and heads in our format for its shapes, also written by
hand since our converter refuses the architecture. With heads the context is refused at creation, naming the layer
and the reason; without heads (the streaming policy) the same model evicts and generates.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter, GGUFValueType

from conftest import THREADS, run, tool

N_EMBD, N_HEAD, N_HEAD_KV, D, N_LAYER, N_FF, D_R = 128, 4, 2, 32, 2, 256, 32


def _copy_tokenizer(src: GGUFReader, w: GGUFWriter) -> int:
    """The default model's tokenizer keys; returns its vocabulary size."""
    n_vocab = 0
    for name, field in src.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY:
            w.add_array(name, value)
            if name == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        elif field.types[0] == GGUFValueType.STRING:
            w.add_string(name, value)
        elif field.types[0] == GGUFValueType.BOOL:
            w.add_bool(name, value)
        else:
            w.add_uint32(name, int(value))
    return n_vocab


@pytest.fixture(scope="module")
def openelm(tmp_path_factory, model_path):
    work = tmp_path_factory.mktemp("openelm")
    rng = np.random.default_rng(0)
    model, heads = work / "openelm.gguf", work / "openelm-heads.gguf"

    w = GGUFWriter(str(model), "openelm")
    w.add_name("tiny random OpenELM (test fixture)")
    n_vocab = _copy_tokenizer(GGUFReader(str(model_path)), w)
    w.add_context_length(4096)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)

    def t(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float16 if shape[0] == n_vocab else np.float32))

    t("token_embd.weight", n_vocab, N_EMBD)
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        t(f"blk.{i}.attn_qkv.weight", (N_HEAD + 2 * N_HEAD_KV) * D, N_EMBD)
        w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(D, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(D, dtype=np.float32))
        t(f"blk.{i}.attn_output.weight", N_EMBD, N_HEAD * D)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        t(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        write()
    w.close()

    # heads in the format of convert/HEADS-FORMAT.md, for the model's shapes
    h = GGUFWriter(str(heads), "openelm")
    h.add_type("locret_heads")
    h.add_uint32("locret.format_version", 1)
    h.add_string("locret.base.architecture", "openelm")
    for key, value in (("n_layer", N_LAYER), ("n_head", N_HEAD), ("n_head_kv", N_HEAD_KV), ("head_dim_k", D),
                       ("head_dim_v", D)):
        h.add_uint32(f"locret.base.{key}", value)
    h.add_string("locret.input_layout", "q,k,v pre-rope")
    h.add_string("locret.qk_layout", "llama.cpp")
    h.add_bool("locret.qk_permuted", False)
    h.add_uint32("locret.hidden_size", D_R)
    h.add_string("locret.activation", "silu")
    d_in = (N_HEAD + N_HEAD_KV) * D + N_HEAD_KV * D
    for i in range(N_LAYER):
        h.add_tensor(f"locret.blk.{i}.fc1.weight", rng.standard_normal((D_R, d_in)).astype(np.float32))
        h.add_tensor(f"locret.blk.{i}.fc2.weight", rng.standard_normal((N_HEAD_KV, D_R)).astype(np.float32))
    for write in (h.write_header_to_file, h.write_kv_data_to_file, h.write_tensors_to_file):
        write()
    h.close()
    return model, heads


def _complete(model, *flags):
    return run([tool("llama-completion"), "-m", model, *flags, "-c", "4096", "-b", "32", "-ub", "32",
                "--locret-stabilizers", "4", "--locret-local", "4", "-p", "one two three four five six seven " * 12,
                "-n", "8", "-no-cnv", "--temp", "0", "-t", str(THREADS), "-lv", "4"], timeout=120)


def test_heads_on_a_model_whose_builder_bypasses_build_qkv_are_refused_at_creation(openelm):
    model, heads = openelm
    proc = _complete(model, "--locret-heads", heads, "--locret-budget", "48")
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "the 'openelm' graph does not compute layer 0's Q, K, V through build_qkv" in proc.stderr, proc.stderr[-2000:]
    # refused while the context is made: no prompt was evaluated
    assert "failed to create context" in proc.stderr and "prompt eval time" not in proc.stderr
    assert "Aborted" not in proc.stderr


def test_the_same_model_evicts_without_heads(openelm):
    model, _ = openelm
    proc = _complete(model, "--locret-policy", "streaming", "--locret-budget", "48")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Locret eviction: policy streaming, budget 48" in proc.stderr
