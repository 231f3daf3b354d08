"""The needle tasks over real text (real_number, real_code, real_lookalike): placement, the values' shapes, the
made-up subjects, scoring, and telling a confusion from a miss, through to the evaluation's records and summary.
Prompts are built with the default model's own tokenizer (vocab only: no weights, no context)."""
from __future__ import annotations

import random
import re

import pytest

from locret import tasks
from locret.evaluation import decoding, heldout, items as items_module, report
from locret.tasks import confusion, numbers, realneedle, realtext
from locret.tasks.realtext import Corpus, Document

from conftest import SHIPPED_HEADS_FAMILIES

REAL_TASKS = ("real_number", "real_code", "real_lookalike")
N_TOKENS = 2048


@pytest.fixture(scope="module")
def vocab(model_path):
    v = items_module.vocab_model(str(model_path))
    yield v
    v.close()


@pytest.fixture(scope="module")
def tok(vocab):
    return decoding.tokenizer(vocab)


@pytest.fixture(scope="module")
def chat(vocab):
    return decoding.chat_format(vocab)


def filler(sample) -> str:
    return "".join(p.text for p in sample.pieces if p.kind == "filler")


# ------------------------------------------------------------------ placement

@pytest.mark.parametrize("family", realtext.NEEDLE_FAMILIES)
@pytest.mark.parametrize("name", REAL_TASKS)
def test_needles_are_placed_once_with_values_the_document_lacks(name, family, tok, chat):
    task = tasks.get(name)
    for index, depth in enumerate((0.2, 0.5, 0.9)):
        s = task.generate(3, index, tokenize=tok, n_tokens=N_TOKENS, depth=depth, chat_format=chat, haystack=family)
        meta = s.metadata
        assert N_TOKENS - 700 < len(s.tokens) <= N_TOKENS and meta["haystack"] == family
        needles = [p for p in s.pieces if p.kind == "needle"]
        assert len(needles) == len(meta["values"]) == (4 if name == "real_lookalike" else 1)
        assert sorted(p.label for p in needles) == ["answer"] + ["distractor"] * (len(needles) - 1)
        assert s.answers == (meta["values"][0],) and meta["keys"] == meta["subjects"][:1]
        at = 0
        for p in s.pieces:                       # each needle's tokens are in the prompt where its span says
            if p.kind == "needle":
                assert s.tokens[at:at + len(p.tokens)] == list(p.tokens)
            at += len(p.tokens)
        text = filler(s)
        held = numbers.tokens(text)
        for k, (value, subject) in enumerate(zip(meta["values"], meta["subjects"])):
            [p] = [p for p in needles if value in p.text]                  # in prompt order, not the values'
            assert subject in p.text and p.label == ("answer" if k == 0 else "distractor")
            assert s.text.count(value) == 1
            assert value.lower() not in held                                # not a number of the document
            assert subject not in text.lower()                             # a made-up name: nowhere else
            assert not realtext.load(family).contains(subject)
            assert p.text.startswith(" # ") == (family in ("pysource", "pypackages")) and p.text.endswith("\n\n")
        # the question names the asked subject, and no other
        assert meta["subjects"][0] in s.question and not any(x in s.question for x in meta["subjects"][1:])
        assert len({p.depth for p in needles}) == len(needles)              # distinct depths
        assert abs(next(p.depth for p in needles if p.label == "answer") - depth) < 0.25
        assert s.score(f"The answer is {meta['values'][0]}.") == 1.0
        assert meta["document_numbers"] == sorted(n for n in held if numbers.is_document_number(n))
        assert meta["corpus"] == realtext.load(family).id and meta["documents"]
        assert all(re.fullmatch(r"[0-9a-f]{64}", d["sha256"]) for d in meta["documents"])


