"""Score pooling: each token's score replaced by the mean over the `window` tokens centred on it.

The engine's `--locret-pool` does this inside each chunk it reads; a kvpress press sees the whole sequence (or one
ChunkPress chunk) at once, so here the window is clipped at that sequence's edges: a token near an edge averages
over the neighbours that exist, not over padding.
"""
from __future__ import annotations

import torch


def check_window(window) -> int:
    """The window as an int, or a ValueError: it must be 0 or 1 (off) or odd, so that it is centred on its token."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"pool must be a non-negative integer, got {window!r}")
    if window > 1 and window % 2 == 0:
        raise ValueError(f"pool must be odd (a window centred on each token) or 0/1 for none, got {window}")
    return window


def pool_scores(scores: torch.Tensor, window: int) -> torch.Tensor:
    """Mean of `scores` [batch, heads, seq] over a centred window along seq, clipped at both ends."""
    if window <= 1 or scores.shape[-1] < 2:
        return scores
    # avg_pool1d without counting the padding is exactly the clipped mean: padded places are left out of the count
    return torch.nn.functional.avg_pool1d(scores, kernel_size=window, stride=1, padding=window // 2,
                                          count_include_pad=False)
