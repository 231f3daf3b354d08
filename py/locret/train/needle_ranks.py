"""Where trained heads rank a passkey's digits among all the prompt's tokens: a survival forecast.

Locret's eviction keeps, per layer and KV head, the units whose scores are in the top of everything
seen so far (scores never change once computed). After a prompt of n tokens under a budget b, a unit
is still held only if its score is roughly in the top (b - stabilizers - local) / n of the prompt's.
This module scores the evaluation's own passkey prompt with heads in PyTorch (no llama.cpp run) and
reports, for shares `keep`, how many of the key's digit tokens (and of the whole needle sentence,
whose words a model copies before the key) rank inside that top share, per (layer, KV head). The
model's own labels (the trainer's targets) get the same report, as the bound a head that fitted
them exactly would reach.

Used to compare heads checkpoints in about a minute on a CPU, before a passkey run of many minutes.
Keeping the key is necessary for an answer, not sufficient: heads fine-tuned with the `repeats` task
rank the digits higher than the shipped heads and still answer less often within the window
(heads/README.md), so a passkey run has the last word.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .backbone import Backbone
from .heads_model import RetainingHeads


@dataclass(frozen=True)
class NeedlePrompt:
    name: str                 # e.g. "passkey-6000-d0.50"
    token_ids: list[int]      # prompt then answer
    n_prompt: int
    digit_positions: list[int]
    needle_positions: list[int]   # the whole needle, digits included


@dataclass(frozen=True)
class NeedleRanks:
    """Rank shares of the needle's tokens: 0 is the top-scored position of the prompt, 1 the lowest."""
    prompt: str
    source: str                # a heads file, or "labels"
    needle_shares: np.ndarray  # [n_layer, n_head_kv, n_needle]
    digits: list[int]          # indices of the key's digit tokens within the needle

    @property
    def shares(self) -> np.ndarray:
        """[n_layer, n_head_kv, n_digits] the digit tokens' rank shares."""
        return self.needle_shares[:, :, self.digits]

    def inside(self, keep: float) -> float:
        """Share of (layer, KV head, digit) ranked inside the top `keep` of the prompt."""
        return float((self.shares < keep).mean())

    def needle_inside(self, keep: float) -> float:
        """Share of (layer, KV head, needle token) ranked inside the top `keep` of the prompt."""
        return float((self.needle_shares < keep).mean())

    def layers_inside(self, keep: float) -> np.ndarray:
        """[n_layer] the same, per layer."""
        return (self.shares < keep).mean(axis=(1, 2))

    def pairs_holding_all(self, keep: float) -> int:
        """(layer, KV head) pairs that would hold every digit of the key."""
        return int((self.shares < keep).all(axis=2).sum())


def rank_shares(scores: torch.Tensor, positions: list[int]) -> np.ndarray:
    """scores [n_head_kv, n_prompt] -> [n_head_kv, len(positions)]: each position's rank / n_prompt
    (0 = highest score; ties broken by position, as a stable sort)."""
    n = scores.shape[1]
    order = torch.argsort(-scores, dim=1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(n).expand_as(order).contiguous())
    return (rank[:, positions].double() / n).numpy()


@torch.no_grad()
def needle_ranks(backbone: Backbone, prompt: NeedlePrompt,
                 heads: dict[str, RetainingHeads]) -> list[NeedleRanks]:
    """The labels' ranks, then each named heads' ranks, for one prompt."""
    features = backbone.features(prompt.token_ids, prompt.n_prompt)
    sources = [("labels", list(features.labels))]
    sources += [(name, [model.layer_scores(layer, x) for layer, x in enumerate(features.inputs)])
                for name, model in heads.items()]
    digits = [prompt.needle_positions.index(p) for p in prompt.digit_positions]
    return [NeedleRanks(prompt.name, name, np.stack([rank_shares(s, prompt.needle_positions) for s in scores]), digits)
            for name, scores in sources]
