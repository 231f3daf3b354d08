"""Training labels of the retaining heads (Locret paper, section 3; DESIGN-NOTES section 1).

For prompt token k and KV head j the label is the largest pre-softmax attention score any answer
token gives k from any query head of j's GQA group:

    label[j, k] = max over answer tokens p, over query heads h in group j, of  q_p^h . k_k^j * scaling

with Q and K as the model attends with them (RoPE applied, q/k norms applied). The answer-by-prompt
score block is computed a slice of answer tokens at a time, so a long sequence never materialises
more than about `max_elements` scores at once.
"""
from __future__ import annotations

import torch


def attention_labels(query: torch.Tensor, key: torch.Tensor, n_prompt: int, scaling: float,
                     keep: torch.Tensor | None = None, max_elements: int = 1 << 25) -> torch.Tensor:
    """Labels float32 [n_head_kv, n_prompt].

    query: [n_head, n_tokens, d] and key: [n_head_kv, n_tokens, d], the whole sequence; tokens
    [0, n_prompt) are the prompt and [n_prompt, n_tokens) the answer. keep: optional bool
    [n_tokens, n_tokens] (query, key) mask of what attention may see (sliding-window layers); a
    prompt token that no answer token may see gets the smallest label of its head.
    """
    n_head, n_tokens, d = query.shape
    n_head_kv = key.shape[0]
    if n_head % n_head_kv:
        raise ValueError(f"{n_head} query heads do not split into {n_head_kv} KV groups")
    group = n_head // n_head_kv
    n_answer = n_tokens - n_prompt
    if n_answer <= 0 or n_prompt <= 0:
        raise ValueError(f"need prompt and answer tokens (prompt {n_prompt}, total {n_tokens})")

    # query heads h = j * group + g belong to KV head j (transformers' repeat_kv layout)
    answer_q = query[:, n_prompt:].float().reshape(n_head_kv, group, n_answer, d)
    prompt_k = key[:, :n_prompt].float()                                  # [n_head_kv, n_prompt, d]
    labels = torch.full((n_head_kv, n_prompt), float("-inf"), device=query.device)
    step = max(1, max_elements // max(1, n_head * n_prompt))
    for start in range(0, n_answer, step):
        q = answer_q[:, :, start:start + step]                             # [n_head_kv, group, c, d]
        c = q.shape[2]
        scores = torch.matmul(q.reshape(n_head_kv, group * c, d), prompt_k.transpose(1, 2)) * scaling
        if keep is not None:
            visible = keep[n_prompt + start:n_prompt + start + c, :n_prompt]  # [c, n_prompt]
            scores = scores.reshape(n_head_kv, group, c, n_prompt).masked_fill(~visible, float("-inf"))
            scores = scores.reshape(n_head_kv, group * c, n_prompt)
        labels = torch.maximum(labels, scores.amax(dim=1))
    unseen = torch.isinf(labels)
    if unseen.any():
        floor = torch.where(unseen, torch.full_like(labels, float("inf")), labels).amin(dim=1, keepdim=True)
        labels = torch.where(unseen, floor.expand_as(labels), labels)
    return labels