@pytest.mark.parametrize("name", REAL_TASKS)
def test_a_sample_is_the_same_for_the_same_seed(name, tok, chat):
    task = tasks.get(name)
    a = task.generate(9, 4, tokenize=tok, n_tokens=1500, depth=0.3, chat_format=chat, haystack="info")
    b = task.generate(9, 4, tokenize=tok, n_tokens=1500, depth=0.3, chat_format=chat, haystack="info")
    c = task.generate(9, 5, tokenize=tok, n_tokens=1500, depth=0.3, chat_format=chat, haystack="info")
    assert a == b and a.tokens != c.tokens and a.metadata["values"] != c.metadata["values"]


def test_the_real_tasks_take_only_real_text_and_the_others_only_generated(vocab, tok):
    for name in REAL_TASKS:
        with pytest.raises(ValueError, match=r"give a real-text family \(info, man, pysource, pypackages\), "
                                             r"not 'prose'"):
            tasks.get(name).generate(0, 0, tokenize=tok, n_tokens=1000, haystack="prose")
    with pytest.raises(items_module.ItemError, match="task real_number does not take the haystack family prose: "
                                                     "it hides its needles in real text, give --haystacks info,man"):
        list(items_module.task_samples(vocab, ["real_number"], [1000], [0.5], 1, 0))
    with pytest.raises(items_module.ItemError, match="task niah does not take the haystack family man: its needles "
                                                     "rely on generated text without digits .* the real-text "
                                                     "families take real_number, real_code, real_lookalike"):
        list(items_module.task_samples(vocab, ["niah"], [1000], [0.5], 1, 0, haystacks=["man"]))


# ------------------------------------------------------------------ the values' shapes

def test_the_shape_chooser_follows_the_numbers_nearest_the_place():
    versions = "Added in Linux 2.6.32; changed in 3.10.1 and 4.4.0. The limit is 10. "
    modes = "Create it with mode 0755, or 0644 for files. "
    assert numbers.nearest_shape(versions, "More text.")[0].kind == "version"
    assert numbers.nearest_shape(modes + versions, "")[0].kind == "version"   # more of them
    later = "Some more words, then Linux 2.6.32 and 3.10.1."
    assert numbers.nearest_shape(modes, later)[0].kind == "octal"           # tied two to two: the nearer kind
    assert numbers.nearest_shape("Not " + modes[:-20] + "words. " * 5, "here: 2.6.32 or 3.10.1")[0].kind == "version"
    assert numbers.nearest_shape("A 1 and 22 and 7.", "no usable numbers") is None
    assert numbers.nearest_shape("in 2004-11-17", "")[0] == numbers.Shape("date", "9999-99-99")
    rng = random.Random(0)
    for example, pattern in (("2.6.32", r"[1-9]\.\d\.[1-9]\d"), ("0755", r"0[1-7][0-7]{2}"),
                             ("0x1F", r"0x[1-9A-F][0-9A-F]"), ("1,048,576", r"[1-9],\d{3},\d{3}"),
                             ("40960", r"[1-9]\d{4}"), ("0o644", r"0o[1-7][0-7]{2}")):
        found = next(numbers.find(example))
        assert found.text == example
        for _ in range(50):
            value = numbers.fresh(numbers.shape(found), rng)
            assert re.fullmatch(pattern, value), (example, value)
            back = numbers.shape(next(numbers.find(value)))   # (a hex value of digits only reads as lower case)
            assert (back.kind, back.pattern.lower()) == (found.kind, numbers.shape(found).pattern.lower())


def _fake_corpus(family: str) -> Corpus:
    """A corpus whose first half speaks of kernel versions and second half of file modes, paragraph by paragraph."""
    versions = [f"This call first appeared in Linux {2 + i % 3}.{i % 7}.{10 + i}; the flags came in "
                f"{3 + i % 2}.{i % 9}.{20 + i}." for i in range(60)]
    modes = [f"The directory is created with mode 0{(i % 6) + 1}{i % 8}{(i + 3) % 8}, its files with "
             f"0{(i % 5) + 2}{(i + 1) % 8}4." for i in range(60)]
    return Corpus(family, (Document("versions.txt", "0" * 64, tuple(versions)),
                           Document("modes.txt", "1" * 64, tuple(modes))), {"key": "fake"})


