"""A wrong answer is a miss or a confusion: telling the two apart for the real-text needle tasks.

In a real document the needle is not the only fact: the text around it holds versions, dates, sizes and modes of
its own, and real_lookalike adds needles that read like the asked one. A model that answers with one of those read
the text and took the wrong fact (a *confusion*: what eviction does when it keeps a look-alike and drops the
needle); a model that answers with nothing the text holds did not find a fact at all (a *miss*).

- ``right``: the asked value stands in the answer as a whole token (numbers.stands_in), whatever else it says;
- ``confusion``: otherwise, the answer holds another needle's value (real_lookalike), or a number of the document
  (the haystack text of the prompt) other than the asked value; single digits do not count
  (numbers.is_document_number);
- ``miss``: anything else (no number, or only numbers the prompt does not hold).
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

from . import numbers

RIGHT, CONFUSION, MISS = "right", "confusion", "miss"
OUTCOMES = (RIGHT, CONFUSION, MISS)


class Judgement(NamedTuple):
    outcome: str                 # one of OUTCOMES
    confused_with: str | None    # the other needle's value or the document's number the answer gave
    source: str | None           # "needle" or "document" for a confusion


def judge(prediction: str, answer: str, other_values: Iterable[str], document_numbers: Iterable[str]) -> Judgement:
    if numbers.stands_in(prediction, answer):
        return Judgement(RIGHT, None, None)
    for value in other_values:
        if value.lower() != answer.lower() and numbers.stands_in(prediction, value):
            return Judgement(CONFUSION, value, "needle")
    held = {n.lower() for n in document_numbers if numbers.is_document_number(n)} - {answer.lower()}
    for f in numbers.find(prediction):
        if f.text.lower() in held:
            return Judgement(CONFUSION, f.text, "document")
    return Judgement(MISS, None, None)


def judge_sample(prediction: str, sample) -> Judgement:
    """judge() with what a real-text needle sample records: `sample.answers[0]` is asked, `sample.metadata` holds
    every needle's value ("values") and the haystack's numbers ("document_numbers"). `sample` is a haystack.Sample
    or anything with those two attributes (an evaluation Item)."""
    meta = sample.metadata
    return judge(prediction, sample.answers[0], meta.get("values", ()), meta.get("document_numbers", ()))


def classify(prediction: str, sample) -> str:
    """"right", "confusion" or "miss" (judge_sample's outcome)."""
    return judge_sample(prediction, sample).outcome
