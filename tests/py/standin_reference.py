"""Independent PyTorch references for the stand-in models (locret.standins): each layer's pre-RoPE Q, K, V as the
Hugging Face model computes them, the RoPE that Hugging Face applies (frequencies and attention scaling from
transformers' own RoPE initialisers), and causal importance scores from heads in the published checkpoint layout.

Nothing here shares code with llama.cpp or with our converter. Q and K come out in Hugging Face order; for the
`llama` architecture llama.cpp's converter interleaves each head's two halves (to_llama_order does the same, so the
reference can be compared with the cache as stored).
"""
from __future__ import annotations

import numpy as np


def load(hf_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    return model


def _layers(model):
    return model.model.layers


def pre_rope_qkv(model, token_ids: list[int]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per layer (q [n, n_head*d], k [n, n_kv*d], v [n, n_kv*d]) in float64, before RoPE (after biases)."""
    import torch

    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    n_q, n_kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    captured: dict[tuple[int, str], np.ndarray] = {}
    handles = []
    for i, layer in enumerate(_layers(model)):
        attn = layer.self_attn
        if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection, [Q | K | V]
            def fused(_m, _inp, out, i=i):
                o = out.detach()[0].double().numpy()
                captured[(i, "q")], captured[(i, "k")], captured[(i, "v")] = o[:, :n_q], o[:, n_q:n_q + n_kv], o[:, n_q + n_kv:]
            handles.append(attn.qkv_proj.register_forward_hook(fused))
        else:
            for name in ("q", "k", "v"):
                def single(_m, _inp, out, i=i, name=name):
                    captured[(i, name)] = out.detach()[0].double().numpy()
                handles.append(getattr(attn, f"{name}_proj").register_forward_hook(single))
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids], dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    return [(captured[(i, "q")], captured[(i, "k")], captured[(i, "v")]) for i in range(len(_layers(model)))]


def rope_parameters(model, n_ctx_rope: int) -> tuple[np.ndarray, float]:
    """(inv_freq [n_rot/2], attention scaling) that Hugging Face uses; LongRoPE chooses its long factors when the
    positions seen (n_ctx_rope) pass the original context, as llama.cpp's get_rope_factors does."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = model.config
    rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type == "default":
        rotary = model.model.rotary_emb
        inv_freq, scaling = rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0)
    elif rope_type == "longrope":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), seq_len=n_ctx_rope)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    return np.asarray(inv_freq, dtype=np.float64), float(scaling)


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, scaling: float) -> np.ndarray:
    """Hugging Face's rotate-half RoPE of rows x [n, d] (one head) at `positions`, on the first 2*len(inv_freq)
    dimensions, cos/sin multiplied by `scaling`; the other dimensions pass through."""
    x = np.asarray(x, dtype=np.float64)
    half = len(inv_freq)
    theta = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    c, s = np.cos(theta) * scaling, np.sin(theta) * scaling
    out = x.copy()
    x0, x1 = x[:, :half], x[:, half:2 * half]
    out[:, :half] = x0 * c - x1 * s
    out[:, half:2 * half] = x1 * c + x0 * s
    return out


def to_llama_order(x: np.ndarray, n_rot: int) -> np.ndarray:
    """Rows [n, d] of one head in llama.cpp's order for the `llama` architecture: pair (i, i + n_rot/2) adjacent."""
    out = x.copy()
    half = n_rot // 2
    out[:, 0:n_rot:2] = x[:, :half]
    out[:, 1:n_rot:2] = x[:, half:n_rot]
    return out


def heads_scores(qkv: list, weights: dict[str, np.ndarray], activation: str = "silu") -> np.ndarray:
    """Causal importance scores [n_layer, n_head_kv, n_tokens] from published-layout heads."""
    out = []
    for i, (q, k, v) in enumerate(qkv):
        x = np.concatenate([q, k, v], axis=1)
        h = x @ weights[f"model.layers.{i}.self_attn.fc1.weight"].astype(np.float64).T
        if activation != "silu":
            raise NotImplementedError(activation)
        h = h / (1.0 + np.exp(-h))
        out.append((h @ weights[f"model.layers.{i}.self_attn.fc2.weight"].astype(np.float64).T).T)
    return np.stack(out)