def test_the_value_takes_the_shape_of_the_numbers_around_the_needle(monkeypatch, tok):
    fake = _fake_corpus("man")
    monkeypatch.setattr(realtext, "load", lambda family: fake)
    seen = set()
    for index in range(40):
        s = tasks.get("real_number").generate(1, index, tokenize=tok, n_tokens=700, depth=0.5, haystack="man")
        before, after = realneedle.around_answer(s)
        near = numbers.find(before[-1500:] + after[:1500])        # the window the shape is read from
        kinds = {f.kind for f in near if numbers.usable(numbers.shape(f))}
        value = s.metadata["values"][0]
        got = next(numbers.find(value)).kind
        assert s.metadata["shape"].split()[0] == got and value not in filler(s)
        if len(kinds) == 1:                      # the numbers near the needle all of one kind: the value's kind
            assert got == kinds.pop(), value
            seen.add(got)
    assert seen == {"version", "octal"}           # both regions were drawn


@pytest.mark.parametrize("family", realtext.FAMILIES)
def test_on_real_text_the_value_has_a_shape_from_near_the_needle(family, tok):
    kinds = set()
    for index in range(8):
        s = tasks.get("real_number").generate(2, index, tokenize=tok, n_tokens=3000, depth=0.6, haystack=family)
        meta = s.metadata
        value, example = meta["values"][0], meta["shape_from"]
        if example:                               # a stretch with numbers: the example stands near the needle
            before, after = realneedle.around_answer(s)
            assert example in before[-6000:] + after[:6000]
            want, got = numbers.shape(next(numbers.find(example))), numbers.shape(next(numbers.find(value)))
            assert (want.kind, want.pattern.lower()) == (got.kind, got.pattern.lower())
        kinds.add(meta["shape"].split()[0])
    assert kinds                                  # and the facts follow the kind
    for kind, facts in realneedle.FACTS.items():
        assert all("{subject}" in f.sentence and "{value}" in f.sentence and "{subject}" in f.question for f in facts)


# ------------------------------------------------------------------ right, confusion, miss

def test_confusions_are_told_from_misses(tok, chat):
    s = tasks.get("real_lookalike").generate(5, 0, tokenize=tok, n_tokens=N_TOKENS, depth=0.4, chat_format=chat,
                                             haystack="man")
    asked, *others = s.metadata["values"]
    document = [n for n in s.metadata["document_numbers"] if n not in (asked, *others) and len(n) > 1]
    assert document, "a man page stretch holds numbers of its own"
    task = tasks.get("real_lookalike")
    cases = {f"It is {asked}.": "right",
             f"{others[0]}": "confusion",                                 # a wrong needle's value
             f"The value is {document[0]}.": "confusion",                 # a number of the document
             "I cannot find it in the text.": "miss",
             f"{asked}0": "miss",                                         # the value inside a longer number
             f"Maybe {others[1]} or {asked}": "right"}
    for answer, want in cases.items():
        assert task.classify(answer, s) == want, answer
        assert task.score(answer, s.answers) == float(want == "right"), answer
    assert task.judge(others[2], s) == confusion.Judgement("confusion", others[2], "needle")
    assert task.judge(document[0], s) == confusion.Judgement("confusion", document[0], "document")
    fresh = numbers.draw(numbers.Shape("integer", "9999999"), random.Random(1), 1,
                         lambda v: v in s.metadata["document_numbers"] or v in s.text)[0]
    assert task.classify(f"It is {fresh}.", s) == "miss"                   # a number the prompt does not hold
    assert task.classify("It is 7.", s) == "miss"                          # a single digit tells nothing
    for name in ("real_number", "real_code"):
        one = tasks.get(name).generate(5, 1, tokenize=tok, n_tokens=N_TOKENS, depth=0.4, haystack="pysource")
        doc = [n for n in one.metadata["document_numbers"] if len(n) > 1]
        assert tasks.get(name).classify(one.answers[0].lower(), one) == "right"
        assert tasks.get(name).classify("no idea", one) == "miss"
        if doc:
            assert tasks.get(name).classify(f"It is {doc[0]}", one) == "confusion"


