"""Independent reference for causal importance scores: PyTorch + Hugging Face transformers.

transformers loads the GGUF model itself (dequantizing every tensor and undoing llama.cpp's Q/K row
permutation, so Q and K come out in Hugging Face order; locret.hf_gguf keeps its result as transformers made
it), and forward hooks on each layer's q_proj / k_proj / v_proj capture the pre-RoPE projections. The heads are
applied in the published checkpoint format, in Hugging Face order: nothing here shares code with llama.cpp or with
our converter, which is what makes a match meaningful.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def load_hf_model(gguf_path: Path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from locret import hf_gguf

    model = hf_gguf.load_model(gguf_path, dtype=torch.float32)  # transformers' own reading, kept once converted
    model.eval()
    return model


def reference_scores(model, token_ids: list[int], head_weights: dict[str, "np.ndarray"]) -> np.ndarray:
    """CIS [n_layer, n_head_kv, n_tokens] for `token_ids`, with heads given as published-format
    arrays (model.layers.{i}.self_attn.fc1.weight [d_R, d_in], fc2.weight [n_head_kv, d_R])."""
    import torch

    layers = model.model.layers
    captured: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            def hook(_module, _inputs, output, i=i, name=name):
                captured[(i, name)] = output.detach()[0]  # [n_tokens, n_heads * d_head]
            handles.append(getattr(attn, name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids], dtype=torch.long))
    finally:
        for h in handles:
            h.remove()

    # the heads take the model's activation: SiLU, or GELU's tanh form (Gemma's gelu_pytorch_tanh; ggml's gelu)
    acts = {"silu": torch.nn.functional.silu,
            "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}
    name = getattr(model.config, "hidden_act", None) or getattr(model.config, "hidden_activation", None)  # Gemma's
    act = acts.get(name)
    if act is None:
        raise NotImplementedError(f"reference for activation {name}")
    out = []
    for i in range(len(layers)):
        x = torch.cat([captured[(i, "q_proj")], captured[(i, "k_proj")], captured[(i, "v_proj")]], dim=-1)
        fc1 = torch.from_numpy(head_weights[f"model.layers.{i}.self_attn.fc1.weight"]).float()
        fc2 = torch.from_numpy(head_weights[f"model.layers.{i}.self_attn.fc2.weight"]).float()
        s = act(x @ fc1.T) @ fc2.T  # [n_tokens, n_head_kv]
        out.append(s.T.numpy())
    return np.stack(out)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation of two 1-D arrays (no ties expected in float scores)."""
    ra = np.empty(len(a))
    rb = np.empty(len(b))
    ra[np.argsort(a)] = np.arange(len(a))
    rb[np.argsort(b)] = np.arange(len(b))
    return float(np.corrcoef(ra, rb)[0, 1])
