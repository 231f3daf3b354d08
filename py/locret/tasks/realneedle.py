"""Needles in real text (the realtext families): what real_number, real_code and real_lookalike share.

A needle must read like the document around it and still be the only place its answer occurs:

- its subject is a made-up name ("quenmoor") that occurs nowhere in the family's whole corpus, not even inside a
  word (checked on every draw), so the question points at the needle alone;
- its sentence is one of a few plain statements of a fact (a limit, a version, a date, a flag, a mode), written as
  the family writes: a paragraph of its own in the manuals, a comment line in the Python source;
- its value has the shape of the document's own numbers near the insertion point (numbers.nearest_shape: a version
  among versions, a mode among modes), drawn fresh so that it is not in the haystack, neither as a number nor
  inside one (where a short shape cannot miss every substring of a long haystack: at least none of its numbers).

How a sample is built (two passes of haystack.assemble over the same stretch of the corpus): the first, with
provisional needles of the same length class, finds where the asked needle lands and the numbers around it; the
value's shape comes from there; the second places the real needles. The value and the depths are drawn again in
the rare case the second pass's haystack holds a value or puts two needles at one boundary.

Every sample's metadata names the corpus and the documents the haystack spans (name and sha256), the needles'
values (the asked one first), the shape and the number it was taken from, and the haystack's own numbers
(`document_numbers`, for telling a confusion from a miss: confusion.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from . import confusion, numbers, realtext
from .haystack import ChatFormat, Needle, Sample, Tokenize, assemble, rng_for
from .numbers import Shape

MAX_NEW_TOKENS = 64     # room for an answer that restates the question first

WHAT = {"info": "GNU manuals", "man": "Linux manual pages", "pysource": "the source code of Python's standard library",
        "pypackages": "the source code of Python libraries"}
# families whose text is Python source: the needle is a comment line there
PYTHON_SOURCE = ("pysource", "pypackages")

# syllables of the made-up subjects: two of them make a name that reads like a program or a library
_ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "k", "l", "m", "n", "p", "qu", "r", "s", "st", "t", "tr", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "n", "r", "l", "m", "x", "nd", "rn", "st")


@dataclass(frozen=True)
class Fact:
    sentence: str        # "{subject}" and "{value}" in it
    question: str        # "{subject}" in it
    noun: str            # what the answer is: "Answer with the {noun} only."


# the facts a needle may state, by the kind of value it carries (numbers.KINDS)
FACTS: dict[str, tuple[Fact, ...]] = {
    "integer": (Fact("The {subject} daemon keeps at most {value} entries in its queue.",
                     "At most how many entries does the {subject} daemon keep in its queue?", "number"),
                Fact("By default the {subject} driver reserves {value} bytes for its buffer.",
                     "How many bytes does the {subject} driver reserve for its buffer by default?", "number")),
    "grouped": (Fact("The {subject} index held {value} records after its last rebuild.",
                     "How many records did the {subject} index hold after its last rebuild?", "number"),
                Fact("The {subject} mirror answers {value} requests on a busy day.",
                     "How many requests does the {subject} mirror answer on a busy day?", "number")),
    "decimal": (Fact("The {subject} scheduler uses a load factor of {value}.",
                     "What load factor does the {subject} scheduler use?", "number"),
                Fact("The {subject} filter lets through signals above {value} kilohertz.",
                     "Above how many kilohertz does the {subject} filter let signals through?", "number")),
    "version": (Fact("Support for the {subject} option first appeared in version {value}.",
                     "In which version did support for the {subject} option first appear?", "version"),
                Fact("The {subject} library must be at least version {value}.",
                     "At least which version must the {subject} library be?", "version")),
    "date": (Fact("The {subject} interface was first released on {value}.",
                  "On which date was the {subject} interface first released?", "date"),
             Fact("The {subject} file format was frozen on {value}.",
                  "On which date was the {subject} file format frozen?", "date")),
    "hex": (Fact("The {subject} flag is defined as {value}.", "What value is the {subject} flag defined as?", "value"),
            Fact("The {subject} register sits at offset {value}.", "At which offset does the {subject} register sit?",
                 "offset")),
    "octal": (Fact("Files written by the {subject} service are created with mode {value}.",
                   "With which mode are files written by the {subject} service created?", "mode"),
              Fact("The {subject} spool directory has the permissions {value}.",
                   "Which permissions does the {subject} spool directory have?", "permissions")),
}
DEFAULT_SHAPE = Shape("integer", "99999")   # for a stretch without a usable number (rare: prose-only manuals)
# the provisional needle of the first pass: as long as the longer facts, so the second pass lands where it did
_PROVISIONAL = Fact("By default the {subject} driver reserves {value} bytes for its buffer.", "", "number")


def number_fact(shape: Shape, rng: random.Random) -> Fact:
    """A fact whose value has the number's kind (a port, a version, an amount...): the number tasks' rule."""
    return rng.choice(FACTS[shape.kind])


def number_values(shape: Shape, rng: random.Random, n: int, taken: Callable[[str], bool]) -> list[str]:
    """`n` values formatted like the document's number near the needle, none already in the text."""
    return numbers.draw(shape, rng, n, taken)