def test_the_evaluation_records_the_outcome_and_counts_confusions(vocab):
    real = items_module.task_items(vocab, ["real_lookalike"], [1200], [0.5], 1, 0, haystacks=["man"])
    plain = items_module.task_items(vocab, ["niah_single"], [1200], [0.5], 1, 0)
    [item], [other] = real, plain
    assert item.source == "real_lookalike@man" and item.metadata["values"][0] == item.answers[0]
    assert item.extra["corpus"] == realtext.load("man").id and item.extra["documents"]
    assert "document_numbers" not in item.extra                           # the records stay small
    asked, wrong = item.metadata["values"][:2]
    assert items_module.outcome(item, f"It is {asked}") == {"outcome": "right", "confused_with": None,
                                                             "confused_source": None}
    assert items_module.outcome(item, wrong) == {"outcome": "confusion", "confused_with": wrong,
                                                 "confused_source": "needle"}
    assert items_module.outcome(other, "1234567") == {} and other.metadata == {}

    def record(item, answer, method="locret"):
        return {"source": item.source, "method": method, "budget": 256, "length": 1200, "run": f"{method}/1200",
                "depth": 0.5, "score": items_module.score(item, answer, {}), "prompt_tokens": 1000,
                "prefill_tok_s": 1.0, "decode_tok_s": 1.0, "cells_used_max": 384, "n_cells": 512,
                **items_module.outcome(item, answer)}

    samples = [record(item, wrong), record(item, "no idea", "streaming"), record(other, "1234567")]
    rows = {(r["source"], r["method"]): r for r in report.summarize(samples, [], [])}
    assert rows[("real_lookalike@man", "locret")]["confusions"] == 1
    assert rows[("real_lookalike@man", "streaming")]["confusions"] == 0
    assert rows[("niah_single", "locret")]["confusions"] is None
    table = report.markdown(list(rows.values()), [], [])
    assert "| score | confusions | by depth |" in table
    assert "| real_lookalike@man | locret | 256 | 1200 | 1 | 0.00 | 1 |" in table
    assert "| niah_single | locret | 256 | 1200 | 1 | 0.00 | - |" in table
    plain_table = report.markdown([rows[("niah_single", "locret")]], [], [])
    assert "confusions" not in plain_table and "| score | by depth |" in plain_table   # other tables as before


# ------------------------------------------------------------------ held out

def test_the_real_families_are_held_out_for_the_shipped_heads(repo, tmp_path):
    import json

    shipped = {"locret": str(repo / "heads" / "smollm2-135m-instruct.gguf"),
               "locret-q": str(repo / "heads" / "smollm2-135m-instruct.query.gguf")}
    trained = heldout.check_held_out(list(realtext.FAMILIES), shipped)
    assert trained == SHIPPED_HEADS_FAMILIES  # the Locret-Q heads' through stage 2's log to stage 1's to the plain's
    (tmp_path / "h.run").mkdir()
    (tmp_path / "h.run" / "train-log.json").write_text(json.dumps({"config": {"data": [], "contexts": ["man"]}}))
    (tmp_path / "h.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="man is not held out for x: its heads were trained on man"):
        heldout.check_held_out(["info", "man"], {"x": str(tmp_path / "h.gguf")})
    # the tuning family is never a held-out figure, even for heads whose logs do not name it
    assert "pypackages" not in trained["locret"]
    with pytest.raises(ValueError, match="pypackages is the tuning family of the real-text tasks .* never held out: "
                                         "the held-out real text is info, man, pysource"):
        heldout.check_held_out(["man", "pypackages"], shipped)
