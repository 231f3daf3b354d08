"""The retaining heads as a PyTorch module, their loss, and the paper's accuracy metric.

One head per layer: S = W2 . act(W1 . x), x = concat(Q, K, V) of one token, W1 [d_R, d_in],
W2 [n_head_kv, d_R], no biases. Parameter names are the published Locret checkpoint's
(model.layers.{i}.self_attn.fc1.weight / fc2.weight) and Q/K are in Hugging Face order, so a
state dict saved from here goes through the converter (locret.convert) like a published checkpoint.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..convert.heads import tensor_name

ACTIVATIONS = {
    "silu": nn.functional.silu,
    "gelu": lambda x: nn.functional.gelu(x, approximate="tanh"),  # llama.cpp's ggml_gelu is the tanh form
    "relu": nn.functional.relu,
}

SMOOTHNESS_WEIGHT = 0.0025  # the paper's alpha
TOP_FRACTION = 0.10         # the paper's accuracy: overlap of the top 10 % by prediction and by label


class RetainingHeads(nn.Module):
    def __init__(self, n_layer: int, d_in: int, d_r: int, n_head_kv: int, activation: str, seed: int) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation}")
        self.activation = activation
        self.fc1 = nn.ParameterList()
        self.fc2 = nn.ParameterList()
        generator = torch.Generator().manual_seed(seed)
        for _ in range(n_layer):
            self.fc1.append(nn.Parameter(_linear_init((d_r, d_in), generator)))
            self.fc2.append(nn.Parameter(_linear_init((n_head_kv, d_r), generator)))

    @property
    def n_layer(self) -> int:
        return len(self.fc1)

    def layer_scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [n_tokens, d_in] -> scores [n_head_kv, n_tokens]."""
        hidden = ACTIVATIONS[self.activation](x @ self.fc1[layer].T)
        return (hidden @ self.fc2[layer].T).T

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The published checkpoint's names and layout, float32."""
        out = {}
        for i in range(self.n_layer):
            out[tensor_name(i, "fc1", "weight")] = self.fc1[i].detach().cpu().clone().contiguous()
            out[tensor_name(i, "fc2", "weight")] = self.fc2[i].detach().cpu().clone().contiguous()
        return out


    @property
    def d_r(self) -> int:
        return self.fc1[0].shape[0]

    def set_layer(self, layer: int, fc1: torch.Tensor, fc2: torch.Tensor) -> None:
        """Take one layer's weights in `checkpoint_tensors()`'s layout (shapes checked by the caller)."""
        with torch.no_grad():
            self.fc1[layer].copy_(fc1)
            self.fc2[layer].copy_(fc2)


def _linear_init(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    bound = 1.0 / math.sqrt(shape[1])  # torch.nn.Linear's default range
    return (torch.rand(shape, generator=generator) * 2.0 - 1.0) * bound


def head_loss(pred: torch.Tensor, label: torch.Tensor, rank_weight: float = 0.0) -> torch.Tensor:
    """SmoothL1(pred, label) + alpha * MSE between neighbouring tokens' predictions; both [n_head_kv, n].
    rank_weight > 0 adds rank_weight * attention_kl(pred, label), an opt-in term that is not the paper's."""
    loss = nn.functional.smooth_l1_loss(pred, label)
    if pred.shape[-1] > 1:
        loss = loss + SMOOTHNESS_WEIGHT * nn.functional.mse_loss(pred[:, 1:], pred[:, :-1])
    if rank_weight > 0:
        loss = loss + rank_weight * attention_kl(pred, label)
    return loss


def attention_kl(pred: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Mean over KV heads of KL(softmax(label) || softmax(pred)) over the prompt's tokens; both [n_head_kv, n].

    The labels are pre-softmax attention scores, so softmax(label) is the attention the answer's strongest
    query pays over the prompt. Unlike SmoothL1, whose gradient is capped at 1/n per token, this term weighs
    each token by the attention it gets, so the few units eviction must keep (a needle among thousands of
    filler tokens) dominate it. It ignores a per-head offset: only the order and gaps of the scores count,
    which is all a top-b selection uses."""
    target = torch.log_softmax(label, dim=-1)
    return (target.exp() * (target - torch.log_softmax(pred, dim=-1))).sum(dim=-1).mean()


@torch.no_grad()
def top_overlap(pred: torch.Tensor, label: torch.Tensor, fraction: float = TOP_FRACTION) -> float:
    """Mean over heads of |top-k by pred ∩ top-k by label| / k, k = ceil(fraction * n)."""
    n = pred.shape[-1]
    k = max(1, math.ceil(fraction * n))
    top_pred = torch.topk(pred, k, dim=-1).indices
    top_label = torch.topk(label, k, dim=-1).indices
    hits = torch.zeros(pred.shape[0], device=pred.device)
    for j in range(pred.shape[0]):
        hits[j] = torch.isin(top_pred[j], top_label[j]).sum()
    return float((hits / k).mean())
