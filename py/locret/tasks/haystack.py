"""Token-level assembly of a long prompt: template head, filler sentences with needles at chosen depths,
question and template tail. Shared by the synthetic tasks so that each task only says what its needles
and question are.

Why token pieces: eviction decisions depend on token positions, so an evaluation must know exactly where
a needle sits. Every piece (head, a run of filler, a needle, the tail) is tokenized on its own and the
prompt is their concatenation, as in passkey.py; a needle's token span is therefore known exactly, and the
prompt is the same on every run for a given tokenizer. Needles go between whole filler sentences, so a
needle asked at depth d sits at the sentence boundary nearest to d of the filler's tokens (within half a
sentence), and the filler stops at the last whole sentence that fits, so a prompt is at most `n_tokens`
long and short of it by less than one filler sentence.

Depth is measured over the filler only: the share of filler tokens before the needle (0: right after the
instructions, 1: right before the question), the same convention as passkey's insert offset.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

Tokenize = Callable[[str, bool], list]        # tokenize(text, add_bos) -> token ids
ChatFormat = Callable[[str], str]             # chat_format(user_message) -> templated prompt text

MARKER = "\u0000HAYSTACK\u0000"


@dataclass(frozen=True)
class Needle:
    """A sentence to insert. `label` says what it is to the task ("answer", "distractor", "hop 2", ...)."""
    text: str
    depth: float
    label: str = "answer"


@dataclass(frozen=True)
class Piece:
    kind: str                  # "head" | "filler" | "needle" | "tail"
    text: str
    tokens: tuple[int, ...]
    label: str = ""            # for needles: the Needle's label
    depth: float | None = None  # for needles: where it landed (share of filler tokens before it)


@dataclass(frozen=True)
class Sample:
    """One generated prompt with its gold answers.

    `pieces` concatenated are the prompt (`tokens`, `text`). `answers` are what `score` compares a
    prediction with. `metadata` is JSON-serialisable: asked and actual length and depths, task options.
    """
    task: str
    seed: int
    index: int
    pieces: tuple[Piece, ...]
    question: str
    answers: tuple[str, ...]
    metadata: dict = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return [t for p in self.pieces for t in p.tokens]

    @property
    def text(self) -> str:
        """The prompt as text, for runners that send text (a server). Re-tokenizing it may differ from
        `tokens` at piece boundaries by a token or so."""
        return "".join(p.text for p in self.pieces)

    @property
    def context(self) -> str:
        """The long text alone (filler and needles), without instructions, question or template."""
        return "".join(p.text for p in self.pieces if p.kind in ("filler", "needle"))

    def spans(self, kind: str = "needle") -> list[tuple[str, int, int]]:
        """(label, start, end) token offsets in the prompt of every piece of `kind`."""
        out, at = [], 0
        for p in self.pieces:
            if p.kind == kind:
                out.append((p.label, at, at + len(p.tokens)))
            at += len(p.tokens)
        return out

    def score(self, prediction: str) -> float:
        """The task's score of a model's answer, in [0, 1]."""
        from . import get
        return get(self.task).score(prediction, self.answers)


def template(intro: str, question: str, tokenize: Tokenize, chat_format: ChatFormat | None) -> tuple[Piece, Piece]:
    """Head and tail pieces around the long text: the user message is intro, long text, question; with
    no chat template the prompt ends in "Answer:". BOS is added to the head when the tokenizer adds one."""
    body = f"{intro}\n\n{MARKER}\n\n{question}"
    text = chat_format(body) if chat_format else body + "\nAnswer:"
    if text.count(MARKER) != 1:
        raise ValueError("the chat template must keep the user message intact (placeholder lost or repeated)")
    head, tail = text.split(MARKER)
    return (Piece("head", head, tuple(tokenize(head, True))), Piece("tail", tail, tuple(tokenize(tail, False))))


def sentence_stream(sentences: Sequence[str], rng: random.Random) -> Iterator[str]:
    """Endless filler: the sentences in a fresh seeded order on every pass, no sentence twice in a row."""
    last = None
    while True:
        order = list(sentences)
        rng.shuffle(order)
        if len(order) > 1 and order[0] == last:
            order[0], order[-1] = order[-1], order[0]
        yield from order
        last = order[-1]


def assemble(*, task: str, seed: int, index: int, tokenize: Tokenize, chat_format: ChatFormat | None,
             n_tokens: int, intro: str, question: str, filler: Iterator[str], needles: Sequence[Needle],
             answers: Sequence[str], metadata: dict | None = None) -> Sample:
    """Build a sample of at most `n_tokens` prompt tokens: the head, filler sentences from `filler` with
    each needle at the sentence boundary nearest its depth (needles at one boundary keep their order),
    then the tail. Raises ValueError when the template and needles alone exceed `n_tokens`."""
    for n in needles:
        if not 0.0 <= n.depth <= 1.0:
            raise ValueError(f"needle depth {n.depth} outside [0, 1]")
    head, tail = template(intro, question, tokenize, chat_format)
    needle_pieces = [(n, tuple(tokenize(" " + n.text, False))) for n in needles]
    fixed = len(head.tokens) + len(tail.tokens) + sum(len(t) for _, t in needle_pieces)
    budget = n_tokens - fixed
    if budget < 0:
        raise ValueError(f"n_tokens={n_tokens} is too small: the instructions, question and needles alone "
                         f"take {fixed} tokens")

    cache: dict[str, tuple[int, ...]] = {}
    sentences: list[tuple[str, tuple[int, ...]]] = []
    used = 0
    for s in filler:
        toks = cache.get(s)
        if toks is None:
            toks = cache[s] = tuple(tokenize(" " + s, False))
        if used + len(toks) > budget:
            break
        sentences.append((" " + s, toks))
        used += len(toks)
    n_filler = used

    bounds = [0]                                   # filler tokens before each sentence boundary
    for _, toks in sentences:
        bounds.append(bounds[-1] + len(toks))
    at_boundary: dict[int, list[tuple[Needle, tuple[int, ...]]]] = {}
    for needle, toks in needle_pieces:
        at_boundary.setdefault(nearest_boundary(bounds, needle.depth * n_filler), []).append((needle, toks))

    pieces: list[Piece] = [head]
    run_text: list[str] = []
    run_tokens: list[int] = []

    def flush() -> None:
        if run_tokens:
            pieces.append(Piece("filler", "".join(run_text), tuple(run_tokens)))
            run_text.clear()
            run_tokens.clear()

    for b in range(len(bounds)):
        for needle, toks in at_boundary.get(b, ()):
            flush()
            depth = bounds[b] / n_filler if n_filler else 0.0
            pieces.append(Piece("needle", " " + needle.text, toks, needle.label, round(depth, 6)))
        if b < len(sentences):
            run_text.append(sentences[b][0])
            run_tokens.extend(sentences[b][1])
    flush()
    pieces.append(tail)

    total = sum(len(p.tokens) for p in pieces)
    meta = {"n_tokens": total, "n_tokens_asked": n_tokens, "n_filler": n_filler,
            "needles": [{"label": p.label, "depth": p.depth} for p in pieces if p.kind == "needle"]}
    meta.update(metadata or {})
    return Sample(task, seed, index, tuple(pieces), question, tuple(answers), meta)


def nearest_boundary(bounds: Sequence[int], target: float) -> int:
    """Index of the value in the sorted `bounds` closest to `target` (the earlier one on a tie)."""
    k = bisect.bisect_left(bounds, target)
    if k == len(bounds) or (k > 0 and target - bounds[k - 1] <= bounds[k] - target):
        return k - 1
    return k


def rng_for(task: str, seed: int, index: int) -> random.Random:
    """The task's random source for one sample: the same (task, seed, index) always gives the same sample."""
    return random.Random(f"{task}:{seed}:{index}")
