"""Passkey retrieval: a five-digit key hidden once in a long run of filler text, asked back at the end.

The filler is our own set of plain sentences, repeated (the usual passkey setup: nothing in the
filler resembles the key, so the task isolates whether the model can still see one sentence after
eviction). It is deliberately unlike the head trainer's built-in data (Python documentation
sections), and the wording of the key sentence and question differ from the trainer's passkey task.

Prompts are assembled from token pieces, not re-tokenized text, so a needle placed at token t sits
exactly there: [template head + intro] [filler[:t]] [needle] [filler[t:]] [question + template tail].
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Sequence

FILLER = ("The morning ferry left the quay on time. Gulls circled above the fish market. "
          "A baker on the corner opened his shutters and swept the step. Two cyclists argued about the "
          "weather and then rode on. The library clock struck the hour, as it always does. ")
INTRO = ("A five-digit passkey is hidden somewhere in the long text below. Find it and remember it; "
         "you will be asked for it at the end.")
QUESTION = "What is the five-digit passkey hidden in the text? Answer with the passkey only."
MARKER = "\u0000HAYSTACK\u0000"


def needle_text(key: str) -> str:
    return f" Keep this in mind: the passkey is {key}. Once more, the passkey is {key}. "


@dataclass(frozen=True)
class PromptPieces:
    head: list[int]      # template start, intro (BOS included when the model adds one)
    filler: list[int]    # the haystack, at least as long as asked
    tail: list[int]      # question, template end, assistant turn start

    def build(self, n_filler: int, insert_at: int, needle: list[int]) -> list[int]:
        """Prompt with `n_filler` filler tokens and the needle inserted after filler token `insert_at`."""
        if not 0 <= insert_at <= n_filler <= len(self.filler):
            raise ValueError(f"needle at {insert_at} outside a filler of {n_filler} tokens")
        return self.head + self.filler[:insert_at] + needle + self.filler[insert_at:n_filler] + self.tail


def prompt_pieces(tokenize: Callable[[str, bool], list[int]], chat_format: Callable[[str], str] | None,
                  n_filler: int) -> PromptPieces:
    """Token pieces for a prompt with about `n_filler` filler tokens.

    tokenize(text, add_bos) -> ids; chat_format(user_message) -> the templated prompt text (None: plain).
    """
    body = f"{INTRO}\n\n{MARKER}\n\n{QUESTION}"
    text = chat_format(body) if chat_format else body + "\nAnswer:"
    head_text, tail_text = text.split(MARKER)
    unit = tokenize(FILLER, False)
    filler = unit * (n_filler // len(unit) + 1)
    return PromptPieces(head=tokenize(head_text, True), filler=filler[:n_filler], tail=tokenize(tail_text, False))


def key_token_offsets(needle: list[int], detokenize: Callable[[list[int]], bytes]) -> list[int]:
    """Offsets in the needle's tokens of those that carry the key's digits, in both statements (the
    needle's other words hold no digit). A tokenizer that merges a digit with other text ("3.") still
    has that token found."""
    return [k for k, t in enumerate(needle) if any(c.isdigit() for c in detokenize([t]).decode(errors="replace"))]


def make_keys(seed: int, n: int) -> list[str]:
    rng = random.Random(f"passkey:{seed}")
    return [str(rng.randint(10000, 99999)) for _ in range(n)]


def spread_depths(n: int) -> list[float]:
    """n depths evenly over [0, 1] (both ends included)."""
    return [0.5] if n == 1 else [i / (n - 1) for i in range(n)]


def aligned_insert_points(n_head: int, n_filler: int, align: int, depths: Sequence[float]) -> list[int]:
    """Filler offsets for the given depths, each snapped to the nearest point where head + filler[:t] is a
    whole number of `align`-token chunks (0 is always allowed). Aligned points let an evaluation reuse the
    cache state of the shared prefix and still split the prompt into the same chunks as a single pass."""
    points = [0] + [t for t in range(align - n_head % align, n_filler + 1, align)]
    return [min(points, key=lambda t: abs(t - d * n_filler)) for d in depths]


def score(answer: str, key: str) -> bool:
    """Correct when the key appears as a whole number in the answer."""
    return key in re.findall(r"\d+", answer)
