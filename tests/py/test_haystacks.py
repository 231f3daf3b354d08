"""Haystack families (py/locret/tasks/haystacks.py): the same needle tasks over prose, code, licence clauses
and logs. No model: prompts are built with test_eval_tasks' whitespace tokenizer."""
from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from itertools import islice

import pytest

from locret import tasks
from locret.tasks import filler, haystack, haystacks, long_qa, niah, niah_name, niah_quote, passkey_task
from test_eval_tasks import CHAT, word_tokenizer

TOK = word_tokenizer()
GENERATED = [f for f in haystacks.FAMILIES if f != "prose"]
NEEDLE_TASKS = ("niah", "niah_single", "niah_code", "niah_quote", "niah_name", "passkey", "variable_tracking",
                "long_qa")


def first_units(family: str, n: int, seed: int = 0, **kw) -> list[str]:
    return list(islice(haystacks.units(family, random.Random(f"test:{seed}"), **kw), n))


@functools.cache
def longest_unit(family: str, task: str = "niah") -> int:
    """Tokens in the longest of many units of `family` as assemble tokenizes them (with the leading space)."""
    kw = {"prose": passkey_task.SENTENCES} if task == "passkey" else {}
    return max(len(TOK(" " + u, False)) for seed in range(3) for u in first_units(family, 3000, seed, **kw))


def filler_before(sample, piece_index: int) -> int:
    return sum(len(p.tokens) for p in sample.pieces[:piece_index] if p.kind == "filler")


def answer_strings(sample) -> list[tuple[str, int]]:
    """(string, times it occurs in the long text): passkey says its key twice in its one needle."""
    if sample.task == "passkey":
        return [(sample.answers[0], 2)]
    if sample.task == "variable_tracking":
        return [(sample.metadata["value"], 1)]          # in hop 0 (and in the question, not in the context)
    if sample.task == "long_qa":
        return [(sample.answers[0], 1)]
    return [(a, 1) for a in sample.answers]


# ------------------------------------------------------------------ needles in every family

@pytest.mark.parametrize("family", haystacks.FAMILIES)
@pytest.mark.parametrize("name", ["niah", "niah_single", "niah_code", "niah_quote", "niah_name", "passkey"])
@pytest.mark.parametrize("n_tokens", [2048, 8192])
def test_needle_once_at_the_asked_depth(name, family, n_tokens):
    task = tasks.get(name)
    unit = longest_unit(family, name)
    for i, depth in enumerate((0.1, 0.5, 0.9)):
        s = task.generate(5, i, tokenize=TOK, n_tokens=n_tokens, depth=depth, chat_format=CHAT, haystack=family)
        assert n_tokens - unit < len(s.tokens) <= n_tokens == s.metadata["n_tokens_asked"]
        assert s.metadata.get("haystack") == (None if family == "prose" else family)
        n_filler = s.metadata["n_filler"]
        answers_seen = 0
        at = 0
        for k, p in enumerate(s.pieces):
            if p.kind == "needle":
                assert s.text.count(p.text.strip()) == 1, p.text          # the needle occurs once
                assert s.tokens[at:at + len(p.tokens)] == list(p.tokens) == TOK(p.text, False)
                assert p.depth == round(filler_before(s, k) / n_filler, 6)    # the recorded depth is true
                if p.label == "answer":
                    answers_seen += 1
                    assert abs(p.depth - depth) * n_filler <= unit, (p.depth, depth)   # within one unit
            at += len(p.tokens)
        assert answers_seen == (s.metadata["n_values"] if name == "niah" else 1)
        for text, times in answer_strings(s):
            assert s.text.count(text) == times, text
        assert s.score(", ".join(s.answers)) == 1.0


@pytest.mark.parametrize("family", GENERATED)
@pytest.mark.parametrize("name", ["variable_tracking", "long_qa"])
def test_other_needle_tasks_take_a_family(name, family):
    s = tasks.get(name).generate(3, 1, tokenize=TOK, n_tokens=4000, depth=0.3, haystack=family)
    assert s.metadata["haystack"] == family and 4000 - longest_unit(family) < len(s.tokens) <= 4000
    for text, times in answer_strings(s):
        assert s.context.count(text) == times, text
    for p in s.pieces:
        if p.kind == "needle":
            assert s.text.count(p.text.strip()) == 1, p.text
    if name == "variable_tracking":        # the filler adds no five-capital name: the chains still resolve
        assert set(re.findall(r"\b[A-Z]{5}\b", s.context)) == {
            w for p in s.pieces if p.kind == "needle" for w in re.findall(r"\b[A-Z]{5}\b", p.text)}
    else:
        person = s.metadata["person"]
        assert s.context.count(person) == 1