def make_subjects(rng: random.Random, corpus: realtext.Corpus, n: int) -> list[str]:
    """`n` distinct made-up names that the corpus holds nowhere (in any case, not even inside a word; so neither
    do the instructions and questions, whose words are all common ones the corpus has)."""
    out: list[str] = []
    while len(out) < n:
        name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(2))
        if len(name) < 6 or any(name in o or o in name for o in out):
            continue
        if not corpus.contains(name):
            out.append(name)
    return out


def needle_text(family: str, sentence: str) -> str:
    """The needle as the family writes: a comment line in Python source, a paragraph of its own in the manuals
    (a unit of the stretch ends in a blank line, so does the needle)."""
    return ("# " + sentence if family in PYTHON_SOURCE else sentence) + "\n\n"


def check_family(task: str, family: str) -> None:
    if family not in realtext.NEEDLE_FAMILIES:
        raise ValueError(f"{task} hides its needles in real text: give a real-text family "
                         f"({', '.join(realtext.NEEDLE_FAMILIES)}), not {family!r}")


def intro(family: str) -> str:
    return (f"The long text below is taken from {WHAT[family]}. Read it carefully: at the end you will be asked "
            "about one fact it states.")


def question(fact: Fact, subject: str) -> str:
    return f"{fact.question.format(subject=subject)} Answer with the {fact.noun} only."


def filler_text(sample: Sample) -> str:
    return "".join(p.text for p in sample.pieces if p.kind == "filler")


def around_answer(sample: Sample) -> tuple[str, str]:
    """The haystack text before and after the asked needle."""
    k = next(i for i, p in enumerate(sample.pieces) if p.kind == "needle" and p.label == "answer")
    before = "".join(p.text for p in sample.pieces[:k] if p.kind == "filler")
    after = "".join(p.text for p in sample.pieces[k + 1:] if p.kind == "filler")
    return before, after


def shape_near(before: str, after: str) -> tuple[Shape, str]:
    """The shape of the numbers nearest the place between `before` and `after`: within about a paragraph or two,
    else a wider window, else the whole haystack; DEFAULT_SHAPE when it holds no usable number."""
    for window in (1500, 6000, None):
        found = numbers.nearest_shape(before if window is None else before[-window:],
                                      after if window is None else after[:window])
        if found:
            return found
    return DEFAULT_SHAPE, ""


def spread_depths(rng: random.Random, asked: float, n: int, gap: float = 0.1) -> list[float]:
    """`n` depths in [0, 1] at least `gap` from `asked` and from each other (the gap shrinks when they do not fit)."""
    while True:
        for _ in range(200):
            ds = [round(rng.random(), 4) for _ in range(n)]
            points = [asked] + ds
            if all(abs(a - b) >= gap for i, a in enumerate(points) for b in points[i + 1:]):
                return ds
        gap /= 2


Values = Callable[[Shape, random.Random, int, Callable[[str], bool]], list[str]]


