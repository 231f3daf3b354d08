"""`LocretPress`: Locret's retaining heads as a kvpress press.

kvpress (NVIDIA's KV cache compression library for Hugging Face transformers) compresses each layer's cache once,
right after the prefill, keeping per KV head the tokens its press scores highest. This press scores them with the
heads our engine reads: the same heads GGUF, run in PyTorch on the layer's pre-RoPE Q, K, V (the raw projections of
the attention input, before RoPE and before any q/k norm), W1's Q/K columns returned to Hugging Face order
(locret.peers.torch_heads). That puts Locret beside kvpress's own presses on equal terms, and lets kvpress's
wrappers (AdaKVPress, ChunkPress, PerLayerCompressionPress, ...) take it.

What the engine does and this press does not: it evicts chunk by chunk while reading (never holding more than
budget + chunk units), keeps stabilizers and a local tail, and with Locret-Q pins the question; here one selection
follows a full prefill. Kept units are chosen as the engine chooses within one chunk: top scores, ties to the
earlier position, kept in their original order.

    from kvpress import KVPressTextGenerationPipeline
    from locret.peers import LocretPress

    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    pipe(context, question=question, press=LocretPress(0.75, heads="heads/smollm2-135m-instruct.gguf"))
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from kvpress import ScorerPress
from kvpress.utils import compute_n_kept

from .pooling import check_window, pool_scores
from .torch_heads import AttentionShape, TorchHeads, load_torch_heads

# tokens scored at once: bounds the float32 copies of Q, K, V and the hidden layer on long contexts
TOKENS_PER_STEP = 8192


def default_heads() -> str:
    """The shipped heads of the default model (SmolLM2-135M-Instruct)."""
    from locret import models

    path = models.shipped_heads(models.DEFAULT_MODEL)
    if path is None:
        raise ValueError(f"no shipped heads for {models.DEFAULT_MODEL} in this checkout: pass heads=")
    return str(path)


@dataclass
class LocretPress(ScorerPress):
    """Locret's causal importance scores (CIS) as a kvpress ScorerPress.

    compression_ratio: the share of each layer's prefill cache to drop (kvpress's meaning).
    heads: a heads GGUF for the model (standalone or merged); default: the default model's shipped heads.
    pool: 0 or 1 for none, else an odd window: each score becomes the mean over that many tokens around it.
    """

    compression_ratio: float = 0.0
    heads: str | os.PathLike | None = None
    pool: int = 0
    # tests only: False scores with W1 as the file stores it (llama.cpp's Q/K order), wrong for permuted models
    _undo_qk_permutation: bool = field(default=True, repr=False)
    _heads: TorchHeads = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        self.pool = check_window(self.pool)
        if self.heads is None:
            self.heads = default_heads()
        # read now, so that a bad file is refused where the press is made, not in the middle of a prefill
        self._heads = load_torch_heads(self.heads, hf_order=self._undo_qk_permutation)

    def post_init_from_model(self, model):
        # kvpress calls this on entering `with press(model)`, wrappers pass it on: the first moment the model is known
        self._heads.check_fits(attention_shape(model))

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        if hidden_states.shape[1] != keys.shape[2]:
            # a CIS belongs to the token whose projections made it; scores for cached tokens whose hidden states are
            # gone (kvpress's DecodingPress hands over only recent ones) cannot be computed here
            raise ValueError(f"LocretPress scores the tokens it is given the hidden states of: {hidden_states.shape[1]}"
                             f" hidden states for {keys.shape[2]} cached tokens")
        with torch.no_grad():
            steps = [self._heads.scores(module.layer_idx, *pre_rope_qkv(module, part))
                     for part in hidden_states.split(TOKENS_PER_STEP, dim=1)]
            scores = torch.cat(steps, dim=1).transpose(1, 2).contiguous()  # [batch, n_head_kv, seq]
            return pool_scores(scores, self.pool)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        # ScorerPress's own selection, but with the engine's order: ties go to the earlier token (torch.topk leaves
        # them unspecified) and kept units stay in position order
        if self.compression_ratio == 0:
            return keys, values
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        kept = top_positions(scores, compute_n_kept(keys.shape[2], self.compression_ratio))
        return gather_positions(keys, kept), gather_positions(values, kept)


def top_positions(scores: torch.Tensor, n_kept: int) -> torch.Tensor:
    """Positions [batch, heads, n_kept] of the n_kept highest scores per row, ascending; ties to the earlier one."""
    # stable: equal scores stay in position order, so the earlier of them ranks first
    ranked = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return ranked[..., :n_kept].sort(dim=-1).values


def gather_positions(states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """states [batch, heads, seq, dim] at positions [batch, heads, n]."""
    index = positions.unsqueeze(-1).expand(-1, -1, -1, states.shape[-1])
    return states.gather(2, index).contiguous()


def pre_rope_qkv(module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw Q, K, V projections [batch, seq, width] of an attention layer's input: after their bias, before RoPE
    and before any q/k norm (Qwen3 and Gemma 3 normalise after projecting; the heads read what comes before)."""
    if hasattr(module, "q_proj"):
        return module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)
    if hasattr(module, "qkv_proj"):  # Phi-3 projects all three at once: Q heads, then K heads, then V heads
        q_width, k_width, _ = projection_widths(module)
        qkv = module.qkv_proj(hidden_states)
        return qkv[..., :q_width], qkv[..., q_width:q_width + k_width], qkv[..., q_width + k_width:]
    raise ValueError(f"LocretPress: {type(module).__name__} has neither q_proj/k_proj/v_proj nor qkv_proj")


def projection_widths(module) -> tuple[int, int, int]:
    """Widths of an attention layer's Q, K and V projections."""
    config = module.config
    head_dim = getattr(module, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if hasattr(module, "q_proj"):
        return module.q_proj.out_features, module.k_proj.out_features, module.v_proj.out_features
    n_kv = config.num_key_value_heads
    return config.num_attention_heads * head_dim, n_kv * head_dim, n_kv * head_dim


def attention_shape(model) -> AttentionShape:
    """Layers, KV heads and projection widths of a transformers model, as the heads must match them."""
    language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    layers = language_model.layers
    attention = layers[0].self_attn
    q_width, k_width, v_width = projection_widths(attention)
    return AttentionShape(n_layer=len(layers), n_head_kv=attention.config.num_key_value_heads, q_width=q_width,
                          k_width=k_width, v_width=v_width)