def test_the_filler_is_the_family_asked():
    prose = niah.generate(1, 0, tokenize=TOK, n_tokens=3000)
    filler_text = {f: "".join(p.text for p in niah.generate(1, 0, tokenize=TOK, n_tokens=3000, haystack=f).pieces
                              if p.kind == "filler") for f in haystacks.FAMILIES}
    assert filler_text["prose"] == "".join(p.text for p in prose.pieces if p.kind == "filler")
    assert filler_text["code"].count("\n def ") > 5 and "return" in filler_text["code"]
    assert filler_text["legal"].count(" shall ") > 20 and "\n" not in filler_text["legal"]
    assert len(re.findall(r"\n \[[a-z ]+\] [a-z]+ [a-z._]+: ", filler_text["logs"])) > 50
    for f in GENERATED:
        assert not any(s in filler_text[f] for s in filler.SENTENCES)


# ------------------------------------------------------------------ the streams

TASK_WORDS = {"archive", "archives", "passkey", "passkeys", "key", "keys", "number", "numbers", "digit", "digits",
              "variable", "variables", "value", "values", "hidden", "remember", "born", "founded", "firm"}
TASK_PHRASES = ("pass key", "code for", "keep this in mind", "once more", "numbers for", "set ", "works as")


def _check_clean(text: str) -> None:
    assert not re.search(r"\d", text), re.search(r".{30}\d.{30}", text, re.S)
    assert "-" not in text                                        # niah keys are "adjective-noun"
    assert not re.findall(r"\b[A-Z]{5}\b", text)                 # variable_tracking's names
    words = set(re.findall(r"[a-z]+", text.lower()))
    assert not words & TASK_WORDS
    assert not words & set(niah.ADJECTIVES + niah.NOUNS + long_qa.ANIMALS + niah_quote.MOTTO_WORDS
                           + tuple(w.lower() for w in niah_name.NAME_WORDS))
    lower = text.lower()
    assert not [p for p in TASK_PHRASES if p in lower and p != "set "] and "Set " not in text
    assert not [p for p in long_qa.PROFESSIONS if p in lower]     # even inside a word: "cooper" in "cooperate"
    assert not [w for w in long_qa.FIRST_NAMES + long_qa.TRADES + long_qa.MONTHS if re.search(rf"\b{w}\b", text)]
    # a capitalised consonant-vowel-consonant-vowel word could be one of long_qa's pet names
    assert not re.findall(r"\b[BDFGKLMNPRSTVZ][aeiou][bdfgklmnprstvz][aeiou]\b", text)


@pytest.mark.parametrize("family", haystacks.FAMILIES)
def test_no_digits_and_nothing_a_task_asks_about(family):
    for seed in range(2):
        _check_clean("\n".join(first_units(family, 4000, seed)))
    _check_clean("\n".join(passkey_task.SENTENCES))


def test_the_checks_catch_what_they_look_for():
    _check_clean("The licensee shall pay promptly.\n[at dawn] info api: retried the job\n    return self.items\n")
    for bad in ("items = load(rows, limit=8)", "a well-kept record", "the ULTRA flag", "    return self.archive",
                "logger.debug(\"code for %s\", name)", "copy the amber files", "the cooperative agreed",
                "Note the run", "signed by Bertil", "the passkey", "Set the flag"):
        with pytest.raises(AssertionError):
            _check_clean(bad)


@pytest.mark.parametrize("family", haystacks.FAMILIES)
def test_streams_are_seeded_varied_and_never_repeat_a_unit_at_once(family):
    units = first_units(family, 5000)
    assert units == first_units(family, 5000) and units[:50] != first_units(family, 50, seed=1)
    assert all(a != b for a, b in zip(units, units[1:]))
    assert all(u.endswith(".") if family in ("prose", "legal") else u.endswith("\n") for u in units)
    assert all(u == u.strip(" ") and u.strip() for u in units)
    if family == "prose":
        assert set(units) == set(filler.SENTENCES)              # today's filler, nothing else
    else:
        assert len(set(units[:2000])) >= 500                     # not a short loop
        assert len(set(units)) >= 0.6 * len(units)


