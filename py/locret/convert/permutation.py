"""The column order of W1 that matches llama.cpp's Q/K row order.

For the architectures it permutes, llama.cpp's HF-to-GGUF converter reorders the rows of Wq (per
query head) and Wk (per KV head) so that, within a head of size d, HF's rotate-half pairs
(j, j + d/2) become adjacent: llama.cpp's row 2j is HF's row j and its row 2j + 1 is HF's row
j + d/2. llama.cpp's pre-RoPE Q and K are therefore HF's Q and K with that reordering, and a head
trained on HF activations gives the same scores on llama.cpp's activations only if W1's Q and K
columns are reordered the same way: W1_gguf[:, c] = W1_hf[:, order[c]]. V is never reordered.
"""
from __future__ import annotations

import numpy as np

from .errors import ConversionError


def head_rows_in_llama_cpp_order(head_dim: int) -> np.ndarray:
    """order[c] = the HF index, within one head, of llama.cpp's index c."""
    if head_dim % 2:
        raise ConversionError(f"head size {head_dim} is odd; the Q/K permutation needs an even head size")
    half = head_dim // 2
    order = np.empty(head_dim, dtype=np.int64)
    order[0::2] = np.arange(half)          # llama.cpp 2j     <- HF j
    order[1::2] = np.arange(half) + half   # llama.cpp 2j + 1 <- HF j + d/2
    return order


def llama_cpp_input_order(n_head: int, n_head_kv: int, head_dim_k: int, head_dim_v: int) -> np.ndarray:
    """order[c] = the HF column of W1 that becomes column c: Q heads, then K heads permuted, V kept."""
    within_head = head_rows_in_llama_cpp_order(head_dim_k)
    q_and_k = [h * head_dim_k + within_head for h in range(n_head + n_head_kv)]
    v_start = (n_head + n_head_kv) * head_dim_k
    v = np.arange(v_start, v_start + n_head_kv * head_dim_v)
    return np.concatenate(q_and_k + [v])