def generate(*, task: str, seed: int, index: int, tokenize: Tokenize, n_tokens: int, depth: float,
             chat_format: ChatFormat | None, family: str, n_needles: int, uses_shape: bool,
             fact_for: Callable[[Shape | None, random.Random], Fact], values_for: Values) -> Sample:
    """A sample of `n_needles` needles of one fact (the first asked, at `depth`; the others at spread depths,
    labelled "distractor"), its values from `values_for(shape, rng, n, taken)`; with `uses_shape`, the shape of
    the numbers near the asked needle decides the fact and the values."""
    check_family(task, family)
    rng = rng_for(task, seed, index)
    corpus = realtext.load(family)
    start = rng.randrange(corpus.n_paragraphs)
    subjects = make_subjects(rng, corpus, n_needles)
    depths = [float(depth)] + spread_depths(rng, float(depth), n_needles - 1)
    labels = ["answer"] + ["distractor"] * (n_needles - 1)

    def build(fact: Fact, values: Sequence[str]) -> tuple[Sample, realtext.Stretch]:
        stretch = realtext.Stretch(corpus, start)
        needles = [Needle(needle_text(family, fact.sentence.format(subject=s, value=v)), d, label)
                   for s, v, d, label in zip(subjects, values, depths, labels)]
        sample = assemble(task=task, seed=seed, index=index, tokenize=tokenize, chat_format=chat_format,
                          n_tokens=n_tokens, intro=intro(family), question=question(fact, subjects[0]),
                          filler=iter(stretch), needles=needles, answers=[values[0]])
        return sample, stretch

    shape, example, seen_filler = None, "", ""   # seen_filler: every haystack text a drawn value must avoid
    if uses_shape:
        first, _ = build(_PROVISIONAL, ["48213"] * n_needles)
        shape, example = shape_near(*around_answer(first))
        seen_filler = filler_text(first)
    fact = fact_for(shape, rng)

    for _ in range(50):
        values, strict = _draw(shape, rng, n_needles, seen_filler, values_for)
        sample, stretch = build(fact, values)
        text = filler_text(sample)
        held = numbers.tokens(text)
        if any(v.lower() in held or (strict and v.lower() in text.lower()) for v in values):
            seen_filler += "\n" + text
            continue
        landed = [p.depth for p in sample.pieces if p.kind == "needle"]
        if len(set(landed)) < len(landed):            # two needles at one boundary: other depths
            depths[1:] = spread_depths(rng, depths[0], n_needles - 1)
            continue
        break
    else:
        raise ValueError(f"{task}: no placement of {n_needles} needle(s) with values the haystack lacks at "
                         f"{n_tokens} tokens (a longer prompt has more room)")

    used = stretch.documents(len(stretch.given) - 1)   # assemble draws one unit more than fits, and stops
    return replace(sample, metadata={
        **sample.metadata, "depth": float(depth), "keys": subjects[:1], "subjects": subjects, "haystack": family,
        "values": list(values), "shape": str(shape) if shape else None, "shape_from": example,
        "document_numbers": sorted(n for n in held if numbers.is_document_number(n)),
        "corpus": corpus.id, "documents": [{"name": d.name, "sha256": d.sha256} for d in used]})


def _draw(shape: Shape | None, rng: random.Random, n: int, seen_filler: str,
          values_for: Values) -> tuple[list[str], bool]:
    """Values that stand nowhere in `seen_filler`, not even inside a longer number (True: strict); where a short
    shape cannot avoid every substring of a long haystack, values that are at least none of its numbers (False)."""
    lower = seen_filler.lower()
    try:
        return values_for(shape, rng, n, lambda v: v.lower() in lower), True
    except ValueError:
        held = numbers.tokens(seen_filler)
        return values_for(shape, rng, n, lambda v: v.lower() in held), False


def score(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the asked value stands in the prediction as a whole token (not inside a longer number), else 0.0."""
    return float(bool(answers) and numbers.stands_in(prediction, answers[0]))


def classify(prediction: str, sample) -> str:
    """"right", "confusion" or "miss" (confusion.py)."""
    return confusion.classify(prediction, sample)


def judge(prediction: str, sample) -> confusion.Judgement:
    """classify's outcome with the value a confusion gave, and where that value stands (a needle, the document)."""
    return confusion.judge_sample(prediction, sample)