def test_families_differ():
    firsts = {f: set(first_units(f, 2000)) for f in haystacks.FAMILIES}
    for a in haystacks.FAMILIES:
        for b in haystacks.FAMILIES:
            if a < b:
                assert not firsts[a] & firsts[b], (a, b)


def test_unknown_family_is_refused_with_the_valid_ones():
    message = r"unknown haystack family 'poetry'; valid families: prose, code, legal, logs, recipes, weather, manual, minutes"
    with pytest.raises(ValueError, match=message):
        haystacks.units("poetry", random.Random(0))                # at once, not on the first unit
    for name in NEEDLE_TASKS:
        with pytest.raises(ValueError, match=message):
            tasks.get(name).generate(0, 0, tokenize=TOK, n_tokens=2000, haystack="poetry")


# ------------------------------------------------------------------ prose samples are unchanged

def test_prose_is_todays_sentence_stream():
    a, b = random.Random("x"), random.Random("x")
    assert list(islice(haystacks.units("prose", a), 300)) == \
        list(islice(haystack.sentence_stream(filler.SENTENCES, b), 300))
    assert a.getstate() == b.getstate()                          # the same draws: the task's later draws too
    assert list(islice(haystacks.units("prose", random.Random(2), prose=passkey_task.SENTENCES), 40)) == \
        list(islice(haystack.sentence_stream(passkey_task.SENTENCES, random.Random(2)), 40))


# fingerprints of samples made before haystack families existed: (task, seed, n_tokens, depth) -> sha256 prefix
# of json [tokens, metadata, text], index = seed % 2, chat template for odd seeds, a fresh tokenizer each
BEFORE = {
    ("niah", 0, 2000, 0.1): "c374342b90f833a4", ("niah", 0, 8000, 0.5): "51cfe1645474f5aa",
    ("niah", 1, 2000, 0.1): "e44f9c8cbe86d111", ("niah", 1, 8000, 0.5): "716e1b8c13d9e22f",
    ("passkey", 0, 2000, 0.1): "3a946ea306a39daa", ("passkey", 0, 8000, 0.5): "4148e99f31ef517a",
    ("passkey", 1, 2000, 0.1): "ef7d9754f6169a6a", ("passkey", 1, 8000, 0.5): "23e47daea712051a",
    ("variable_tracking", 0, 2000, 0.1): "5a9f18b8f95925bf", ("variable_tracking", 0, 8000, 0.5): "4289be91b40d667f",
    ("variable_tracking", 1, 2000, 0.1): "29c84676e1338c39", ("variable_tracking", 1, 8000, 0.5): "76666481ee0e6aab",
    ("long_qa", 0, 2000, 0.1): "1e15c683c9d0effc", ("long_qa", 0, 8000, 0.5): "828361d834c05ae1",
    ("long_qa", 1, 2000, 0.1): "98d7f76c13d5dab8", ("long_qa", 1, 8000, 0.5): "9d01a714aa2da03c",
}


@pytest.mark.parametrize("key", sorted(BEFORE))
def test_prose_samples_are_unchanged(key):
    name, seed, n, depth = key
    task = tasks.get(name)
    kw = dict(tokenize=word_tokenizer(), n_tokens=n, depth=depth, chat_format=CHAT if seed % 2 else None)
    s = task.generate(seed, seed % 2, **kw)
    fingerprint = hashlib.sha256(json.dumps([s.tokens, s.metadata, s.text]).encode()).hexdigest()[:16]
    assert fingerprint == BEFORE[key] and "haystack" not in s.metadata
    kw["tokenize"] = word_tokenizer()
    assert task.generate(seed, seed % 2, haystack="prose", **kw) == s
    kw["tokenize"] = word_tokenizer()
    other = task.generate(seed, seed % 2, haystack="legal", **kw)
    assert other.tokens != s.tokens and other.answers == s.answers and other.metadata["haystack"] == "legal"
