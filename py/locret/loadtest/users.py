"""The user script of a load test: each user arrives at a time of its own with a long real document that carries a
needle, asks the needle's question, then asks follow-ups in the same conversation.

Documents are the real-text needle tasks (real_code, real_number, real_lookalike over the info, man and pysource
families: tasks/realneedle.py), which no shipped heads were trained on. A user's length is drawn from the range
given, its task and family go round in turn, its depth is drawn; arrivals are a Poisson process (exponential gaps
of the mean given) from a seeded generator, so one seed gives every server the same script.

A follow-up turn asks the same question again in other words ("Once more: ..."): the needle is still the answer, so
each turn is scored the same way, and the turn exercises what an operator's traffic does (the conversation grows,
the server may reuse its prefix cache or evict it).

A model whose GGUF has no chat template (a base model, such as the Gemma-3-270M installed here) is not chatted with:
llama-server would wrap the messages in a template the model never learned (ChatML) and it answers with template
tokens. Its users send completions instead (`User.completion`): the document is the whole prompt, ending in
"Answer:", and a follow-up appends the answer, the turn's text and "Answer:" again (`follow_up_prompt`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..evaluation import decoding, items

TASKS = ("real_code", "real_number", "real_lookalike")
FAMILIES = ("info", "man", "pysource")
FOLLOW_UP = "Once more, and answer with the value only: {question}"
COMPLETION_FOLLOW_UP = "\n\n{text}\nAnswer:"   # a completion user's next turn, after the answer so far


@dataclass(frozen=True)
class User:
    id: int
    arrival_s: float          # seconds after the start of the run
    source: str               # "task@family"
    length: int               # prompt tokens asked for
    document: str             # the first user message: the document with the question at its end
    question: str
    turns: tuple[str, ...]    # the user messages after the first
    sample: object = field(repr=False, compare=False)  # the task sample: its `score(answer)` judges every turn
    completion: bool = False  # the model has no chat template: `document` is a whole completion prompt

    def score(self, answer: str) -> float:
        return float(self.sample.score(answer))


def follow_up_prompt(prompt: str, answer: str, text: str) -> str:
    """A completion user's next prompt: the prompt so far, the answer it got, then the turn's text and "Answer:"."""
    return prompt + answer + COMPLETION_FOLLOW_UP.format(text=text)


def parse_lengths(text: str) -> tuple[int, int]:
    """'4096:7168' (a range) or '6000' (one length) in prompt tokens; ValueError otherwise."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or hi is None or not 256 <= lo <= hi:
        raise ValueError(f"lengths must be N or LO:HI in prompt tokens with 256 <= LO <= HI, got {text!r}")
    return lo, hi


def build(vocab, *, n_users: int, lengths: tuple[int, int], turns: int, mean_gap_s: float, seed: int,
          tasks: tuple[str, ...] = TASKS, families: tuple[str, ...] = FAMILIES, progress=None) -> list[User]:
    """`n_users` users of the model whose tokenizer is `vocab` (items.vocab_model); ValueError for settings that
    cannot make them. `progress` (a tqdm bar or None) is advanced once per user."""
    if n_users < 1:
        raise ValueError(f"users must be at least 1, got {n_users}")
    if turns < 1:
        raise ValueError(f"turns must be at least 1 (the first question), got {turns}")
    if mean_gap_s < 0:
        raise ValueError(f"the mean gap between arrivals must be >= 0 s, got {mean_gap_s}")
    rng = random.Random(seed)
    chat = decoding.chat_format(vocab)
    out, t = [], 0.0
    for i in range(n_users):
        task, family = tasks[i % len(tasks)], families[(i // len(tasks)) % len(families)]
        length = rng.randint(*lengths)
        depth = round(rng.uniform(0.1, 0.9), 2)
        ts = next(iter(items.task_samples(vocab, [task], [length], [depth], 1, seed * 1000 + i, [family])))
        s = ts.sample
        question = s.question.strip()
        follow = tuple(FOLLOW_UP.format(question=question) for _ in range(turns - 1))
        out.append(User(i, round(t, 3), ts.source, length, items.user_message(s, chat), question, follow, s,
                        completion=chat is None))
        t += rng.expovariate(1.0 / mean_gap_s) if mean_gap_s > 0 else 0.0
        if progress is not None:
            progress.update()
    return out
