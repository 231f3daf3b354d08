"""Question answering over a long synthetic document: a register of facts about invented people.

The document is filler with fact sentences about people of a fictional province (where they were born
and when, their trade, their pet, the firm they founded). One fact is asked about; the others are
distractors, among them `confusers` facts of the same kind about people who share the asked person's
first name, so an answer must come from the right sentence, not from a nearby one. All names, towns
and firms are invented, so a model cannot answer from its prior knowledge.

Placement: the asked fact at `depth`; distractors at seeded random depths. The asked person's full name
and the answer occur in the text only in that fact (a distractor that would repeat either is drawn
again).

Score (`score`): token F1 after SQuAD normalisation, best over the gold answers (a date has two
accepted spellings), as LongBench and L-Eval score their English QA tasks (metrics.qa_f1).
"""
from __future__ import annotations

import random
from typing import Sequence

from .. import metrics
from . import haystacks
from .haystack import ChatFormat, Needle, Sample, Tokenize, assemble, rng_for

NAME = "long_qa"
USES_DEPTH = True
MAX_NEW_TOKENS = 32

FIRST_NAMES = ("Adela", "Bertil", "Corin", "Dagny", "Elvio", "Fenna", "Goran", "Halvard", "Ilse", "Jorun",
               "Kasimir", "Liesl", "Marek", "Nadia", "Oswin", "Perla", "Quintus", "Rosalind", "Sten", "Tamsin",
               "Ulla", "Vesna", "Wendel", "Yara", "Zoltan")
PROFESSIONS = ("glassblower", "cartographer", "bookbinder", "astronomer", "locksmith", "saddler", "vintner",
               "engraver", "surveyor", "perfumer", "clockmaker", "beekeeper", "falconer", "stonemason",
               "bellfounder", "luthier", "archivist", "botanist", "geologist", "chandler", "wheelwright",
               "cobbler", "weaver", "ropemaker", "furrier", "jeweller", "glazier", "tanner", "cooper",
               "lamplighter")
ANIMALS = ("tortoise", "parrot", "goat", "ferret", "donkey", "canary", "hedgehog", "greyhound", "rabbit", "mule")
TRADES = ("Textiles", "Ironworks", "Shipping", "Printing", "Pottery", "Brewery", "Tannery", "Glassworks")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
KINDS = ("birthplace", "birthdate", "profession", "pet", "company")

INTRO = ("Below is a long register of facts about people of a fictional province, mixed with unrelated notes. "
         "Read it carefully: at the end you will be asked one question about it.")


def _syllables(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(n))


def _surname(rng: random.Random) -> str:
    return (_syllables(rng, rng.choice((2, 3))) + rng.choice(("n", "r", "s", "k", "ll", "v"))).capitalize()


def _town(rng: random.Random) -> str:
    return (_syllables(rng, 2) + rng.choice(("ford", "holm", "wick", "stead", "mere", "by"))).capitalize()


def _fact(kind: str, name: str, rng: random.Random) -> tuple[str, str, tuple[str, ...]]:
    """(fact sentence, question, gold answers) for one kind of fact about `name`."""
    if kind == "birthplace":
        town = _town(rng)
        return f"{name} was born in the town of {town}.", f"In which town was {name} born?", (town,)
    if kind == "birthdate":
        day, month, year = rng.randint(1, 28), rng.choice(MONTHS), rng.randint(1900, 1999)
        return (f"{name} was born on {day} {month} {year}.", f"On what date was {name} born?",
                (f"{day} {month} {year}", f"{month} {day}, {year}"))
    if kind == "profession":
        job = rng.choice(PROFESSIONS)
        article = "an" if job[0] in "aeiou" else "a"
        return f"{name} works as {article} {job}.", f"What is the profession of {name}?", (job,)
    if kind == "pet":
        animal, pet = rng.choice(ANIMALS), _syllables(rng, 2).capitalize()
        return (f"{name} keeps a {animal} named {pet}.", f"What is the name of the {animal} that {name} keeps?",
                (pet,))
    if kind == "company":
        firm = f"{_syllables(rng, 2).capitalize()} {rng.choice(TRADES)}"
        return f"{name} founded a firm called {firm}.", f"What is the name of the firm that {name} founded?", (firm,)
    raise ValueError(f"unknown fact kind {kind!r}; valid: {', '.join(KINDS)}")


def generate(seed: int, index: int, *, tokenize: Tokenize, n_tokens: int, depth: float = 0.5,
             chat_format: ChatFormat | None = None, kind: str | None = None, n_distractors: int = 24,
             confusers: int = 1, haystack: str = "prose") -> Sample:
    """One sample of at most `n_tokens` prompt tokens. `kind`: the kind of fact asked (default: drawn
    from KINDS by the seed). `haystack`: the kind of filler, one of haystacks.FAMILIES."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown fact kind {kind!r}; valid: {', '.join(KINDS)}")
    if not 0 <= confusers <= n_distractors:
        raise ValueError("need 0 <= confusers <= n_distractors")
    rng = rng_for(NAME, seed, index)
    kind = kind or rng.choice(KINDS)
    first = rng.choice(FIRST_NAMES)
    name = f"{first} {_surname(rng)}"
    fact, question, answers = _fact(kind, name, rng)
    used_names = {name}

    needles = [Needle(fact, depth, "answer")]
    while len(needles) < 1 + n_distractors:
        confuser = len(needles) <= confusers
        other = f"{first if confuser else rng.choice(FIRST_NAMES)} {_surname(rng)}"
        text, _, _ = _fact(kind if confuser else rng.choice(KINDS), other, rng)
        if other in used_names or name in text or any(a in text for a in answers):
            continue                     # would repeat the asked name or the answer: draw again
        used_names.add(other)
        needles.append(Needle(text, rng.random(), "confuser" if confuser else "distractor"))
    return assemble(task=NAME, seed=seed, index=index, tokenize=tokenize, chat_format=chat_format,
                    n_tokens=n_tokens, intro=INTRO, question=question + " Answer in a few words.",
                    filler=haystacks.units(haystack, rng), needles=needles, answers=answers,
                    metadata={"depth": depth, "kind": kind, "person": name, "n_distractors": n_distractors,
                              "confusers": confusers, **haystacks.metadata(haystack)})


def score(prediction: str, answers: Sequence[str]) -> float:
    """Best SQuAD token F1 of the prediction over the gold answers."""
    return metrics.best_over(metrics.qa_f1, prediction, answers)
